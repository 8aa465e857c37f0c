"""Stage 09 op: decode attention, one new query token per sequence against its KV cache.

In a decode step every running sequence brings exactly one new token. Its keys and values
were written into the cache (at position context_lens[b] - 1 of slot seq_slots[b]) before
this op runs, so attention reads

    out[b, h] = softmax(scale * q[b, h] . K_b^T) V_b,   K_b = k_cache[seq_slots[b], :context_lens[b], g]

with g = h // (n_heads // n_kv_heads), the KV head of query head h. No causal mask: the new
token is the last one, so it may see every cached key. A context length of 0 marks a padding
row (a batch padded to a fixed size, e.g. for a CUDA graph): its output is zeros and its slot
is not looked at. `decode_attention` sends CUDA tensors to decode_attention.cu and CPU
tensors to `decode_attention_native`.
"""
from __future__ import annotations

import torch

from course import parts


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           seq_slots: torch.Tensor, context_lens: torch.Tensor) -> tuple[list[int], list[int]]:
    """Validate shapes and values; return seq_slots and context_lens as Python lists."""
    if q.dim() != 3:
        raise ValueError(f"decode_attention: q must be [batch, n_heads, head_dim], got shape "
                         f"{tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"decode_attention: k_cache and v_cache must be one shape [num_slots, "
                         f"max_len, n_kv_heads, head_dim], got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    batch, n_heads, head_dim = q.shape
    num_slots, max_len, n_kv, cache_dim = k_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"decode_attention: q has head_dim {head_dim} but the caches "
                         f"{cache_dim}")
    if n_kv == 0 or n_heads % n_kv:
        raise ValueError(f"decode_attention: n_heads ({n_heads}) must be a multiple of "
                         f"n_kv_heads ({n_kv})")
    for name, t in (("seq_slots", seq_slots), ("context_lens", context_lens)):
        if t.shape != (batch,) or t.is_floating_point() or t.is_complex():
            raise ValueError(f"decode_attention: {name} must be [{batch}] integers (one per "
                             f"sequence of q), got {t.dtype} {tuple(t.shape)}")
    slots, lens = seq_slots.tolist(), context_lens.tolist()
    for b, (slot, n) in enumerate(zip(slots, lens)):
        if not 0 <= n <= max_len:
            raise ValueError(f"decode_attention: context_lens[{b}] = {n} is outside "
                             f"[0, max_len = {max_len}]")
        if n and not 0 <= slot < num_slots:
            raise ValueError(f"decode_attention: seq_slots[{b}] = {slot} is not a cache slot "
                             f"(there are {num_slots})")
    return slots, lens


def decode_attention_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            seq_slots: torch.Tensor, context_lens: torch.Tensor, scale: float,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch, one sequence at a time, in float32; the result is cast to q's dtype.

    q: [batch, n_heads, head_dim] (any strides); k_cache, v_cache: [num_slots, max_len,
    n_kv_heads, head_dim]; seq_slots, context_lens: [batch] integers; scale: usually
    1 / sqrt(head_dim). Returns [batch, n_heads, head_dim], written into `out` when given.
    """
    slots, lens = _check(q, k_cache, v_cache, seq_slots, context_lens)
    n_heads, head_dim = q.shape[1:]
    n_kv = k_cache.shape[2]
    group = n_heads // n_kv
    result = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    for b, (slot, n) in enumerate(zip(slots, lens)):
        if n == 0:  # a padding row
            result[b] = 0
            continue
        # Query heads g*group .. g*group + group - 1 share KV head g: view them that way.
        qs = q[b].float().reshape(n_kv, group, head_dim)          # [n_kv, group, d]
        ks = k_cache[slot, :n].float().transpose(0, 1)              # [n_kv, n, d]
        vs = v_cache[slot, :n].float().transpose(0, 1)              # [n_kv, n, d]
        scores = (qs @ ks.transpose(1, 2)) * scale                  # [n_kv, group, n]
        probs = torch.softmax(scores, dim=-1)                       # subtracts the row max
        result[b] = (probs @ vs).reshape(n_heads, head_dim).to(q.dtype)
    return result


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     seq_slots: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new token per sequence: decode_attention.cu on CUDA, the twin on CPU.

    q: [batch, n_heads, head_dim] bf16, each row's heads contiguous, rows a multiple of 8
    elements apart (it may be a view of a fused QKV tensor). k_cache, v_cache: [num_slots,
    max_len, n_kv_heads, head_dim] bf16, contiguous. head_dim: a multiple of 8 up to 128 (64
    and 128 are the tuned sizes). seq_slots: [batch] int32, the cache slot of each sequence;
    context_lens: [batch] int32, the keys it attends to (including the token just written; 0 =
    a padding row, whose output is zeros). scale: usually 1 / sqrt(head_dim). out: optional
    contiguous [batch, n_heads, head_dim] bf16 buffer (reuse it in a decode loop).
    Returns [batch, n_heads, head_dim] bf16.
    The CUDA path never waits for the device (it can be captured in a CUDA graph), so it
    cannot check slot and length values: a row whose slot is outside the cache or whose
    length exceeds max_len is not read, and its output is NaN. Validate them on the host.
    """
    if not q.is_cuda:
        return decode_attention_native(q, k_cache, v_cache, seq_slots, context_lens, scale, out)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    parts.kernels().decode_attention(q, k_cache, v_cache, seq_slots, context_lens, float(scale),
                                     out)
    return out
