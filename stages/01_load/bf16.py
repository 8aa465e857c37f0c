# GIVEN FILE: generated from solutions/01_load/bf16.py by `nox -s sync-stages`.
# Read it; do not edit it. It is not graded (the grader uses the reference
# copy), and any edit here is overwritten.
"""float32 <-> bfloat16 conversion: the op of stage 01.

fp32_to_bf16_native / bf16_to_fp32_native are the readable twins of the kernels in bf16.cu,
written with integer operations on the bit patterns so that they show the algorithm instead of
calling `.to(torch.bfloat16)`:

    float32  = sign(1) exponent(8) mantissa(23)
    bfloat16 = sign(1) exponent(8) mantissa(7)      -- the top 16 bits of a float32

    narrowing: round the low 16 bits away, to nearest, ties to even; NaN -> 0x7FC0
    widening:  append 16 zero bits (exact)

fp32_to_bf16 / bf16_to_fp32 dispatch: CUDA tensors go to the kernels (`parts.kernels()`),
other tensors to the twins. The result equals torch's `.to(torch.bfloat16)` bit for bit, except
that every NaN becomes the one quiet NaN 0x7FC0 (torch's own NaN bits vary by backend).
"""
from __future__ import annotations

import torch

from course import parts

BF16_NAN = 0x7FC0  # sign 0, exponent all ones, top mantissa bit set: the canonical quiet NaN


def _require(x: torch.Tensor, dtype: torch.dtype, op: str) -> None:
    if x.dtype != dtype:
        raise TypeError(f"{op}: x must be {str(dtype).removeprefix('torch.')}, got {x.dtype}")


def fp32_to_bf16_native(x: torch.Tensor) -> torch.Tensor:
    """x: [...] float32 -> [...] bfloat16, round to nearest even, NaN -> 0x7FC0."""
    _require(x, torch.float32, "fp32_to_bf16")
    # int64 holds the unsigned 32-bit pattern and the carry without overflow.
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lsb = (bits >> 16) & 1                     # the last kept bit: ties round to make it 0
    rounded = (bits + 0x7FFF + lsb) >> 16      # > half an ulp (or a tie on odd) carries up
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000  # exponent all ones, mantissa not zero
    out = torch.where(is_nan, BF16_NAN, rounded)
    # 0..0xFFFF back to int16's two's complement before reinterpreting the bits as bf16.
    return torch.where(out >= 0x8000, out - 0x10000, out).to(torch.int16).view(torch.bfloat16)


def bf16_to_fp32_native(x: torch.Tensor) -> torch.Tensor:
    """x: [...] bfloat16 -> [...] float32, exact: the bf16 bits become the top 16 bits."""
    _require(x, torch.bfloat16, "bf16_to_fp32")
    # Sign-extending int16 -> int32 and shifting left by 16 leaves exactly the bf16 bits on top.
    return (x.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


def _convert_on_gpu(x: torch.Tensor, src: torch.dtype, dst: torch.dtype, op: str) -> torch.Tensor:
    """x (src) -> a new dst tensor, by bf16.cu's kernel named op."""
    _require(x, src, op)
    x = x.contiguous()
    out = torch.empty_like(x, dtype=dst)
    getattr(parts.kernels(), op)(x, out)
    return out


def fp32_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """x: [...] float32 -> [...] bfloat16; the CUDA kernel for CUDA tensors."""
    if not x.is_cuda:
        return fp32_to_bf16_native(x)
    return _convert_on_gpu(x, torch.float32, torch.bfloat16, "fp32_to_bf16")


def bf16_to_fp32(x: torch.Tensor) -> torch.Tensor:
    """x: [...] bfloat16 -> [...] float32; the CUDA kernel for CUDA tensors."""
    if not x.is_cuda:
        return bf16_to_fp32_native(x)
    return _convert_on_gpu(x, torch.bfloat16, torch.float32, "bf16_to_fp32")
