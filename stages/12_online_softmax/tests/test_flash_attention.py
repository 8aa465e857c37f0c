"""Stage 12: FlashAttention-style causal prefill attention (online softmax, tensor cores).

Every case compares the kernel with two references computed from the same bf16 inputs:
torch.nn.functional.scaled_dot_product_attention in float32, one sequence at a time (an
oracle that shares no code with this course), and stage 07's twin attention_native (whole
rows of scores, torch.softmax). The kernel reads bf16, accumulates in float32, rounds P to
bf16 for the second tensor-core product and the output once, so the bf16 tolerance applies.
When the output is wrong, the test replays the usual mistakes of an online softmax (o or l
not rescaled when the max grows, the causal mask aligned to the start of the keys, the KV
head by modulo, no mask, no scale, the row sum of one lane) and names the one that matches.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course import parts
from course.testing import checks

# (n_heads, n_kv_heads, head_dim): GQA 1, 3 and 4 at head_dim 64 and 128.
HEADS = [(8, 8, 64), (9, 3, 64), (32, 8, 64), (4, 4, 128), (6, 2, 128), (32, 8, 128)]
TOKENS = [1, 7, 127, 129, 1000]
PACKED = [[1, 7, 129], [129, 1, 7, 64, 300], [3, 0, 70, 1], [65, 64, 63, 200], [0, 1, 0, 128, 0]]
BLOCK_KEYS = 64  # the kernel's key tile: the mistakes below are replayed with the same tiles

RACE_HINT = ("two identical calls gave different outputs: a race. __syncthreads() after "
             "cp.async.wait_group, before any warp reads the tile; and again at the end of each "
             "key tile, before the next prefetch overwrites a buffer other warps may still read")


def flash_op():
    return parts.load("12", "flash_attention")


def offsets(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                        device="cuda")


def make_inputs(gen: torch.Generator, lens: list[int], n_heads: int, n_kv: int, d: int,
                lens_k: list[int] | None = None, fused: bool = False, q_scale: float = 1.0):
    """q, k, v for sequences packed along T, and cu_seqlens_q, cu_seqlens_k (int32).

    lens_k: keys per sequence (default lens): more keys than queries is a cached prefix.
    q_scale widens the queries (and so the scores). fused=True returns q, k, v as views of
    one [T, (n_heads + 2 n_kv) * d] tensor, as a fused QKV projection makes them.
    """
    lens_k = lens if lens_k is None else lens_k
    tq, tk = sum(lens), sum(lens_k)
    if fused:
        assert lens_k == lens
        qkv = checks.randn((tq, (n_heads + 2 * n_kv) * d), torch.bfloat16, "cuda", gen)
        q, k, v = qkv.split([n_heads * d, n_kv * d, n_kv * d], dim=1)
        return (q.view(tq, n_heads, d), k.view(tq, n_kv, d), v.view(tq, n_kv, d),
                offsets(lens), offsets(lens))
    q = checks.randn((tq, n_heads, d), torch.bfloat16, "cuda", gen, scale=q_scale)
    k = checks.randn((tk, n_kv, d), torch.bfloat16, "cuda", gen)
    v = checks.randn((tk, n_kv, d), torch.bfloat16, "cuda", gen)
    return q, k, v, offsets(lens), offsets(lens_k)


def _runs(cu_q: torch.Tensor, cu_k: torch.Tensor):
    bq, bk = cu_q.tolist(), cu_k.tolist()
    return [(bq[b], bq[b + 1], bk[b], bk[b + 1]) for b in range(len(bq) - 1)]


def sdpa_oracle(q, k, v, cu_q, cu_k, scale: float, kv_of_head: list[int] | None = None,
                causal: bool = True, align_end: bool = True) -> torch.Tensor:
    """F.scaled_dot_product_attention per sequence in float32 -> [Tq, n_heads, d] float32.

    A sequence's queries are its last positions: query i sees keys j <= i + len_k - len_q
    (align_end=False: j <= i, the mistake of aligning the mask to the start of the keys).
    """
    n_heads, n_kv = q.shape[1], k.shape[1]
    if kv_of_head is None:
        kv_of_head = [h // (n_heads // n_kv) for h in range(n_heads)]
    index = torch.tensor(kv_of_head, device=q.device)
    k, v = k.index_select(1, index), v.index_select(1, index)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for qs0, qs1, ks0, ks1 in _runs(cu_q, cu_k):
        n_q, n_k = qs1 - qs0, ks1 - ks0
        if n_q == 0:
            continue
        qs = q[qs0:qs1].float().transpose(0, 1)
        ks, vs = (t[ks0:ks1].float().transpose(0, 1) for t in (k, v))
        mask = None
        if causal:
            mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device)
            mask = mask.tril(n_k - n_q if align_end else 0)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        out[qs0:qs1] = o.transpose(0, 1)
    return out


def tiled_mistake(q, k, v, cu_q, cu_k, scale: float, rescale_o: bool = True,
                  rescale_l: bool = True) -> torch.Tensor:
    """The online softmax over key tiles of 64, as the kernel runs it, with one update left out."""
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for qs0, qs1, ks0, ks1 in _runs(cu_q, cu_k):
        n_q, n_k = qs1 - qs0, ks1 - ks0
        if n_q == 0:
            continue
        qs = q[qs0:qs1].float().transpose(0, 1) * scale
        ks = k[ks0:ks1].float().repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[ks0:ks1].float().repeat_interleave(group, dim=1).transpose(0, 1)
        qpos = torch.arange(n_q, device=q.device) + (n_k - n_q)
        m = torch.full((qs.shape[0], n_q, 1), float("-inf"), device=q.device)
        l = torch.zeros((qs.shape[0], n_q, 1), device=q.device)
        o = torch.zeros(qs.shape, device=q.device)
        for k0 in range(0, n_k, BLOCK_KEYS):
            s = qs @ ks[:, k0:k0 + BLOCK_KEYS].transpose(1, 2)
            kpos = torch.arange(k0, min(k0 + BLOCK_KEYS, n_k), device=q.device)
            s = s.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            base = m_new.masked_fill(m_new == float("-inf"), 0.0)
            alpha = torch.exp(m - base)
            p = torch.exp(s - base)
            l = (alpha * l if rescale_l else l) + p.sum(dim=-1, keepdim=True)
            o = (alpha * o if rescale_o else o) + p @ vs[:, k0:k0 + BLOCK_KEYS]
            m = m_new
        out[qs0:qs1] = torch.where(l > 0, o / l, 0.0).transpose(0, 1)
    return out


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    atol, rtol = checks.TOLERANCES[torch.bfloat16]
    g, e = got.float(), expected.float()
    return bool(((g - e).abs() <= atol + rtol * e.abs()).all())


def likely_cause(got, q, k, v, cu_q, cu_k, scale: float) -> str:
    """Name the classic mistake whose output matches `got`, if one does."""
    n_heads, n_kv = q.shape[1], k.shape[1]
    right = sdpa_oracle(q, k, v, cu_q, cu_k, scale)
    mistakes = [
        (lambda: tiled_mistake(q, k, v, cu_q, cu_k, scale, rescale_o=False),
         "forgot to rescale o when the running max grows: before adding P V, multiply the "
         "accumulator by alpha = exp2(m_old - m_new), as l is"),
        (lambda: tiled_mistake(q, k, v, cu_q, cu_k, scale, rescale_l=False),
         "forgot to rescale l when the running max grows: l = alpha * l + sum(p), "
         "alpha = exp2(m_old - m_new), as o is"),
        (lambda: tiled_mistake(q, k, v, cu_q, cu_k, scale, rescale_o=False, rescale_l=False),
         "o and l are never rescaled: every tile's p = exp2(s - m_new) is against a different "
         "max; multiply both by alpha = exp2(m_old - m_new) when the max grows"),
        (lambda: sdpa_oracle(q, k, v, cu_q, cu_k, scale, align_end=False),
         "the causal mask must be aligned to the END of the keys: query i of a sequence with "
         "len_q queries and len_k keys sits at key position i + len_k - len_q"),
        (lambda: sdpa_oracle(q, k, v, cu_q, cu_k, scale,
                             kv_of_head=[h % n_kv for h in range(n_heads)]),
         "the KV head must be q_head // (n_heads // n_kv_heads): neighbouring query heads share "
         "a KV head (this output matches q_head % n_kv_heads)"),
        (lambda: sdpa_oracle(q, k, v, cu_q, cu_k, scale, causal=False),
         "the causal mask is missing: query i may only see keys up to its own position"),
        (lambda: sdpa_oracle(q, k, v, cu_q, cu_k, 1.0),
         "the scale is missing: the exponent is s * scale_log2 - m * scale_log2 (the launcher "
         "passes scale * log2 e; one fmaf per score)"),
    ]
    for wrong_fn, hint in mistakes:
        wrong = wrong_fn()
        if not _close(wrong, right) and _close(got, wrong):
            return hint
    if got.isnan().any() and not got.isnan().all():
        return ("NaN where the poison was overwritten: exp2 of -inf - -inf (a row with nothing "
                "visible yet: use 0 as the base), unloaded K/V rows past the sequence end (fill "
                "them with zeros: 0 * NaN = NaN), or 0/0 in the final division?")
    if got.isnan().all():
        return "nothing was written: is the kernel launched, and is every row < len_q stored?"
    ratio = (got.float().abs() / right.abs().clamp_min(1e-3))[right.abs() > 0.05]
    if ratio.numel() and 3.0 < float(ratio.median()) < 5.0:
        return ("the output is about 4x too large: a lane's l sums only its own 2 columns of "
                "each key tile; add the row's 4 lanes together (__shfl_xor_sync 1 and 2) before "
                "dividing")
    return ("compare with flash_attention_native in flash_attention.py: per key tile, "
            "m_new = max(m, rowmax(S)), alpha = exp2(m - m_new), P = exp2(S - m_new), "
            "l = alpha l + rowsum(P), o = alpha o + P V; at the end o / l. Check the fragment "
            "layouts (lane = 4g + t) against the comments at the top of flash_attention.cu")


def run_and_check(q, k, v, cu_q, cu_k, scale: float, what: str,
                  max_seqlen_q: int | None = None) -> torch.Tensor:
    """Launch into a poisoned buffer; compare with SDPA and stage 07's twin; inputs untouched."""
    before = [t.clone() for t in (q, k, v, cu_q, cu_k)]
    out = checks.poison(torch.empty(q.shape, dtype=q.dtype, device="cuda"))
    got = flash_op().prefill_attention(q, k, v, cu_q, scale, out=out, cu_seqlens_k=cu_k,
                                       max_seqlen_q=max_seqlen_q)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr(), "prefill_attention(..., out=buf) must return buf"
    expected = sdpa_oracle(q, k, v, cu_q, cu_k, scale)
    hint = "" if _close(got, expected) else likely_cause(got, q, k, v, cu_q, cu_k, scale)
    checks.assert_close(got, expected, what=f"{what} vs scaled_dot_product_attention",
                        dtype=torch.bfloat16, hint=hint)
    twin = parts.reference("07", "attention").attention_native(q, k, v, cu_q, scale,
                                                               cu_seqlens_k=cu_k)
    checks.assert_close(got, twin, what=f"{what} vs stage 07's attention_native", hint=hint)
    for name, old, new in zip(("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"), before,
                              (q, k, v, cu_q, cu_k)):
        checks.assert_unmodified(old, new, name)
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("n_heads,n_kv,d", HEADS, ids=lambda v: str(v))
def test_one_sequence(seed, tokens, n_heads, n_kv, d):
    q, k, v, cu_q, cu_k = make_inputs(checks.generator("cuda", seed), [tokens], n_heads, n_kv, d)
    run_and_check(q, k, v, cu_q, cu_k, d ** -0.5, f"T={tokens}, heads {n_heads}/{n_kv}, head_dim {d}")


