"""course/testing/gemv_mistakes.py and attention_mistakes.py: a wrong output made by hand the
way a known mistake makes it is named by that mistake, with the case's shape (CPU, ~2 s).

Each mistaken output here is built from torch directly (slices, F.scaled_dot_product_attention
with another mask), never from the helpers' own replays of the mistakes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course.testing import attention_mistakes, gemv_mistakes


def _gemv_message(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> str:
    with pytest.raises(AssertionError) as info:
        gemv_mistakes.assert_gemv(y, x, w, what="gemv", warps_per_block=8)
    return str(info.value)


def _gemv_case(tokens: int = 3, in_features: int = 576, out_features: int = 45):
    g = torch.Generator().manual_seed(tokens + in_features)
    x = torch.randn(tokens, in_features, generator=g).bfloat16()
    w = (torch.randn(out_features, in_features, generator=g) * in_features ** -0.5).bfloat16()
    return x, w, (x.float() @ w.float().t())


def test_a_right_gemv_passes():
    x, w, y = _gemv_case()
    gemv_mistakes.assert_gemv(y.bfloat16(), x, w, what="gemv")


@pytest.mark.parametrize("mistake,named", [
    ("tail", "last 64 columns are missing"), ("transposed", "written as [out, tokens]"),
    ("token0", "read token 0's x"), ("grid", "grid was rounded down"),
    ("later_tokens", "only the tokens after the first are wrong")])
def test_gemv_mistakes_are_named(mistake, named):
    x, w, right = _gemv_case()
    if mistake == "tail":       # 576 columns = 72 pieces: the loop stopped at 64 pieces
        y = x[:, :512].float() @ w[:, :512].float().t()
    elif mistake == "transposed":
        y = right.t().contiguous().view(right.shape)
    elif mistake == "token0":
        y = (x[:1].float() @ w.float().t()).expand(3, -1)
    elif mistake == "grid":     # 45 outputs, blocks of 8: the last 5 never written
        y = right.clone()
        y[:, 40:] = float("nan")
    else:
        y = right.clone()
        y[1:] *= 0.5
    text = _gemv_message(y.bfloat16(), x, w)
    assert named in text and "gemv [tokens 3, weight 45 x 576, out bfloat16]" in text, text


def _attention_case(lens_q=(5, 40), lens_k=(5, 40), n_heads=4, n_kv=2, d=16):
    g = torch.Generator().manual_seed(sum(lens_q) + n_heads)
    q = torch.randn(sum(lens_q), n_heads, d, generator=g).bfloat16()
    k = torch.randn(sum(lens_k), n_kv, d, generator=g).bfloat16()
    v = torch.randn(sum(lens_k), n_kv, d, generator=g).bfloat16()
    return q, k, v, list(lens_q), list(lens_k)


def _sdpa(q, k, v, lens_q, lens_k, *, diagonal=0, kv_of_head=None, values=None):
    """Causal attention per sequence by F.scaled_dot_product_attention in float32; a query sees
    the keys up to its position + diagonal (its position: aligned to the end of the keys)."""
    n_heads, n_kv = q.shape[1], k.shape[1]
    heads = torch.tensor([(kv_of_head or (lambda h: h // (n_heads // n_kv)))(h)
                          for h in range(n_heads)])
    values = v if values is None else values
    out, sq, sk = torch.zeros(q.shape), 0, 0
    for lq, lk in zip(lens_q, lens_k):
        qs = q[sq:sq + lq].float().transpose(0, 1)
        ks, vs = (t[sk:sk + lk][:, heads].float().transpose(0, 1) for t in (k, values))
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq + diagonal)
        out[sq:sq + lq] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(0, 1)
        sq, sk = sq + lq, sk + lk
    return out


def _attention_message(out, q, k, v, lens_q, lens_k) -> str:
    with pytest.raises(AssertionError) as info:
        attention_mistakes.assert_attention(out.bfloat16(), q, k, v, lens_q, lens_k,
                                            q.shape[2] ** -0.5, what="attention", tile_rows=16)
    return str(info.value)


def test_a_right_attention_passes():
    q, k, v, lq, lk = _attention_case()
    attention_mistakes.assert_attention(_sdpa(q, k, v, lq, lk).bfloat16(), q, k, v, lq, lk,
                                        q.shape[2] ** -0.5, what="attention", tile_rows=16)


@pytest.mark.parametrize("mistake,named", [
    ("too_many", "one key too many"), ("too_few", "one key too few"),
    ("modulo", "the wrong KV head"), ("values_from_k", "the values are not"),
    ("later_tiles", "rows past each sequence's first tile of 16 queries")])
def test_attention_mistakes_are_named(mistake, named):
    q, k, v, lq, lk = _attention_case()
    if mistake == "too_many":
        out = _sdpa(q, k, v, lq, lk, diagonal=1)
    elif mistake == "too_few":     # a row that sees nothing is 0 in the kernels, not NaN
        out = _sdpa(q, k, v, lq, lk, diagonal=-1).nan_to_num(0.0)
    elif mistake == "modulo":
        out = _sdpa(q, k, v, lq, lk, kv_of_head=lambda h: h % 2)
    elif mistake == "values_from_k":
        out = _sdpa(q, k, v, lq, lk, values=k)
    else:                          # sequence 2's rows 16-39 (tokens 21-44) wrong
        out = _sdpa(q, k, v, lq, lk)
        out[21:] += 1.0
    text = _attention_message(out, q, k, v, lq, lk)
    assert named in text, text
    assert "batch 2, query lengths [5, 40], key lengths [5, 40], heads 4/2, head dim 16" in text


def test_a_mistake_that_also_differs_at_a_tile_edge_is_still_named():
    """A mask one key off in a kernel also misses the extra key where it lies in a tile the
    kernel never loads: a few rows differ from the plain computation of the mistake."""
    q, k, v, lq, lk = _attention_case(lens_q=(130,), lens_k=(130,), n_heads=2, n_kv=2)
    out = _sdpa(q, k, v, lq, lk, diagonal=1)
    out[63] = _sdpa(q, k, v, lq, lk)[63]   # row 63's extra key, 64, is in the next tile
    assert "one key too many" in _attention_message(out, q, k, v, lq, lk)
