"""Every op's `out=` buffer on the CPU path (course/out_buffer.py): filled and returned when it
has the result's shape and dtype, refused with a ValueError otherwise, as the CUDA bindings
refuse it. A plain copy_ would broadcast one row over four or convert the dtype, so a caller's
wrong buffer would pass here and fail only on a GPU."""
from __future__ import annotations

import pytest
import torch

from course import parts


def _embedding(out, rows):
    ids, table = torch.arange(rows) % 8, torch.randn(8, 16)
    return parts.reference("03", "embedding").embedding(ids, table, out)


def _rmsnorm(out, rows):
    x, w = torch.randn(rows, 16), torch.randn(16)
    return parts.reference("04", "rmsnorm").rmsnorm(x, w, 1e-5, out)


def _silu_mul(out, rows):
    return parts.reference("08", "activation").silu_mul(torch.randn(rows, 32), out)


def _argmax(out, rows):
    return parts.reference("08", "argmax").argmax(torch.randn(rows, 50), out)


def _linear(out, rows):
    x, w = torch.randn(rows, 16).bfloat16(), torch.randn(8, 16).bfloat16()
    return parts.reference("06", "linear").linear(x, w, out)


# op -> (its result's shape for `rows` rows, its dtype)
OPS = {_embedding: (lambda r: (r, 16), torch.float32), _rmsnorm: (lambda r: (r, 16), torch.float32),
       _silu_mul: (lambda r: (r, 16), torch.float32), _argmax: (lambda r: (r,), torch.int64),
       _linear: (lambda r: (r, 8), torch.bfloat16)}
IDS = [f.__name__[1:] for f in OPS]


@pytest.mark.parametrize("op", OPS, ids=IDS)
def test_a_matching_out_is_filled_and_returned(op):
    shape, dtype = OPS[op]
    out = torch.full(shape(4), -7, dtype=dtype)
    torch.manual_seed(0)
    got = op(out, 4)
    assert got is out, "the op must return the buffer it was given"
    torch.manual_seed(0)
    fresh = op(None, 4)
    assert fresh.shape == shape(4) and fresh.dtype == dtype
    assert torch.equal(out, fresh), "out must hold what the op returns without one"


@pytest.mark.parametrize("op", OPS, ids=IDS)
def test_one_row_is_not_broadcast_over_an_out_of_four(op):
    shape, dtype = OPS[op]
    out = torch.full(shape(4), -7, dtype=dtype)
    with pytest.raises(ValueError, match="out must be"):
        op(out, 1)
    assert (out == -7).all(), "a refused buffer must be left as it was"


@pytest.mark.parametrize("op", OPS, ids=IDS)
def test_an_out_of_another_dtype_is_refused_not_converted(op):
    shape, dtype = OPS[op]
    with pytest.raises(ValueError, match="out must be"):
        op(torch.zeros(shape(4), dtype=torch.float16), 4)


def test_a_float32_out_keeps_the_linear_accumulator_as_the_kernel_does():
    """The binding takes a float32 out for bf16 x as the logits' unrounded accumulator; the twin
    must give the same float32 values, not bf16 ones widened."""
    linear = parts.reference("06", "linear")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 64, generator=g).bfloat16(), torch.randn(8, 64, generator=g).bfloat16()
    out = torch.empty(2, 8)
    linear.linear(x, w, out)
    exact = x.float() @ w.float().t()
    assert torch.equal(out, exact)
    assert not torch.equal(exact, exact.bfloat16().float()), \
        "the seed must give values a bf16 rounding changes"
