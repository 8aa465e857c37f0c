"""Stage 04: the RMSNorm kernels (rmsnorm.cu), through the ops in rmsnorm.py.

Oracles: transformers' LlamaRMSNorm (and, for the fused op, HF's decoder-layer residual add
`hidden = residual + hidden` in the model's dtype) and the plain-torch twins. Rows get very
different scales, so a kernel that mixes rows or forgets a row's own mean fails. Shapes:
token counts 1, 7, 127, 129, 1031; hidden sizes 576 (SmolLM2), 2048 (Llama-3.2-1B), 320, 100
(not a whole number of 16-byte vectors in bf16), 8192 and 4099 (long rows, many per thread).

In bf16, equal within tolerance is not enough to match HF token for token: HF rounds the
normalized row to bf16 before the weight multiply. test_bf16_rounds_like_hf checks that
fewer than 0.1% of the elements differ from HF's bits (only the summation order may differ).
"""
from __future__ import annotations

import pytest
import torch

from course import parts
from course.testing import checks

EPS = 1e-5
TOKENS = [1, 7, 127, 129, 1031]
HIDDEN = [576, 2048, 320, 100]
DTYPES = [torch.bfloat16, torch.float32]
DTYPE_IDS = ["bf16", "fp32"]


def op():
    return parts.load("04", "rmsnorm")


def hf_norm(weight: torch.Tensor, eps: float):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    norm = LlamaRMSNorm(weight.shape[0], eps=eps).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


def inputs(tokens: int, hidden: int, dtype: torch.dtype, gen: torch.Generator, scale=1.0):
    """Rows with scales spread over e^-2 .. e^2, and a random weight (never all ones)."""
    row_scale = torch.randn(tokens, 1, generator=gen, device="cuda").exp()
    x = (checks.randn((tokens, hidden), torch.float32, "cuda", gen) * row_scale * scale).to(dtype)
    weight = checks.randn((hidden,), dtype, "cuda", gen)
    return x, weight


def run_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = checks.poison(torch.empty_like(x))
    x_before, w_before = x.clone(), weight.clone()
    result = op().rmsnorm(x, weight, eps, out=out)
    torch.cuda.synchronize()
    assert result is out, "rmsnorm(..., out=out) must write into out and return it"
    checks.assert_unmodified(x_before, x, "x")
    checks.assert_unmodified(w_before, weight, "weight")
    return out


