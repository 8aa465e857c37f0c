# GIVEN FILE: generated from solutions/06_gemm/linear.py by `nox -s sync-stages`.
# Read it; do not edit it. It is not graded (the grader uses the reference
# copy), and any edit here is overwritten.
"""Stage 06 op: a Linear layer without bias, y = x @ weight^T (torch.nn.functional.linear).

Every projection of a Llama layer is one of these: q/k/v/o, gate/up/down, and the lm_head.
The weight keeps torch's nn.Linear layout [out, in]; `linear` sends CUDA tensors to the
cuBLAS call in gemm.cu, or for one bf16 token (a batch-1 decode step) to a GEMV, and CPU
tensors to `linear_native`. The stage has two GEMVs: gemv_simple.cu (part 1, a warp per
output) and gemv.cu (part 2, the fast one); the engine runs the fast one once it is written,
else the simple one (course.ops.FirstWritten: one line on stderr says so). The GEMVs handle
1-8 tokens, but measured on an H200 the fast one is only worth it at one: at 4 tokens
cuBLAS's small-M kernels took half its time, so `linear` asks for a GEMV at
2-8 tokens only when told to (gemv=True).

On an sm_90 GPU the fast GEMV is launched with programmatic dependent launch (PDL: it may
start streaming its weights while the previous kernel finishes); the environment variable
TINYVLLM_PDL=0 turns that off, e.g. to measure what it gains (read in C++ by
course/cuda/pdl.cuh's may_launch_early, for every kernel launched early).
"""
from __future__ import annotations

import torch

from course import parts
from course.ops import FirstWritten
from course.out_buffer import fill

GEMV_MAX_TOKENS = 8   # course/cuda/gemv.cuh's kGemvMaxTokens


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"linear: x must be [tokens, in] and weight [out, in], got shapes "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear: x has {x.shape[1]} features but weight is [out, in] = "
                         f"{tuple(weight.shape)} (in must match)")


def linear_native(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ weight^T in float32, rounded once to x's dtype (what the kernel computes).

    x: [tokens, in], weight: [out, in], same dtype (bf16, fp16 or fp32), any device.
    Returns y: [tokens, out] of out_dtype, written into `out` when given; out_dtype is x's
    dtype, or float32 (the accumulator unrounded), as the kernel takes it: from a float32 `out`
    when out_dtype is not given.
    """
    _check(x, weight)
    if out_dtype is None:
        out_dtype = torch.float32 if out is not None and out.dtype == torch.float32 else x.dtype
    if out_dtype not in (x.dtype, torch.float32):
        raise ValueError(f"linear: out_dtype must be x's dtype ({x.dtype}) or torch.float32, "
                         f"got {out_dtype}")
    return fill(out, (x.float() @ weight.float().t()).to(out_dtype), "linear")


def gemv_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a GEMV takes x @ weight^T (course/cuda/gemv.cuh's gemv_fits): bf16, 1-8 tokens,
    in % 8 == 0, 16-byte aligned x and weight."""
    return (x.dtype == weight.dtype == torch.bfloat16 and 1 <= x.shape[0] <= GEMV_MAX_TOKENS
            and x.shape[1] % 8 == 0 and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0)


def _gemv(simple: bool):
    def run(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
        parts.kernels().gemv(x, weight, out, simple)
    return run


_KERNELS = {"fast": _gemv(False), "simple": _gemv(True)}
# the fast GEMV (part 2) once it is written, else the simple one (part 1)
_decode = FirstWritten("linear: stage 06's fast GEMV (gemv.cu)", _KERNELS["fast"],
                       _KERNELS["simple"])


def linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, gemv: bool | str | None = None) -> torch.Tensor:
    """y = x @ weight^T: cuBLAS or a GEMV on CUDA tensors (gemm.cu, gemv_simple.cu, gemv.cu),
    linear_native on CPU.

    x: [tokens, in] bf16/fp16/fp32, weight: [out, in] same dtype, both contiguous.
    out: optional [tokens, out] buffer (reuse it to time without allocating).
    out_dtype: x's dtype (default) or torch.float32, which keeps the float32 accumulator:
    the model's logits use it, so two scores closer than a bf16 step are not made equal.
    gemv: None (default) lets a GEMV take one bf16 token, True 1-8 of them (where gemv_fits),
    the fast GEMV if written, else the simple one; False sends every call to cuBLAS;
    "simple" or "fast" that GEMV only (its tests, and to compare them; it refuses what does
    not fit).
    Returns y: [tokens, out].
    """
    if not x.is_cuda:
        return linear_native(x, weight, out, out_dtype)
    _check(x, weight)
    if out is None:
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=out_dtype or x.dtype,
                          device=x.device)
    if gemv in _KERNELS:
        _KERNELS[gemv](x, weight, out)
    elif (x.shape[0] == 1 if gemv is None else gemv) and gemv_fits(x, weight):
        _decode(x, weight, out)
    else:
        parts.kernels().linear(x, weight, out)
    return out
