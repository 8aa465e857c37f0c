# GIVEN FILE: generated from solutions/07_attention/attention.py by `nox -s sync-stages`.
# Read it; do not edit it. It is not graded (the grader uses the reference
# copy), and any edit here is overwritten.
"""Stage 07 op: causal prefill attention over packed sequences, with grouped-query heads.

Several prompts are packed along the token axis (no padding); `cu_seqlens` holds where each
starts (vLLM's "varlen" layout): sequence b is tokens cu_seqlens[b] .. cu_seqlens[b+1] - 1,
and its tokens attend only to earlier tokens of the same sequence. With a KV cache (stage 09
on) a sequence can bring more keys than queries -- its first tokens were computed in an
earlier step -- so the keys may have offsets of their own, `cu_seqlens_k`. Query head h reads KV head
h // (n_heads // n_kv_heads). `prefill_attention` sends CUDA tensors to attention.cu and CPU
tensors to `attention_native`.
"""
from __future__ import annotations

import torch

from course import parts


def _bounds(cu: torch.Tensor, rows: int, name: str) -> list[int]:
    bounds = cu.tolist() if cu.dim() == 1 else []
    if not bounds or bounds[0] != 0 or bounds[-1] != rows \
            or any(b > a for b, a in zip(bounds, bounds[1:])):
        raise ValueError(f"attention: {name} must rise from 0 to the row count {rows} without "
                         f"decreasing, got {bounds}")
    return bounds


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 cu_seqlens_k: torch.Tensor) -> tuple[list[int], list[int]]:
    """Validate shapes and offsets on the host; return both offset lists.

    This reads the offsets, so it makes the CPU wait for the GPU: the engine validates a
    step's offsets once when it builds them, never per layer.
    """
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"attention: q must be [tokens, n_heads, head_dim] and k, v "
                         f"[tokens, n_kv_heads, head_dim], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"attention: q is {tuple(q.shape)} so k and v must be "
                         f"[tokens, n_kv_heads, {q.shape[2]}], got {tuple(k.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"attention: n_heads ({q.shape[1]}) must be a multiple of "
                         f"n_kv_heads ({k.shape[1]})")
    bq = _bounds(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    bk = _bounds(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    if len(bk) != len(bq):
        raise ValueError(f"attention: cu_seqlens_q has {len(bq)} entries but cu_seqlens_k "
                         f"{len(bk)}: one pair of offsets per sequence")
    for b in range(len(bq) - 1):
        if bk[b + 1] - bk[b] < bq[b + 1] - bq[b]:
            raise ValueError(f"attention: sequence {b} has {bq[b + 1] - bq[b]} queries but only "
                             f"{bk[b + 1] - bk[b]} keys; its queries are its last positions, so "
                             "it needs at least as many keys")
    return bq, bk


def attention_native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens: torch.Tensor, scale: float,
                     out: torch.Tensor | None = None, *,
                     cu_seqlens_k: torch.Tensor | None = None,
                     max_seqlen_q: int | None = None) -> torch.Tensor:
    """Plain torch, one sequence at a time, in float32; the result is cast to q's dtype.

    q: [Tq, n_heads, head_dim], k, v: [Tk, n_kv_heads, head_dim] (any strides),
    cu_seqlens: [n_seqs + 1] int, the query offsets; cu_seqlens_k: the key offsets (default:
    the same, every query attends to its own sequence's tokens). A sequence with more keys
    than queries has its queries at its last positions (the first keys were cached earlier).
    scale: usually 1 / sqrt(head_dim). max_seqlen_q: ignored here (the kernel's grid size).
    Returns [Tq, n_heads, head_dim], written into `out` when given.
    """
    cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    bq, bk = check_inputs(q, k, v, cu_seqlens, cu_k)
    group = q.shape[1] // k.shape[1]
    result = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    for b in range(len(bq) - 1):
        n_q, n_k = bq[b + 1] - bq[b], bk[b + 1] - bk[b]
        if n_q == 0:
            continue
        qs = q[bq[b]:bq[b + 1]].float().transpose(0, 1)                 # [H, Lq, d]
        # KV head g serves query heads g*group .. g*group + group - 1.
        ks = k[bk[b]:bk[b + 1]].float().repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[bk[b]:bk[b + 1]].float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (qs @ ks.transpose(1, 2)) * scale                       # [H, Lq, Lk]
        # Query i sits at key position i + (n_k - n_q) and sees keys up to it.
        future = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).triu(n_k - n_q + 1)
        scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1)                            # subtracts the row max
        result[bq[b]:bq[b + 1]] = (probs @ vs).transpose(0, 1).to(q.dtype)
    return result


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens: torch.Tensor, scale: float,
                      out: torch.Tensor | None = None, *,
                      cu_seqlens_k: torch.Tensor | None = None,
                      max_seqlen_q: int | None = None) -> torch.Tensor:
    """Causal attention of packed sequences: attention.cu on CUDA, attention_native on CPU.

    q: [Tq, n_heads, head_dim] bf16, k, v: [Tk, n_kv_heads, head_dim] bf16; each may be a view
    of a fused QKV tensor (rows any multiple of 8 elements apart, each token's heads
    contiguous). head_dim: a multiple of 8 up to 128 (64 and 128 are the tuned sizes).
    cu_seqlens: [n_seqs + 1] int32 query offsets on q's device; cu_seqlens_k: key offsets
    (default: the same). scale: usually 1 / sqrt(head_dim).
    out: optional contiguous [Tq, n_heads, head_dim] bf16 buffer (reuse it to time).
    max_seqlen_q: the longest query run, known on the host. Given, the CUDA path never waits for
    the GPU (the caller validated the offsets, as the engine does once per step); left out,
    the offsets are read and validated on the host first (one small copy per call).
    The kernel's tile fits the GPU's shared memory per block (64 rows, or 32 on a T4 at
    head_dim 128): see prefill_attention_with_smem_limit.
    Returns [Tq, n_heads, head_dim] bf16.
    """
    return prefill_attention_with_smem_limit(q, k, v, cu_seqlens, scale, None, out,
                                             cu_seqlens_k=cu_seqlens_k,
                                             max_seqlen_q=max_seqlen_q)


def prefill_attention_with_smem_limit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                      cu_seqlens: torch.Tensor, scale: float,
                                      smem_limit: int | None,
                                      out: torch.Tensor | None = None, *,
                                      cu_seqlens_k: torch.Tensor | None = None,
                                      max_seqlen_q: int | None = None) -> torch.Tensor:
    """prefill_attention with the kernel's shared memory per block capped at smem_limit bytes.

    The kernel takes 64-row tiles where they fit that many bytes, else 32-row tiles, else it
    refuses (RuntimeError: how much it needs, how much is allowed). None: the GPU's own limit
    (cudaDevAttrMaxSharedMemoryPerBlockOptin), what prefill_attention uses. A T4's 64 * 1024
    runs the T4's tile on any GPU: the tests do that. Ignored on CPU (attention_native).
    The engine calls prefill_attention, whose signature stage 12's op shares.
    """
    cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    if not q.is_cuda:
        return attention_native(q, k, v, cu_seqlens, scale, out, cu_seqlens_k=cu_k)
    if max_seqlen_q is None:
        bq, _ = check_inputs(q, k, v, cu_seqlens, cu_k)
        max_seqlen_q = max((b - a for a, b in zip(bq, bq[1:])), default=0)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    parts.kernels().prefill_attention(q, k, v, cu_seqlens, cu_k, int(max_seqlen_q), float(scale),
                                      out, -1 if smem_limit is None else int(smem_limit))
    return out
