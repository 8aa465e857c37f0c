# GIVEN FILE: generated from solutions/13_paged_kv_cache/cache_write.py by `nox -s sync-stages`.
# Read it; do not edit it. It is not graded (the grader uses the reference
# copy), and any edit here is overwritten.
"""Stage 13 op: store the new tokens' K and V in the paged cache, each at its slot.

    k_cache.view(num_blocks * block_size, n_kv_heads, head_dim)[slot_mapping[t]] = k[t]
    v_cache.view(num_blocks * block_size, n_kv_heads, head_dim)[slot_mapping[t]] = v[t]

for every token t whose slot is not -1 (a padding row of a CUDA-graph batch writes nowhere).
`cache_write` sends CUDA tensors to cache_write.cu and CPU tensors to `cache_write_native`.

`rope_cache_write` is stage 05's rope and this store in one kernel: it rotates q and k in
place, then stores k and v as above (the paged attention backend calls it: one kernel of a
decode step instead of two).
"""
from __future__ import annotations

import torch

from course import parts


def _check(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           slot_mapping: torch.Tensor) -> None:
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"cache_write: k and v must be one shape [tokens, n_kv_heads, head_dim], "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"cache_write: the caches must be one shape [num_blocks, block_size, "
                         f"{k.shape[1]}, {k.shape[2]}], got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"cache_write: slot_mapping must be [{k.shape[0]}] int64 (one slot per "
                         f"token), got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")


def cache_write_native(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Plain torch, any device: k, v [T, n_kv_heads, head_dim] (views allowed) into k_cache,
    v_cache [num_blocks, block_size, n_kv_heads, head_dim] at the flat rows slot_mapping [T]
    int64; a slot of -1 is skipped.

    Skipping without asking the device which slots are -1 (that would make the CPU wait):
    each -1 token is sent to the row of the first real token instead, carrying that token's
    K/V, so the row gets the same values twice; a call with no real token rewrites row 0
    with what it already holds."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    if k.shape[0] == 0:
        return
    kc = k_cache.view(-1, *k_cache.shape[2:])
    vc = v_cache.view(-1, *v_cache.shape[2:])
    real = slot_mapping >= 0
    first = real.to(torch.int8).argmax()                    # the first real token (0 if none)
    any_real = real.any()
    fallback = torch.where(any_real, slot_mapping.index_select(0, first.view(1)), 0)
    rows = torch.where(real, slot_mapping, fallback)
    take = torch.where(real, torch.arange(k.shape[0], device=k.device), first)
    for src, cache in ((k, kc), (v, vc)):
        values = torch.where(any_real, src.index_select(0, take), cache[0])
        cache.index_copy_(0, rows, values.to(cache.dtype))


def cache_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    """Write the new tokens' K/V into the paged cache: cache_write.cu on CUDA, the twin on CPU.

    k, v: [T, n_kv_heads, head_dim] bf16, each token's heads contiguous, rows a multiple of
    8 elements apart (views of the fused qkv tensor are fine). k_cache, v_cache: [num_blocks,
    block_size, n_kv_heads, head_dim] bf16, contiguous; head_dim a multiple of 8.
    slot_mapping: [T] int64, the flat cache row of each token (block * block_size + offset),
    -1 = skip. The CUDA path never waits for the device (CUDA-graph safe), so it cannot check
    slot values: a slot past the end of the cache is skipped silently. Validate on the host.
    """
    if not k.is_cuda:
        return cache_write_native(k, v, k_cache, v_cache, slot_mapping)
    parts.kernels().cache_write(k, v, k_cache, v_cache, slot_mapping)


def rope_cache_write_native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            positions: torch.Tensor, cos_sin: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slot_mapping: torch.Tensor) -> None:
    """Stage 05's apply_rope_native on q and k (in place), then cache_write_native."""
    parts.load("05", "rope").apply_rope_native(q, k, positions, cos_sin)
    cache_write_native(k, v, k_cache, v_cache, slot_mapping)


def rope_cache_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
    """Rotate q and k in place (RoPE), then write k and v into the paged cache: one kernel
    (cache_write.cu) on CUDA, the twin on CPU.

    q: [T, n_heads, d], k, v: [T, n_kv_heads, d] bf16, each token's heads contiguous (views of
    the fused qkv tensor are fine); d a multiple of 16, at most 256. positions: [T] int64;
    cos_sin: [max_positions, d] float32 (stage 05's table). The caches and slot_mapping as
    for `cache_write`. Like `apply_rope_(check=False)` the CUDA path does not check positions
    (a token outside the table gets NaN q and k): the engine checks them when a request enters.
    """
    if not k.is_cuda:
        return rope_cache_write_native(q, k, v, positions, cos_sin, k_cache, v_cache,
                                       slot_mapping)
    parts.kernels().rope_cache_write(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
