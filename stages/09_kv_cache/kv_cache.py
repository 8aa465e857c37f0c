"""Stage 09: a KV cache, and attention that reads it.

A token's key and value never change once computed (attention only looks back), so keep
them: then each new token costs one token-forward instead of a forward over the whole
sequence. Per layer the cache holds

    k[layer], v[layer]: [num_slots + 1, max_len, n_kv_heads, head_dim]

Sequence s owns one slot (a row block of max_len positions); the K/V of its token at
position p live in row p of its slot, that is flat row `slot * max_len + p` of
`k[layer].view(-1, n_kv_heads, head_dim)`. K is stored after rotary embedding, so a cached key
never needs rotating again. The extra last slot, `pad_slot`, belongs to nobody: padding rows of
a fixed-size batch (stage 10's CUDA graphs) write their K/V there.

`StepPlan` describes one step on the host -- which sequences, how many tokens each has cached
and how many are new -- and turns into the AttentionMetadata of stage 08. `KVCacheAttention`
is the attention backend that writes the new K/V into the cache and then attends:

    every sequence has one new token   -> decode_attention (stage 09's kernel) over its slot
    no sequence has cached tokens      -> prefill_attention (stage 07) over the new tokens
    otherwise (a prompt continued)     -> gather each sequence's keys, prefill_attention with
                                          more keys than queries
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from course import ops, parts

_meta = parts.load("08", "attention_metadata")
check_prompt = parts.load("08", "model").check_prompt
AttentionMetadata, offsets, to_device = _meta.AttentionMetadata, _meta.offsets, _meta.to_device
if TYPE_CHECKING:   # a stage folder is no package: parts.load names its types
    ModelConfig = parts.load("01", "config").ModelConfig
    LlamaModel = parts.load("08", "model").LlamaModel


class KVCache:
    """K and V of every layer for `num_slots` sequences of up to `max_len` tokens each."""

    def __init__(self, num_layers: int, num_slots: int, max_len: int, n_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str | torch.device):
        if min(num_layers, num_slots, max_len, n_kv_heads, head_dim) < 1:
            raise ValueError("a KV cache needs at least one layer, slot, position, head and "
                             f"head dimension, got {num_layers}, {num_slots}, {max_len}, "
                             f"{n_kv_heads}, {head_dim}")
        self.num_slots, self.max_len = num_slots, max_len
        self.pad_slot = num_slots   # the extra slot that padding rows write to
        # Seen as a paged cache (stage 13): blocks of max_len positions, one per sequence.
        self.block_size, self.num_blocks = max_len, num_slots + 1
        # TODO stage 09: per layer, zero k and v tensors [num_slots + 1, max_len, n_kv_heads, head_dim] (about 3 lines)
        raise NotImplementedError("TODO stage 09: per layer, zero k and v tensors [num_slots + 1, max_len, n_kv_heads, head_dim] (about 3 lines)")

    @classmethod
    def for_model(cls, model: LlamaModel, num_slots: int, max_len: int | None = None) -> "KVCache":
        """A cache shaped for a stage-08 LlamaModel (its dtype and device)."""
        c = model.config
        return cls(c.num_hidden_layers, num_slots, max_len or model.max_positions,
                   c.num_key_value_heads, c.head_dim, model.dtype, model.device)

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
        """K and V of one token in every layer: 2 * layers * kv_heads * head_dim * itemsize."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * itemsize

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """Store the new tokens' K and V: k, v [T, n_kv_heads, head_dim] (views allowed),
        slot_mapping [T] int64, each token's flat row slot * max_len + position."""
        # TODO stage 09: index_copy_ into flat [rows, n_kv_heads, head_dim] views of k[layer] and v[layer] (about 3 lines)
        raise NotImplementedError("TODO stage 09: index_copy_ into flat [rows, n_kv_heads, head_dim] views of k[layer] and v[layer] (about 3 lines)")

    def gather(self, layer: int, key_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given flat rows, packed: key_rows [N] int64 -> two [N, kv, d]."""
        # TODO stage 09: index_select the rows from flat views of k[layer] and v[layer] (about 3 lines)
        raise NotImplementedError("TODO stage 09: index_select the rows from flat views of k[layer] and v[layer] (about 3 lines)")


@dataclass(slots=True)   # made for every sequence of every step: slots make it cheaper
class SeqStep:
    """One sequence's share of a step: the cache blocks it owns, in order (here one block, its
    slot: `[slot]`; stage 13 pages the cache), tokens already cached, new tokens."""
    blocks: Sequence[int]
    cached: int
    new: int


@dataclass
class StepPlan:
    """A step on the host: plain lists, checked once, then copied to the device.

    Position p of a sequence lives in cache row blocks[p // block_size] * block_size +
    p % block_size of the flat [rows, n_kv_heads, head_dim] view: with one block of max_len
    positions per sequence (this stage's cache) that is slot * max_len + p.
    """
    positions: list[int]
    cu_seqlens_q: list[int]
    cu_seqlens_k: list[int]
    slot_mapping: list[int]
    block_tables: list[list[int]]
    context_lens: list[int]
    key_rows: list[int] | None
    decode: bool

    @classmethod
    def build(cls, steps: Sequence[SeqStep], cache: KVCache) -> "StepPlan":
        """The plan of a step over `cache` (its block_size and num_blocks); ValueError for a
        sequence that does not fit the blocks it owns.

        It runs on the host every step, for every sequence (256 of them in a decode step of a
        busy engine), so it is written as plain loops over Python ints with no per-position
        work beyond what the step needs: a decode step costs a few lists of B entries.
        """
        if not steps:
            raise ValueError("a step needs at least one sequence")
        bs, n_blocks = cache.block_size, cache.num_blocks
        positions, slot_mapping, lens = [], [], []
        decode = all(s.new == 1 for s in steps)
        key_rows = [] if not decode and any(s.cached for s in steps) else None
        for s in steps:
            blocks, start, end = s.blocks, s.cached, s.cached + s.new
            # The blocks this step writes must exist (the kernels would write elsewhere); the
            # allocator that made the table vouches for the rest.
            if not (0 <= start < end <= len(blocks) * bs
                    and 0 <= blocks[start // bs] < n_blocks
                    and 0 <= blocks[(end - 1) // bs] < n_blocks):
                raise ValueError(f"bad sequence step {s}: {s.cached} cached + {s.new} new "
                                 f"tokens must fit its {len(blocks)} block(s) of {bs} positions, "
                                 f"numbered 0..{n_blocks - 1}, with at least one new token")
            if end - start == 1:
                positions.append(start)
                slot_mapping.append(blocks[start // bs] * bs + start % bs)
            else:
                positions.extend(range(start, end))
                slot_mapping.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            if key_rows is not None:
                key_rows.extend(blocks[p // bs] * bs + p % bs for p in range(end))
            lens.append(end)
        return cls(positions=positions, cu_seqlens_q=[0, *accumulate(s.new for s in steps)],
                   cu_seqlens_k=[0, *accumulate(lens)], slot_mapping=slot_mapping,
                   block_tables=[s.blocks for s in steps], context_lens=lens,
                   key_rows=key_rows, decode=decode)

    @property
    def seq_slots(self) -> list[int]:
        """Each sequence's first block: its slot in a cache of one block per sequence."""
        return [blocks[0] for blocks in self.block_tables]

    def padded_block_tables(self, width: int | None = None) -> list[list[int]]:
        """The block tables as a rectangle, rows padded with 0 to `width` (default: the
        longest); a kernel reads only the blocks its context length needs."""
        width = width or max(len(b) for b in self.block_tables)
        return [b + [0] * (width - len(b)) for b in self.block_tables]

    def metadata(self, cache: KVCache, device: str | torch.device
                 ) -> tuple[torch.Tensor, AttentionMetadata]:
        """(positions [T] int64, AttentionMetadata) on `device`."""
        def t(values, dtype):
            return to_device(values, dtype, device)
        lens_q = [b - a for a, b in zip(self.cu_seqlens_q, self.cu_seqlens_q[1:])]
        meta = AttentionMetadata(
            cu_seqlens_q=t(self.cu_seqlens_q, torch.int32),
            cu_seqlens_k=t(self.cu_seqlens_k, torch.int32),
            max_seqlen_q=max(lens_q), max_seqlen_k=max(self.context_lens),
            last_rows=t([c - 1 for c in self.cu_seqlens_q[1:]], torch.int64), kv_cache=cache,
            slot_mapping=t(self.slot_mapping, torch.int64),
            seq_slots=t(self.seq_slots, torch.int32),
            block_tables=t(self.padded_block_tables(), torch.int32),
            context_lens=t(self.context_lens, torch.int32),
            key_rows=None if self.key_rows is None else t(self.key_rows, torch.int64),
            decode=self.decode)
        return t(self.positions, torch.int64), meta


class KVCacheAttention:
    """The attention backend with a cache: write the new K/V, then attend (see the top)."""

    def __init__(self) -> None:
        self.prefill = ops.get("prefill_attention")
        self.decode = ops.get("decode_attention")

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, n_heads, d], k, v: [T, n_kv_heads, d] of the new tokens -> [T, n_heads, d]."""
        cache = meta.kv_cache
        if cache is None:   # a step described without a cache (stage 08's packed_inputs)
            return self.prefill(q, k, v, meta.cu_seqlens_q, scale, max_seqlen_q=meta.max_seqlen_q)
        # TODO stage 09: cache.write; decode -> self.decode over the slots; no key_rows -> self.prefill over the new tokens; else gather and self.prefill with cu_seqlens_k (about 10 lines)
        raise NotImplementedError("TODO stage 09: cache.write; decode -> self.decode over the slots; no key_rows -> self.prefill over the new tokens; else gather and self.prefill with cu_seqlens_k (about 10 lines)")


def generate_greedy(model: LlamaModel, prompt_ids: list[int], max_new_tokens: int,
                    eos_ids: Iterable[int] = (), cache: KVCache | None = None) -> list[int]:
    """Greedy decoding with a KV cache: one prefill of the prompt, then one token a step.

    model: a stage-08 LlamaModel whose attention backend is KVCacheAttention (this function
    sets it). Returns up to max_new_tokens ids, ending with an eos id if one was emitted.
    """
    check_prompt(model, prompt_ids, max_new_tokens)
    if max_new_tokens < 1:
        return []
    cache = cache or KVCache.for_model(model, num_slots=1,
                                       max_len=len(prompt_ids) + max_new_tokens)
    model.attention = KVCacheAttention()
    argmax, eos = ops.get("argmax"), set(eos_ids)
    out: list[int] = []
    # TODO stage 09: prefill the prompt (SeqStep([0], 0, len)); then while tokens remain, decode the last token (SeqStep([0], cached, 1)); stop after an eos (about 13 lines)
    raise NotImplementedError("TODO stage 09: prefill the prompt (SeqStep([0], 0, len)); then while tokens remain, decode the last token (SeqStep([0], cached, 1)); stop after an eos (about 13 lines)")
