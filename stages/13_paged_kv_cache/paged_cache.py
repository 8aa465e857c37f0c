# GIVEN FILE: generated from solutions/13_paged_kv_cache/paged_cache.py by `nox -s sync-stages`.
# Read it; do not edit it. It is not graded (the grader uses the reference
# copy), and any edit here is overwritten.
"""Stage 13 (given): the paged KV cache, the attention backend that uses it, and the pool size.

Per layer the cache is a pool of blocks,

    k[layer], v[layer]: [num_blocks, block_size, n_kv_heads, head_dim]

and a sequence's K/V are spread over the blocks of its block table (block_manager.py):
position p is flat row `block_table[p // block_size] * block_size + p % block_size` of
`k[layer].view(-1, n_kv_heads, head_dim)` -- stage 09's StepPlan computes exactly those rows
(its slot_mapping and key_rows) from each sequence's blocks, so the step plan, the metadata
and stage 10's decode graphs work unchanged. Block 0 is the pad block (`pad_slot`): padding
rows of a decode graph write their K/V there and their block tables point at it.

`PagedAttention` is the attention backend over this cache:

    rotate q, k and write the new K/V   -> rope_cache_write (this stage's kernel: stage 05's
                                           rope and the store in one; the model hands the
                                           rotation over because `applies_rope` is true)
    every sequence has one new token    -> paged_decode_attention (stage 14) over the block
                                           tables; with stage 14 it does the rotation and
                                           the store itself (new_token=...), and
                                           rope_cache_write does not run here
    no sequence has cached tokens       -> prefill_attention over the new tokens
    otherwise (a prompt continued, a prefix-cache hit, a recompute after preemption)
                                        -> gather each sequence's keys (key_rows), prefill with
                                           more keys than queries (cu_seqlens_k)

`kv_cache_blocks` sizes the pool: on a GPU from the memory left after a warm-up forward of the
largest prefill step, on a CPU from a budget in GiB.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from course import manifest, ops, parts

_meta = parts.load("08", "attention_metadata")
if TYPE_CHECKING:   # a stage folder is no package: parts.load names its types
    AttentionMetadata = _meta.AttentionMetadata
    ModelConfig = parts.load("01", "config").ModelConfig
    LlamaModel = parts.load("08", "model").LlamaModel

GiB = 1 << 30


class PagedKVCache:
    """K and V of every layer in num_blocks blocks of block_size positions.

    max_len: the longest sequence (the engine's max_model_len; decode graphs read it), so a
    block table has at most ceil(max_len / block_size) blocks.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, max_len: int,
                 n_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str | torch.device):
        if min(num_layers, block_size, max_len, n_kv_heads, head_dim) < 1 or num_blocks < 2:
            raise ValueError("a paged KV cache needs at least one layer, position, head and head "
                             "dimension, and two blocks (one is the pad block), got "
                             f"{num_layers}, {block_size}, {max_len}, {n_kv_heads}, {head_dim}, "
                             f"{num_blocks}")
        self.num_blocks, self.block_size, self.max_len = num_blocks, block_size, max_len
        self.pad_slot = 0   # the pad block: block 0, never handed out by the block manager
        self.max_blocks = -(-max_len // block_size)
        shape = (num_blocks, block_size, n_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._rope_write = ops.get("rope_cache_write")

    @classmethod
    def for_model(cls, model: LlamaModel, num_blocks: int, block_size: int,
                  max_len: int | None = None) -> "PagedKVCache":
        """A cache shaped for a stage-08 LlamaModel (its dtype and device)."""
        c = model.config
        return cls(c.num_hidden_layers, num_blocks, block_size, max_len or model.max_positions,
                   c.num_key_value_heads, c.head_dim, model.dtype, model.device)

    @staticmethod
    def block_bytes(config: ModelConfig, dtype: torch.dtype, block_size: int) -> int:
        """K and V of one block in every layer."""
        return block_size * parts.load("09", "kv_cache").KVCache.bytes_per_token(config, dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def rope_write(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slot_mapping: torch.Tensor, positions: torch.Tensor,
                   cos_sin: torch.Tensor) -> None:
        """Rotate q and k in place (RoPE at `positions`, stage 05's cos_sin table), then store
        the new tokens' K and V (views allowed) at their flat rows (-1: nowhere): one kernel."""
        self._rope_write(q, k, v, positions, cos_sin, self.k[layer], self.v[layer], slot_mapping)

    def gather(self, layer: int, key_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given flat rows, packed: key_rows [N] int64 -> two [N, kv, d]."""
        kc, vc = self.k[layer], self.v[layer]
        return (kc.view(-1, *kc.shape[2:]).index_select(0, key_rows),
                vc.view(-1, *vc.shape[2:]).index_select(0, key_rows))


def _gathered_decode(q, k_cache, v_cache, block_tables, context_lens, scale, max_context=None):
    """Decode attention over a paged cache without stage 14: copy each sequence's blocks into
    a contiguous [B, max_blocks * block_size] cache and run stage 09's decode attention over
    it. Correct and graph-safe, but it moves every sequence's whole block table each layer."""
    batch = block_tables.shape[0]
    index = block_tables.long()
    ks = k_cache[index].flatten(1, 2)       # [B, max_blocks * block_size, n_kv, d]
    vs = v_cache[index].flatten(1, 2)
    slots = torch.arange(batch, dtype=torch.int32, device=q.device)
    return ops.get("decode_attention")(q, ks, vs, slots, context_lens, scale)


class PagedAttention:
    """The attention backend over a PagedKVCache (see the top)."""

    applies_rope = True     # the model passes rope=(positions, cos_sin) instead of rotating

    def __init__(self) -> None:
        self.rope = ops.get("apply_rope_")
        self.prefill = ops.get("prefill_attention")
        try:
            self.decode = ops.get("paged_decode_attention")
        except KeyError:    # stage 14 not available yet
            self.decode = _gathered_decode

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata, scale: float,
                 rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """q: [T, n_heads, d], k, v: [T, n_kv_heads, d] of the new tokens, not yet rotated;
        rope: (positions [T] int64, cos_sin [max_positions, d] float32) -> [T, n_heads, d]."""
        positions, cos_sin = rope
        cache = meta.kv_cache
        if cache is None:   # a step without a cache (a warm-up, stage 08's packed_inputs)
            self.rope(q, k, positions, cos_sin, check=False)
            return self.prefill(q, k, v, meta.cu_seqlens_q, scale, max_seqlen_q=meta.max_seqlen_q)
        # stage 14 takes the new token itself (new_token=): no separate rope_cache_write
        if meta.decode and self.decode is not _gathered_decode:
            return self.decode(q, cache.k[layer], cache.v[layer], meta.block_tables,
                               meta.context_lens, scale, max_context=cache.max_len,
                               new_token=(k, v, positions, cos_sin))
        cache.rope_write(layer, q, k, v, meta.slot_mapping, positions, cos_sin)
        if meta.decode:
            return self.decode(q, cache.k[layer], cache.v[layer], meta.block_tables,
                               meta.context_lens, scale, max_context=cache.max_len)
        if meta.key_rows is None:
            return self.prefill(q, k, v, meta.cu_seqlens_q, scale,
                                max_seqlen_q=meta.max_seqlen_q)
        keys, values = cache.gather(layer, meta.key_rows)
        return self.prefill(q, keys, values, meta.cu_seqlens_q, scale,
                            cu_seqlens_k=meta.cu_seqlens_k, max_seqlen_q=meta.max_seqlen_q)


def paging_ready() -> bool:
    """Whether stage 13 is available (the engine pages its cache by default then)."""
    return manifest.find("13").ready


def warmup_lengths(tokens: int, max_len: int, max_seqs: int) -> list[int]:
    """Sequence lengths of the largest prefill step: `tokens` tokens over as many sequences as
    a step may hold (max_seqs; more if max_len forces it), as even as possible."""
    n = max(min(max_seqs, tokens), -(-tokens // max_len))
    return [tokens // n + (i < tokens % n) for i in range(n)]


@torch.no_grad()
def peak_step_bytes(model: LlamaModel, tokens: int, max_len: int, max_seqs: int) -> int:
    """CUDA: the memory one prefill step of `tokens` tokens (and its logits) takes at its peak,
    beyond what is allocated now, measured by running it (the model's attention backend must
    handle a step without a cache)."""
    device = model.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    lengths = warmup_lengths(tokens, max_len, max_seqs)
    ids = torch.zeros(sum(lengths), dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    meta = _meta.prefill_metadata(lengths, device)
    hidden = model.forward(ids, positions, meta)
    logits = model.compute_logits(hidden, meta.last_rows)
    del hidden, logits
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return peak


def kv_cache_blocks(model: LlamaModel, block_size: int, max_len: int, max_num_seqs: int,
                    max_num_batched_tokens: int, gpu_memory_utilization: float = 0.9,
                    cpu_gib: float = 1.0) -> int:
    """How many blocks (the pad block included) the pool gets.

    CUDA: gpu_memory_utilization of the device's total memory, minus what is in use now
    (weights, other processes), minus the peak of a warm-up step of max_num_batched_tokens
    tokens (activations), in blocks. CPU: cpu_gib GiB. Never more than every sequence at
    max_len would use (max_num_seqs full block tables and the pad block). ValueError when
    the memory does not hold one sequence of max_len positions.
    """
    per_block = PagedKVCache.block_bytes(model.config, model.dtype, block_size)
    max_blocks = -(-max_len // block_size)
    if model.device.type == "cuda":
        activations = peak_step_bytes(model, max_num_batched_tokens, max_len, max_num_seqs)
        free, total = torch.cuda.mem_get_info(model.device)
        budget = total * gpu_memory_utilization - (total - free) - activations
    else:
        budget = cpu_gib * GiB
    blocks = min(int(budget // per_block), max_num_seqs * max_blocks + 1)
    if blocks < max_blocks + 1:
        advice = ("lower max_model_len or max_num_batched_tokens, or raise "
                  "gpu_memory_utilization" if model.device.type == "cuda" else
                  "lower max_model_len, or raise the CPU cache size (EngineConfig.kv_cache_gib)")
        raise ValueError(f"the KV cache memory ({max(budget, 0) / GiB:.3g} GiB) does not hold "
                         f"one sequence of {max_len} positions ({max_blocks} blocks of "
                         f"{block_size} and the pad block: {(max_blocks + 1) * per_block / GiB:.3g}"
                         f" GiB): {advice}")
    return blocks
