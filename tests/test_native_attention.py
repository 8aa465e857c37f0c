"""attention_native (stage 07's CPU backend) against independent oracles, on CPU:
torch.nn.functional.scaled_dot_product_attention (enable_gqa) and transformers'
eager_attention_forward, the attention HF's Llama runs, each one sequence at a time."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from course import parts
from course.testing import checks

CASES = [  # (sequence lengths packed along T, n_heads, n_kv_heads, head_dim)
    ([1], 4, 4, 64),
    ([7], 9, 3, 64),
    ([129], 6, 2, 128),
    ([1, 7, 129], 9, 3, 64),
    ([3, 0, 70, 1], 8, 2, 16),
    ([65, 64], 6, 3, 24),
]


def native():
    return parts.reference("07", "attention").attention_native


def make(lens, n_heads, n_kv, d, dtype, seed):
    gen = checks.generator("cpu", seed)
    tokens = sum(lens)
    q = checks.randn((tokens, n_heads, d), dtype, gen=gen)
    k = checks.randn((tokens, n_kv, d), dtype, gen=gen)
    v = checks.randn((tokens, n_kv, d), dtype, gen=gen)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, cu


def per_sequence(cu, fn, q):
    """Run fn(start, end) -> [L, H, d] float32 for each sequence; stack along T."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    bounds = cu.tolist()
    for start, end in zip(bounds, bounds[1:]):
        if end > start:
            out[start:end] = fn(start, end)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lens,n_heads,n_kv,d", CASES, ids=str)
def test_native_matches_sdpa(seed, dtype, lens, n_heads, n_kv, d):
    q, k, v, cu = make(lens, n_heads, n_kv, d, dtype, seed)
    scale = d ** -0.5

    def sdpa(start, end):
        qs, ks, vs = (t[start:end].float().transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                           enable_gqa=True)
        return o[0].transpose(0, 1)

    got = native()(q, k, v, cu, scale)
    assert got.dtype == dtype and got.shape == q.shape
    checks.assert_close(got, per_sequence(cu, sdpa, q), dtype=dtype)


@pytest.mark.parametrize("lens,n_heads,n_kv,d", CASES, ids=str)
def test_native_matches_transformers_eager(seed, lens, n_heads, n_kv, d):
    from transformers.models.llama.modeling_llama import eager_attention_forward
    q, k, v, cu = make(lens, n_heads, n_kv, d, torch.float32, seed)
    module = SimpleNamespace(num_key_value_groups=n_heads // n_kv, training=False)
    scale = 0.7 * d ** -0.5

    def eager(start, end):
        n = end - start
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        qs, ks, vs = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        return eager_attention_forward(module, qs, ks, vs, mask, scaling=scale)[0][0]

    checks.assert_close(native()(q, k, v, cu, scale), per_sequence(cu, eager, q),
                        dtype=torch.float32)


def test_native_accepts_strided_views_and_out(seed):
    """Views of a fused QKV tensor, and an out= buffer that is filled and returned."""
    gen = checks.generator("cpu", seed)
    qkv = checks.randn((20, (6 + 2 * 2) * 16), torch.bfloat16, gen=gen)
    q, k, v = (t.view(20, -1, 16) for t in qkv.split([96, 32, 32], dim=1))
    cu = torch.tensor([0, 9, 20], dtype=torch.int32)
    out = checks.poison(torch.empty((20, 6, 16), dtype=torch.bfloat16))
    got = parts.reference("07", "attention").prefill_attention(q, k, v, cu, 0.25, out=out)
    assert got is out
    checks.assert_equal(out, native()(q.contiguous(), k.contiguous(), v.contiguous(), cu, 0.25))


@pytest.mark.parametrize("cu", [[0, 5], [1, 20], [0, 12, 9, 20], [0, 20, 21]], ids=str)
def test_native_rejects_bad_cu_seqlens(cu):
    q = torch.ones(20, 4, 16)
    with pytest.raises(ValueError, match="cu_seqlens"):
        native()(q, q[:, :2], q[:, :2], torch.tensor(cu, dtype=torch.int32), 0.25)
