"""Stage 06, gemm.cu: y = x @ weight^T with cublasGemmEx, the `linear` op of every layer (a
decode step's few tokens go to a GEMV instead: test_gemv_simple.py, test_gemv.py).

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

# cuBLAS carries 40 of the stage's 100 points, shared by this file's tests (see
# tests/test_stage_points.py), the simple GEMV 40 and the fast one 20.
TESTS = len(SHAPES) * len(TOKENS) + len(LM_HEADS) + 2 + 2 + 1 + 1
pytestmark = pytest.mark.points(40 / TESTS)


def linear_op():
    return parts.load("06", "linear")


def make_inputs(gen: torch.Generator, tokens: int, in_features: int, out_features: int,
                dtype=torch.bfloat16):
    x = checks.randn((tokens, in_features), dtype, "cuda", gen)
    w = checks.randn((out_features, in_features), dtype, "cuda", gen,
                     scale=in_features ** -0.5)
    return x, w


def run_and_check(x: torch.Tensor, w: torch.Tensor, gemv: bool | str = False,
                  hint: str = TRANSPOSE_HINT) -> None:
    """linear(x, w) against both oracles. gemv=False (these tests): cuBLAS at every size;
    the GEMV tests pass "simple" or "fast" (that GEMV only)."""
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
            kernel(*args)
        assert "linear" in str(info.value) or "must" in str(info.value), (
            f"{name}: the error should say what is wrong, got: {info.value}")
