"""The memory-bandwidth floor of a decode step: no step can take less than its bytes allow.

A decode step reads every weight once (the tied embedding once, as the lm_head) and the K/V
of every cached token of every sequence; at the measured copy bandwidth that is the least
time it can take. For Llama-3.2-1B in bf16: 2.47 GB of weights, 32 KiB of K/V per token;
at 4.28 TB/s about 0.58 ms per step at batch 1.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:   # a stage folder is no package: parts.load names its types
    from course import parts
    LlamaModel = parts.load("08", "model").LlamaModel


def weight_bytes(model: LlamaModel) -> int:
    """Bytes of the stage-08 LlamaModel's weights (each tensor once, however it is used)."""
    tensors = [model.embed_tokens, model.final_norm, model.lm_head]
    tensors += [w for layer in model.layers for w in vars(layer).values()
                if hasattr(w, "element_size")]
    seen, total = set(), 0
    for t in tensors:
        if t.data_ptr() not in seen:       # a tied lm_head is the embedding: read once
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def kv_bytes_per_token(model: LlamaModel) -> int:
    """K and V bytes of one cached token over all layers."""
    from course import parts
    return parts.load("09", "kv_cache").KVCache.bytes_per_token(model.config, model.dtype)


def step_floor_s(weights: int, kv_per_token: int, cached_tokens: int, bandwidth: float) -> float:
    """Seconds a decode step needs at least: (weights + K/V of cached_tokens) / bandwidth.

    weights, kv_per_token: bytes; cached_tokens: summed over the batch; bandwidth: bytes/s."""
    return (weights + kv_per_token * cached_tokens) / bandwidth


def decode_floor_s(weights: int, kv_per_token: int, batch: int, prompt: int, new: int,
                   bandwidth: float) -> float:
    """Mean floor (s) of the decode steps of `batch` sequences, prompt + new tokens each: the
    step producing token i reads prompt + i cached tokens per sequence, on average
    prompt + (new - 1) / 2 (the first token comes from the prefill, not a decode step)."""
    mean_cached = prompt + (new - 1) / 2
    return step_floor_s(weights, kv_per_token, round(batch * mean_cached), bandwidth)
