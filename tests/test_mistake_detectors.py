"""The stage tests' detectors of classic mistakes, fed the mistakes' outputs on the CPU.

A stage's GPU test names the mistake a wrong output matches ("likely cause: ..."); here each
detector gets exactly that wrong output (made on the CPU by the same oracle the detector
replays, or built apart from it and checked equal to it) and must name it, and a right
output must not be called any mistake. The stage tests' input builders, written for
device="cuda", run here on the CPU (_OnTheCpu).
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.overrides import TorchFunctionMode

from course import manifest


@pytest.fixture(autouse=True)
def _one_thread():
    """These tensors are tiny: one thread (several wait on each other on a busy CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _stage_test(stage: str, name: str):
    path = manifest.ROOT / "stages" / manifest.find(stage).dir / "tests" / name
    spec = importlib.util.spec_from_file_location(f"_detectors_{stage}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _inputs(lens: list[int], n_heads: int, n_kv: int, d: int):
    g = torch.Generator().manual_seed(7)
    tokens = sum(lens)
    q, k, v = (torch.randn(tokens, h, d, generator=g).bfloat16() for h in (n_heads, n_kv, n_kv))
    bounds = [0] + torch.tensor(lens).cumsum(0).tolist()
    return q, k, v, bounds


def test_stage_07_names_an_output_never_divided_by_the_row_sum():
    t07 = _stage_test("07", "test_attention.py")
    q, k, v, bounds = _inputs([40, 17], 8, 2, 64)
    scale = 64 ** -0.5
    wrong = t07.sdpa_oracle(q, k, v, bounds, scale, normalized=False).bfloat16()
    assert "never divided by the row sum" in t07.likely_cause(wrong, q, k, v, bounds, scale)
    right = t07.sdpa_oracle(q, k, v, bounds, scale).bfloat16()
    assert "row sum" not in t07.likely_cause(right, q, k, v, bounds, scale)
    modulo = t07.sdpa_oracle(q, k, v, bounds, scale, kv_of_head=[h % 2 for h in range(8)])
    assert "q_head // (n_heads // n_kv_heads)" in t07.likely_cause(modulo.bfloat16(), q, k, v,
                                                                   bounds, scale)


class _OnTheCpu(TorchFunctionMode):
    """Runs a stage test's own helpers, which say device="cuda", on the CPU: every device=
    "cuda" keyword becomes "cpu" (the helpers' logic is untouched)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _filled(t: torch.Tensor, seed: int) -> torch.Tensor:
    """A copy of a NaN-poisoned cache with numbers in every row: a mistake that reads rows
    it does not own then gives numbers, and must be named all the same."""
    g = torch.Generator().manual_seed(seed)
    t = t.clone()
    t[t.isnan()] = torch.randn(int(t.isnan().sum()), generator=g).to(t.dtype)
    return t


def _names_only(cause: str, phrase: str | None, phrases: list[str]) -> None:
    """`cause` holds `phrase` (None: the fallback) and no other mistake's phrase."""
    for other in phrases:
        assert (other in cause) == (other == phrase), f"expected {phrase!r}, got {cause!r}"


# -- stage 09: decode attention over a slot cache ---------------------------------------------

S09 = {
    "modulo": "this output matches h % n_kv_heads",
    "slot": "not in slot b",
    "newest": "the newest key is missing",
    "scale": "multiplied by `scale`",
    "nan": "NaN in the output",
}


def test_stage_09_names_each_decode_mistake():
    t09 = _stage_test("09", "test_decode_attention.py")
    lens, scale = [5, 40, 1, 17], 32 ** -0.5
    with _OnTheCpu():   # the GPU test's own inputs: NaN in every row no sequence owns
        q, kc, vc, slots, ctx = t09.make_inputs(torch.Generator().manual_seed(9), lens, 8, 2, 32)
    assert q.device.type == "cpu" and kc.isnan().any()
    slots = slots.tolist()
    assert slots != list(range(len(lens)))
    phrases = list(S09.values())

    def cause(got, k=kc, v=vc):
        return t09.likely_cause(got.bfloat16(), q, k, v, slots, lens, scale)

    def oracle(k=kc, v=vc, **change):
        args = dict(slots=slots, lens=lens, scale=scale) | change
        return t09.sdpa_oracle(q, k, v, args.pop("slots"), args.pop("lens"), args.pop("scale"),
                               **args)

    right = oracle()
    assert not right.isnan().any()
    _names_only(cause(right), None, phrases)
    assert "compare with decode_attention_native" in cause(right)
    _names_only(cause(oracle(kv_of_head=[h % 2 for h in range(8)])), S09["modulo"], phrases)
    _names_only(cause(oracle(lens=[n - 1 for n in lens])), S09["newest"], phrases)
    _names_only(cause(oracle(scale=1.0)), S09["scale"], phrases)
    # slot b instead of seq_slots[b], as the GPU test sees it: slot b's rows are NaN there,
    # and the output's NaN where the mistake's replay has them still names it
    wrong = oracle(slots=list(range(len(lens))))
    assert wrong.isnan().any()
    _names_only(cause(wrong), S09["slot"], phrases)
    # and with numbers in every row
    kf, vf = _filled(kc, 1), _filled(vc, 2)
    wrong = oracle(kf, vf, slots=list(range(len(lens))))
    _names_only(cause(wrong, kf, vf), S09["slot"], phrases)
    _names_only(cause(oracle(kf, vf), kf, vf), None, phrases)
    nan = right.clone()
    nan[2, 3, 5] = float("nan")
    _names_only(cause(nan), S09["nan"], phrases)
    _names_only(cause(right * 1.5), None, phrases)


# -- stage 12: FlashAttention prefill (online softmax over key tiles of 64) -------------------

S12 = {
    "o": "o is not rescaled",
    "l": "l is not rescaled",
    "both": "the running state is not rescaled",
    "align": "the causal diagonal starts at the first key",
    "modulo": "the wrong KV head",
    "causal": "no causal mask",
    "scale": "the scores were not scaled",
    "nan": "NaN inside rows that are otherwise right",
    "unwritten": "whole rows are NaN",
    "4x": "about 4x too large",
}


def _stale_online_softmax(q, k, v, lens_q, lens_k, scale, rescale_o, rescale_l, tile=64):
    """The online softmax's mistakes built without a loop: key j's exp is taken against the
    running max m_t after its tile t; right, it is brought to the final max m (times
    exp(m_t - m)); an accumulator that is never rescaled keeps exp(s_j - m_t)."""
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape)
    bq, bk = 0, 0
    for n_q, n_k in zip(lens_q, lens_k):
        if n_q:
            qs = q[bq:bq + n_q].float().transpose(0, 1)                       # [H, n_q, d]
            ks = k[bk:bk + n_k].float().repeat_interleave(group, 1).transpose(0, 1)
            vs = v[bk:bk + n_k].float().repeat_interleave(group, 1).transpose(0, 1)
            s = scale * qs @ ks.transpose(1, 2)                                 # [H, n_q, n_k]
            visible = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
            s = s.masked_fill(~visible, float("-inf"))
            tiles = torch.arange(n_k) // tile
            tile_max = torch.stack([s[..., tiles == t].amax(-1) for t in range(int(tiles[-1]) + 1)],
                                   -1)
            running = tile_max.cummax(-1).values[..., tiles]                  # m_t per key
            final = running[..., -1:]
            fresh, stale = torch.exp(s - final), torch.exp(s - running)
            o = (fresh if rescale_o else stale) @ vs
            l = (fresh if rescale_l else stale).sum(-1, keepdim=True)
            out[bq:bq + n_q] = (o / l).transpose(0, 1)
        bq, bk = bq + n_q, bk + n_k
    return out


def _stage_12_case():
    """The GPU tests' inputs, made on the CPU: a cached prefix of 150 keys (three key tiles)
    for 3 queries, a plain prompt of 70, a sequence with no query; GQA 3."""
    t12 = _stage_test("12", "test_flash_attention.py")
    lens_q, lens_k = [3, 70, 0], [150, 70, 5]
    with _OnTheCpu():
        q, k, v, cu_q, cu_k = t12.make_inputs(torch.Generator().manual_seed(12), lens_q, 6, 2, 32,
                                              lens_k=lens_k)
    assert cu_q.device.type == "cpu"
    return t12, q, k, v, cu_q, cu_k, lens_q, lens_k


def test_stage_12_names_each_online_softmax_mistake():
    """course/testing/attention_mistakes.py, as both kernels' tests call it."""
    from course.testing import attention_mistakes
    t12, q, k, v, cu_q, cu_k, lens_q, lens_k = _stage_12_case()
    scale = 32 ** -0.5
    phrases = list(S12.values())

    def cause(got):
        try:
            attention_mistakes.assert_attention(got.bfloat16(), q, k, v, lens_q, lens_k, scale,
                                                what="attention", tile_rows=64)
        except AssertionError as e:
            return str(e)
        return ""

    right = t12.sdpa_oracle(q, k, v, cu_q, cu_k, scale)
    assert cause(right) == ""
    for name, flags in (("o", dict(rescale_o=False)), ("l", dict(rescale_l=False)),
                        ("both", dict(rescale_o=False, rescale_l=False))):
        mine = _stale_online_softmax(q, k, v, lens_q, lens_k, scale,
                                     flags.get("rescale_o", True), flags.get("rescale_l", True))
        _names_only(cause(mine), S12[name], phrases)
    oracle = dict(align=dict(align_end=False), causal=dict(causal=False),
                  modulo=dict(kv_of_head=[h % 2 for h in range(6)]))
    for name, change in oracle.items():
        _names_only(cause(t12.sdpa_oracle(q, k, v, cu_q, cu_k, scale, **change)), S12[name],
                    phrases)
    _names_only(cause(t12.sdpa_oracle(q, k, v, cu_q, cu_k, 1.0)), S12["scale"], phrases)
    nan = right.clone()
    nan[40, 1, 7] = float("nan")
    _names_only(cause(nan), S12["nan"], phrases)
    _names_only(cause(torch.full_like(right, float("nan"))), S12["unwritten"], phrases)
    _names_only(cause(4 * right), S12["4x"], phrases)
    _names_only(cause(1.5 * right), None, phrases)


def test_stage_12_replays_are_attention_and_its_mistakes():
    """attention_mistakes.attention with nothing left out is the right answer, and with a
    rescale left out it is _stale_online_softmax's (built without a loop over tiles): on a
    sequence of exactly one tile, one of one key, a cached prefix and an empty one."""
    from course.testing import attention_mistakes
    t12 = _stage_test("12", "test_flash_attention.py")
    lens_q, lens_k, scale = [64, 1, 5, 0, 129], [64, 1, 200, 3, 129], 0.2
    with _OnTheCpu():
        q, k, v, cu_q, cu_k = t12.make_inputs(torch.Generator().manual_seed(1), lens_q, 4, 4, 16,
                                              lens_k=lens_k)
    replay = attention_mistakes.attention
    torch.testing.assert_close(replay(q, k, v, lens_q, lens_k, scale),
                               t12.sdpa_oracle(q, k, v, cu_q, cu_k, scale), rtol=1e-4, atol=1e-5)
    for rescale, o, l in (("l", False, True), ("o", True, False), ("none", False, False)):
        torch.testing.assert_close(replay(q, k, v, lens_q, lens_k, scale, rescale=rescale),
                                   _stale_online_softmax(q, k, v, lens_q, lens_k, scale, o, l),
                                   rtol=1e-4, atol=1e-5)


# -- stage 14: paged decode attention (block tables, split-K partitions) ----------------------

S14 = {
    "column": "not in column j",
    "modulo": "this output matches h % n_kv_heads",
    "values": "scores right but values wrong",
    "scale": "must be multiplied by scale",
    "last_dropped": "were left out",
    "last_whole": "it was read whole",
    "k_end_single": "a block takes the whole context",
    "k_end_split": "k_end is not clipped",
    "no_rescale": "without the exp",
    "plain": "plain average of the partitions",
    "empty_warp": "of the 4 warps saw no key",
    "long_rows": "sequences longer than one partition",
    "nan": "NaN inside rows",
}


def _split_k_merged_wrong(pg, scale: float, partition: int, weighted: bool) -> torch.Tensor:
    """Split-K's reduction mistakes built apart from the stage's oracle: each partition of
    `partition` keys softmax-normalised alone (o_i, with l_i = sum exp(s - m_i) against its own
    max m_i), then averaged (weighted=False) or weighted by l_i without exp(m_i - M)."""
    n_heads, n_kv = pg.q.shape[1], pg.k.shape[2]
    out = torch.zeros(pg.q.shape)
    for b, n in enumerate(pg.lens):
        if n == 0:
            continue
        j = torch.arange(n)
        blocks = torch.tensor(pg.tables[b])[j // pg.block_size]
        for h in range(n_heads):
            kv = h // (n_heads // n_kv)
            ks = pg.k[blocks, j % pg.block_size, kv].float()                     # [n, d]
            vs = pg.v[blocks, j % pg.block_size, kv].float()
            s = scale * ks @ pg.q[b, h].float()                                   # [n]
            o, l = [], []
            for sp, vp in zip(s.split(partition), vs.split(partition)):
                e = torch.exp(sp - sp.max())
                o.append(e @ vp / e.sum())
                l.append(e.sum())
            o, l = torch.stack(o), torch.stack(l)[:, None]
            out[b, h] = (o * l).sum(0) / l.sum() if weighted else o.mean(0)
    return out


def test_stage_14_names_each_paged_mistake():
    t14 = _stage_test("14", "test_paged_attention.py")
    scale, partition = 0.25, 64
    with _OnTheCpu():   # the GPU test's Paged: shuffled blocks, NaN in every row none owns
        # block_size 4 and a table of 153 columns: key j < 150 has a column j to read from
        pg = t14.Paged(torch.Generator().manual_seed(14), [150, 9, 0, 70], 8, 2, 16,
                       block_size=4, extra_columns=115)
    assert pg.q.device.type == "cpu" and pg.k.isnan().any()
    assert pg.block_tables.shape[1] >= 150
    phrases = list(S14.values())

    def cause(got, paged=pg, part=partition, kernel="fast"):
        """The failure's "likely cause" line as check_paged writes it ("" when it passes)."""
        with _OnTheCpu():
            try:
                t14.check_paged(got.bfloat16(), t14.sdpa_oracle(paged, scale), paged.q, paged.k,
                                paged.v, paged.tables, paged.lens, scale, kernel=kernel,
                                partition=part, what="out")
            except AssertionError as e:
                return str(e).partition("likely cause: ")[2]
            return ""

    def oracle(paged=pg, **change):
        with _OnTheCpu():
            return t14.attend(paged.q, paged.k, paged.v, paged.tables, paged.lens,
                              change.pop("scale", scale), **change)

    right = oracle()
    for part in (0, partition):
        assert cause(right, part=part) == "", "the right output must pass"
    modulo = oracle(kv_of_head=[h % 2 for h in range(8)])
    for part in (0, partition):
        _names_only(cause(modulo, part=part), S14["modulo"], phrases)
    for name in ("no_rescale", "plain"):
        wrong = _split_k_merged_wrong(pg, scale, partition, weighted=name == "no_rescale")
        torch.testing.assert_close(oracle(merge=name, partition=partition), wrong, rtol=1e-4,
                                   atol=1e-5)
        _names_only(cause(wrong), S14[name], phrases)
    # key j read from table column j, as the GPU test sees it (NaN where nobody owns a row),
    # then with numbers in every block
    wrong = oracle(column=lambda j, bs: j)
    assert wrong.isnan().any()
    _names_only(cause(wrong), S14["column"], phrases)
    filled = t14.Paged.__new__(t14.Paged)
    filled.__dict__ |= pg.__dict__ | dict(k=_filled(pg.k, 3), v=_filled(pg.v, 4))
    wrong = oracle(filled, column=lambda j, bs: j)
    _names_only(cause(wrong, filled), S14["column"], phrases)
    _names_only(cause(oracle(filled), filled), None, phrases)
    _names_only(cause(oracle(filled, values="k"), filled), S14["values"], phrases)
    _names_only(cause(oracle(scale=1.0)), S14["scale"], phrases)
    _names_only(cause(oracle(keys=lambda n: n - n % 4 if n > 4 else n)), S14["last_dropped"],
                phrases)
    _names_only(cause(oracle(filled, keys=lambda n: -(-n // 4) * 4), filled),
                S14["last_whole"], phrases)
    # the single pass's k_end = min(len, k_begin + keys): rows past 256 keys never written
    # (NaN, the poison); split-K's k_end not clipped: the last partition reads past the length
    with _OnTheCpu():
        long_pg = t14.Paged(torch.Generator().manual_seed(15), [300, 9, 0, 70], 8, 2, 16,
                            block_size=4, extra_columns=2)
    unwritten = oracle(long_pg)
    unwritten[0] = float("nan")
    _names_only(cause(unwritten, long_pg, part=0), S14["k_end_single"], phrases)
    wrong = oracle(filled, keys=lambda n: -(-n // partition) * partition)
    _names_only(cause(wrong, filled), S14["k_end_split"], phrases)
    # a warp that saw no key merged into NaN: the short sequence's rows (9 keys), simple kernel
    empty = right.clone()
    empty[1] = float("nan")
    _names_only(cause(empty, kernel="simple", part=0), None, phrases)   # 9 keys fill 4 warps
    _names_only(cause(empty, part=0), S14["empty_warp"], phrases)       # 9 < 4 steps of 16
    # the merge wrong in some other way: only the rows longer than one partition
    merged = right.clone()
    merged[[0, 3]] *= 0.5
    _names_only(cause(merged), S14["long_rows"], phrases)
    nan = right.clone()
    nan[3, 0, 0] = float("nan")
    _names_only(cause(nan), S14["nan"], phrases)
    _names_only(cause(1.5 * right), None, phrases)
