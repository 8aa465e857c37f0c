"""flash_attention_native (stage 12's CPU backend, the online softmax in torch) on CPU, against
stage 07's attention_native (whole rows, torch.softmax) and against
torch.nn.functional.scaled_dot_product_attention, one sequence at a time."""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from course import parts
from course.testing import checks

CASES = [  # (query lengths, key lengths, n_heads, n_kv_heads, head_dim)
    ([1], [1], 4, 4, 64),
    ([7], [7], 9, 3, 64),
    ([129], [129], 6, 2, 128),
    ([1, 7, 129], [1, 7, 129], 9, 3, 64),
    ([3, 0, 70, 1], [3, 0, 70, 1], 8, 2, 16),
    ([65, 64, 200], [65, 64, 200], 32, 8, 64),
    ([1, 64, 5, 70], [300, 64, 200, 71], 9, 3, 64),    # cached prefixes: more keys than queries
    ([129, 0], [1000, 9], 8, 2, 128),
]


def op():
    return parts.reference("12", "flash_attention")


def stage07():
    return parts.reference("07", "attention")


def make(lq, lk, n_heads, n_kv, d, dtype, seed, q_scale=1.0):
    gen = checks.generator("cpu", seed)
    q = checks.randn((sum(lq), n_heads, d), dtype, gen=gen, scale=q_scale)
    k = checks.randn((sum(lk), n_kv, d), dtype, gen=gen)
    v = checks.randn((sum(lk), n_kv, d), dtype, gen=gen)
    cu_q = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def sdpa(q, k, v, cu_q, cu_k, scale):
    """Per sequence in float32: its queries are the last rows of a full causal attention."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for b in range(len(bq) - 1):
        n_q, n_k = bq[b + 1] - bq[b], bk[b + 1] - bk[b]
        if n_q == 0:
            continue
        qs = q[bq[b]:bq[b + 1]].float().transpose(0, 1)[None]
        ks, vs = (t[bk[b]:bk[b + 1]].float().transpose(0, 1)[None] for t in (k, v))
        mask = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                           enable_gqa=True)
        out[bq[b]:bq[b + 1]] = o[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lq,lk,n_heads,n_kv,d", CASES, ids=str)
def test_native_matches_stage07_and_sdpa(seed, dtype, lq, lk, n_heads, n_kv, d):
    q, k, v, cu_q, cu_k = make(lq, lk, n_heads, n_kv, d, dtype, seed)
    scale = d ** -0.5
    got = op().flash_attention_native(q, k, v, cu_q, scale, cu_seqlens_k=cu_k)
    assert got.dtype == dtype and got.shape == q.shape
    whole_rows = stage07().attention_native(q, k, v, cu_q, scale, cu_seqlens_k=cu_k)
    checks.assert_close(got, whole_rows, what="online softmax vs stage 07's attention_native",
                        dtype=dtype)
    checks.assert_close(got, sdpa(q, k, v, cu_q, cu_k, scale), what="vs SDPA", dtype=dtype)


@pytest.mark.parametrize("block", [1, 3, 16, 64, 100, 4096])
def test_any_tile_size_gives_the_same_result(seed, block):
    """The running (m, l, o) after every tile is exact: the tile size changes rounding only."""
    q, k, v, cu_q, cu_k = make([5, 130, 1], [9, 200, 1], 6, 2, 32, torch.float32, seed)
    got = op().flash_attention_native(q, k, v, cu_q, 0.2, cu_seqlens_k=cu_k, block=block)
    checks.assert_close(got, sdpa(q, k, v, cu_q, cu_k, 0.2), what=f"key tiles of {block}",
                        dtype=torch.float32)


def test_growing_scores_need_the_rescale(seed):
    """Scores that rise along the keys: every tile raises the running max. Large queries make
    exp(s) overflow float32 unless each tile is taken relative to the running max."""
    q, k, v, cu_q, cu_k = make([300], [300], 4, 2, 64, torch.float32, seed, q_scale=30.0)
    # KV head g serves query heads 2g and 2g + 1: lean each key further along its head's query
    k = k + torch.linspace(0, 3, 300)[:, None, None] * q[:, ::2].mean(0, keepdim=True).sign()
    got = op().flash_attention_native(q, k, v, cu_q, 0.125, cu_seqlens_k=cu_k)
    checks.assert_finite(got, "online softmax with growing scores")
    checks.assert_close(got, sdpa(q, k, v, cu_q, cu_k, 0.125), dtype=torch.float32)


def test_cpu_dispatch_views_and_out(seed):
    """On CPU prefill_attention is the twin: views of a fused QKV tensor, out= filled and returned."""
    gen = checks.generator("cpu", seed)
    qkv = checks.randn((90, (6 + 2 * 2) * 64), torch.bfloat16, gen=gen)
    q, k, v = (t.view(90, -1, 64) for t in qkv.split([384, 128, 128], dim=1))
    cu = torch.tensor([0, 9, 90], dtype=torch.int32)
    out = checks.poison(torch.empty((90, 6, 64), dtype=torch.bfloat16))
    got = op().prefill_attention(q, k, v, cu, 0.125, out=out)
    assert got is out
    checks.assert_equal(out, op().flash_attention_native(q.contiguous(), k.contiguous(),
                                                         v.contiguous(), cu, 0.125))


def test_same_signature_as_stage07():
    """The engine takes prefill_attention from whichever stage is ready: one signature."""
    assert (inspect.signature(op().prefill_attention)
            == inspect.signature(stage07().prefill_attention))


@pytest.mark.parametrize("cu", [[0, 5], [1, 20], [0, 12, 9, 20], [0, 20, 21]], ids=str)
def test_native_rejects_bad_cu_seqlens(cu):
    q = torch.ones(20, 4, 16)
    with pytest.raises(ValueError, match="cu_seqlens"):
        op().flash_attention_native(q, q[:, :2], q[:, :2], torch.tensor(cu, dtype=torch.int32), 0.25)


def test_native_rejects_fewer_keys_than_queries():
    q = torch.ones(6, 4, 16)
    with pytest.raises(ValueError, match="at least as many keys"):
        op().flash_attention_native(q, q[:4, :2], q[:4, :2], torch.tensor([0, 6], dtype=torch.int32),
                                    0.25, cu_seqlens_k=torch.tensor([0, 4], dtype=torch.int32))
