"""Stage 06, part 2, gemv.cu: the fast GEMV, for a decode step's 1-8 bf16 tokens.

The same oracles and tolerance as part 1 (test_gemv_simple.py); a failure names the shape,
the wrong outputs and tokens and, where their pattern is a known mistake's, that mistake
(course/testing/gemv_mistakes.py). Then the things the fast GEMV gets wrong that the simple
one cannot: a row split into several units, a last unit partly empty, warps with different
numbers of rows, the tokens past the first, and reading x before the kernel that writes it
has finished (programmatic dependent launch on an sm_90 GPU). Its speed is not graded:
`python3 -m grader 06 --bench` times it.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course import build, parts
from course.testing import checks, gemv_mistakes

GEMV_HINT = gemv_mistakes.FAST_HINT

# (in, out): Llama-3.2-1B's decode projections (qkv, o, gate_up, down), SmolLM2's, and sizes
# whose rows end in a partly empty unit (in / 8 not a multiple of 256 pieces), whose warps own
# different numbers of rows, or with fewer rows than warps (out = 13).
GEMV_SHAPES = [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048), (576, 960),
               (1536, 576), (72, 211), (2056, 13), (4104, 100)]
GEMV_TOKENS = [1, 2, 3, 4, 5, 8]


def linear_op():
    return parts.load("06", "linear")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", GEMV_TOKENS)
@pytest.mark.parametrize("in_features,out_features", GEMV_SHAPES, ids=lambda v: str(v))
def test_gemv_bf16(seed, tokens, in_features, out_features):
    x, w = gemv_mistakes.operands(checks.generator("cuda", seed), tokens, in_features, out_features)
    x0, w0 = x.clone(), w.clone()
    out = checks.poison(torch.empty((tokens, out_features), dtype=torch.bfloat16, device="cuda"))
    got = linear_op().linear(x, w, out=out, gemv="fast")
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr(), "linear(..., out=buf) must fill buf and return it"
    gemv_mistakes.assert_gemv(got, x, w, what="gemv (fast)", unit=gemv_mistakes.FAST_UNIT,
                              hint=GEMV_HINT)
    checks.assert_close(got, parts.reference("06", "linear").linear_native(x, w),
                        what="gemv (fast) vs linear_native", dtype=torch.bfloat16, hint=GEMV_HINT)
    checks.assert_unmodified(x0, x, "x")
    checks.assert_unmodified(w0, w, "weight")


@pytest.mark.gpu
@pytest.mark.parametrize("in_features,out_features,tokens", [(2048, 128256, 1), (576, 49152, 4)],
                         ids=lambda v: str(v))
def test_gemv_float32_logits(seed, in_features, out_features, tokens):
    """The lm_head of a decode step: float32 out, the accumulator not rounded to bf16."""
    x, w = gemv_mistakes.operands(checks.generator("cuda", seed), tokens, in_features, out_features)
    got = linear_op().linear(x, w, out_dtype=torch.float32, gemv="fast")
    torch.cuda.synchronize()
    assert got.dtype == torch.float32, f"out_dtype=torch.float32 must give float32, got {got.dtype}"
    checks.assert_close(got, F.linear(x.float(), w.float()), dtype=torch.float32, atol=1e-4,
                        rtol=1e-4, what="GEMV with float32 output vs F.linear in float32",
                        hint="write from_float<OutT>(sum): OutT is float for logits")


def _chain(x_big: torch.Tensor, src: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
           tokens: int) -> None:
    # x is written by an add over 64 MB (tens of microseconds), then read at once by the GEMV.
    torch.add(src, 1.0, out=x_big)
    linear_op().linear(x_big[: tokens * w.shape[1]].view(tokens, w.shape[1]), w, out=out,
                       gemv="fast")


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
    _, w = gemv_mistakes.operands(gen, 1, in_features, 4096)
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
        x, w = gemv_mistakes.operands(gen, tokens, in_features, rows)
        if paired:
            got = torch.empty((tokens, out_features), dtype=torch.bfloat16, device="cuda")
            _, ran = checks.kernels_of(lambda: parts.kernels().linear_silu_mul(x, w, got))
        else:
            got, ran = checks.kernels_of(lambda: op.linear(x, w, gemv="fast"))
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
SILU_TOKENS = [1, 3, 8]

# The fast GEMV carries 20 of the stage's 100 points, shared by this file's tests.
TESTS = (len(GEMV_SHAPES) * len(GEMV_TOKENS) + 2 + 4 + 1
         + len(SILU_SHAPES) * len(SILU_TOKENS) + 1)
pytestmark = pytest.mark.points(20 / TESTS)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", SILU_TOKENS)
@pytest.mark.parametrize("in_features,inter", SILU_SHAPES, ids=lambda v: str(v))
def test_gemv_silu_mul_equals_linear_then_silu_mul(seed, tokens, in_features, inter):
    """Against the plain GEMV's output then stage 08's silu_mul twin (the same roundings: equal
    but for a sum that lands on a bf16 rounding boundary), and against the float32 oracle."""
    x, w = gemv_mistakes.operands(checks.generator("cuda", seed), tokens, in_features, 2 * inter)
    out = checks.poison(torch.empty((tokens, inter), dtype=torch.bfloat16, device="cuda"))
    parts.kernels().linear_silu_mul(x, w, out)
    plain = linear_op().linear(x, w, gemv="fast")
    torch.cuda.synchronize()
    silu_mul_native = parts.reference("08", "activation").silu_mul_native
    shape = f"[tokens {tokens}, weight {2 * inter} x {in_features}]"
    checks.assert_close(out, silu_mul_native(plain), what=f"linear_silu_mul {shape} vs linear "
                        "(GEMV) then silu_mul_native", dtype=torch.bfloat16, hint=SILU_HINT)
    oracle = silu_mul_native(F.linear(x.float(), w.float()))
    checks.assert_close(out, oracle, what=f"linear_silu_mul {shape} vs the float32 oracle",
                        dtype=torch.bfloat16, hint=SILU_HINT)


@pytest.mark.gpu
def test_gemv_silu_mul_refuses_what_it_cannot_run(seed):
    """It runs what it can (one token, checked first: the refusals alone are given code), and
    refuses 9 tokens and an odd number of weight rows with a sentence."""
    x, w = gemv_mistakes.operands(checks.generator("cuda", seed), 9, 256, 64)
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