@pytest.mark.gpu
@pytest.mark.parametrize("n_heads,n_kv,d", [(32, 8, 64), (8, 2, 128)], ids=lambda v: str(v))
def test_long_sequence(seed, n_heads, n_kv, d):
    """4096 tokens: 64 key tiles per row, and 32 query tiles whose work differs 32-fold."""
    q, k, v, cu_q, cu_k = make_inputs(checks.generator("cuda", seed), [4096], n_heads, n_kv, d)
    run_and_check(q, k, v, cu_q, cu_k, d ** -0.5, f"T=4096, heads {n_heads}/{n_kv}, head_dim {d}")


@pytest.mark.gpu
@pytest.mark.parametrize("lens", PACKED, ids=lambda v: "+".join(map(str, v)))
@pytest.mark.parametrize("n_heads,n_kv,d", [(9, 3, 64), (6, 2, 128)], ids=lambda v: str(v))
def test_packed_sequences(seed, lens, n_heads, n_kv, d):
    """Sequences of different lengths (empty ones and length 1 among them) packed along T."""
    q, k, v, cu_q, cu_k = make_inputs(checks.generator("cuda", seed), lens, n_heads, n_kv, d)
    run_and_check(q, k, v, cu_q, cu_k, d ** -0.5, f"sequences {lens}, heads {n_heads}/{n_kv}")


