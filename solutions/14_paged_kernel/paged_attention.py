"""Stage 14 op: decode attention over a paged KV cache, reading each sequence's block table.

    out[b, h] = sum_j softmax_j(scale * q[b, h] . K_b[j]) V_b[j],   j < context_lens[b]

where key j of sequence b lives in block block_tables[b, j // block_size], row
j % block_size, of k_cache / v_cache: [num_blocks, block_size, n_kv_heads, head_dim]. Query
head h reads KV head h // (n_heads // n_kv_heads). `paged_decode_attention` sends CUDA
tensors to paged_attention.cu and CPU tensors to `paged_decode_attention_native`.
"""
from __future__ import annotations

import torch

from course import parts


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"paged attention: q must be [batch, n_heads, head_dim] and the caches "
                         f"[num_blocks, block_size, n_kv_heads, head_dim], got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    batch, n_heads, head_dim = q.shape
    if k_cache.shape[3] != head_dim or n_heads % k_cache.shape[2]:
        raise ValueError(f"paged attention: q {tuple(q.shape)} does not match the caches "
                         f"{tuple(k_cache.shape)} (head_dim, and n_heads a multiple of n_kv_heads)")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch \
            or context_lens.shape != (batch,):
        raise ValueError(f"paged attention: block_tables must be [{batch}, max_blocks] and "
                         f"context_lens [{batch}], got {tuple(block_tables.shape)} and "
                         f"{tuple(context_lens.shape)}")


def paged_decode_attention_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor,
                                  scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch, one sequence at a time, in float32; the result is cast to q's dtype.

    q: [batch, n_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, n_kv_heads,
    head_dim]; block_tables: [batch, max_blocks] int; context_lens: [batch] int (0: a padding
    row, its output is zeros). Returns [batch, n_heads, head_dim], into `out` when given.
    """
    _check(q, k_cache, v_cache, block_tables, context_lens)
    batch, n_heads, head_dim = q.shape
    num_blocks, block_size, n_kv, _ = k_cache.shape
    group = n_heads // n_kv
    result = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    tables, lens = block_tables.tolist(), context_lens.tolist()
    for b in range(batch):
        n = lens[b]
        if n == 0:
            result[b] = 0
            continue
        blocks = tables[b][: -(-n // block_size)]
        if not all(0 <= x < num_blocks for x in blocks) or n > len(tables[b]) * block_size:
            raise ValueError(f"paged attention: sequence {b} needs {n} keys but its block table "
                             f"{tables[b]} does not hold them (blocks 0..{num_blocks - 1})")
        index = torch.tensor(blocks, device=k_cache.device)
        ks = k_cache.index_select(0, index).reshape(-1, n_kv, head_dim)[:n]   # [n, kv, d]
        vs = v_cache.index_select(0, index).reshape(-1, n_kv, head_dim)[:n]
        qs = q[b].float().reshape(n_kv, group, head_dim)                        # [kv, g, d]
        scores = (qs @ ks.float().transpose(0, 1).transpose(1, 2)) * scale      # [kv, g, n]
        probs = torch.softmax(scores, dim=-1)
        result[b] = (probs @ vs.float().transpose(0, 1)).reshape(n_heads, head_dim).to(q.dtype)
    return result


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence against its paged cache: the kernel on CUDA (bf16; q may
    be a view of a fused QKV tensor; block_tables, context_lens int32), the twin on CPU.
    Never reads a device value on the host on CUDA (CUDA-graph safe)."""
    if not q.is_cuda:
        return paged_decode_attention_native(q, k_cache, v_cache, block_tables, context_lens,
                                             scale, out)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    parts.kernels().paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                                           float(scale), out)
    return out
