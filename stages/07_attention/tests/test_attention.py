"""Stage 07: causal prefill attention over packed sequences with grouped-query heads.

Every case compares the kernel with two references computed from the same bf16 inputs:
torch.nn.functional.scaled_dot_product_attention in float32, one sequence at a time (an
oracle that shares no code with this course), and the native twin attention_native. The
kernel reads bf16, computes in float32 and rounds once, so the bf16 tolerance applies.
When the output is wrong, the test also tries the usual mistakes (KV head chosen by modulo,
one causal mask over the whole batch, no mask, no scale) and names the one that matches.
The kernel picks its tile from the GPU's shared memory per block: the tests given a smem_limit
cap it at a T4's 64 KB (or less) so the 32-row tile runs on any GPU.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course import parts
from course.testing import checks

# (n_heads, n_kv_heads, head_dim): SmolLM2-135M, Llama-3.2-1B, plain multi-head, GQA 3 at 128.
HEADS = [(9, 3, 64), (32, 8, 64), (4, 4, 128), (6, 2, 128), (32, 8, 128)]
TOKENS = [1, 7, 127, 129, 1000]
PACKED = [[1, 7, 129], [129, 1, 7, 64, 300], [3, 0, 70, 1], [65, 64, 63, 200]]
# Shared memory per block: a T4's (opt-in), and any GPU's without cudaFuncSetAttribute.
T4_SMEM = 64 * 1024
NO_OPT_IN = 48 * 1024


def attention_op():
    return parts.load("07", "attention")


def make_inputs(gen: torch.Generator, lens: list[int], n_heads: int, n_kv: int, d: int,
                fused: bool = False, q_scale: float = 1.0):
    """q, k, v for sequences of these lengths packed along T, and cu_seqlens (int32).

    q_scale widens the queries (and so the scores). fused=True returns q, k, v as views of
    one [T, (n_heads + 2 n_kv) * d] tensor, the way a fused QKV projection produces them:
    row stride (n_heads + 2 n_kv) * d, not n_heads * d.
    """
    tokens = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                      device="cuda")
    if fused:
        qkv = checks.randn((tokens, (n_heads + 2 * n_kv) * d), torch.bfloat16, "cuda", gen)
        q, k, v = qkv.split([n_heads * d, n_kv * d, n_kv * d], dim=1)
        return q.view(tokens, n_heads, d), k.view(tokens, n_kv, d), v.view(tokens, n_kv, d), cu
    q = checks.randn((tokens, n_heads, d), torch.bfloat16, "cuda", gen, scale=q_scale)
    k = checks.randn((tokens, n_kv, d), torch.bfloat16, "cuda", gen)
    v = checks.randn((tokens, n_kv, d), torch.bfloat16, "cuda", gen)
    return q, k, v, cu


def sdpa_oracle(q, k, v, bounds: list[int], scale: float, kv_of_head: list[int] | None = None,
                causal: bool = True, normalized: bool = True) -> torch.Tensor:
    """F.scaled_dot_product_attention per sequence in float32 -> [T, n_heads, d] float32.

    The keyword arguments replay mistakes: kv_of_head another head mapping, causal=False no
    mask, normalized=False softmax's numerator alone, sum_j e^(s_j - m) v_j (never divided
    by the row sum)."""
    n_heads, n_kv = q.shape[1], k.shape[1]
    if kv_of_head is None:
        kv_of_head = [h // (n_heads // n_kv) for h in range(n_heads)]
    index = torch.tensor(kv_of_head, device=q.device)
    k, v = k.index_select(1, index), v.index_select(1, index)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for start, end in zip(bounds, bounds[1:]):
        if end > start:
            qs, ks, vs = (t[start:end].float().transpose(0, 1) for t in (q, k, v))
            if normalized:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale)
            else:
                s = scale * qs @ ks.transpose(1, 2)
                n = end - start
                if causal:
                    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool,
                                                 device=q.device).triu(1), float("-inf"))
                o = torch.exp(s - s.amax(-1, keepdim=True)) @ vs
            out[start:end] = o.transpose(0, 1)
    return out


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    atol, rtol = checks.TOLERANCES[torch.bfloat16]
    g, e = got.float(), expected.float()
    return bool(((g - e).abs() <= atol + rtol * e.abs()).all())


def likely_cause(got, q, k, v, bounds: list[int], scale: float) -> str:
    """Name the classic mistake whose output matches `got`, if one does."""
    n_heads, n_kv = q.shape[1], k.shape[1]
    right = sdpa_oracle(q, k, v, bounds, scale)
    mistakes = [
        (dict(kv_of_head=[h % n_kv for h in range(n_heads)]),
         "the KV head must be q_head // (n_heads // n_kv_heads): neighbouring query heads share "
         "a KV head (this output matches q_head % n_kv_heads)"),
        (dict(bounds=[0, bounds[-1]]),
         "did you apply the causal mask per sequence, not per batch? A query sees only the keys of "
         "its own sequence (cu_seqlens[b] .. its own position); this output matches one causal "
         "mask over all packed tokens"),
        (dict(causal=False),
         "the causal mask is missing: query t may only see keys j <= t of its sequence"),
        (dict(scale=1.0),
         "the scores must be multiplied by `scale` (1/sqrt(head_dim)) before the softmax"),
        (dict(normalized=False),
         "the output was never divided by the row sum: softmax is e^(s - m) / sum_j "
         "e^(s_j - m); divide each row of P @ V by its sum once, at the end"),
    ]
    for change, hint in mistakes:
        args = dict(bounds=bounds, scale=scale) | change
        wrong = sdpa_oracle(q, k, v, args.pop("bounds"), args.pop("scale"), **args)
        if not _close(wrong, right) and _close(got, wrong):
            return hint
    if got.isnan().any() and not got.isnan().all():
        return ("NaN where the poison was overwritten: exp of an unmasked -inf - -inf, 0 * NaN "
                "from unloaded (garbage) K/V rows past the sequence end, or 0/0 in the final "
                "division?")
    return ("compare with attention_native in attention.py: scores = scale * q.k, causal mask "
            "within the sequence, softmax(s - rowmax), then P @ V")


def run_op(q, k, v, cu, scale: float, smem_limit: int | None = None, **kwargs) -> torch.Tensor:
    """prefill_attention, or with the kernel's shared memory capped at smem_limit bytes."""
    if smem_limit is None:
        return attention_op().prefill_attention(q, k, v, cu, scale, **kwargs)
    return attention_op().prefill_attention_with_smem_limit(q, k, v, cu, scale, smem_limit,
                                                            **kwargs)