# (queries, keys) per sequence: the first keys - queries tokens were cached in earlier steps.
CACHED = [[(1, 1)], [(1, 300)], [(64, 64), (5, 200), (1, 1000), (70, 71)],
          [(129, 1000), (0, 9)], [(200, 263), (128, 128), (127, 4000)]]


@pytest.mark.gpu
@pytest.mark.parametrize("runs", CACHED, ids=lambda v: "+".join(f"{a}of{b}" for a, b in v))
@pytest.mark.parametrize("n_heads,n_kv,d", [(9, 3, 64), (32, 8, 128)], ids=lambda v: str(v))
def test_queries_after_a_cached_prefix(seed, runs, n_heads, n_kv, d):
    """More keys than queries (chunked prefill, prefix caching, recompute): query i of a
    sequence with Lq queries and Lk keys is key position i + Lk - Lq, and sees the keys up to
    it. max_seqlen_q is given, as the engine gives it: no host reads."""
    lq, lk = [a for a, _ in runs], [b for _, b in runs]
    q, k, v, cu_q, cu_k = make_inputs(checks.generator("cuda", seed), lq, n_heads, n_kv, d,
                                      lens_k=lk)
    run_and_check(q, k, v, cu_q, cu_k, d ** -0.5, f"{runs} (queries, keys)",
                  max_seqlen_q=max(lq))


