"""Stage 07 op: causal prefill attention over packed sequences, with grouped-query heads.

Several prompts are packed along the token axis (no padding); `cu_seqlens` holds where each
starts (vLLM's "varlen" layout): sequence b is tokens cu_seqlens[b] .. cu_seqlens[b+1] - 1,
and its tokens attend only to earlier tokens of the same sequence. Query head h reads KV head
h // (n_heads // n_kv_heads). `prefill_attention` sends CUDA tensors to attention.cu and CPU
tensors to `attention_native`.
"""
from __future__ import annotations

import torch

from course import parts


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           cu_seqlens: torch.Tensor) -> list[int]:
    """Validate the shapes; return cu_seqlens as a Python list."""
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"attention: q must be [tokens, n_heads, head_dim] and k, v "
                         f"[tokens, n_kv_heads, head_dim], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"attention: q is {tuple(q.shape)} so k and v must be "
                         f"[{q.shape[0]}, n_kv_heads, {q.shape[2]}], got {tuple(k.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"attention: n_heads ({q.shape[1]}) must be a multiple of "
                         f"n_kv_heads ({k.shape[1]})")
    bounds = cu_seqlens.tolist() if cu_seqlens.dim() == 1 else []
    if not bounds or bounds[0] != 0 or bounds[-1] != q.shape[0] \
            or any(b > a for b, a in zip(bounds, bounds[1:])):
        raise ValueError(f"attention: cu_seqlens must rise from 0 to the token count "
                         f"{q.shape[0]} without decreasing, got {bounds}")
    return bounds


def attention_native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens: torch.Tensor, scale: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch, one sequence at a time, in float32; the result is cast to q's dtype.

    q: [tokens, n_heads, head_dim], k, v: [tokens, n_kv_heads, head_dim] (any strides),
    cu_seqlens: [n_seqs + 1] int, scale: usually 1 / sqrt(head_dim).
    Returns [tokens, n_heads, head_dim], written into `out` when given.
    """
    bounds = _check(q, k, v, cu_seqlens)
    group = q.shape[1] // k.shape[1]
    result = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    for start, end in zip(bounds, bounds[1:]):
        if end == start:
            continue
        qs = q[start:end].float().transpose(0, 1)                      # [H, L, d]
        # KV head g serves query heads g*group .. g*group + group - 1.
        ks = k[start:end].float().repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[start:end].float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (qs @ ks.transpose(1, 2)) * scale                     # [H, L, L]
        n = end - start
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1)                          # subtracts the row max
        result[start:end] = (probs @ vs).transpose(0, 1).to(q.dtype)
    return result


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens: torch.Tensor, scale: float,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of packed sequences: attention.cu on CUDA, attention_native on CPU.

    q: [tokens, n_heads, head_dim] bf16, k, v: [tokens, n_kv_heads, head_dim] bf16; each may be
    a view of a fused QKV tensor (rows any multiple of 8 elements apart, each token's heads
    contiguous). head_dim: a multiple of 8 up to 128 (64 and 128 are the tuned sizes).
    cu_seqlens: [n_seqs + 1] int32 on q's device. scale: usually 1 / sqrt(head_dim).
    out: optional contiguous [tokens, n_heads, head_dim] bf16 buffer (reuse it to time).
    Returns [tokens, n_heads, head_dim] bf16. The CUDA path reads cu_seqlens on the host to
    validate it and size the grid (one small copy per call).
    """
    if not q.is_cuda:
        return attention_native(q, k, v, cu_seqlens, scale, out)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    parts.kernels().prefill_attention(q, k, v, cu_seqlens, float(scale), out)
    return out
