# GIVEN FILE: generated from solutions/12_online_softmax/flash_attention.py by `nox -s sync-stages`.
# Read it; do not edit it. It is not graded (the grader uses the reference
# copy), and any edit here is overwritten.
"""Stage 12 op: prefill attention with the online softmax, one tile of keys at a time.

The same op as stage 07's `prefill_attention` (causal, packed sequences with `cu_seqlens`,
grouped-query heads, more keys than queries after a cached prefix) and the same signature,
so the engine takes whichever stage is ready (course/ops.py: stage 12 first). What differs is
the algorithm: instead of a whole row of scores, then its max, then its softmax, each row
keeps a running state over the key tiles seen so far -- the max m, the sum l and the
unnormalised output o -- and rescales it whenever a tile raises the max. One pass over the
keys, and no [T, T] matrix anywhere.

The stage has two kernels: flash_attention_simple.cu (part 1: a warp per query row, float
math) and flash_attention.cu (part 2: the tensor cores and a cp.async ring). `prefill_attention`
sends CUDA tensors to the fast one once it is written, else to the simple one
(course.ops.FirstWritten: one line on stderr says so) -- head_dim 64 and 128; other sizes go
to stage 07's kernel -- and CPU tensors to `flash_attention_native`.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from course import parts
from course.ops import FirstWritten

KERNEL_HEAD_DIMS = (64, 128)   # the sizes both kernels are built for
BLOCK_KEYS = 64                # keys per tile, in the kernel and in the twin


def _stage07():
    return parts.load("07", "attention")


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 cu_seqlens_k: torch.Tensor) -> tuple[list[int], list[int]]:
    """Validate shapes and offsets on the host (stage 07's checks); return both offset lists.

    This reads the offsets, so it makes the CPU wait for the GPU: the engine validates a
    step's offsets once when it builds them and passes max_seqlen_q, never per layer.
    """
    return _stage07().check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)


def flash_attention_native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None, *,
                           cu_seqlens_k: torch.Tensor | None = None,
                           max_seqlen_q: int | None = None,
                           block: int = BLOCK_KEYS) -> torch.Tensor:
    """The online softmax in plain torch: key tiles of `block`, float32, one sequence at a time.

    q: [Tq, n_heads, head_dim], k, v: [Tk, n_kv_heads, head_dim] (any dtype and strides);
    cu_seqlens: [n_seqs + 1] int query offsets; cu_seqlens_k: key offsets (default: the same).
    A sequence with more keys than queries has its queries at its last positions. scale:
    usually 1 / sqrt(head_dim). max_seqlen_q: ignored here (the kernel's grid size).
    Returns [Tq, n_heads, head_dim] in q's dtype, written into `out` when given.

    Per query row, over the key tiles J = [k0, k0 + block):

        m_new = max(m, max_J s)              running max (m starts at -inf)
        alpha = exp(m - m_new)               what the old terms must be scaled by
        p     = exp(s_J - m_new)
        l     = alpha * l + sum p            running sum of exponentials
        o     = alpha * o + p @ V_J          running, unnormalised output
        m     = m_new
    and at the end out = o / l. The kernel does exactly this per warp (in base 2, with P
    rounded to bf16 for the tensor cores); here all query rows of a sequence move together.
    """
    cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    bq, bk = check_inputs(q, k, v, cu_seqlens, cu_k)
    # Query head h reads KV head h // (n_heads // n_kv_heads) (grouped-query attention).
    kv_of_head = torch.arange(q.shape[1], device=q.device) // (q.shape[1] // k.shape[1])
    result = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    for q_start, q_end, k_start, k_end in zip(bq, bq[1:], bk, bk[1:]):
        if q_end > q_start:
            qs = q[q_start:q_end].float().transpose(0, 1) * scale          # [H, Lq, d]
            ks = k[k_start:k_end].float()[:, kv_of_head].transpose(0, 1)  # [H, Lk, d]
            vs = v[k_start:k_end].float()[:, kv_of_head].transpose(0, 1)
            o = online_softmax_attention(qs, ks, vs, block)
            result[q_start:q_end] = o.transpose(0, 1).to(q.dtype)
    return result


def online_softmax_attention(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                             block: int) -> torch.Tensor:
    """One sequence: qs [H, Lq, d] (already scaled), ks, vs [H, Lk, d], float32 -> [H, Lq, d].

    Causal, aligned to the end of the keys: query i sits at key position i + (Lk - Lq) and
    sees the keys up to it. Keys are visited in tiles of `block`, as the kernel does.
    """
    n_heads, n_q, n_k = qs.shape[0], qs.shape[1], ks.shape[1]
    qpos = torch.arange(n_q, device=qs.device) + (n_k - n_q)
    m = torch.full((n_heads, n_q, 1), float("-inf"), device=qs.device)
    l = torch.zeros((n_heads, n_q, 1), device=qs.device)
    o = torch.zeros(qs.shape, device=qs.device)
    for k0 in range(0, n_k, block):
        s = qs @ ks[:, k0:k0 + block].transpose(1, 2)                       # [H, Lq, tile]
        kpos = torch.arange(k0, min(k0 + block, n_k), device=qs.device)
        s = s.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        # A row that has seen no key yet keeps m = -inf; -inf - -inf is NaN, so use 0.
        base = m_new.masked_fill(m_new == float("-inf"), 0.0)
        alpha = torch.exp(m - base)                                         # m = -inf: 0
        p = torch.exp(s - base)
        l = alpha * l + p.sum(dim=-1, keepdim=True)
        o = alpha * o + p @ vs[:, k0:k0 + block]
        m = m_new
    return torch.where(l > 0, o / l, 0.0)                       # a row that saw no key: 0


def _kernel(name: str):
    def run(*args) -> None:
        getattr(parts.kernels(), name)(*args)
    return run


KERNELS = {"fast": _kernel("flash_attention"), "simple": _kernel("flash_attention_simple")}
# the fast kernel (part 2) once it is written, else the simple one (part 1)
_fastest = FirstWritten("prefill_attention: stage 12's fast kernel (flash_attention.cu)",
                        KERNELS["fast"], KERNELS["simple"])


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens: torch.Tensor, scale: float,
                      out: torch.Tensor | None = None, *,
                      cu_seqlens_k: torch.Tensor | None = None,
                      max_seqlen_q: int | None = None) -> torch.Tensor:
    """Causal attention of packed sequences: stage 12's kernels on CUDA, the twin on CPU.

    Stage 07's signature and meaning. q: [Tq, n_heads, head_dim] bf16, k, v:
    [Tk, n_kv_heads, head_dim] bf16; each may be a view of a fused QKV tensor (rows any
    multiple of 8 elements apart, each token's heads contiguous). cu_seqlens: [n_seqs + 1]
    int32 query offsets on q's device; cu_seqlens_k: key offsets (default: the same).
    scale: usually 1 / sqrt(head_dim). out: optional contiguous [Tq, n_heads, head_dim] bf16
    buffer (reuse it to time). max_seqlen_q: the longest query run, known on the host. Given,
    the CUDA path never waits for the GPU (the caller validated the offsets, as the engine
    does once per step); left out, the offsets are read and validated on the host first.
    head_dim: the kernel is built for 64 and 128; on CUDA any other size (a multiple of 8 up
    to 128) falls back to stage 07's kernel, `parts.load("07", "attention").prefill_attention`,
    and so does a scale that is not positive (the kernel's softmax needs scale > 0).
    On CUDA the fast kernel runs once it is written, else the simple one.
    Returns [Tq, n_heads, head_dim] bf16.
    """
    return _prefill(_fastest, q, k, v, cu_seqlens, scale, out, cu_seqlens_k, max_seqlen_q)


def prefill_attention_of(kernel: str) -> Callable[..., torch.Tensor]:
    """prefill_attention run by one kernel only, "simple" (part 1) or "fast" (part 2): their
    tests, and comparisons. Same arguments and fallbacks to stage 07."""
    def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cu_seqlens: torch.Tensor, scale: float,
                          out: torch.Tensor | None = None, *,
                          cu_seqlens_k: torch.Tensor | None = None,
                          max_seqlen_q: int | None = None) -> torch.Tensor:
        return _prefill(KERNELS[kernel], q, k, v, cu_seqlens, scale, out, cu_seqlens_k,
                        max_seqlen_q)
    return prefill_attention


def _prefill(run: Callable[..., None], q, k, v, cu_seqlens, scale, out, cu_seqlens_k,
             max_seqlen_q) -> torch.Tensor:
    cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    if not q.is_cuda:
        return flash_attention_native(q, k, v, cu_seqlens, scale, out, cu_seqlens_k=cu_k)
    if (q.dim() == 3 and q.shape[2] not in KERNEL_HEAD_DIMS) or not scale > 0:
        return _stage07().prefill_attention(q, k, v, cu_seqlens, scale, out, cu_seqlens_k=cu_k,
                                            max_seqlen_q=max_seqlen_q)
    if max_seqlen_q is None:
        bq, _ = check_inputs(q, k, v, cu_seqlens, cu_k)
        max_seqlen_q = max((b - a for a, b in zip(bq, bq[1:])), default=0)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    run(q, k, v, cu_seqlens, cu_k, int(max_seqlen_q), float(scale), out)
    return out