@pytest.mark.gpu
@pytest.mark.parametrize("n_heads,n_kv,d", [(9, 3, 64), (32, 8, 128)], ids=lambda v: str(v))
def test_views_of_fused_qkv(seed, n_heads, n_kv, d):
    """q, k, v sliced out of one fused QKV projection: rows are (H + 2 KV) * d elements apart."""
    q, k, v, cu_q, cu_k = make_inputs(checks.generator("cuda", seed), [7, 129, 1, 300], n_heads,
                                      n_kv, d, fused=True)
    assert not q.is_contiguous() and not k.is_contiguous()
    run_and_check(q, k, v, cu_q, cu_k, d ** -0.5, "views of a fused qkv tensor (use each row stride)")


@pytest.mark.gpu
@pytest.mark.parametrize("q_scale", [8.0, 40.0])
def test_large_scores_stay_finite(seed, q_scale):
    """Scores in the hundreds: exp(s) overflows float32 unless the running max is subtracted."""
    q, k, v, cu_q, cu_k = make_inputs(checks.generator("cuda", seed), [200, 1000], 8, 2, 64,
                                      q_scale=q_scale)
    got = run_and_check(q, k, v, cu_q, cu_k, 64 ** -0.5, f"queries scaled by {q_scale}")
    checks.assert_finite(got, "attention output with large scores")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_growing_scores(seed, d):
    """Scores that rise along the keys, so the running max grows in every key tile: a missing
    rescale of o or l by exp2(m_old - m_new) cannot hide here."""
    gen = checks.generator("cuda", seed)
    lens = [700, 64, 300]
    q, k, v, cu_q, cu_k = make_inputs(gen, lens, 8, 2, d)
    # One direction u per KV head (it serves query heads 4g .. 4g + 3): queries lean along it,
    # and key j of a sequence a little more each position, so q . k grows along the keys.
    u = F.normalize(torch.randn((2, d), generator=gen, device="cuda"), dim=-1)
    q = (q.float() + 3.0 * u.repeat_interleave(4, dim=0)).to(torch.bfloat16)
    ramp = torch.cat([torch.linspace(0, 6, n, device="cuda") for n in lens])
    k = (k.float() + ramp[:, None, None] * u * d ** 0.5).to(torch.bfloat16)
    run_and_check(q, k, v, cu_q, cu_k, d ** -0.5, f"growing scores, head_dim {d}")