def run_and_check(q, k, v, cu, scale: float, what: str,
                  smem_limit: int | None = None) -> torch.Tensor:
    """Launch into a poisoned buffer; compare with SDPA and the twin; inputs untouched."""
    before = [t.clone() for t in (q, k, v, cu)]
    out = checks.poison(torch.empty(q.shape, dtype=q.dtype, device="cuda"))
    got = run_op(q, k, v, cu, scale, smem_limit, out=out)
    if smem_limit is not None:
        what = f"{what}, at most {smem_limit} bytes of shared memory per block"
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr(), "prefill_attention(..., out=buf) must return buf"
    bounds = cu.tolist()
    expected = sdpa_oracle(q, k, v, bounds, scale)
    hint = "" if _close(got, expected) else likely_cause(got, q, k, v, bounds, scale)
    checks.assert_close(got, expected, what=f"{what} vs scaled_dot_product_attention",
                        dtype=torch.bfloat16, hint=hint)
    twin = parts.reference("07", "attention").attention_native(q, k, v, cu, scale)
    checks.assert_close(got, twin, what=f"{what} vs attention_native", hint=hint)
    for name, old, new in zip(("q", "k", "v", "cu_seqlens"), before, (q, k, v, cu)):
        checks.assert_unmodified(old, new, name)
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("n_heads,n_kv,d", HEADS, ids=lambda v: str(v))
def test_one_sequence(seed, tokens, n_heads, n_kv, d):
    q, k, v, cu = make_inputs(checks.generator("cuda", seed), [tokens], n_heads, n_kv, d)
    run_and_check(q, k, v, cu, d ** -0.5, f"T={tokens}, heads {n_heads}/{n_kv}, head_dim {d}")


