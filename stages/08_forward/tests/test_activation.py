"""Stage 08: the SwiGLU activation kernel (activation.cu): out = silu(gate) * up.

Oracles: the plain-torch twin silu_mul_native (HF's rounding: silu rounded to bf16, then times
up), and torch.nn.functional.silu(gate) * up, the op sequence of transformers' LlamaMLP.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course import parts
from course.testing import checks

BF16 = torch.bfloat16
# (tokens, intermediate): SmolLM2 (1536), Llama-3.2-1B (8192), multiples of 8 that are not
# powers of two, and sizes that are not multiples of 8 (the one-element fallback).
SHAPES = [(1, 1536), (7, 8192), (127, 576), (129, 200), (1000, 100), (1031, 2053), (3, 1)]
HINT = ("x holds the gate in columns [0, inter) and up in [inter, 2 * inter) of each row; "
        "out[t, j] = silu(x[t, j]) * x[t, inter + j]")


def act():
    return parts.reference("08", "activation")


def run(x: torch.Tensor) -> torch.Tensor:
    """The kernel's output for x, into a poisoned buffer; x must come back unmodified."""
    before = x.clone()
    out = checks.poison(torch.empty(x.shape[0], x.shape[1] // 2, dtype=BF16, device=x.device))
    act().silu_mul(x, out)
    torch.cuda.synchronize()
    checks.assert_unmodified(before, x, "x")
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,inter", SHAPES)
def test_silu_mul_matches_twin(tokens, inter, seed):
    x = checks.randn((tokens, 2 * inter), BF16, "cuda", scale=3.0)
    out = run(x)
    checks.assert_close(out, act().silu_mul_native(x), what=f"silu_mul [{tokens}, {inter}]",
                        hint=HINT)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,inter", [(129, 1536), (17, 100)])
def test_silu_mul_matches_torch_silu(tokens, inter, seed):
    """torch.nn.functional.silu in bf16, as transformers' LlamaMLP computes it."""
    x = checks.randn((tokens, 2 * inter), BF16, "cuda", scale=3.0)
    out = run(x)
    gate, up = x[:, :inter], x[:, inter:]
    checks.assert_close(out, F.silu(gate) * up, what="silu_mul vs F.silu(gate) * up",
                        hint=HINT + "; silu(g) = g / (1 + exp(-g)) in float32")


@pytest.mark.gpu
def test_silu_mul_extreme_gates(seed):
    """Gates up to about +-100: exp(-g) overflows to inf for g < -88, and silu(g) must be 0,
    not NaN; for large g, silu(g) = g."""
    x = checks.randn((64, 2 * 1536), BF16, "cuda", scale=30.0)
    out = run(x)
    checks.assert_finite(out, "silu_mul of large gates")
    checks.assert_close(out, act().silu_mul_native(x), what="silu_mul, gates up to +-100",
                        hint="compute g / (1 + expf(-g)) in float32: for g < -88 expf(-g) is "
                             "inf and the quotient is -0, which is right")


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["x", "out"])
def test_silu_mul_unaligned(which, seed):
    """Tensors that start 2 bytes past a 16-byte boundary: 16-byte loads would fault or read
    the wrong elements; the kernel must fall back to narrower accesses."""
    tokens, inter = 33, 1536
    x_buf = checks.randn((tokens * 2 * inter + 1,), BF16, "cuda", scale=3.0)
    x = (x_buf[1:] if which == "x" else x_buf[:-1]).view(tokens, 2 * inter)
    before = x.clone()
    out_buf = checks.poison(torch.empty(tokens * inter + 1, dtype=BF16, device="cuda"))
    out = (out_buf[1:] if which == "out" else out_buf[:-1]).view(tokens, inter)
    act().silu_mul(x, out)
    torch.cuda.synchronize()
    checks.assert_unmodified(before, x, "x")
    checks.assert_close(out, act().silu_mul_native(x), what=f"silu_mul with unaligned {which}",
                        hint="use 16-byte packs only when both pointers are 16-byte aligned "
                             "and inter % 8 == 0")


@pytest.mark.gpu
def test_silu_mul_large(seed):
    """Llama-3.2-1B's MLP at 4096 tokens: [4096, 16384] -> [4096, 8192]."""
    x = checks.randn((4096, 2 * 8192), BF16, "cuda", scale=3.0)
    out = run(x)
    checks.assert_close(out, act().silu_mul_native(x), what="silu_mul [4096, 8192]", hint=HINT)
