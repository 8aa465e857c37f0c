"""Stage 06: y = x @ weight^T with cublasGemmEx (gemm.cu) and, for 1-8 tokens, the GEMV of
gemv.cu: the `linear` op of every layer.

Each case compares the kernel with two references computed from the same bf16 inputs:
the native twin (linear_native: float32 math, rounded once) and torch.nn.functional.linear
in float32, an oracle that shares no code with this course.

Tolerance: y[t, o] is a sum of `in` products, up to 8192 here. The weights are drawn with
standard deviation 1/sqrt(in), as a trained Linear's are, so every output is O(1) whatever
`in` is. Then the float32 accumulation error (about sqrt(in) * 2^-24) is negligible and what
remains is the one rounding of y to bf16, at most 2^-9 relative: the bf16 tolerance of
course.testing.checks (atol 1e-2, rtol 1.6e-2) applies unchanged. Accumulating in bf16, a swapped
operand or a wrong leading dimension all miss it by far more.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course import build, parts
from course.testing import checks

TRANSPOSE_HINT = (
    "cuBLAS is column-major: the row-major x [T, in] is the column-major matrix x^T [in, T], and "
    "y's bytes are the column-major y^T [out, T]. So compute y^T = W x^T: m = out, n = T, k = in, "
    "A = weight with CUBLAS_OP_T (lda = in), B = x with CUBLAS_OP_N (ldb = in), C = y (ldc = out). "
    "Did you swap A and B, m and n, or a leading dimension?")

# (in_features, out_features): SmolLM2 (576 hidden, 1536 MLP, 49152 vocab), Llama-3.2-1B
# (2048 hidden, 8192 MLP, 128256 vocab) and sizes that are nothing special.
SHAPES = [(576, 576), (576, 1536), (1536, 576), (2048, 2048), (2048, 8192), (8192, 2048),
          (320, 100), (100, 320), (72, 211)]
TOKENS = [1, 7, 127, 129, 1000]
LM_HEADS = [(576, 49152, 7), (576, 49152, 1000), (2048, 128256, 1), (2048, 128256, 129)]


def linear_op():
    return parts.load("06", "linear")


def make_inputs(gen: torch.Generator, tokens: int, in_features: int, out_features: int,
                dtype=torch.bfloat16):
    x = checks.randn((tokens, in_features), dtype, "cuda", gen)
    w = checks.randn((out_features, in_features), dtype, "cuda", gen,
                     scale=in_features ** -0.5)
    return x, w


def run_and_check(x: torch.Tensor, w: torch.Tensor, gemv: bool = False,
                  hint: str = TRANSPOSE_HINT) -> None:
    """linear(x, w) against both oracles. gemv=False (these tests): cuBLAS at every size;
    the GEMV tests below pass gemv=True, so 1-8 bf16 tokens go to gemv.cu."""
    x0, w0 = x.clone(), w.clone()
    out = checks.poison(torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device="cuda"))
    got = linear_op().linear(x, w, out=out, gemv=gemv)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr(), "linear(..., out=buf) must fill buf and return it"
    shape = f"x {tuple(x.shape)} @ weight {tuple(w.shape)}^T"
    oracle = F.linear(x.float(), w.float())
    checks.assert_close(got, oracle, what=f"linear, {shape}, vs F.linear in float32",
                        dtype=x.dtype, hint=hint)
    twin = parts.reference("06", "linear").linear_native(x, w)
    checks.assert_close(got, twin, what=f"linear, {shape}, vs linear_native", dtype=x.dtype,
                        hint=hint)
    checks.assert_unmodified(x0, x, "x")
    checks.assert_unmodified(w0, w, "weight")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("in_features,out_features", SHAPES, ids=lambda v: str(v))
def test_linear_bf16(seed, tokens, in_features, out_features):
    run_and_check(*make_inputs(checks.generator("cuda", seed), tokens, in_features, out_features))


@pytest.mark.gpu
@pytest.mark.parametrize("in_features,out_features,tokens", LM_HEADS, ids=lambda v: str(v))
def test_lm_head_sizes(seed, in_features, out_features, tokens):
    """The vocabulary projection: the widest GEMM of the model (n = 49152 or 128256)."""
    run_and_check(*make_inputs(checks.generator("cuda", seed), tokens, in_features, out_features))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_other_dtypes(seed, dtype):
    """float32 (no TF32: the result must match a float32 product) and float16."""
    gen = checks.generator("cuda", seed)
    for tokens, in_features, out_features in [(7, 576, 1536), (129, 2048, 320), (1, 100, 72)]:
        run_and_check(*make_inputs(gen, tokens, in_features, out_features, dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("in_features,out_features,tokens", [(576, 49152, 3), (2048, 4099, 5)],
                         ids=lambda v: str(v))
def test_float32_output_keeps_the_accumulator(seed, in_features, out_features, tokens):
    """Logits: bf16 x and weight, float32 y (out_dtype=torch.float32), not rounded to bf16."""
    gen = checks.generator("cuda", seed)
    x, w = make_inputs(gen, tokens, in_features, out_features)
    got = linear_op().linear(x, w, out_dtype=torch.float32, gemv=False)
    torch.cuda.synchronize()
    assert got.dtype == torch.float32, f"out_dtype=torch.float32 must give float32, got {got.dtype}"
    oracle = F.linear(x.float(), w.float())
    # float32 accumulation of O(1) terms: far inside a bf16 step (2^-8 relative).
    checks.assert_close(got, oracle, what="linear with float32 output vs F.linear in float32",
                        dtype=torch.float32, atol=1e-4, rtol=1e-4,
                        hint="pass the output's own cudaDataType (CUDA_R_32F) as C's type, "
                             "not x's: the launcher's y_dtype")


@pytest.mark.gpu
def test_fused_projection_equals_separate_ones(seed):
    """One GEMM with weights concatenated along `out` = the separate GEMMs side by side."""
    gen = checks.generator("cuda", seed)
    x, wq = make_inputs(gen, 129, 576, 576)
    wk, wv = (make_inputs(gen, 1, 576, 192)[1] for _ in range(2))
    op = linear_op()
    fused = op.linear(x, torch.cat([wq, wk, wv]), gemv=False)
    separate = torch.cat([op.linear(x, w, gemv=False) for w in (wq, wk, wv)], dim=1)
    checks.assert_close(fused, separate, what="fused QKV projection vs separate q, k, v",
                        hint="a fused weight only adds output columns: check ldc = out_features")


@pytest.mark.gpu
def test_rejects_bad_input(seed):
    op = linear_op()
    x, w = make_inputs(checks.generator("cuda", seed), 7, 320, 100)
    checks.assert_close(op.linear(x, w, gemv=False), F.linear(x.float(), w.float()),
                        dtype=x.dtype, hint=TRANSPOSE_HINT)
    kernel = parts.kernels().linear
    out = torch.empty((7, 100), dtype=x.dtype, device="cuda")
    bad = {
        "in features differ": (x, w[:, :319].contiguous(), out),
        "weight is not contiguous": (x, w.t().contiguous().t(), out),
        "x is float32, weight bf16": (x.float(), w, out.float()),
        "out has the wrong shape": (x, w, out[:, :99]),
        "x is 1-D": (x[0], w, out),
    }
    for name, args in bad.items():
        with pytest.raises(RuntimeError) as info:
            kernel(*args, 0)
        assert "linear" in str(info.value) or "must" in str(info.value), (
            f"{name}: the error should say what is wrong, got: {info.value}")


# --- Part 2: the GEMV of gemv.cu, which `linear` uses for 1-8 bf16 tokens -----------------
#
# The same two oracles as above (F.linear in float32, linear_native) and the same bf16
# tolerance: the GEMV accumulates in float32 and rounds once, as cuBLAS does. Then the things a
# GEMV gets wrong that a cuBLAS call cannot: a row split into several units, a last unit partly
# empty, warps with different numbers of rows, the tokens past the first, and reading x before
# the kernel that writes it has finished (programmatic dependent launch on an sm_90 GPU).

GEMV_HINT = (
    "a warp's units i = 0, 1, ... run through its rows gw, gw + W, ...; unit i sits in slot "
    "i % kStages once copies_wait<kStages - 1>() returns after fetching unit i + kStages - 1; "
    "lane l's pieces are slot[p * 32 + l] (columns u.first + p * 32 + l, none past in / 8), each "
    "times the same pieces of every token's x (x + t * in / 8 pieces); at a row's last unit a "
    "butterfly sum, lane 0 writes y[t * out + row], and acc goes back to 0. Did you skip a "
    "partly empty unit, keep a row's sums for the next row, or mix two tokens' sums?")

# (in, out): Llama-3.2-1B's decode projections (qkv, o, gate_up, down), SmolLM2's, and sizes
# whose rows end in a partly empty unit (in / 8 not a multiple of 256 pieces), whose warps own
# different numbers of rows, or with fewer rows than warps (out = 13).
GEMV_SHAPES = [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048), (576, 960),
               (1536, 576), (72, 211), (2056, 13), (4104, 100)]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("in_features,out_features", GEMV_SHAPES, ids=lambda v: str(v))
def test_gemv_bf16(seed, tokens, in_features, out_features):
    x, w = make_inputs(checks.generator("cuda", seed), tokens, in_features, out_features)
    run_and_check(x, w, gemv=True, hint=GEMV_HINT)


@pytest.mark.gpu
@pytest.mark.parametrize("in_features,out_features,tokens", [(2048, 128256, 1), (576, 49152, 4)],
                         ids=lambda v: str(v))
def test_gemv_float32_logits(seed, in_features, out_features, tokens):
    """The lm_head of a decode step: float32 out, the accumulator not rounded to bf16."""
    x, w = make_inputs(checks.generator("cuda", seed), tokens, in_features, out_features)
    got = linear_op().linear(x, w, out_dtype=torch.float32, gemv=True)
    torch.cuda.synchronize()
    assert got.dtype == torch.float32, f"out_dtype=torch.float32 must give float32, got {got.dtype}"
    checks.assert_close(got, F.linear(x.float(), w.float()), dtype=torch.float32, atol=1e-4,
                        rtol=1e-4, what="GEMV with float32 output vs F.linear in float32",
                        hint="write from_float<OutT>(sum): OutT is float for logits")


@pytest.mark.gpu
def test_gemv_runs_for_decode_and_cublas_otherwise(seed):
    """The dispatch: by default one bf16 token goes to gemv_kernel and more to cuBLAS; with
    gemv=True 1-8 bf16 tokens with 16-byte aligned rows do; 9 tokens, float16, a row length
    that is not a multiple of 8 and a misaligned x always go to cuBLAS, and every one of them
    is right."""
    gen = checks.generator("cuda", seed)
    op = linear_op()
    x, w = make_inputs(gen, 9, 2048, 512)
    flat = torch.empty(9 * 2048 + 1, dtype=torch.bfloat16, device="cuda")
    shifted = flat[1:].view(9, 2048).copy_(x)              # contiguous, 2 bytes off alignment
    half_x, half_w = x.half(), w.half()
    odd_x, odd_w = make_inputs(gen, 3, 100, 512)
    # (x, weight, gemv argument, whether the GEMV must run): by default one token only
    cases = {"1 bf16 token": (x[:1], w, None, True), "2 bf16 tokens": (x[:2], w, None, False),
             "2 bf16 tokens, gemv=True": (x[:2], w, True, True),
             "8 bf16 tokens, gemv=True": (x[:8], w, True, True),
             "9 bf16 tokens, gemv=True": (x, w, True, False),
             "1 bf16 token, gemv=False": (x[:1], w, False, False),
             "float16, gemv=True": (half_x[:1], half_w, True, False),
             "in = 100, gemv=True": (odd_x[:1], odd_w, True, False),
             "misaligned x, gemv=True": (shifted[:1], w, True, False)}
    for name, (xs, ws, gemv, expect_gemv) in cases.items():
        got, ran = checks.kernels_of(lambda: op.linear(xs, ws, gemv=gemv))
        used_gemv = any("gemv_kernel" in n for n in ran)
        assert used_gemv == expect_gemv, (
            f"{name}: expected {'gemv_kernel' if expect_gemv else 'cuBLAS only'}, the GPU ran "
            f"{sorted(set(ran))}")
        checks.assert_close(got, F.linear(xs.float(), ws.float()), dtype=xs.dtype,
                            what=f"linear, {name}", hint=GEMV_HINT)


def _chain(x_big: torch.Tensor, src: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
           tokens: int) -> None:
    # x is written by an add over 64 MB (tens of microseconds), then read at once by the GEMV.
    torch.add(src, 1.0, out=x_big)
    linear_op().linear(x_big[: tokens * w.shape[1]].view(tokens, w.shape[1]), w, out=out,
                       gemv=True)


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda_graph"])
@pytest.mark.parametrize("tokens", [1, 2])
def test_gemv_waits_for_the_kernel_that_writes_x(seed, graph, tokens):
    """With PDL the GEMV starts before the previous kernel ends: it may load weights early,
    but x only after griddepcontrol.wait. A GEMV that reads x too early sees the old values
    here (the writer is a long kernel), eagerly and inside a CUDA graph; one token (on an
    sm_90 GPU, gemv_kernel_tma) and two (gemv_kernel)."""
    gen = checks.generator("cuda", seed)
    in_features = 2048
    _, w = make_inputs(gen, 1, in_features, 4096)
    src = checks.randn((32 * 1024 * 1024,), torch.bfloat16, "cuda", gen)
    x_big = torch.zeros_like(src)
    out = torch.empty((tokens, 4096), dtype=torch.bfloat16, device="cuda")
    if graph:
        _chain(x_big, src, w, out, tokens)        # warm-up outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            _chain(x_big, src, w, out, tokens)
    for step in range(3):
        src.copy_(checks.randn(src.shape, torch.bfloat16, "cuda", gen))
        x_big.zero_()
        torch.cuda.synchronize()
        g.replay() if graph else _chain(x_big, src, w, out, tokens)
        torch.cuda.synchronize()
        x = (src[: tokens * in_features].float() + 1.0).to(torch.bfloat16).view(tokens, in_features)
        checks.assert_close(out, F.linear(x.float(), w.float()), dtype=torch.bfloat16,
                            what=f"GEMV after the kernel that writes x (step {step})",
                            hint="read x (and write y) only after wait_for_previous_kernel(): "
                                 "before it, only the weights are safe to load")


def _runs_sm90_code() -> bool:
    """Whether this GPU runs kernel code built for sm_90 or later: the GPU is one, and one of
    the architectures the library is built for (course/build.py) lies between 9.0 and it."""
    device = torch.cuda.get_device_capability()
    return device >= (9, 0) and any((9, 0) <= build.arch_capability(a) <= device
                                    for a in build.archs())


@pytest.mark.gpu
def test_one_token_takes_bulk_copies_on_hopper(seed):
    """On an sm_90 GPU one token with rows of a multiple of 2048 columns goes to
    gemv_kernel_tma (bulk copies), plain and paired; other rows, and 2 tokens, to gemv_kernel.
    Below sm_90, or with a library built only for older GPUs (a T4's compute_75 PTX, which
    the driver compiles for this one), every one goes to gemv_kernel. Each result against the
    float32 oracle."""
    hopper = _runs_sm90_code()
    gen = checks.generator("cuda", seed)
    op = linear_op()
    cases = {"1 token, in = 2048": (1, 2048, 300, False, hopper),
             "1 token, in = 8192": (1, 8192, 100, False, hopper),
             "1 token, in = 2048, gate_up": (1, 2048, 200, True, hopper),
             "1 token, in = 1024": (1, 1024, 300, False, False),
             "1 token, in = 576": (1, 576, 300, False, False),
             "2 tokens, in = 2048": (2, 2048, 300, False, False)}
    for name, (tokens, in_features, out_features, paired, expect_tma) in cases.items():
        rows = 2 * out_features if paired else out_features
        x, w = make_inputs(gen, tokens, in_features, rows)
        if paired:
            got = torch.empty((tokens, out_features), dtype=torch.bfloat16, device="cuda")
            _, ran = checks.kernels_of(lambda: parts.kernels().linear_silu_mul(x, w, got))
        else:
            got, ran = checks.kernels_of(lambda: op.linear(x, w, gemv=True))
        used_tma = any("gemv_kernel_tma" in n for n in ran)
        assert used_tma == expect_tma, (
            f"{name}: expected {'gemv_kernel_tma' if expect_tma else 'gemv_kernel'}, the GPU "
            f"ran {sorted(set(ran))}")
        expected = F.linear(x.float(), w.float())
        if paired:
            expected = parts.reference("08", "activation").silu_mul_native(expected)
        checks.assert_close(got, expected, dtype=torch.bfloat16, what=f"GEMV, {name}",
                            hint="launch: one token that tma_fits goes to launch_tma")


# The MLP's gate_up projection with its activation in the GEMV's epilogue (gemv.cu, `pair`):
# output j is silu(x . gate[j]) * (x . up[j]), each group holding a gate row and an up row.
SILU_HINT = (
    "with pair = inter, output j's group is 2 or 4 warps: the first half on gate row j, the "
    "second half on up row j + inter (unit_of gives each member its row); the group's first warp "
    "adds each half's partial sums, rounds both to bf16 and applies silu_mul_of; y is "
    "[tokens, inter], so it writes column u.out, not the weight row")

# (in, inter): Llama-3.2-1B's and SmolLM2's MLPs (2 and 1 units per row: groups of 4 and 2),
# 4 units per row (two per warp), and rows of an odd number of partly empty units.
SILU_SHAPES = [(2048, 8192), (576, 1536), (4096, 64), (2056, 13), (72, 100)]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("in_features,inter", SILU_SHAPES, ids=lambda v: str(v))
def test_gemv_silu_mul_equals_linear_then_silu_mul(seed, tokens, in_features, inter):
    """Against the plain GEMV's output then stage 08's silu_mul twin (the same roundings: equal
    but for a sum that lands on a bf16 rounding boundary), and against the float32 oracle."""
    x, w = make_inputs(checks.generator("cuda", seed), tokens, in_features, 2 * inter)
    out = checks.poison(torch.empty((tokens, inter), dtype=torch.bfloat16, device="cuda"))
    parts.kernels().linear_silu_mul(x, w, out)
    plain = linear_op().linear(x, w, gemv=True)
    torch.cuda.synchronize()
    silu_mul_native = parts.reference("08", "activation").silu_mul_native
    checks.assert_close(out, silu_mul_native(plain), what="linear_silu_mul vs linear (GEMV) "
                        "then silu_mul_native", dtype=torch.bfloat16, hint=SILU_HINT)
    oracle = silu_mul_native(F.linear(x.float(), w.float()))
    checks.assert_close(out, oracle, what="linear_silu_mul vs the float32 oracle",
                        dtype=torch.bfloat16, hint=SILU_HINT)


@pytest.mark.gpu
def test_gemv_silu_mul_refuses_what_it_cannot_run(seed):
    """It runs what it can (one token, checked first: the refusals alone are given code), and
    refuses 9 tokens and an odd number of weight rows with a sentence."""
    x, w = make_inputs(checks.generator("cuda", seed), 9, 256, 64)
    out = checks.poison(torch.empty((1, 32), dtype=torch.bfloat16, device="cuda"))
    parts.kernels().linear_silu_mul(x[:1], w, out)
    torch.cuda.synchronize()
    silu_mul_native = parts.reference("08", "activation").silu_mul_native
    checks.assert_close(out, silu_mul_native(F.linear(x[:1].float(), w.float())),
                        dtype=torch.bfloat16, what="linear_silu_mul, 1 token", hint=SILU_HINT)
    with pytest.raises(RuntimeError, match="1-8 tokens"):
        parts.kernels().linear_silu_mul(x, w, torch.empty(9, 32, dtype=torch.bfloat16,
                                                          device="cuda"))
    with pytest.raises(RuntimeError, match="odd number of rows"):
        parts.kernels().linear_silu_mul(x[:1], w[:63], torch.empty(1, 31, dtype=torch.bfloat16,
                                                                   device="cuda"))
