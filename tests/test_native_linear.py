"""linear_native (stage 06's CPU backend) against torch.nn.functional.linear, on CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course import parts
from course.testing import checks


def linear_module():
    return parts.reference("06", "linear")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens,in_features,out_features",
                         [(1, 576, 576), (7, 576, 1536), (129, 320, 100), (5, 72, 211)])
def test_linear_native_matches_f_linear(seed, dtype, tokens, in_features, out_features):
    gen = checks.generator("cpu", seed)
    x = checks.randn((tokens, in_features), dtype, gen=gen)
    w = checks.randn((out_features, in_features), dtype, gen=gen, scale=in_features ** -0.5)
    got = linear_module().linear_native(x, w)
    assert got.dtype == dtype and got.shape == (tokens, out_features)
    # The oracle in float32 from the same (rounded) inputs; bf16 results are rounded once.
    checks.assert_close(got, F.linear(x.float(), w.float()), dtype=dtype)
    if dtype == torch.float32:
        checks.assert_close(got, F.linear(x.double(), w.double()), dtype=dtype)


def test_linear_dispatches_cpu_to_the_twin_and_fills_out(seed):
    gen = checks.generator("cpu", seed)
    x = checks.randn((7, 96), torch.bfloat16, gen=gen)
    w = checks.randn((160, 96), torch.bfloat16, gen=gen, scale=96 ** -0.5)
    out = checks.poison(torch.empty((7, 160), dtype=torch.bfloat16))
    got = linear_module().linear(x, w, out=out)
    assert got is out
    checks.assert_equal(out, linear_module().linear_native(x, w))


@pytest.mark.parametrize("xs,ws", [((7, 96), (160, 95)), ((96,), (160, 96)), ((7, 96), (96,))])
def test_linear_native_rejects_bad_shapes(xs, ws):
    with pytest.raises(ValueError, match="linear"):
        linear_module().linear_native(torch.ones(xs), torch.ones(ws))
