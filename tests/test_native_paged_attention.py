"""paged_decode_attention_native (stage 14's CPU backend) against stage 09's
decode_attention_native on the same keys: once laid out contiguously (one slot per sequence),
once cut into shuffled blocks of a pool. The two must agree to the last bit in float32 (same
math on the same numbers) and within bf16 rounding in bf16; and the CPU path of the op
(`paged_decode_attention` on CPU tensors) is the twin."""
from __future__ import annotations

import pytest
import torch

from course import parts
from course.testing import checks

CASES = [  # (context lengths, n_heads, n_kv_heads, head_dim, block_size)
    ([1], 4, 4, 64, 16),
    ([15, 16, 17], 9, 3, 64, 16),
    ([129, 1, 40, 0], 32, 8, 64, 16),
    ([5, 0, 70, 1], 8, 2, 16, 32),
    ([33, 12], 32, 4, 24, 8),
    ([200, 1000], 6, 3, 128, 16),
]


def paged():
    return parts.reference("14", "paged_attention")


def both_layouts(lens, n_heads, n_kv, d, block_size, dtype, seed, spare=3):
    """(q, contiguous k, v, slots), (paged k, v, block_tables) and the lengths: the same keys."""
    gen = checks.generator("cpu", seed)
    batch, max_len = len(lens), max(lens) + 3
    q = checks.randn((batch, n_heads, d), dtype, gen=gen)
    k = torch.full((batch, max_len, n_kv, d), float("nan"), dtype=dtype)
    v = torch.full((batch, max_len, n_kv, d), float("nan"), dtype=dtype)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + spare
    pk = torch.full((num_blocks, block_size, n_kv, d), float("nan"), dtype=dtype)
    pv = torch.full_like(pk, float("nan"))
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(need) + 2
    tables = []
    for b, n in enumerate(lens):
        k[b, :n] = checks.randn((n, n_kv, d), dtype, gen=gen)
        v[b, :n] = checks.randn((n, n_kv, d), dtype, gen=gen)
        blocks, perm = perm[:need[b]], perm[need[b]:]
        for i, blk in enumerate(blocks):
            rows = min(block_size, n - i * block_size)
            pk[blk, :rows] = k[b, i * block_size:i * block_size + rows]
            pv[blk, :rows] = v[b, i * block_size:i * block_size + rows]
        tables.append(blocks + [num_blocks - 1] * (max_blocks - len(blocks)))
    slots = torch.arange(batch, dtype=torch.int32)
    ctx = torch.tensor(lens, dtype=torch.int32)
    return (q, k, v, slots), (pk, pv, torch.tensor(tables, dtype=torch.int32)), ctx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lens,n_heads,n_kv,d,block_size", CASES, ids=str)
def test_paged_twin_matches_contiguous_twin(seed, dtype, lens, n_heads, n_kv, d, block_size):
    (q, k, v, slots), (pk, pv, tables), ctx = both_layouts(lens, n_heads, n_kv, d, block_size,
                                                           dtype, seed)
    scale = d ** -0.5
    expected = parts.reference("09", "decode_attention").decode_attention_native(
        q, k, v, slots, ctx, scale)
    got = paged().paged_decode_attention_native(q, pk, pv, tables, ctx, scale)
    assert got.dtype == dtype and got.shape == q.shape
    checks.assert_finite(got, "paged twin output (NaN rows past the context must not leak)")
    if dtype == torch.float32:
        checks.assert_equal(got, expected, what="paged twin vs contiguous twin (float32)")
    else:
        checks.assert_close(got, expected, dtype=dtype)
    via_op = paged().paged_decode_attention(q, pk, pv, tables, ctx, scale,
                                            out=torch.empty_like(q))
    checks.assert_equal(via_op, got, what="paged_decode_attention on CPU (the twin)")


def test_padding_row_is_zeros_and_its_table_is_not_read(seed):
    (q, k, v, slots), (pk, pv, tables), ctx = both_layouts([4, 0, 9], 4, 2, 8, 4, torch.float32,
                                                           seed)
    tables[1] = -5
    got = paged().paged_decode_attention_native(q, pk, pv, tables, ctx, 0.3)
    checks.assert_equal(got[1], torch.zeros_like(got[1]), what="padding row")


