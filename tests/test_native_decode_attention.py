"""decode_attention_native (stage 09's CPU backend) against independent oracles, on CPU:
torch.nn.functional.scaled_dot_product_attention (enable_gqa) on each sequence's gathered
keys, a naive float64 loop over (sequence, head, key), and the last row of stage 07's causal
prefill attention over the same keys (decoding token n must equal prefill's row n)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from course import parts
from course.testing import checks

CASES = [  # (context lengths, n_heads, n_kv_heads, head_dim)
    ([1], 4, 4, 64),
    ([7], 9, 3, 64),
    ([129, 1, 40], 32, 8, 64),
    ([5, 0, 70, 1], 8, 2, 16),
    ([33, 12], 32, 4, 24),
    ([200], 6, 3, 128),
]


def op():
    return parts.reference("09", "decode_attention")


def make(lens, n_heads, n_kv, d, dtype, seed, extra_slots=2):
    """Inputs whose cache rows past each context length (and unused slots) are NaN."""
    gen = checks.generator("cpu", seed)
    batch, max_len = len(lens), max(lens) + 3
    num_slots = batch + extra_slots
    q = checks.randn((batch, n_heads, d), dtype, gen=gen)
    k = torch.full((num_slots, max_len, n_kv, d), float("nan"), dtype=dtype)
    v = torch.full((num_slots, max_len, n_kv, d), float("nan"), dtype=dtype)
    slots = torch.randperm(num_slots, generator=gen)[:batch].to(torch.int32)
    for b, n in enumerate(lens):
        k[int(slots[b]), :n] = checks.randn((n, n_kv, d), dtype, gen=gen)
        v[int(slots[b]), :n] = checks.randn((n, n_kv, d), dtype, gen=gen)
    return q, k, v, slots, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lens,n_heads,n_kv,d", CASES, ids=str)
def test_native_matches_sdpa(seed, dtype, lens, n_heads, n_kv, d):
    q, k, v, slots, ctx = make(lens, n_heads, n_kv, d, dtype, seed)
    scale = d ** -0.5
    expected = torch.zeros(q.shape, dtype=torch.float32)
    for b, n in enumerate(lens):
        if n:
            s = int(slots[b])
            ks, vs = (t[s, :n].float().transpose(0, 1)[None] for t in (k, v))  # [1, KV, n, d]
            o = F.scaled_dot_product_attention(q[b].float()[None, :, None], ks, vs, scale=scale,
                                               enable_gqa=True)
            expected[b] = o[0, :, 0]
    got = op().decode_attention_native(q, k, v, slots, ctx, scale)
    assert got.dtype == dtype and got.shape == q.shape
    checks.assert_finite(got, "decode attention output (NaN rows past context_lens must not leak)")
    checks.assert_close(got, expected, dtype=dtype)


def test_native_matches_a_naive_loop(seed):
    """The definition, one (sequence, head, key) at a time, in float64."""
    lens, n_heads, n_kv, d = [3, 9, 0, 1], 6, 2, 8
    q, k, v, slots, ctx = make(lens, n_heads, n_kv, d, torch.float32, seed)
    scale = 0.3
    expected = torch.zeros(q.shape, dtype=torch.float64)
    for b, n in enumerate(lens):
        for h in range(n_heads):
            g = h // (n_heads // n_kv)
            s = int(slots[b])
            scores = [scale * float(q[b, h].double() @ k[s, j, g].double()) for j in range(n)]
            if not scores:
                continue
            top = max(scores)
            weights = [math.exp(x - top) for x in scores]
            for j in range(n):
                expected[b, h] += weights[j] / sum(weights) * v[s, j, g].double()
    got = op().decode_attention_native(q, k, v, slots, ctx, scale)
    checks.assert_close(got, expected.float(), dtype=torch.float32)


def test_native_is_the_last_row_of_prefill(seed):
    """Decoding token n over n cached keys = row n-1 of causal prefill over the same n tokens."""
    gen = checks.generator("cpu", seed)
    n, n_heads, n_kv, d = 37, 9, 3, 64
    q = checks.randn((n, n_heads, d), torch.float32, gen=gen)
    k = checks.randn((n, n_kv, d), torch.float32, gen=gen)
    v = checks.randn((n, n_kv, d), torch.float32, gen=gen)
    prefill = parts.reference("07", "attention").attention_native(
        q, k, v, torch.tensor([0, n], dtype=torch.int32), 0.125)
    one = torch.tensor([0], dtype=torch.int32)
    got = op().decode_attention_native(q[-1:], k[None], v[None], one,
                                       torch.tensor([n], dtype=torch.int32), 0.125)
    checks.assert_close(got[0], prefill[-1], dtype=torch.float32)


def test_padding_rows_are_zero_and_their_slot_is_ignored(seed):
    q, k, v, slots, ctx = make([4, 0, 6], 4, 2, 16, torch.float32, seed)
    slots[1] = -7
    got = op().decode_attention_native(q, k, v, slots, ctx, 0.25)
    checks.assert_equal(got[1], torch.zeros_like(got[1]), what="padding row")
    checks.assert_finite(got)


def test_dispatch_on_cpu_accepts_views_and_out(seed):
    """decode_attention on CPU tensors is the twin; q may be a view of a fused QKV tensor,
    and an out= buffer is filled and returned."""
    gen = checks.generator("cpu", seed)
    qkv = checks.randn((3, (6 + 2 * 2) * 16), torch.bfloat16, gen=gen)
    q = qkv[:, :96].view(3, 6, 16)
    _, k, v, slots, ctx = make([5, 1, 9], 6, 2, 16, torch.bfloat16, seed)
    out = checks.poison(torch.empty((3, 6, 16), dtype=torch.bfloat16))
    got = op().decode_attention(q, k, v, slots, ctx, 0.25, out=out)
    assert got is out
    checks.assert_equal(out, op().decode_attention_native(q.contiguous(), k, v, slots, ctx, 0.25))


@pytest.mark.parametrize("change,match", [
    (dict(ctx=[4, 99]), "context_lens\\[1\\] = 99 is outside"),
    (dict(ctx=[-1, 2]), "context_lens\\[0\\] = -1 is outside"),
    (dict(slots=[0, 5]), "seq_slots\\[1\\] = 5 is not a cache slot"),
    (dict(slots=[-1, 1]), "seq_slots\\[0\\] = -1 is not a cache slot"),
    (dict(ctx=[4]), "context_lens must be \\[2\\]"),
    (dict(slots=[0.0, 1.0]), "seq_slots must be \\[2\\] integers"),
    (dict(n_kv=3), "multiple of n_kv_heads"),
    (dict(cache_dim=8), "head_dim"),
])
def test_native_rejects_bad_input(change, match):
    n_kv, d = change.get("n_kv", 2), change.get("cache_dim", 16)
    q = torch.ones(2, 4, 16)
    cache = torch.ones(3, 10, n_kv, d)
    slots = torch.tensor(change.get("slots", [0, 1]))
    ctx = torch.tensor(change.get("ctx", [4, 10]))
    with pytest.raises(ValueError, match=match):
        op().decode_attention_native(q, cache, cache, slots, ctx, 0.25)
