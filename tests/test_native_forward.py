"""The stage-08 twins against independent oracles (project tests, CPU).

- silu_mul_native against transformers' LlamaMLP activation (ACT2FN["silu"](gate) * up), bit
  for bit in bf16 and float32: the twin rounds where HF rounds;
- argmax_native against the contract the argmax kernel is graded on (torch.argmax's): the
  first maximum on ties, NaN as the maximum.
"""
from __future__ import annotations

import pytest
import torch

from course import parts
from course.testing import checks


def act():
    return parts.reference("08", "activation")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("tokens,inter", [(1, 1536), (37, 100), (130, 576)])
def test_silu_mul_native_is_hf_activation(tokens, inter, dtype, seed):
    from transformers.activations import ACT2FN
    x = checks.randn((tokens, 2 * inter), dtype, scale=3.0)
    gate, up = x[:, :inter], x[:, inter:]
    expected = ACT2FN["silu"](gate) * up        # two ops of x's dtype, as in LlamaMLP.forward
    got = act().silu_mul_native(x)
    checks.assert_equal(got, expected, what=f"silu_mul_native {dtype}",
                        hint="round silu(gate) to the dtype before multiplying by up")


def test_silu_mul_rejects_odd_width():
    with pytest.raises(ValueError, match="gate, then up"):
        act().silu_mul(torch.ones(3, 7))


def test_argmax_native_contract():
    argmax = parts.reference("08", "argmax").argmax_native
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0],        # tie: the first
                           [3.0, 1.0, 2.0, 3.0],        # tie between the ends: 0
                           [0.0, nan, 5.0, nan],        # NaN beats numbers: the first NaN
                           [inf, 0.0, 0.0, nan],        # NaN beats +inf
                           [-inf, -inf, -inf, -inf]])   # all -inf: 0
    for dtype in (torch.float32, torch.bfloat16):
        checks.assert_equal(argmax(logits.to(dtype)), torch.tensor([1, 0, 1, 3, 0]),
                            what=f"argmax_native {dtype}")