@pytest.mark.gpu
@pytest.mark.parametrize("n_heads,n_kv,d", [(32, 8, 64), (8, 2, 128)], ids=lambda v: str(v))
def test_long_sequence(seed, n_heads, n_kv, d):
    """A few thousand tokens: a row of scores is far longer than one tile of keys."""
    q, k, v, cu = make_inputs(checks.generator("cuda", seed), [2500], n_heads, n_kv, d)
    run_and_check(q, k, v, cu, d ** -0.5, f"T=2500, heads {n_heads}/{n_kv}, head_dim {d}")


@pytest.mark.gpu
@pytest.mark.parametrize("lens", PACKED, ids=lambda v: "+".join(map(str, v)))
@pytest.mark.parametrize("n_heads,n_kv,d", [(9, 3, 64), (6, 2, 128)], ids=lambda v: str(v))
def test_packed_sequences(seed, lens, n_heads, n_kv, d):
    """Sequences of different lengths (one of length 1, one empty) packed along T."""
    q, k, v, cu = make_inputs(checks.generator("cuda", seed), lens, n_heads, n_kv, d)
    run_and_check(q, k, v, cu, d ** -0.5, f"sequences {lens}, heads {n_heads}/{n_kv}")


@pytest.mark.gpu
@pytest.mark.parametrize("n_heads,n_kv,d", [(9, 3, 64), (32, 8, 128)], ids=lambda v: str(v))
def test_views_of_fused_qkv(seed, n_heads, n_kv, d):
    """q, k, v sliced out of one fused QKV projection: rows are (H + 2 KV) * d elements apart."""
    q, k, v, cu = make_inputs(checks.generator("cuda", seed), [7, 129, 1], n_heads, n_kv, d,
                              fused=True)
    assert not q.is_contiguous() and not k.is_contiguous()
    run_and_check(q, k, v, cu, d ** -0.5, "views of a fused qkv tensor (use each row stride)")


@pytest.mark.gpu
@pytest.mark.parametrize("q_scale", [8.0, 40.0])
def test_large_scores_stay_finite(seed, q_scale):
    """Scores in the hundreds: exp(s) overflows float32 unless the row max is subtracted."""
    q, k, v, cu = make_inputs(checks.generator("cuda", seed), [200, 1000], 8, 2, 64,
                              q_scale=q_scale)
    got = run_and_check(q, k, v, cu, 64 ** -0.5, f"queries scaled by {q_scale}")
    checks.assert_finite(got, "attention output with large scores")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [16, 24, 32, 96])
def test_other_head_dims(seed, d):
    """The generic path: any head_dim that is a multiple of 8, up to 128 (tiny test models)."""
    q, k, v, cu = make_inputs(checks.generator("cuda", seed), [5, 130, 1], 6, 2, d)
    run_and_check(q, k, v, cu, d ** -0.5, f"head_dim {d}")


