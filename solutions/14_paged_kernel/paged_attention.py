"""Stage 14 op: decode attention over a paged KV cache, reading each sequence's block table.

    out[b, h] = sum_j softmax_j(scale * q[b, h] . K_b[j]) V_b[j],   j < context_lens[b]

where key j of sequence b lives in block block_tables[b, j // block_size], row
j % block_size, of k_cache / v_cache: [num_blocks, block_size, n_kv_heads, head_dim]. Query
head h reads KV head h // (n_heads // n_kv_heads).

Two kernels compute it, the stage's two parts:

    paged_decode_attention_simple   part 1, paged_attention_simple.cu: one thread block per
                                    (sequence, query head), scalar float math
    paged_decode_attention_fast     part 2, paged_attention.cu: tensor cores, a cp.async ring,
                                    split-K merged in the kernel (below)
    paged_decode_attention          what the engine calls: CPU tensors go to the native twin,
                                    CUDA tensors to the fast kernel, or to the simple one while
                                    the fast one is a TODO (course.ops.FirstWritten, one line on
                                    stderr)

On CUDA, the fast kernel splits small batches are split into partitions of keys computed by separate thread blocks
and merged by the last of them to finish (flash-decoding's split-K, in one kernel):
partitions of 1024 keys, halved down to 64 while the grid is short of one block per SM (one
sequence of 8 KV heads on 132 SMs: 64-key partitions up to max_context 2048). The partition
size and count come from the batch size, the heads and `max_context` (the engine's
max_model_len; by default the block table's capacity, max_blocks * block_size), never from the
lengths on the device, so a decode step is the same kernel launch at every step and can be
captured in a CUDA graph. `partition_keys` says what a call would use; inside it, the kernel
reads a sequence of at most 256 keys whole (one partition, nothing to merge) unless the call
forces its partition size.

With `new_token=(k, v, positions, cos_sin)` the step's new tokens are not in the cache yet and
q is not rotated: the kernel rotates q (stage 05's RoPE, in registers), and stores each
sequence's new key, rotated, and value at its key context_lens[b] - 1 before it reads them
(the lesson's "The new token"): one kernel of a decode step instead of stage 13's
rope_cache_write and this one. q, k and v themselves are not changed. The simple kernel leaves
that fusion out: with new_token, stage 13's rope_cache_write stores the token first
(write_new_token), then the kernel reads it from the cache.
"""
from __future__ import annotations

import torch

from course import ops, parts


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"paged attention: q must be [batch, n_heads, head_dim] and the caches "
                         f"[num_blocks, block_size, n_kv_heads, head_dim], got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    batch, n_heads, head_dim = q.shape
    if k_cache.shape[3] != head_dim or k_cache.shape[2] == 0 or n_heads % k_cache.shape[2]:
        raise ValueError(f"paged attention: q {tuple(q.shape)} does not match the caches "
                         f"{tuple(k_cache.shape)} (head_dim, and n_heads a multiple of n_kv_heads)")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch \
            or context_lens.shape != (batch,):
        raise ValueError(f"paged attention: block_tables must be [{batch}, max_blocks] and "
                         f"context_lens [{batch}], got {tuple(block_tables.shape)} and "
                         f"{tuple(context_lens.shape)}")