@pytest.mark.gpu
def test_scale_is_a_parameter(seed):
    """scale is the caller's (models may set it); 1/sqrt(head_dim) must not be hard-coded."""
    q, k, v, cu_q, cu_k = make_inputs(checks.generator("cuda", seed), [100, 37], 4, 4, 64)
    run_and_check(q, k, v, cu_q, cu_k, 0.31, "scale 0.31")


@pytest.mark.gpu
def test_rows_past_the_last_sequence_are_not_written(seed):
    """q and out have rows that belong to no sequence (cu_seqlens ends before them): a tile's
    padding rows are computed but never stored, so those rows keep their contents."""
    gen = checks.generator("cuda", seed)
    q, k, v, cu_q, cu_k = make_inputs(gen, [150, 70], 8, 2, 64)
    extra = checks.randn((20, 8, 64), torch.bfloat16, "cuda", gen)
    q_big = torch.cat([q, extra])
    out = checks.poison(torch.empty(q_big.shape, dtype=q.dtype, device="cuda"))
    flash_op().prefill_attention(q_big, k, v, cu_q, 0.125, out=out, cu_seqlens_k=cu_k,
                                 max_seqlen_q=150)
    torch.cuda.synchronize()
    assert out[220:].isnan().all(), (
        "rows past the last sequence were written: store only rows < len_q of each sequence "
        "(the last query tile of a sequence is partly padding)")
    checks.assert_close(out[:220], sdpa_oracle(q, k, v, cu_q, cu_k, 0.125),
                        what="the sequences' own rows", dtype=torch.bfloat16)


@pytest.mark.gpu
def test_deterministic(seed):
    """No atomics, a fixed order of tiles: the same call gives the same bits every time."""
    q, k, v, cu_q, cu_k = make_inputs(checks.generator("cuda", seed), [1000, 129, 3], 32, 8, 64)
    first = run_and_check(q, k, v, cu_q, cu_k, 0.125, "first call")
    for _ in range(3):
        again = flash_op().prefill_attention(q, k, v, cu_q, 0.125, cu_seqlens_k=cu_k)
        torch.cuda.synchronize()
        checks.assert_equal(again, first, what="a repeated call", hint=RACE_HINT)