def test_refuses_tables_that_do_not_hold_the_context(seed):
    (q, k, v, slots), (pk, pv, tables), ctx = both_layouts([4, 20], 4, 2, 8, 4, torch.float32,
                                                           seed)
    bad = tables.clone()
    bad[1, 0] = pk.shape[0]
    with pytest.raises(ValueError, match="block table"):
        paged().paged_decode_attention_native(q, pk, pv, bad, ctx, 0.3)
    with pytest.raises(ValueError, match="block table"):
        paged().paged_decode_attention_native(q, pk, pv, tables[:, :2], ctx, 0.3)
    with pytest.raises(ValueError, match="max_context"):
        paged().paged_decode_attention_native(q, pk, pv, tables, ctx, 0.3, max_context=10)
    with pytest.raises(ValueError, match="paged attention"):
        paged().paged_decode_attention_native(q[:, :3], pk, pv, tables, ctx, 0.3)
    with pytest.raises(ValueError, match="paged attention"):   # no KV heads: not a division by 0
        paged().paged_decode_attention_native(q, pk[:, :, :0], pv[:, :, :0], tables, ctx, 0.3)
    # the kernel's split-K arguments are refused here as the binding refuses them
    for partition, split in ((7, None), (-16, None), (32, False), (1 << 21, True)):
        with pytest.raises(ValueError, match="partition"):
            paged().paged_decode_attention_native(q, pk, pv, tables, ctx, 0.3, split=split,
                                                  partition=partition)
    for partition, split in ((0, None), (0, False), (32, True), (16, None)):
        paged().paged_decode_attention_native(q, pk, pv, tables, ctx, 0.3, split=split,
                                              partition=partition)
    # with the new token to store, a refused call stores nothing (the other sequence's included)
    new_token = (torch.randn(2, 2, 8), torch.randn(2, 2, 8), ctx.long() - 1,
                 torch.rand(64, 8))
    before = pk.clone(), pv.clone()
    with pytest.raises(ValueError, match="block table"):
        paged().paged_decode_attention_native(q, pk, pv, bad, ctx, 0.3, new_token=new_token)
    for cache, kept in zip((pk, pv), before):   # the pool's unused rows are NaN
        torch.testing.assert_close(cache, kept, rtol=0, atol=0, equal_nan=True, msg=(
            "a refused call must not have written the new token into the cache"))


def test_new_token_is_rotated_and_stored_at_its_key(seed):
    """new_token on the CPU (write_new_token, which the CUDA op also runs at head_dims its
    kernel does not rotate): sequence b's new key, rotated by stage 05's RoPE at positions[b],
    and its value land in the row of key len - 1 that its block table names; a padding row
    stores nothing; q, k and v are not changed; the output is the twin's over those caches
    with q rotated."""
    lens, d = [4, 0, 9], 8
    (q, k, v, slots), (pk, pv, tables), ctx = both_layouts(lens, 4, 2, d, 4, torch.float32, seed)
    gen = checks.generator("cpu", seed + 1)
    k_new, v_new = (checks.randn((3, 2, d), torch.float32, gen=gen) for _ in range(2))
    positions = torch.tensor([7, 0, 20])
    cos_sin = parts.load("05", "rope_tables").cos_sin_cache(d, 10000.0, None, 64)
    given = [t.clone() for t in (q, k_new, v_new)]
    q_rot, k_rot = q.clone(), k_new.clone()
    parts.load("05", "rope").apply_rope_native(q_rot, k_rot, positions, cos_sin)
    want_k, want_v = pk.clone(), pv.clone()
    for b, n in enumerate(lens):
        if n:
            block, row = tables[b, (n - 1) // 4], (n - 1) % 4
            want_k[block, row], want_v[block, row] = k_rot[b], v_new[b]
    want = paged().paged_decode_attention_native(q_rot, want_k, want_v, tables, ctx, 0.3)
    got = paged().paged_decode_attention_native(q, pk, pv, tables, ctx, 0.3,
                                                new_token=(k_new, v_new, positions, cos_sin))
    for mine, theirs, what in ((pk, want_k, "k_cache"), (pv, want_v, "v_cache"),
                               (got, want, "the output")):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0, equal_nan=True, msg=lambda m: (
            f"{what} after new_token differs from RoPE'd k stored by hand at key len - 1: {m}"))
    for t, before, name in zip((q, k_new, v_new), given, ("q", "k", "v")):
        assert torch.equal(t, before), f"new_token: {name} itself must not change"
