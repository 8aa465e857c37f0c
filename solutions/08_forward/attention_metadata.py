"""What one forward step looks like to attention: the packed layout, and where K/V live.

A step runs the new tokens of B sequences packed back to back along the token axis (no
padding). Every op but attention works token by token; attention needs to know where each
sequence starts, how many keys it has, and -- once there is a KV cache (stage 09) -- where
each new token's K/V go and where earlier tokens' K/V are. `AttentionMetadata` says exactly
that, built once per step on the host (which is also where it is validated), so no op inside
the step ever makes the CPU wait for the GPU.

    sequences      new tokens   cached before   keys = cached + new
    a              5            0               5
    b              1            7               8         (a decode step of b)

    cu_seqlens_q = [0, 5, 6]      where each sequence's new tokens (queries) start
    cu_seqlens_k = [0, 5, 13]     where each sequence's keys start, once gathered
    positions    = [0 1 2 3 4 | 7]

An attention backend is any callable `backend(layer, q, k, v, meta, scale) -> out`:
`PrefillAttention` here (stage 07's kernel, no cache) and stage 09's `KVCacheAttention`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from course import ops


@dataclass
class AttentionMetadata:
    """One step. Tensors live on the model's device; the ints are host values.

    cu_seqlens_q: [B + 1] int32, offsets of each sequence's new tokens in the packed batch.
    cu_seqlens_k: [B + 1] int32, offsets of each sequence's keys (cached + new) when they are
        laid out packed; equal to cu_seqlens_q when nothing is cached.
    max_seqlen_q, max_seqlen_k: the longest run of each, as host ints (kernel grid sizes).
    last_rows: [B] int64, the packed row of each sequence's last new token (its logits).
    kv_cache: the stage-09 cache object, or None (stage 08: attention over the new tokens).
    slot_mapping: [T] int64, the cache row each new token's K/V is written to.
    seq_slots: [B] int32, the cache slot each sequence owns (stage 09's decode reads it).
    block_tables: [B, max_blocks] int32, the cache blocks of each sequence (stage 14's paged
        decode reads them; stage 09's cache has one block per sequence, its slot).
    context_lens: [B] int32, keys each sequence attends to (cached + new).
    key_rows: [sum of keys] int64, the cache rows of every sequence's keys, packed by
        cu_seqlens_k; None when no sequence brings cached keys (then the new K/V are the keys).
    decode: every sequence has exactly one new token (the decode kernel's case).
    """
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    last_rows: torch.Tensor
    kv_cache: Any = None
    slot_mapping: torch.Tensor | None = None
    seq_slots: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    key_rows: torch.Tensor | None = None
    decode: bool = False


class AttentionBackend(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, n_heads, d], k, v: [T, n_kv_heads, d] (the new tokens) -> [T, n_heads, d]."""


def to_device(values: Sequence[int], dtype: torch.dtype, device: str | torch.device
              ) -> torch.Tensor:
    """A host list as a tensor on `device`. To a GPU it goes through pinned (page-locked)
    memory without blocking: the copy is queued behind the GPU's work, the CPU goes on."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def offsets(lengths: Sequence[int]) -> list[int]:
    """[0, l0, l0 + l1, ...]: where each run starts when runs are packed back to back."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def prefill_metadata(lengths: Sequence[int], device: str | torch.device) -> AttentionMetadata:
    """Sequences of these lengths, every token new, no cache (stage 08's only case)."""
    if any(n < 0 for n in lengths):
        raise ValueError(f"sequence lengths must be >= 0, got {list(lengths)}")
    cu = offsets(lengths)
    cu_t = to_device(cu, torch.int32, device)
    longest = max(lengths, default=0)
    # An empty sequence has no last token; its row is clamped so compute_logits stays in range.
    last = to_device([max(c - 1, 0) for c in cu[1:]], torch.int64, device)
    return AttentionMetadata(cu_seqlens_q=cu_t, cu_seqlens_k=cu_t, max_seqlen_q=longest,
                             max_seqlen_k=longest, last_rows=last)


def packed_inputs(prompts: Sequence[Sequence[int]], device: str | torch.device = "cpu"
                  ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Whole prompts packed for one forward: (ids [T] int64, positions [T] int64, metadata).

    Positions restart at 0 in each prompt. The one helper every test, benchmark and the
    stage-08 generator use to build a packed batch.
    """
    ids = [int(t) for p in prompts for t in p]
    positions = [i for p in prompts for i in range(len(p))]
    return (to_device(ids, torch.int64, device), to_device(positions, torch.int64, device),
            prefill_metadata([len(p) for p in prompts], device))


class PrefillAttention:
    """Stage 08's backend: causal attention over the new tokens only, no cache (stage 07)."""

    def __init__(self) -> None:
        self.prefill = ops.get("prefill_attention")

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self.prefill(q, k, v, meta.cu_seqlens_q, scale, max_seqlen_q=meta.max_seqlen_q)