@pytest.mark.gpu
def test_captured_in_a_cuda_graph(seed):
    """Given max_seqlen_q, the op reads nothing on the host: it can be captured, and a replay
    sees the offsets and inputs written since (same maximum)."""
    gen = checks.generator("cuda", seed)
    q, k, v, cu_q, cu_k = make_inputs(gen, [100, 28], 8, 2, 64, lens_k=[300, 28])
    op = flash_op().prefill_attention
    out = torch.empty(q.shape, dtype=q.dtype, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture (builds, loads the library)
        op(q, k, v, cu_q, 0.125, out, cu_seqlens_k=cu_k, max_seqlen_q=100)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op(q, k, v, cu_q, 0.125, out, cu_seqlens_k=cu_k, max_seqlen_q=100)
    q.copy_(checks.randn(q.shape, torch.bfloat16, "cuda", gen))
    cu_q.copy_(offsets([28, 100]))
    cu_k.copy_(offsets([28, 300]))
    checks.poison(out)
    graph.replay()
    torch.cuda.synchronize()
    checks.assert_close(out, sdpa_oracle(q, k, v, cu_q, cu_k, 0.125),
                        what="graph replay with new offsets", dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [16, 32, 96])
def test_other_head_dims_fall_back_to_stage07(seed, d):
    """The kernel is built for head_dim 64 and 128; prefill_attention sends other sizes (tiny
    test models) to stage 07's kernel. The same lengths at 64 run the kernel."""
    for dim in (64, d):
        q, k, v, cu_q, cu_k = make_inputs(checks.generator("cuda", seed), [5, 130, 1], 6, 2, dim)
        run_and_check(q, k, v, cu_q, cu_k, dim ** -0.5, f"head_dim {dim}")


@pytest.mark.gpu
def test_scales_not_positive_fall_back_to_stage07(seed):
    """The kernel's softmax takes the scale into its exponent, which needs scale > 0 (then the
    max of the raw scores is the max of the scaled ones); prefill_attention sends 0 and negative
    scales to stage 07's kernel. A positive one first: it runs the kernel."""
    q, k, v, cu_q, cu_k = make_inputs(checks.generator("cuda", seed), [100, 37], 4, 2, 64)
    for scale in (0.125, -0.2, 0.0):
        run_and_check(q, k, v, cu_q, cu_k, scale, f"scale {scale}")


@pytest.mark.gpu
def test_rejects_bad_input(seed):
    q, k, v, cu_q, cu_k = make_inputs(checks.generator("cuda", seed), [3, 5], 4, 2, 64)
    run_and_check(q, k, v, cu_q, cu_k, 0.125, "a valid call")
    kernel = parts.kernels().flash_attention
    out = torch.empty(q.shape, dtype=q.dtype, device="cuda")
    q96 = torch.zeros((8, 2, 96), dtype=q.dtype, device="cuda")
    bad = {
        "head_dim": (q96, q96, q96, cu_q, cu_q, 5, 0.1, q96.clone()),
        "multiple of n_kv_heads": (q, k[:, :1].expand(8, 3, 64).contiguous(),
                                   v[:, :1].expand(8, 3, 64).contiguous(), cu_q, cu_q, 5, 0.1, out),
        "bfloat16": (q.float(), k, v, cu_q, cu_q, 5, 0.1, out),
        "positive": (q, k, v, cu_q, cu_q, 5, -0.1, out),
        "cu_seqlens_q": (q, k, v, cu_q.long(), cu_q, 5, 0.1, out),
        "max_seqlen_q": (q, k, v, cu_q, cu_q, 9, 0.1, out),
        "16-byte aligned": (torch.zeros(q.numel() + 8, dtype=q.dtype, device="cuda")[4:4 + q.numel()]
                            .view(q.shape), k, v, cu_q, cu_q, 5, 0.1, out),
    }
    # What the grid cannot hold (blockIdx.y: sequences; blockIdx.z: tile rows of a sequence).
    one = torch.zeros((65536, 1, 64), dtype=q.dtype, device="cuda")
    many = torch.arange(65537, dtype=torch.int32, device="cuda")
    bad["65535 sequences"] = (one, one, one, many, many, 1, 0.1, torch.empty_like(one))
    n = 65535 * 64 + 1
    long = torch.zeros((n, 1, 64), dtype=q.dtype, device="cuda")
    ends = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    bad["4194240 queries"] = (long, long, long, ends, ends, n, 0.1, torch.empty_like(long))
    for needle, args in bad.items():
        with pytest.raises(RuntimeError) as info:
            kernel(*args)
        assert needle in str(info.value), (
            f"bad input should be refused with a message about {needle!r}, got: {info.value}")
    # Without max_seqlen_q the wrapper reads and checks the offsets on the host first.
    for needle, cu in {"must rise from 0": [0, 3, 7], "must rise": [0, 5, 3, 8]}.items():
        with pytest.raises(ValueError, match=needle):
            flash_op().prefill_attention(
                q, k, v, torch.tensor(cu, dtype=torch.int32, device="cuda"), 0.1)
