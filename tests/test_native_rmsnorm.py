"""The torch-native twins of stage 04 (solutions/04_rmsnorm/rmsnorm.py) against transformers'
LlamaRMSNorm and the decoder layer's residual add, on the CPU, in float32 and bf16; and the
in-place contract of the dispatching fused_add_rmsnorm on the CPU path."""
from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from course import parts
from course.testing import checks

EPS = 1e-5
SHAPES = [(1, 576), (7, 2048), (129, 320), (127, 100)]


def ops():
    return parts.reference("04", "rmsnorm")


def hf_norm(weight: torch.Tensor, eps: float = EPS) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(weight.shape[0], eps=eps).to(weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


def inputs(shape, dtype, gen):
    x = (checks.randn(shape, torch.float32, gen=gen) * torch.randn(shape[0], 1, generator=gen).exp())
    return x.to(dtype), checks.randn((shape[1],), dtype, gen=gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_native_rmsnorm_equals_hf(shape, dtype, seed):
    gen = checks.generator(seed=seed)
    x, weight = inputs(shape, dtype, gen)
    with torch.no_grad():
        expected = hf_norm(weight)(x)
    got = ops().rmsnorm_native(x, weight, EPS)
    assert got.dtype == dtype
    checks.assert_equal(got, expected, what="rmsnorm_native vs LlamaRMSNorm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_native_fused_add_equals_hf_residual_then_norm(shape, dtype, seed):
    gen = checks.generator(seed=seed)
    x, weight = inputs(shape, dtype, gen)
    residual = checks.randn(shape, dtype, gen=gen, scale=3.0)
    x_before, res_before = x.clone(), residual.clone()
    hidden = residual + x  # HF decoder layer: hidden_states = residual + hidden_states
    with torch.no_grad():
        expected = hf_norm(weight)(hidden)
    out, new_residual = ops().fused_add_rmsnorm_native(x, residual, weight, EPS)
    checks.assert_equal(new_residual, hidden, what="new residual")
    checks.assert_equal(out, expected, what="normalized sum")
    checks.assert_unmodified(x_before, x, "x")
    checks.assert_unmodified(res_before, residual, "residual")


def test_cpu_fused_add_rmsnorm_is_in_place(seed):
    gen = checks.generator(seed=seed)
    x, weight = inputs((7, 576), torch.bfloat16, gen)
    residual = checks.randn((7, 576), torch.bfloat16, gen=gen)
    expected_out, expected_res = ops().fused_add_rmsnorm_native(x, residual, weight, EPS)
    out, new_res = ops().fused_add_rmsnorm(x, residual, weight, EPS)
    assert out is x and new_res is residual, "fused_add_rmsnorm returns its two buffers"
    checks.assert_equal(x, expected_out, what="x overwritten with the output")
    checks.assert_equal(residual, expected_res, what="residual overwritten with the sum")


def test_cpu_rmsnorm_writes_out(seed):
    gen = checks.generator(seed=seed)
    x, weight = inputs((7, 320), torch.float32, gen)
    out = checks.poison(torch.empty_like(x))
    assert ops().rmsnorm(x, weight, EPS, out=out) is out
    checks.assert_equal(out, ops().rmsnorm_native(x, weight, EPS))


def test_native_rejects_mismatched_weight():
    with pytest.raises(ValueError, match="weight"):
        ops().rmsnorm_native(torch.randn(3, 8), torch.randn(7), EPS)
    with pytest.raises(ValueError, match="dtype"):
        ops().rmsnorm_native(torch.randn(3, 8), torch.randn(8).bfloat16(), EPS)
    with pytest.raises(ValueError, match="floating-point"):
        ops().rmsnorm_native(torch.ones(3, 8, dtype=torch.int32),
                             torch.ones(8, dtype=torch.int32), EPS)
