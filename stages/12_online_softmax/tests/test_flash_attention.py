"""Stage 12: causal prefill attention with the online softmax, both kernels: part 1
(flash_attention_simple.cu, float math) and part 2 (flash_attention.cu, tensor cores).

Every case runs each kernel and compares it with three references computed from the same bf16
inputs: the online softmax in float32 (course/testing/attention_mistakes.py, which also
replays the usual mistakes -- the mask one key off, no mask, the diagonal at the first key,
the KV head by modulo, l or o not rescaled, the values read from k, no scale -- and names the
one whose output matches, or the rows a mistake spoils), torch's
scaled_dot_product_attention in float32, one sequence at a time (an oracle that shares no code
with this course), and stage 07's twin attention_native. The kernels read bf16, accumulate in
float32 and round the output once (the fast one also P, for its second tensor-core product),
so the bf16 tolerance applies. A failure names the shape: the lengths, the heads, head_dim and
the query rows a block takes.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course import parts
from course.testing import attention_mistakes, checks

# (n_heads, n_kv_heads, head_dim): GQA 1, 3 and 4 at head_dim 64 and 128.
HEADS = [(8, 8, 64), (9, 3, 64), (32, 8, 64), (4, 4, 128), (6, 2, 128), (32, 8, 128)]
TOKENS = [1, 7, 127, 129, 1000]
PACKED = [[1, 7, 129], [129, 1, 7, 64, 300], [3, 0, 70, 1], [65, 64, 63, 200], [0, 1, 0, 128, 0]]

# Both kernels run every test: part 1 (flash_attention_simple.cu) carries 65 of the stage's 100
# points, part 2 (flash_attention.cu) 35 (tests/test_stage_points.py checks the shares).
KERNELS = [pytest.param("simple", marks=pytest.mark.points(65)),
           pytest.param("fast", marks=pytest.mark.points(35))]
FILES = {"simple": "flash_attention_simple.cu", "fast": "flash_attention.cu"}
HINTS = {
    "simple": ("compare with flash_attention_native in flash_attention.py: per key tile, "
               "m_new = max(m, the tile's max score), alpha = exp(m - m_new), p = exp(s - m_new), "
               "l = alpha l + sum p, o = alpha o + p v; at the end o / l, with l summed over the "
               "warp's lanes"),
    "fast": ("compare with flash_attention_native in flash_attention.py: per key tile, "
             "m_new = max(m, rowmax(S)), alpha = exp2(m - m_new), P = exp2(S - m_new), "
             "l = alpha l + rowsum(P), o = alpha o + P V; at the end o / l, with l summed over "
             "the row's 4 lanes (__shfl_xor_sync 1 and 2): a lane alone holds a quarter of it"),
}
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


def lengths(cu: torch.Tensor) -> list[int]:
    bounds = cu.tolist()
    return [b - a for a, b in zip(bounds, bounds[1:])]


def tile_rows(kernel: str, lens_q: list[int]) -> int:
    """Query rows a block of `kernel` takes (the 'rows past the first tile' pattern)."""
    if kernel == "simple":
        return 16
    return 64 if max(lens_q, default=0) <= 1024 else 128


def run_and_check(kernel: str, q, k, v, cu_q, cu_k, scale: float, what: str,
                  max_seqlen_q: int | None = None) -> torch.Tensor:
    """Launch `kernel` ("simple": part 1, "fast": part 2) into a poisoned buffer; compare with
    the float32 online softmax (naming a known mistake's pattern: attention_mistakes), SDPA and
    stage 07's twin; the inputs untouched."""
    before = [t.clone() for t in (q, k, v, cu_q, cu_k)]
    out = checks.poison(torch.empty(q.shape, dtype=q.dtype, device="cuda"))
    got = flash_op().prefill_attention_of(kernel)(q, k, v, cu_q, scale, out=out,
                                                  cu_seqlens_k=cu_k, max_seqlen_q=max_seqlen_q)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr(), "prefill_attention(..., out=buf) must return buf"
    lens_q, lens_k = lengths(cu_q), lengths(cu_k)
    what = f"{FILES[kernel]}, {what}"
    attention_mistakes.assert_attention(got, q, k, v, lens_q, lens_k, scale, what=what,
                                        tile_rows=tile_rows(kernel, lens_q), hint=HINTS[kernel])
    checks.assert_close(got, sdpa_oracle(q, k, v, cu_q, cu_k, scale),
                        what=f"{what} vs scaled_dot_product_attention", dtype=torch.bfloat16,
                        hint=HINTS[kernel])
    twin = parts.reference("07", "attention").attention_native(q, k, v, cu_q, scale,
                                                               cu_seqlens_k=cu_k)
    checks.assert_close(got, twin, what=f"{what} vs stage 07's attention_native",
                        hint=HINTS[kernel])
    for name, old, new in zip(("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"), before,
                              (q, k, v, cu_q, cu_k)):
        checks.assert_unmodified(old, new, name)
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("n_heads,n_kv,d", HEADS, ids=lambda v: str(v))
@pytest.mark.parametrize("kernel", KERNELS)
def test_one_sequence(kernel, seed, tokens, n_heads, n_kv, d):
    q, k, v, cu_q, cu_k = make_inputs(checks.generator("cuda", seed), [tokens], n_heads, n_kv, d)
    run_and_check(kernel, q, k, v, cu_q, cu_k, d ** -0.5, f"T={tokens}, heads {n_heads}/{n_kv}, head_dim {d}")


@pytest.mark.gpu
@pytest.mark.parametrize("n_heads,n_kv,d", [(32, 8, 64), (8, 2, 128)], ids=lambda v: str(v))
@pytest.mark.parametrize("kernel", KERNELS)
def test_long_sequence(kernel, seed, n_heads, n_kv, d):
    """4096 tokens: 64 key tiles per row, and 32 query tiles whose work differs 32-fold."""
    q, k, v, cu_q, cu_k = make_inputs(checks.generator("cuda", seed), [4096], n_heads, n_kv, d)
    run_and_check(kernel, q, k, v, cu_q, cu_k, d ** -0.5, f"T=4096, heads {n_heads}/{n_kv}, head_dim {d}")


@pytest.mark.gpu
@pytest.mark.parametrize("lens", PACKED, ids=lambda v: "+".join(map(str, v)))
@pytest.mark.parametrize("n_heads,n_kv,d", [(9, 3, 64), (6, 2, 128)], ids=lambda v: str(v))
@pytest.mark.parametrize("kernel", KERNELS)
def test_packed_sequences(kernel, seed, lens, n_heads, n_kv, d):
    """Sequences of different lengths (empty ones and length 1 among them) packed along T."""
    q, k, v, cu_q, cu_k = make_inputs(checks.generator("cuda", seed), lens, n_heads, n_kv, d)
    run_and_check(kernel, q, k, v, cu_q, cu_k, d ** -0.5, f"sequences {lens}, heads {n_heads}/{n_kv}")


# (queries, keys) per sequence: the first keys - queries tokens were cached in earlier steps.
CACHED = [[(1, 1)], [(1, 300)], [(64, 64), (5, 200), (1, 1000), (70, 71)],
          [(129, 1000), (0, 9)], [(200, 263), (128, 128), (127, 4000)]]


@pytest.mark.gpu
@pytest.mark.parametrize("runs", CACHED, ids=lambda v: "+".join(f"{a}of{b}" for a, b in v))
@pytest.mark.parametrize("n_heads,n_kv,d", [(9, 3, 64), (32, 8, 128)], ids=lambda v: str(v))
@pytest.mark.parametrize("kernel", KERNELS)
def test_queries_after_a_cached_prefix(kernel, seed, runs, n_heads, n_kv, d):
    """More keys than queries (chunked prefill, prefix caching, recompute): query i of a
    sequence with Lq queries and Lk keys is key position i + Lk - Lq, and sees the keys up to
    it. max_seqlen_q is given, as the engine gives it: no host reads."""
    lq, lk = [a for a, _ in runs], [b for _, b in runs]
    q, k, v, cu_q, cu_k = make_inputs(checks.generator("cuda", seed), lq, n_heads, n_kv, d,
                                      lens_k=lk)
    run_and_check(kernel, q, k, v, cu_q, cu_k, d ** -0.5, f"{runs} (queries, keys)",
                  max_seqlen_q=max(lq))


@pytest.mark.gpu
@pytest.mark.parametrize("n_heads,n_kv,d", [(9, 3, 64), (32, 8, 128)], ids=lambda v: str(v))
@pytest.mark.parametrize("kernel", KERNELS)
def test_views_of_fused_qkv(kernel, seed, n_heads, n_kv, d):
    """q, k, v sliced out of one fused QKV projection: rows are (H + 2 KV) * d elements apart."""
    q, k, v, cu_q, cu_k = make_inputs(checks.generator("cuda", seed), [7, 129, 1, 300], n_heads,
                                      n_kv, d, fused=True)
    assert not q.is_contiguous() and not k.is_contiguous()
    run_and_check(kernel, q, k, v, cu_q, cu_k, d ** -0.5, "views of a fused qkv tensor (use each row stride)")


@pytest.mark.gpu
@pytest.mark.parametrize("q_scale", [8.0, 40.0])
@pytest.mark.parametrize("kernel", KERNELS)
def test_large_scores_stay_finite(kernel, seed, q_scale):
    """Scores in the hundreds: exp(s) overflows float32 unless the running max is subtracted."""
    q, k, v, cu_q, cu_k = make_inputs(checks.generator("cuda", seed), [200, 1000], 8, 2, 64,
                                      q_scale=q_scale)
    got = run_and_check(kernel, q, k, v, cu_q, cu_k, 64 ** -0.5, f"queries scaled by {q_scale}")
    checks.assert_finite(got, "attention output with large scores")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kernel", KERNELS)
def test_growing_scores(kernel, seed, d):
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
    run_and_check(kernel, q, k, v, cu_q, cu_k, d ** -0.5, f"growing scores, head_dim {d}")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_scale_is_a_parameter(kernel, seed):
    """scale is the caller's (models may set it); 1/sqrt(head_dim) must not be hard-coded."""
    q, k, v, cu_q, cu_k = make_inputs(checks.generator("cuda", seed), [100, 37], 4, 4, 64)
    run_and_check(kernel, q, k, v, cu_q, cu_k, 0.31, "scale 0.31")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_rows_past_the_last_sequence_are_not_written(kernel, seed):
    """q and out have rows that belong to no sequence (cu_seqlens ends before them): a tile's
    padding rows are computed but never stored, so those rows keep their contents."""
    gen = checks.generator("cuda", seed)
    q, k, v, cu_q, cu_k = make_inputs(gen, [150, 70], 8, 2, 64)
    extra = checks.randn((20, 8, 64), torch.bfloat16, "cuda", gen)
    q_big = torch.cat([q, extra])
    out = checks.poison(torch.empty(q_big.shape, dtype=q.dtype, device="cuda"))
    flash_op().prefill_attention_of(kernel)(q_big, k, v, cu_q, 0.125, out=out,
                                            cu_seqlens_k=cu_k, max_seqlen_q=150)
    torch.cuda.synchronize()
    assert out[220:].isnan().all(), (
        "rows past the last sequence were written: store only rows < len_q of each sequence "
        "(the last query tile of a sequence is partly padding)")
    checks.assert_close(out[:220], sdpa_oracle(q, k, v, cu_q, cu_k, 0.125),
                        what="the sequences' own rows", dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_deterministic(kernel, seed):
    """No atomics, a fixed order of tiles: the same call gives the same bits every time."""
    q, k, v, cu_q, cu_k = make_inputs(checks.generator("cuda", seed), [1000, 129, 3], 32, 8, 64)
    first = run_and_check(kernel, q, k, v, cu_q, cu_k, 0.125, "first call")
    for _ in range(3):
        again = flash_op().prefill_attention_of(kernel)(q, k, v, cu_q, 0.125, cu_seqlens_k=cu_k)
        torch.cuda.synchronize()
        checks.assert_equal(again, first, what="a repeated call", hint=RACE_HINT)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_captured_in_a_cuda_graph(kernel, seed):
    """Given max_seqlen_q, the op reads nothing on the host: it can be captured, and a replay
    sees the offsets and inputs written since (same maximum)."""
    gen = checks.generator("cuda", seed)
    q, k, v, cu_q, cu_k = make_inputs(gen, [100, 28], 8, 2, 64, lens_k=[300, 28])
    op = flash_op().prefill_attention_of(kernel)
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
@pytest.mark.parametrize("kernel", KERNELS)
def test_other_head_dims_fall_back_to_stage07(kernel, seed, d):
    """The kernel is built for head_dim 64 and 128; prefill_attention sends other sizes (tiny
    test models) to stage 07's kernel. The same lengths at 64 run the kernel."""
    for dim in (64, d):
        q, k, v, cu_q, cu_k = make_inputs(checks.generator("cuda", seed), [5, 130, 1], 6, 2, dim)
        run_and_check(kernel, q, k, v, cu_q, cu_k, dim ** -0.5, f"head_dim {dim}")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_scales_not_positive_fall_back_to_stage07(kernel, seed):
    """The kernel's softmax takes the scale into its exponent, which needs scale > 0 (then the
    max of the raw scores is the max of the scaled ones); prefill_attention sends 0 and negative
    scales to stage 07's kernel. A positive one first: it runs the kernel."""
    q, k, v, cu_q, cu_k = make_inputs(checks.generator("cuda", seed), [100, 37], 4, 2, 64)
    for scale in (0.125, -0.2, 0.0):
        run_and_check(kernel, q, k, v, cu_q, cu_k, scale, f"scale {scale}")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_rejects_bad_input(kernel, seed):
    q, k, v, cu_q, cu_k = make_inputs(checks.generator("cuda", seed), [3, 5], 4, 2, 64)
    run_and_check(kernel, q, k, v, cu_q, cu_k, 0.125, "a valid call")
    launch = getattr(parts.kernels(), FILES[kernel].removesuffix(".cu"))
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
    n = 65535 * 64 + 1  # past both kernels' limits: 65535 blocks of 16 (simple) or 64 rows
    long = torch.zeros((n, 1, 64), dtype=q.dtype, device="cuda")
    ends = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    most = {"simple": 65535 * 16, "fast": 65535 * 64}[kernel]
    bad[f"{most} queries"] = (long, long, long, ends, ends, n, 0.1, torch.empty_like(long))
    for needle, args in bad.items():
        with pytest.raises(RuntimeError) as info:
            launch(*args)
        assert needle in str(info.value), (
            f"bad input should be refused with a message about {needle!r}, got: {info.value}")
    # Without max_seqlen_q the wrapper reads and checks the offsets on the host first.
    for needle, cu in {"must rise from 0": [0, 3, 7], "must rise": [0, 5, 3, 8]}.items():
        with pytest.raises(ValueError, match=needle):
            flash_op().prefill_attention_of(kernel)(
                q, k, v, torch.tensor(cu, dtype=torch.int32, device="cuda"), 0.1)
