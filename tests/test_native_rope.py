"""The torch-native twin of stage 05 (solutions/05_rope/rope.py) against transformers'
LlamaRotaryEmbedding + apply_rotary_pos_emb, on the CPU, in float32 and bf16, with llama3
scaling (Llama-3.2-1B) and without (SmolLM2, theta 100000)."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from course import parts
from course.testing import checks

MAX_POSITIONS = 4096
LLAMA3 = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=1024)
CASES = {  # name: (theta, llama3 scaling or None, heads, head_dim)
    "smollm2": (100000.0, None, (9, 3), 64),
    "llama3.2-1b": (500000.0, LLAMA3, (32, 8), 64),
    "llama3-mha-128": (500000.0, LLAMA3, (4, 4), 128),
}


def rope():
    return parts.reference("05", "rope")


def table(theta, scaling, head_dim):
    config = parts.reference("01", "config")
    rs = None if scaling is None else config.RopeScaling(rope_type="llama3", **scaling)
    return parts.reference("05", "rope_tables").cos_sin_cache(head_dim, theta, rs, MAX_POSITIONS)


def hf_rope(q, k, positions, theta, scaling):
    nh, d = q.shape[1], q.shape[2]
    kw = dict(hidden_size=nh * d, num_attention_heads=nh, num_key_value_heads=k.shape[1],
              head_dim=d, rope_theta=theta, max_position_embeddings=MAX_POSITIONS)
    if scaling is not None:
        kw["rope_scaling"] = {"rope_type": "llama3", **scaling}
    rotary = LlamaRotaryEmbedding(LlamaConfig(**kw))
    qh, kh = q.transpose(0, 1)[None], k.transpose(0, 1)[None]
    with torch.no_grad():
        cos, sin = rotary(qh, positions[None])
        q_out, k_out = apply_rotary_pos_emb(qh, kh, cos, sin)
    return q_out[0].transpose(0, 1), k_out[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 7, 129])
@pytest.mark.parametrize("name", CASES)
def test_native_rope_matches_hf(name, tokens, dtype, seed):
    theta, scaling, (nh, nkv), d = CASES[name]
    gen = checks.generator(seed=seed)
    q_in = checks.randn((tokens, nh, d), dtype, gen=gen)
    k_in = checks.randn((tokens, nkv, d), dtype, gen=gen)
    positions = torch.randint(0, MAX_POSITIONS, (tokens,), generator=gen)
    positions[0] = MAX_POSITIONS - 1
    q, k = q_in.clone(), k_in.clone()
    rope().apply_rope_native(q, k, positions, table(theta, scaling, d))
    q_hf, k_hf = hf_rope(q_in, k_in, positions, theta, scaling)
    checks.assert_close(q, q_hf, what="q")
    checks.assert_close(k, k_hf, what="k")
    if dtype == torch.bfloat16:  # same roundings as HF: (almost) every bit equal
        frac = torch.cat([(q != q_hf).flatten(), (k != k_hf).flatten()]).float().mean().item()
        assert frac < 1e-3, f"{frac:.3%} of bf16 elements differ from HF"


def test_native_rope_on_strided_views(seed):
    """q, k as views into a fused QKV buffer: rotated in place, v untouched."""
    gen = checks.generator(seed=seed)
    tokens, nh, nkv, d = 7, 9, 3, 64
    qkv = checks.randn((tokens, (nh + 2 * nkv) * d), torch.float32, gen=gen)
    before = qkv.clone()
    q = qkv[:, :nh * d].view(tokens, nh, d)
    k = qkv[:, nh * d:(nh + nkv) * d].view(tokens, nkv, d)
    positions = torch.arange(tokens) + 100
    rope().apply_rope_(q, k, positions, table(100000.0, None, d))
    q_hf, k_hf = hf_rope(before[:, :nh * d].reshape(tokens, nh, d),
                         before[:, nh * d:(nh + nkv) * d].reshape(tokens, nkv, d),
                         positions, 100000.0, None)
    checks.assert_close(q, q_hf, what="q view")
    checks.assert_close(k, k_hf, what="k view")
    checks.assert_equal(qkv[:, (nh + nkv) * d:], before[:, (nh + nkv) * d:], what="v part")


def test_prefill_then_decode_equals_one_pass(seed):
    """Rotating T tokens at once equals rotating T-1 (prefill) and then the last (decode)."""
    gen = checks.generator(seed=seed)
    q_in = checks.randn((9, 4, 64), torch.bfloat16, gen=gen)
    k_in = checks.randn((9, 2, 64), torch.bfloat16, gen=gen)
    cs = table(500000.0, LLAMA3, 64)
    q_all, k_all = q_in.clone(), k_in.clone()
    rope().apply_rope_(q_all, k_all, torch.arange(9), cs)
    q_pre, k_pre = q_in[:8].clone(), k_in[:8].clone()
    rope().apply_rope_(q_pre, k_pre, torch.arange(8), cs)
    q_dec, k_dec = q_in[8:].clone(), k_in[8:].clone()
    rope().apply_rope_(q_dec, k_dec, torch.tensor([8]), cs)
    checks.assert_equal(torch.cat([q_pre, q_dec]), q_all, what="q")
    checks.assert_equal(torch.cat([k_pre, k_dec]), k_all, what="k")


def test_native_refuses_integer_heads():
    q, k = torch.ones(3, 2, 8, dtype=torch.int32), torch.ones(3, 1, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="floating-point"):
        rope().apply_rope_native(q, k, torch.arange(3), torch.randn(MAX_POSITIONS, 8))


@pytest.mark.parametrize("bad", [MAX_POSITIONS, -2])
def test_native_position_outside_table(bad):
    q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    cs = torch.randn(MAX_POSITIONS, 8)
    with pytest.raises(IndexError, match=rf"position {bad} of token 1 .*{MAX_POSITIONS} rows"):
        rope().apply_rope_native(q, k, torch.tensor([0, bad, 2]), cs)
