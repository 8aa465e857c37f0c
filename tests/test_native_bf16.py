"""The torch-native twins of stage 01 (solutions/01_load/bf16.py) against torch's own casts.

fp32_to_bf16_native must equal `x.to(torch.bfloat16)` bit for bit on every non-NaN input
(ties, subnormals, infinities, overflow to infinity, signed zeros) and give 0x7FC0 for every
NaN; bf16_to_fp32_native must equal `x.to(torch.float32)` on all 65536 bf16 bit patterns.
"""
from __future__ import annotations

import pytest
import torch

from course import parts
from course.testing import checks

SPECIAL_BITS = [
    0x00000000, 0x80000000, 0x3F800000, 0xBF800000, 0x7F800000, 0xFF800000,   # 0, 1, inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF, 0xFF800001,   # NaNs
    0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000,                           # exact ties
    0x3F808001, 0x3F807FFF,                                                   # near ties
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F7FFF, 0x7F7F8000, 0x7F7E8000,               # the largest
    0x00000001, 0x00008000, 0x00018000, 0x00010000, 0x807FFFFF, 0x8000FFFF,   # subnormals
    0x00800000, 0x477FE000, 0x4B800001, 0x3EAAAAAB,
]


def bf16_mod():
    return parts.reference("01", "bf16")


def from_bits(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(torch.int32).view(torch.float32)


def u16(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16).to(torch.int32) & 0xFFFF


def check_narrowing(x: torch.Tensor) -> None:
    got = u16(bf16_mod().fp32_to_bf16_native(x))
    expected = torch.where(x.isnan(), 0x7FC0, u16(x.to(torch.bfloat16)))
    bad = (got != expected).nonzero().flatten()
    if len(bad):
        bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        i = int(bad[0])
        raise AssertionError(f"{len(bad)} of {x.numel()} differ; first: input 0x{int(bits[i]):08X}"
                             f", expected 0x{int(expected[i]):04X}, got 0x{int(got[i]):04X}")


def test_special_values():
    check_narrowing(from_bits(SPECIAL_BITS))


def test_random_bit_patterns(seed):
    gen = checks.generator(seed=seed)
    bits = torch.randint(-2**31, 2**31, (1 << 20,), generator=gen, dtype=torch.int64)
    check_narrowing(bits.to(torch.int32).view(torch.float32))


def test_every_tie(seed):
    """Every exponent and sign with a low half of exactly 0x8000, both kept-bit parities."""
    gen = checks.generator(seed=seed)
    high = torch.randint(0, 1 << 16, (1 << 16,), generator=gen, dtype=torch.int64)
    check_narrowing(((high << 16) | 0x8000).to(torch.int32).view(torch.float32))


def test_shapes_and_noncontiguous(seed):
    x = checks.randn((4, 6, 5), torch.float32, gen=checks.generator(seed=seed), scale=1e3)
    y = bf16_mod().fp32_to_bf16_native(x.transpose(0, 2))
    assert y.shape == (5, 6, 4) and y.dtype == torch.bfloat16
    assert torch.equal(u16(y), u16(x.transpose(0, 2).contiguous().to(torch.bfloat16)))
    s = bf16_mod().fp32_to_bf16_native(torch.tensor(3.14159))
    assert s.shape == () and s.item() == torch.tensor(3.14159).to(torch.bfloat16).item()


def test_widening_every_pattern():
    p = torch.arange(1 << 16, dtype=torch.int32)
    x = torch.where(p >= 0x8000, p - 0x10000, p).to(torch.int16).view(torch.bfloat16)
    got = bf16_mod().bf16_to_fp32_native(x)
    assert got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), x.to(torch.float32).view(torch.int32))


def test_wrong_dtype_is_refused():
    with pytest.raises(TypeError, match="float32"):
        bf16_mod().fp32_to_bf16_native(torch.ones(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="bfloat16"):
        bf16_mod().bf16_to_fp32_native(torch.ones(3, dtype=torch.float16))


def test_cpu_dispatch_uses_the_twin(seed):
    x = checks.randn((1001,), torch.float32, gen=checks.generator(seed=seed))
    m = bf16_mod()
    assert torch.equal(u16(m.fp32_to_bf16(x)), u16(m.fp32_to_bf16_native(x)))
    y = m.fp32_to_bf16(x)
    assert torch.equal(m.bf16_to_fp32(y), m.bf16_to_fp32_native(y))
