"""Stage 05: the rotary tables (rope_tables.py), on the CPU, against transformers.

Oracles: transformers' rope init functions (the default one and ROPE_INIT_FUNCTIONS["llama3"])
for inv_freq, and LlamaRotaryEmbedding's cos/sin for the cache. Configurations: SmolLM2
(head_dim 64, theta 100000, no scaling), Llama-3.2-1B (64, 500000, llama3 factor 32),
Llama-3.1-8B (128, 500000, llama3 factor 8) and a tiny context (original 64) that puts
every band of the Llama-3 scaling among a few frequencies.
"""
from __future__ import annotations

import pytest
import torch

from course import parts
from course.testing import checks

# name: (head_dim, theta, llama3 (factor, low, high, original context) or None)
CONFIGS = {
    "smollm2": (64, 100000.0, None),
    "llama3.2-1b": (64, 500000.0, (32.0, 1.0, 4.0, 8192)),
    "llama3.1-8b": (128, 500000.0, (8.0, 1.0, 4.0, 8192)),
    "tiny-context": (128, 10000.0, (4.0, 1.0, 4.0, 64)),
}


def tables():
    return parts.load("05", "rope_tables")


def rope_scaling(spec):
    if spec is None:
        return None
    factor, low, high, context = spec
    config = parts.reference("01", "config")
    return config.RopeScaling(rope_type="llama3", factor=factor, low_freq_factor=low,
                              high_freq_factor=high, original_max_position_embeddings=context)


def hf_config(head_dim: int, theta: float, spec, max_positions: int = 131072):
    from transformers import LlamaConfig
    kw = dict(hidden_size=head_dim * 2, num_attention_heads=2, num_key_value_heads=2,
              head_dim=head_dim, rope_theta=theta, max_position_embeddings=max_positions)
    if spec is not None:
        factor, low, high, context = spec
        kw["rope_scaling"] = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                              "high_freq_factor": high,
                              "original_max_position_embeddings": context}
    return LlamaConfig(**kw)


def hf_inv_freq(head_dim: int, theta: float, spec) -> torch.Tensor:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    config = hf_config(head_dim, theta, spec)
    if spec is None:
        inv, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        inv, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    return inv


@pytest.mark.parametrize("name", CONFIGS)
def test_inv_freq_matches_transformers(name):
    head_dim, theta, spec = CONFIGS[name]
    got = tables().inv_freq(head_dim, theta, rope_scaling(spec))
    expected = hf_inv_freq(head_dim, theta, spec)
    assert got.dtype == torch.float32, f"inv_freq must be float32, got {got.dtype}"
    checks.assert_close(got, expected, what=f"inv_freq ({name})", atol=0.0, rtol=1e-6,
                        hint="theta ** -(2i/d) for i < d/2, computed in float32; with llama3 "
                             "scaling: freq unchanged when wavelen < L/high_freq_factor, "
                             "freq/factor when wavelen > L/low_freq_factor, else "
                             "(1 - s) * freq/factor + s * freq with s = (L/wavelen - low)/(high - low)")


def test_llama3_scaling_bands():
    """The tiny context puts frequencies in all three bands: each band's rule is checked."""
    head_dim, theta, spec = CONFIGS["tiny-context"]
    factor, low, high, context = spec
    plain = tables().inv_freq(head_dim, theta, None)
    scaled = tables().inv_freq(head_dim, theta, rope_scaling(spec))
    wavelen = 2 * torch.pi / plain
    fast, slow = wavelen < context / high, wavelen > context / low
    medium = ~fast & ~slow
    assert fast.any() and slow.any() and medium.any(), "test setup: every band must be populated"
    checks.assert_close(scaled[fast], plain[fast], what="fast pairs (wavelen < L/high)",
                        atol=0.0, rtol=1e-6, hint="short wavelengths are left unchanged")
    checks.assert_close(scaled[slow], plain[slow] / factor, what="slow pairs (wavelen > L/low)",
                        atol=0.0, rtol=1e-6, hint="long wavelengths are divided by factor")
    between = (scaled[medium] < plain[medium]) & (scaled[medium] > plain[medium] / factor)
    assert between.all(), (f"medium pairs must be blended strictly between freq/factor and freq; "
                           f"got {scaled[medium].tolist()} for freq {plain[medium].tolist()}")


@pytest.mark.parametrize("name", CONFIGS)
def test_cos_sin_cache_matches_llama_rotary_embedding(name):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    head_dim, theta, spec = CONFIGS[name]
    max_positions = 131072 if spec is not None else 8192
    cache = tables().cos_sin_cache(head_dim, theta, rope_scaling(spec), max_positions, "cpu")
    assert cache.shape == (max_positions, head_dim) and cache.dtype == torch.float32, (
        f"cos_sin_cache must be [max_positions, head_dim] = [{max_positions}, {head_dim}] "
        f"float32, got {tuple(cache.shape)} {cache.dtype}")
    rotary = LlamaRotaryEmbedding(hf_config(head_dim, theta, spec, max_positions))
    positions = torch.arange(max_positions)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)  # [1, max_positions, d]
    half = head_dim // 2
    hint = ("row p is cat(cos(p * inv_freq), sin(p * inv_freq)); compute the angles as float32 "
            "positions times float32 inv_freq (as HF does): float64 angles differ by up to "
            "0.004 radian at position 100000")
    checks.assert_close(cache[:, :half], cos[0, :, :half], what=f"cos half ({name})", hint=hint)
    checks.assert_close(cache[:, half:], sin[0, :, :half], what=f"sin half ({name})", hint=hint)


def test_unsupported_rope_type_is_an_error():
    config = parts.reference("01", "config")
    yarn = config.RopeScaling(rope_type="yarn", factor=4.0, low_freq_factor=1.0,
                              high_freq_factor=4.0, original_max_position_embeddings=4096)
    with pytest.raises(ValueError, match="yarn"):
        tables().inv_freq(64, 10000.0, yarn)