@pytest.mark.gpu
@pytest.mark.parametrize("smem_limit", [None, T4_SMEM], ids=["gpu-smem", "t4-smem"])
@pytest.mark.parametrize("d", [64, 128])
def test_repeatable(seed, d, smem_limit):
    """The same inputs give bitwise the same output, run after run: this kernel adds in a
    fixed order, so a difference can only be a race on shared memory (P is written over K's
    tile, and the next tile over P and V)."""
    q, k, v, cu = make_inputs(checks.generator("cuda", seed), [1000, 129], 32, 8, d)
    runs = [run_op(q, k, v, cu, d ** -0.5, smem_limit) for _ in range(5)]
    torch.cuda.synchronize()
    for i, again in enumerate(runs[1:], 2):
        differ = int((again.view(torch.int16) != runs[0].view(torch.int16)).sum())
        assert differ == 0, (
            f"run {i} of the same inputs differs from run 1 in {differ} of {again.numel()} "
            "values\n  likely cause: a race: a missing __syncthreads(): after the K tile is "
            "loaded (before any thread reads it), after every score is in registers (before "
            "P is written over K's shared memory), after P is written (before P @ V), and at "
            "the end of the key loop (before the next tile overwrites P and V)")


@pytest.mark.gpu
def test_scale_is_a_parameter(seed):
    """scale is the caller's (models may set it); 1/sqrt(head_dim) must not be hard-coded."""
    q, k, v, cu = make_inputs(checks.generator("cuda", seed), [100, 37], 4, 4, 64)
    run_and_check(q, k, v, cu, 0.31, "scale 0.31")


@pytest.mark.gpu
def test_rejects_bad_input(seed):
    q, k, v, cu = make_inputs(checks.generator("cuda", seed), [3, 5], 4, 2, 64)
    run_and_check(q, k, v, cu, 0.125, "a valid call")
    kernel = parts.kernels().prefill_attention
    out = torch.empty(q.shape, dtype=q.dtype, device="cuda")
    q136 = torch.zeros((8, 2, 136), dtype=q.dtype, device="cuda")
    bad = {
        "head_dim": (q136, q136, q136, cu, cu, 5, 0.1, q136.clone()),
        "multiple of n_kv_heads": (q, k[:, :1].expand(8, 3, 64).contiguous(),
                                   v[:, :1].expand(8, 3, 64).contiguous(), cu, cu, 5, 0.1, out),
        "bfloat16": (q.float(), k, v, cu, cu, 5, 0.1, out),
        "cu_seqlens_q": (q, k, v, cu.long(), cu, 5, 0.1, out),
        "max_seqlen_q": (q, k, v, cu, cu, 9, 0.1, out),
    }
    for needle, args in bad.items():
        with pytest.raises(RuntimeError) as info:
            kernel(*args)
        assert needle in str(info.value), (
            f"bad input should be refused with a message about {needle!r}, got: {info.value}")
    # Without max_seqlen_q the wrapper reads and checks the offsets on the host first.
    for needle, offsets in {"must rise from 0": [0, 3, 7], "must rise": [0, 5, 3, 8]}.items():
        with pytest.raises(ValueError, match=needle):
            attention_op().prefill_attention(
                q, k, v, torch.tensor(offsets, dtype=torch.int32, device="cuda"), 0.1)


# (queries, keys) per sequence: the first keys - queries tokens were cached in earlier steps.
CACHED = [[(1, 1)], [(1, 300)], [(64, 64), (5, 200), (1, 1000), (70, 71)], [(129, 1000), (0, 9)]]


