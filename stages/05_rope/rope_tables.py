"""Stage 05 part: the tables behind rotary embeddings, computed exactly as transformers does.

    inv_freq(head_dim, theta, scaling)   [head_dim/2] float32: the rotation speed of each pair
    cos_sin_cache(...)                   [max_positions, head_dim] float32: cos | sin of pos * inv_freq

Pair i of a head rotates by the angle pos * inv_freq[i], with inv_freq[i] = theta^(-2i/d):
pair 0 turns one radian per token, the last pair barely moves. Llama 3 stretches the slow
(long-wavelength) pairs so a model trained on 8192 tokens reaches 131072; see the lesson.

Every float here is float32, in the order of operations transformers uses, because the engine
must match it bit for bit: an angle computed in float64 differs from HF's float32 one by up to
half an ulp of pos * inv_freq -- at position 100000 that is ~0.004 radian.
Run: nox -s grade -- 05
"""
from __future__ import annotations

import math
from typing import Protocol

import torch


class RopeScalingLike(Protocol):
    """What this module reads of a rope scaling config (stage 01's config.RopeScaling)."""

    rope_type: str
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


def inv_freq(head_dim: int, rope_theta: float,
             scaling: RopeScalingLike | None = None) -> torch.Tensor:
    """The inverse frequency of each rotated pair: [head_dim // 2] float32, on the CPU.

    theta^(-2i / head_dim) for i in 0 .. head_dim/2 - 1, then Llama-3 scaling when `scaling`
    is a "llama3" RopeScaling (None or rope_type "default": no scaling).
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even number, got {head_dim}")
    # TODO stage 05: freqs = 1 / theta ** (arange(0, head_dim, 2) / head_dim), all in float32 as HF does (about 1 line)
    raise NotImplementedError("TODO stage 05: freqs = 1 / theta ** (arange(0, head_dim, 2) / head_dim), all in float32 as HF does (about 1 line)")
    if scaling is None or scaling.rope_type == "default":
        return freqs
    if scaling.rope_type != "llama3":
        raise ValueError(f"rope_type {scaling.rope_type!r} is not supported: tiny-vllm "
                         "implements 'default' and 'llama3' rope scaling")
    return llama3_scaled(freqs, scaling)


def llama3_scaled(freqs: torch.Tensor, scaling: RopeScalingLike) -> torch.Tensor:
    """Llama 3.1's frequency scaling (transformers' _compute_llama3_parameters).

    With wavelen = 2 pi / freq and the original context L = original_max_position_embeddings:
      wavelen < L / high_freq_factor  (fast pairs, local detail)   freq unchanged
      wavelen > L / low_freq_factor   (slow pairs, long range)     freq / factor
      otherwise                                                    a smooth blend of the two
    """
    # TODO stage 05: the three wavelength bands; smooth = (L / wavelen - low) / (high - low) blends freq/factor and freq (about 10 lines)
    raise NotImplementedError("TODO stage 05: the three wavelength bands; smooth = (L / wavelen - low) / (high - low) blends freq/factor and freq (about 10 lines)")


def cos_sin_cache(head_dim: int, rope_theta: float, scaling: RopeScalingLike | None,
                  max_positions: int, device: torch.device | str | None = None) -> torch.Tensor:
    """cos and sin of every angle pos * inv_freq[i]: [max_positions, head_dim] float32.

    Row p holds cos(p * inv_freq) in its first head_dim/2 columns and sin(p * inv_freq) in
    the last head_dim/2 (vLLM's layout). Angles are float32 products of float32 positions
    and inv_freq, as in HF's LlamaRotaryEmbedding; cos and sin run on `device` as HF's do on
    the model's device. Build it once per model for max_position_embeddings positions: prefill
    and decode index the same table.
    """
    if max_positions <= 0:
        raise ValueError(f"max_positions must be positive, got {max_positions}")
    freqs = inv_freq(head_dim, rope_theta, scaling).to(device)
    # TODO stage 05: float32 positions outer freqs -> angles [max_positions, head_dim/2]; cat(cos, sin) (about 3 lines)
    raise NotImplementedError("TODO stage 05: float32 positions outer freqs -> angles [max_positions, head_dim/2]; cat(cos, sin) (about 3 lines)")
