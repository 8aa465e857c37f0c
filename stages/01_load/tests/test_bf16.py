"""Stage 01: the fp32 <-> bf16 conversion kernels (bf16.cu).

The oracle is torch's own conversion on the CPU, compared bit for bit, except for NaN: torch
gives different NaN bit patterns on different backends, so this project pins every NaN to the
canonical quiet NaN 0x7FC0. Inputs mix random bit patterns (every exponent, NaNs and
subnormals included), ordinary numbers, and the hard cases: exact ties with an even and with
an odd kept bit, infinities, signed zeros, the largest floats, and sizes that are not a
multiple of 4 or start at an address that is not 16-byte aligned.
"""
from __future__ import annotations

import pytest
import torch

from course import parts
from course.testing import checks

BF16_NAN = 0x7FC0

# (float32 bit pattern, why it is here)
SPECIAL = [
    (0x00000000, "+0"), (0x80000000, "-0"),
    (0x3F800000, "1.0"), (0xBF800000, "-1.0"),
    (0x7F800000, "+inf"), (0xFF800000, "-inf"),
    (0x7FC00000, "quiet NaN"), (0xFFC00000, "negative NaN"), (0x7F800001, "signalling NaN"),
    (0x7FFFFFFF, "NaN whose rounding carry would make it +inf"), (0xFFFFFFFF, "NaN, all ones"),
    (0x3F808000, "tie, kept lsb even: rounds down to 0x3F80"),
    (0x3F818000, "tie, kept lsb odd: rounds up to 0x3F82"),
    (0xBF818000, "negative tie, kept lsb odd"),
    (0x3F808001, "just above a tie: rounds up"), (0x3F807FFF, "just below a tie: rounds down"),
    (0x7F7FFFFF, "largest float: rounds to +inf"), (0xFF7FFFFF, "most negative: rounds to -inf"),
    (0x7F7F7FFF, "largest float that stays finite"), (0x7F7F8000, "tie to +inf (odd lsb)"),
    (0x00000001, "smallest subnormal: rounds to +0"), (0x00008000, "subnormal tie, even: 0"),
    (0x00018000, "subnormal tie, odd: rounds up"), (0x00010000, "exact bf16 subnormal"),
    (0x807FFFFF, "largest negative subnormal: rounds to the smallest normal"),
    (0x00800000, "smallest normal"), (0x477FE000, "65504, float16's largest"),
    (0x4B800001, "2**24 + 2"), (0x3EAAAAAB, "1/3"),
]
SIZES = [1, 3, 5, 1001, (1 << 20) + 3]