def run_fused(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    x_dev, res_dev = x.clone(), residual.clone()
    w_before = weight.clone()
    out, new_residual = op().fused_add_rmsnorm(x_dev, res_dev, weight, eps)
    torch.cuda.synchronize()
    checks.assert_unmodified(w_before, weight, "weight")
    return out, new_residual


def mismatch_fraction(got: torch.Tensor, expected: torch.Tensor) -> float:
    return (got != expected).float().mean().item()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("tokens", TOKENS)
def test_rmsnorm_matches_hf(tokens, hidden, dtype, seed):
    gen = checks.generator("cuda", seed)
    x, weight = inputs(tokens, hidden, dtype, gen)
    out = run_rmsnorm(x, weight, EPS)
    checks.assert_finite(out, "rmsnorm output")
    with torch.no_grad():
        expected = hf_norm(weight, EPS)(x)
    checks.assert_close(out, expected, what=f"rmsnorm [{tokens}, {hidden}] vs LlamaRMSNorm",
                        hint="each row needs its own sum of squares over all `hidden` elements "
                             "(every thread's part, reduced across warps), divided by hidden, "
                             "plus eps, under the rsqrt; accumulate in float32")
    checks.assert_close(out, op().rmsnorm_native(x, weight, EPS), what="rmsnorm vs the twin")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tokens,hidden", [(129, 8192), (7, 4099), (1, 16384)])
def test_rmsnorm_long_rows(tokens, hidden, dtype, seed):
    gen = checks.generator("cuda", seed)
    x, weight = inputs(tokens, hidden, dtype, gen)
    out = run_rmsnorm(x, weight, EPS)
    with torch.no_grad():
        expected = hf_norm(weight, EPS)(x)
    checks.assert_close(out, expected, what=f"rmsnorm [{tokens}, {hidden}] vs LlamaRMSNorm",
                        hint="long rows: each thread handles several vectors of the row; check "
                             "the per-thread loop and that every warp's partial sum is added")


@pytest.mark.gpu
def test_rmsnorm_unaligned_view(seed):
    """Rows that start 2 bytes past a 16-byte boundary: the kernel must not use 16-byte loads."""
    gen = checks.generator("cuda", seed)
    tokens, hidden = 127, 2048
    flat = checks.randn((tokens * hidden + 1,), torch.bfloat16, "cuda", gen)
    x = flat[1:].view(tokens, hidden)
    weight = checks.randn((hidden,), torch.bfloat16, "cuda", gen)
    out = run_rmsnorm(x, weight, EPS)
    with torch.no_grad():
        expected = hf_norm(weight, EPS)(x)
    checks.assert_close(out, expected, what="rmsnorm of a view that is not 16-byte aligned",
                        hint="check every pointer's alignment before choosing 16-byte loads")


@pytest.mark.gpu
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_rmsnorm_uses_eps(eps, seed):
    """Tiny rows (mean(x^2) ~ 1e-8): the result depends on eps, as HF's does."""
    gen = checks.generator("cuda", seed)
    x, weight = inputs(129, 576, torch.float32, gen, scale=1e-4)
    out = run_rmsnorm(x, weight, eps)
    with torch.no_grad():
        expected = hf_norm(weight, eps)(x)
    checks.assert_close(out, expected, what=f"rmsnorm of tiny rows, eps={eps}",
                        hint="eps goes inside the square root: rsqrt(mean(x^2) + eps)")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("tokens", [1, 129, 1031])
def test_fused_add_rmsnorm_matches_hf(tokens, hidden, dtype, seed):
    gen = checks.generator("cuda", seed)
    x, weight = inputs(tokens, hidden, dtype, gen)
    residual = checks.randn((tokens, hidden), dtype, "cuda", gen, scale=3.0)
    out, new_residual = run_fused(x, residual, weight, EPS)
    checks.assert_finite(out, "fused_add_rmsnorm output")
    expected_residual = residual + x  # HF: hidden_states = residual + hidden_states
    with torch.no_grad():
        expected = hf_norm(weight, EPS)(expected_residual)
    checks.assert_close(new_residual, expected_residual, what="the new residual (x + residual)",
                        hint="residual must be overwritten with x + residual, rounded to the "
                             "dtype, before the normalization")
    checks.assert_close(out, expected, what=f"fused_add_rmsnorm [{tokens}, {hidden}] output",
                        hint="normalize the sum x + residual (as rounded to the dtype), not x")
    twin_out, twin_residual = op().fused_add_rmsnorm_native(x, residual, weight, EPS)
    checks.assert_close(out, twin_out, what="fused_add_rmsnorm vs the twin")
    checks.assert_close(new_residual, twin_residual, what="the new residual vs the twin")


@pytest.mark.gpu
def test_bf16_rounds_like_hf(seed):
    gen = checks.generator("cuda", seed)
    x, weight = inputs(1031, 2048, torch.bfloat16, gen)
    residual = checks.randn((1031, 2048), torch.bfloat16, "cuda", gen, scale=3.0)
    with torch.no_grad():
        norm = hf_norm(weight, EPS)
        expected = norm(x)
        expected_residual = residual + x
        expected_fused = norm(expected_residual)
    out = run_rmsnorm(x, weight, EPS)
    fused, new_residual = run_fused(x, residual, weight, EPS)
    for what, got, want in [("rmsnorm", out, expected), ("fused_add_rmsnorm", fused, expected_fused),
                            ("the new residual", new_residual, expected_residual)]:
        frac = mismatch_fraction(got, want)
        assert frac < 1e-3, (
            f"{what}: {frac:.2%} of the bf16 elements differ from HF's bits (at most 0.1% may, "
            "from a different summation order). HF computes weight * (x * inv_rms).to(bf16): "
            "round the normalized value to bf16, then multiply by the weight and round again; "
            "and it adds the residual in bf16 (round x + residual before normalizing it)")
