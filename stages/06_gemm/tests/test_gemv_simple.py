"""Stage 06, part 1, gemv_simple.cu: y = x @ weight^T for a decode step's 1-8 bf16 tokens, a
warp per output.

Each case compares the kernel with the float32 product of the same bf16 inputs (an oracle that
shares no code with the course) and with linear_native, at the bf16 tolerance: the GEMV
accumulates in float32 and rounds once, as cuBLAS does (test_gemm.py says why that tolerance
holds at any `in`). A failure names the shape, the outputs and tokens that are wrong and,
where their pattern is a known mistake's, that mistake (course/testing/gemv_mistakes.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course import parts
from course.testing import checks, gemv_mistakes

HINT = gemv_mistakes.SIMPLE_HINT
OUR_GEMVS = ("gemv_simple_kernel", "gemv_kernel")   # not cuBLAS's own gemv kernels
WARPS_PER_BLOCK = 8   # gemv_simple.cu's kSimpleThreads / 32: the "grid rounded down" pattern

# (in, out): Llama-3.2-1B's decode projections (qkv, o, gate_up, down), SmolLM2's, rows whose
# last sweep of 32 pieces is partial (576, 1536, 2056, 4104), rows shorter than one sweep (72),
# and outputs that do not fill the last block (211, 13, 100).
SHAPES = [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048), (576, 960),
          (1536, 576), (72, 211), (2056, 13), (4104, 100)]
TOKENS = [1, 2, 3, 4, 5, 8]

# The simple GEMV carries 40 of the stage's 100 points, shared by this file's tests.
TESTS = len(SHAPES) * len(TOKENS) + 2 + 1 + 1
pytestmark = pytest.mark.points(40 / TESTS)


def check(x: torch.Tensor, w: torch.Tensor, got: torch.Tensor, what: str) -> None:
    """got against the float32 product (with the mistakes' patterns) and linear_native."""
    gemv_mistakes.assert_gemv(got, x, w, what=what, warps_per_block=WARPS_PER_BLOCK, hint=HINT)
    twin = parts.reference("06", "linear").linear_native(x, w, out_dtype=got.dtype)
    checks.assert_close(got, twin, what=f"{what} vs linear_native", dtype=got.dtype, hint=HINT)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("in_features,out_features", SHAPES, ids=lambda v: str(v))
def test_gemv_simple_bf16(seed, tokens, in_features, out_features):
    x, w = gemv_mistakes.operands(checks.generator("cuda", seed), tokens, in_features,
                                  out_features)
    x0, w0 = x.clone(), w.clone()
    out = checks.poison(torch.empty((tokens, out_features), dtype=torch.bfloat16, device="cuda"))
    got = parts.load("06", "linear").linear(x, w, out=out, gemv="simple")
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr(), "linear(..., out=buf) must fill buf and return it"
    check(x, w, got, "gemv_simple")
    checks.assert_unmodified(x0, x, "x")
    checks.assert_unmodified(w0, w, "weight")


@pytest.mark.gpu
@pytest.mark.parametrize("in_features,out_features,tokens", [(2048, 128256, 1), (576, 49152, 4)],
                         ids=lambda v: str(v))
def test_gemv_simple_float32_logits(seed, in_features, out_features, tokens):
    """The lm_head of a decode step: float32 out, the accumulator not rounded to bf16."""
    x, w = gemv_mistakes.operands(checks.generator("cuda", seed), tokens, in_features,
                                  out_features)
    got = parts.load("06", "linear").linear(x, w, out_dtype=torch.float32, gemv="simple")
    torch.cuda.synchronize()
    assert got.dtype == torch.float32, f"out_dtype=torch.float32 must give float32, got {got.dtype}"
    checks.assert_close(got, F.linear(x.float(), w.float()), dtype=torch.float32, atol=1e-4,
                        rtol=1e-4, what="gemv_simple with float32 output vs F.linear in float32",
                        hint="write from_float<OutT>(sum): OutT is float for logits")


@pytest.mark.gpu
def test_gemv_simple_refuses_what_it_cannot_run(seed):
    """It runs one token (checked first: the refusals alone are given code) and refuses 9
    tokens, a row length that is not a multiple of 8 and a misaligned x with a sentence."""
    gen = checks.generator("cuda", seed)
    op = parts.load("06", "linear")
    x, w = gemv_mistakes.operands(gen, 9, 256, 64)
    check(x[:1], w, op.linear(x[:1], w, gemv="simple"), "gemv_simple, 1 token")
    odd_x, odd_w = gemv_mistakes.operands(gen, 1, 100, 64)
    shifted = torch.empty(257, dtype=torch.bfloat16, device="cuda")[1:].view(1, 256)
    for name, (xs, ws) in {"9 tokens": (x, w), "in = 100": (odd_x, odd_w),
                           "misaligned x": (shifted, w)}.items():
        with pytest.raises(RuntimeError, match="1-8 tokens") as info:
            op.linear(xs, ws, gemv="simple")
        assert "gemv" in str(info.value), f"{name}: the refusal should name the GEMV: {info.value}"


@pytest.mark.gpu
def test_decode_runs_a_gemv_and_cublas_otherwise(seed):
    """The dispatch (linear.py, given): by default one bf16 token goes to a GEMV -- the fast
    one once gemv.cu is written, else yours -- and more to cuBLAS; with gemv=True 1-8 bf16
    tokens with 16-byte aligned rows do; 9 tokens, float16, a row length that is not a
    multiple of 8 and a misaligned x always go to cuBLAS, and every one of them is right."""
    gen = checks.generator("cuda", seed)
    op = parts.load("06", "linear")
    x, w = gemv_mistakes.operands(gen, 9, 2048, 512)
    flat = torch.empty(9 * 2048 + 1, dtype=torch.bfloat16, device="cuda")
    shifted = flat[1:].view(9, 2048).copy_(x)              # contiguous, 2 bytes off alignment
    half_x, half_w = x.half(), w.half()
    odd_x, odd_w = gemv_mistakes.operands(gen, 3, 100, 512)
    # (x, weight, gemv argument, whether a GEMV must run): by default one token only
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
        used_gemv = any(ours in n for n in ran for ours in OUR_GEMVS)
        assert used_gemv == expect_gemv, (
            f"{name}: expected {'a GEMV' if expect_gemv else 'cuBLAS only'}, the GPU ran "
            f"{sorted(set(ran))}")
        checks.assert_close(got, F.linear(xs.float(), ws.float()), dtype=xs.dtype,
                            what=f"linear, {name}", hint=HINT)