NewToken = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def write_new_token(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor,
                    new_token: NewToken) -> torch.Tensor:
    """What the kernel does first with `new_token`, as stage 13's rope_cache_write on copies of
    q and k: each sequence's new key and value go to the slot of its key context_lens[b] - 1,
    by its block table; a padding row, a length past the table, or a block outside the pool
    stores nothing. The slots are computed on the device (no host read: CUDA-graph safe).
    Returns the rotated q. The twin's first step (on CUDA the kernel does it itself)."""
    k, v, positions, cos_sin = new_token
    num_blocks, block_size = k_cache.shape[:2]
    tables, lens = block_tables.long(), context_lens.long()
    last = (lens - 1).clamp(min=0)
    column = (last // block_size).clamp(max=tables.shape[1] - 1)
    block = tables.gather(1, column.unsqueeze(1)).squeeze(1)
    stored = ((lens > 0) & (lens <= tables.shape[1] * block_size)
              & (block >= 0) & (block < num_blocks))
    slots = torch.where(stored, block * block_size + last % block_size, -1)
    q = q.clone()
    parts.load("13", "cache_write").rope_cache_write(q, k.clone(), v, positions, cos_sin,
                                                      k_cache, v_cache, slots)
    return q


def paged_decode_attention_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor,
                                  scale: float, out: torch.Tensor | None = None,
                                  max_context: int | None = None,
                                  split: bool | None = None,
                                  partition: int | None = None,
                                  new_token: NewToken | None = None) -> torch.Tensor:
    """Plain torch, one sequence at a time, in float32; the result is cast to q's dtype.

    q: [batch, n_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, n_kv_heads,
    head_dim]; block_tables: [batch, max_blocks] int; context_lens: [batch] int (0: a padding
    row, its output is zeros). Returns [batch, n_heads, head_dim], into `out` when given.
    max_context: no context may be longer (the kernel's contract); split and partition are the
    kernel's, checked as it checks them (the math does not depend on them).
    new_token: see the top (write_new_token).
    """
    _check(q, k_cache, v_cache, block_tables, context_lens)
    if partition is not None and (partition < 0 or partition % 16 or partition > 1 << 20
                                  or (partition and split is False)):
        raise ValueError(f"paged attention: partition must be a multiple of 16 keys up to 2^20 "
                         f"(0: the kernel's), and not with split=False, got {partition} "
                         f"(split={split})")
    tables, lens = block_tables.tolist(), context_lens.tolist()
    if max_context is not None and any(n > max_context for n in lens):
        raise ValueError(f"paged attention: a context length in {lens} exceeds "
                         f"max_context = {max_context}")
    batch, n_heads, head_dim = q.shape
    num_blocks, block_size, n_kv, _ = k_cache.shape
    # every row checked before the new token is stored: bad input changes no cache
    for b, n in enumerate(lens):
        blocks = tables[b][: -(-n // block_size)]
        if not all(0 <= x < num_blocks for x in blocks) or n > len(tables[b]) * block_size:
            raise ValueError(f"paged attention: sequence {b} needs {n} keys but its block table "
                             f"{tables[b]} does not hold them (blocks 0..{num_blocks - 1})")
    if new_token is not None:
        q = write_new_token(q, k_cache, v_cache, block_tables, context_lens, new_token)
    group = n_heads // n_kv
    result = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    for b in range(batch):
        n = lens[b]
        if n == 0:
            result[b] = 0
            continue
        index = torch.tensor(tables[b][: -(-n // block_size)], device=k_cache.device)
        ks = k_cache.index_select(0, index).reshape(-1, n_kv, head_dim)[:n]   # [n, kv, d]
        vs = v_cache.index_select(0, index).reshape(-1, n_kv, head_dim)[:n]
        qs = q[b].float().reshape(n_kv, group, head_dim)                        # [kv, g, d]
        scores = (qs @ ks.float().transpose(0, 1).transpose(1, 2)) * scale      # [kv, g, n]
        probs = torch.softmax(scores, dim=-1)
        result[b] = (probs @ vs.float().transpose(0, 1)).reshape(n_heads, head_dim).to(q.dtype)
    return result


def paged_decode_attention_simple(q: torch.Tensor, k_cache: torch.Tensor,
                                  v_cache: torch.Tensor, block_tables: torch.Tensor,
                                  context_lens: torch.Tensor, scale: float,
                                  out: torch.Tensor | None = None,
                                  max_context: int | None = None, split: bool | None = None,
                                  partition: int | None = None,
                                  new_token: NewToken | None = None) -> torch.Tensor:
    """Part 1's kernel on CUDA (paged_attention_simple.cu), the twin on CPU. The arguments are
    paged_decode_attention_fast's; this kernel has no split-K, so split and partition change
    nothing here (they are taken so that either kernel serves the same call). head_dim: any
    multiple of 8 up to 128; block_size a power of two. With new_token, stage 13's
    rope_cache_write stores the new token first (write_new_token), then the kernel reads it."""
    if not q.is_cuda:
        return paged_decode_attention_native(q, k_cache, v_cache, block_tables, context_lens,
                                             scale, out, max_context, split, partition, new_token)
    if new_token is not None:
        q = write_new_token(q, k_cache, v_cache, block_tables, context_lens, new_token)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    parts.kernels().paged_decode_attention_simple(
        q, k_cache, v_cache, block_tables, context_lens, float(scale),
        -1 if max_context is None else int(max_context), out)
    return out


def paged_decode_attention_fast(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, context_lens: torch.Tensor,
                                scale: float, out: torch.Tensor | None = None,
                                max_context: int | None = None, split: bool | None = None,
                                partition: int | None = None,
                                new_token: NewToken | None = None) -> torch.Tensor:
    """Part 2's kernel on CUDA (paged_attention.cu), the twin on CPU.

    q: [batch, n_heads, head_dim] bf16, each row's heads contiguous, rows a multiple of 8
    elements apart (it may be a view of a fused QKV tensor). k_cache, v_cache: [num_blocks,
    block_size, n_kv_heads, head_dim] bf16, contiguous, block_size a power of two; head_dim a
    multiple of 8 up to 128. block_tables: [batch, max_blocks] int32 (entries past a
    sequence's last block are never read); context_lens: [batch] int32 (0 = a padding row,
    zeros). out: optional contiguous [batch, n_heads, head_dim] bf16 buffer.
    max_context: the longest context any call may bring (the engine passes max_model_len);
    None = max_blocks * block_size. With the batch and the heads it fixes split-K's partitions
    (see `partition_keys`). split: None = the kernel decides (split when batch * n_kv_heads is
    small against the SM count), True / False = always / never (tests, measurements).
    partition: None = the kernel's partition size; a multiple of 16 = split-K in partitions
    of that many keys, whatever the batch (tests, measurements; not with split=False).
    new_token: (k, v, positions, cos_sin) of the step's new tokens, not yet in the cache, and q
    not rotated (see the top): k, v [batch, n_kv_heads, head_dim] bf16 (views of the QKV rows,
    one row stride), positions [batch] int64, cos_sin [max_positions, head_dim] float32 (stage
    05's table). A position outside the table gives a NaN row. On CUDA the kernel rotates and
    stores them itself (any head_dim); the twin runs write_new_token first.
    The CUDA path never reads a device value on the host (it can be captured in a CUDA
    graph), so it cannot check values: a row whose length exceeds max_context or the block
    table, or whose blocks lie outside the pool, is NaN. Validate them on the host.
    """
    if not q.is_cuda:
        return paged_decode_attention_native(q, k_cache, v_cache, block_tables, context_lens,
                                             scale, out, max_context, split, partition, new_token)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    parts.kernels().paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, float(scale),
        -1 if max_context is None else int(max_context), -1 if split is None else int(bool(split)),
        out, 0 if partition is None else int(partition), *(new_token or (None,) * 4))
    return out


_written = ops.FirstWritten("paged_decode_attention (stage 14)", paged_decode_attention_fast,
                            paged_decode_attention_simple)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None, max_context: int | None = None,
                           split: bool | None = None, partition: int | None = None,
                           new_token: NewToken | None = None) -> torch.Tensor:
    """What the engine calls (same arguments as paged_decode_attention_fast): the twin on CPU;
    on CUDA the fast kernel, or the simple one while the fast one is still a TODO."""
    if not q.is_cuda:
        return paged_decode_attention_native(q, k_cache, v_cache, block_tables, context_lens,
                                             scale, out, max_context, split, partition, new_token)
    return _written(q, k_cache, v_cache, block_tables, context_lens, scale, out, max_context,
                    split, partition, new_token)


def partition_keys(batch: int, n_heads: int, n_kv_heads: int, max_context: int,
                   split: bool | None = None) -> int:
    """Split-K's partition size on the current CUDA device for a call of these sizes: keys per
    partition (1024, 512, 256, 128 or 64), or 0 for the single pass. max_context: the longest
    context the call allows, min(max_context, max_blocks * block_size) of
    `paged_decode_attention`. Its partition count is then ceil(max_context / keys)."""
    return int(parts.kernels().paged_attention_partition_keys(
        int(batch), int(n_heads), int(n_kv_heads), int(max_context),
        -1 if split is None else int(bool(split))))