def from_bits(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(torch.int32).view(torch.float32)


def u16(t: torch.Tensor) -> torch.Tensor:
    """bf16 bit patterns as non-negative int32, for readable hex."""
    return t.view(torch.int16).to(torch.int32) & 0xFFFF


def u32(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def fp32_inputs(n: int, gen: torch.Generator) -> torch.Tensor:
    """n float32s on the CPU: the special values, random bit patterns, random numbers."""
    special = from_bits([b for b, _ in SPECIAL])
    rand_bits = torch.randint(-2**31, 2**31, (n,), generator=gen, dtype=torch.int64)
    x = rand_bits.to(torch.int32).view(torch.float32).clone()
    x[1::2] = torch.randn(x[1::2].shape, generator=gen) * 100
    k = min(n, len(special))
    x[:k] = special[:k]
    if n > len(special):  # scatter the special values elsewhere too (not only at the start)
        where = torch.randint(0, n, (len(special),), generator=gen)
        x[where] = special
    return x


def expected_bf16_bits(x_cpu: torch.Tensor) -> torch.Tensor:
    bits = u16(x_cpu.to(torch.bfloat16))
    return torch.where(x_cpu.isnan(), BF16_NAN, bits)


def explain(x_bits: int, expected: int, got: int) -> str:
    if got == 0xFFFF:
        return "never written: it still holds the poison 0xFFFF (grid too small? tail skipped?)"
    if expected == BF16_NAN:
        return "a NaN input must give 0x7FC0 (check NaN before rounding: the carry breaks it)"
    if got == x_bits >> 16:
        return "that is truncation (bits >> 16): round to nearest even by adding 0x7FFF + lsb"
    if (x_bits & 0xFFFF) == 0x8000:
        return "an exact tie: round so that the kept last bit is even"
    return "rounding off by one ulp"


def assert_bits(got: torch.Tensor, expected: torch.Tensor, inputs: torch.Tensor, what: str,
                width: int) -> None:
    got, expected, inputs = got.reshape(-1).cpu(), expected.reshape(-1).cpu(), inputs.reshape(-1)
    bad = (got != expected).nonzero().flatten()
    if len(bad) == 0:
        return
    lines = [f"{what}: {len(bad)} of {got.numel()} elements differ"]
    for i in bad[:6].tolist():
        xi, e, g = int(inputs[i]), int(expected[i]), int(got[i])
        why = explain(xi, e, g) if width == 16 else "widening is exact: bits << 16"
        lines.append(f"  at {i}: input 0x{xi:0{8 if width == 16 else 4}X}, expected "
                     f"0x{e:0{width // 4}X}, got 0x{g:0{width // 4}X} -- {why}")
    raise AssertionError("\n".join(lines))


def run_fp32_to_bf16(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    checks.poison(out.view(torch.int16))  # 0xFFFF: a NaN this kernel never writes
    before = x.clone()
    parts.kernels().fp32_to_bf16(x, out)
    torch.cuda.synchronize()
    # Bit patterns, not values: the inputs hold NaNs, and NaN != NaN.
    checks.assert_unmodified(before.view(torch.int32), x.view(torch.int32), "x")
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("n", SIZES)
def test_fp32_to_bf16_bit_exact(n, seed):
    x = fp32_inputs(n, checks.generator(seed=seed))
    out = run_fp32_to_bf16(x.cuda())
    assert_bits(u16(out.cpu()), expected_bf16_bits(x), u32(x), f"fp32_to_bf16 (n={n})", 16)


@pytest.mark.gpu
def test_fp32_to_bf16_special_values():
    x = from_bits([b for b, _ in SPECIAL])
    out = run_fp32_to_bf16(x.cuda())
    got, expected = u16(out.cpu()), expected_bf16_bits(x)
    wrong = [f"  {why} (0x{b:08X}): expected 0x{int(e):04X}, got 0x{int(g):04X}"
             for (b, why), e, g in zip(SPECIAL, expected, got) if e != g]
    assert not wrong, "fp32_to_bf16 special values:\n" + "\n".join(wrong)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(7, 576), (3, 5, 11)])
def test_fp32_to_bf16_shapes_and_unaligned_views(shape, seed):
    gen = checks.generator(seed=seed)
    n = 1
    for d in shape:
        n *= d
    x = fp32_inputs(n + 1, gen).cuda()
    aligned = run_fp32_to_bf16(x[:-1].view(shape))
    assert_bits(u16(aligned.cpu()), expected_bf16_bits(x[:-1].cpu()).view(shape),
                u32(x[:-1].cpu()), f"fp32_to_bf16 shape {shape}", 16)
    # x[1:] is contiguous but starts 4 bytes past a 16-byte boundary; out likewise 2 bytes.
    xs = x[1:]
    out_full = torch.empty(n + 1, dtype=torch.bfloat16, device="cuda")
    checks.poison(out_full.view(torch.int16))
    out = out_full[1:]
    parts.kernels().fp32_to_bf16(xs, out)
    torch.cuda.synchronize()
    assert_bits(u16(out.cpu()), expected_bf16_bits(xs.cpu()), u32(xs.cpu()),
                "fp32_to_bf16 on views that are not 16-byte aligned (x[1:]): a float4 load "
                "there is a misaligned address; check alignment and fall back to scalars", 16)
    assert int(u16(out_full[:1].cpu())) == 0xFFFF, "wrote before the start of out"


@pytest.mark.gpu
@pytest.mark.parametrize("n", [65536, 65536 + 3, 1, 5])
def test_bf16_to_fp32_every_pattern(n, seed):
    gen = checks.generator(seed=seed)
    patterns = torch.arange(65536, dtype=torch.int32)  # every bf16 value, NaNs included
    if n < 65536:
        patterns = patterns[torch.randperm(65536, generator=gen)[:n]]
    elif n > 65536:
        patterns = torch.cat([patterns, patterns[:n - 65536]])
    x = torch.where(patterns >= 0x8000, patterns - 0x10000, patterns).to(torch.int16)
    x = x.view(torch.bfloat16)
    xd = x.cuda()
    before = xd.clone()
    out = torch.empty(n, dtype=torch.float32, device="cuda")
    checks.poison(out.view(torch.int32))  # 0xFFFFFFFF: low bits set, never a widened bf16
    parts.kernels().bf16_to_fp32(xd, out)
    torch.cuda.synchronize()
    checks.assert_unmodified(before.view(torch.int16), xd.view(torch.int16), "x")
    assert_bits(u32(out.cpu()), u32(x.to(torch.float32)), u16(x), f"bf16_to_fp32 (n={n})", 32)


@pytest.mark.gpu
def test_bf16_to_fp32_unaligned_view(seed):
    gen = checks.generator(seed=seed)
    x = checks.randn((1001,), torch.bfloat16, gen=gen, scale=50).cuda()
    out_full = torch.empty(1001, dtype=torch.float32, device="cuda")
    checks.poison(out_full.view(torch.int32))
    parts.kernels().bf16_to_fp32(x[1:], out_full[1:])
    torch.cuda.synchronize()
    assert_bits(u32(out_full[1:].cpu()), u32(x[1:].cpu().to(torch.float32)), u16(x[1:].cpu()),
                "bf16_to_fp32 on views that are not aligned (x[1:]): check alignment and fall "
                "back to scalars", 32)
    assert int(u32(out_full[:1].cpu())) == 0xFFFFFFFF, "wrote before the start of out"


@pytest.mark.gpu
def test_round_trip_through_the_op_module(seed):
    """The dispatching functions other stages call: CUDA tensors take the kernels."""
    op = parts.reference("01", "bf16")
    x = fp32_inputs(4099, checks.generator(seed=seed))
    y = op.fp32_to_bf16(x.cuda())
    assert y.is_cuda and y.dtype == torch.bfloat16
    assert_bits(u16(y.cpu()), expected_bf16_bits(x), u32(x), "bf16.fp32_to_bf16", 16)
    z = op.bf16_to_fp32(y)
    assert z.is_cuda and z.dtype == torch.float32
    assert_bits(u32(z.cpu()), u32(y.cpu().to(torch.float32)), u16(y.cpu()), "bf16.bf16_to_fp32",
                32)