@pytest.mark.gpu
@pytest.mark.parametrize("smem_limit", [None, T4_SMEM], ids=["gpu-smem", "t4-smem"])
@pytest.mark.parametrize("runs", CACHED, ids=lambda v: "+".join(f"{a}of{b}" for a, b in v))
@pytest.mark.parametrize("n_heads,n_kv,d", [(9, 3, 64), (32, 8, 128)], ids=lambda v: str(v))
def test_queries_after_a_cached_prefix(seed, runs, n_heads, n_kv, d, smem_limit):
    """More keys than queries (chunked prefill, stage 11): query i of a sequence with Lq
    queries and Lk keys is key position i + Lk - Lq, and sees the keys up to it."""
    gen = checks.generator("cuda", seed)
    lq, lk = [a for a, _ in runs], [b for _, b in runs]
    q, _, _, cu_q = make_inputs(gen, lq, n_heads, n_kv, d)
    _, k, v, cu_k = make_inputs(gen, lk, n_heads, n_kv, d)
    out = checks.poison(torch.empty(q.shape, dtype=q.dtype, device="cuda"))
    got = run_op(q, k, v, cu_q, d ** -0.5, smem_limit, out=out, cu_seqlens_k=cu_k,
                 max_seqlen_q=max(lq))
    # The oracle: each sequence's queries are the last rows of a full-length causal attention.
    expected = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for b in range(len(runs)):
        if lq[b] == 0:
            continue
        full_q = torch.zeros((lk[b], n_heads, d), dtype=q.dtype, device="cuda")
        full_q[lk[b] - lq[b]:] = q[bq[b]:bq[b + 1]]
        full = sdpa_oracle(full_q, k[bk[b]:bk[b + 1]], v[bk[b]:bk[b + 1]], [0, lk[b]], d ** -0.5)
        expected[bq[b]:bq[b + 1]] = full[lk[b] - lq[b]:]
    checks.assert_close(got, expected, what=f"{runs} (queries, keys) vs SDPA", dtype=torch.bfloat16,
                        hint="a sequence's queries are its LAST positions: query i sits at key "
                             "position i + (len_k - len_q); read K/V from cu_seqlens_k, Q from "
                             "cu_seqlens_q")


# (n_heads, n_kv_heads, head_dim, shared memory per block) -> the tile the kernel must pick:
# a T4 runs head_dim 64 in 64-row tiles (about 50 KB) and 128 in 32-row tiles (about 49 KB;
# 64 rows would take 98 KB); 48 KB forces 32-row tiles at 64 too; 16 KB at head_dim 24 gives
# the generic path 32-row tiles with P in a space of its own (a row of P is longer than K's).
SMALL_SMEM = [(9, 3, 64, T4_SMEM), (32, 8, 64, NO_OPT_IN), (6, 2, 128, T4_SMEM),
              (32, 8, 128, T4_SMEM), (6, 2, 96, T4_SMEM), (6, 2, 24, 16 * 1024)]
SMALL_LENS = [[1000], [1, 31, 32, 33, 0, 129]]


@pytest.mark.gpu
@pytest.mark.parametrize("lens", SMALL_LENS, ids=lambda v: "+".join(map(str, v)))
@pytest.mark.parametrize("n_heads,n_kv,d,smem_limit", SMALL_SMEM, ids=lambda v: str(v))
def test_within_a_t4s_shared_memory(seed, lens, n_heads, n_kv, d, smem_limit):
    """The kernel with its shared memory capped, as on a T4 (64 KB per block, opt-in): it must
    take 32-row tiles where 64 rows do not fit, and give the same answers."""
    q, k, v, cu = make_inputs(checks.generator("cuda", seed), lens, n_heads, n_kv, d)
    run_and_check(q, k, v, cu, d ** -0.5, f"sequences {lens}, heads {n_heads}/{n_kv}, "
                  f"head_dim {d}", smem_limit=smem_limit)


@pytest.mark.gpu
def test_refuses_too_little_shared_memory(seed):
    """Where not even 32-row tiles fit, the op says how much it needs and what it may use."""
    q, k, v, cu = make_inputs(checks.generator("cuda", seed), [3, 40], 4, 2, 128)
    run_and_check(q, k, v, cu, 128 ** -0.5, "a valid call", smem_limit=T4_SMEM)
    with pytest.raises(RuntimeError) as info:
        run_op(q, k, v, cu, 128 ** -0.5, NO_OPT_IN)
    message = str(info.value)
    assert "shared memory" in message and str(NO_OPT_IN) in message, (
        f"head_dim 128 in {NO_OPT_IN} bytes should be refused with a message that names the "
        f"shared memory needed and the {NO_OPT_IN} bytes allowed, got: {message}")
    with pytest.raises(RuntimeError, match="smem_limit"):
        run_op(q, k, v, cu, 0.1, -2)
