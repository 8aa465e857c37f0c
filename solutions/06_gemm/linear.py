"""Stage 06 op: a Linear layer without bias, y = x @ weight^T (torch.nn.functional.linear).

Every projection of a Llama layer is one of these: q/k/v/o, gate/up/down, and the lm_head.
The weight keeps torch's nn.Linear layout [out, in]; `linear` sends CUDA tensors to the
cuBLAS call in gemm.cu, or for one bf16 token (a batch-1 decode step) to the GEMV of
gemv.cu, and CPU tensors to `linear_native`. The GEMV handles 1-8 tokens, but measured on an
H200 it is only worth it at one: at 4 tokens cuBLAS's small-M kernels took half its time
(docs/gpu-runs.md), so `linear` asks for it at 2-8 tokens only when told to (gemv=True).

On an sm_90 GPU the GEMV is launched with programmatic dependent launch (PDL: it may start
streaming its weights while the previous kernel finishes); the environment variable
TINYVLLM_PDL=0 turns that off, e.g. to measure what it gains (read in C++ by
solutions/common/pdl.cuh's may_launch_early, for every kernel launched early).

`plan_prefetch` hands each GEMV the weights of the GEMV after it, which it asks L2 for once
its own product is done: between two GEMVs of a decode step the small kernels leave memory
idle, and the next GEMV could then find (the first part of) its weights in L2 (gemv.cu).
TINYVLLM_L2_PREFETCH_MB sets how much of each weight that is. It is off (0) by default: it
has not yet been measured on a GPU (docs/benchmarks.md says what to run).
"""
from __future__ import annotations

import os

import torch

from course import parts

def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"linear: x must be [tokens, in] and weight [out, in], got shapes "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear: x has {x.shape[1]} features but weight is [out, in] = "
                         f"{tuple(weight.shape)} (in must match)")


_PREFETCH_ATTR = "_tvllm_gemv_prefetch"


def plan_prefetch(order: list[torch.Tensor], max_bytes: int | None = None) -> None:
    """Let the GEMV that reads order[i] prefetch order[i + 1] into L2 (the last one order[0]:
    a decode step ends with the lm_head, and the next one starts with layer 0).

    order: [out, in] weights in the order a decode step reads them. max_bytes: how much of
    each, in whole rows from the top (the rows the next GEMV reads first); default
    TINYVLLM_L2_PREFETCH_MB MiB, 0 (no prefetch) unless set. L2 holds 50 MB on an H100/H200,
    so ask only for what the idle time between two GEMVs can fetch and L2 can keep (~16 MB).
    """
    if max_bytes is None:
        setting = os.environ.get("TINYVLLM_L2_PREFETCH_MB", "0")
        try:
            mib = float(setting)
        except ValueError:
            mib = -1.0
        if not 0 <= mib < 2**20:   # also False for NaN
            raise ValueError(f"TINYVLLM_L2_PREFETCH_MB must be a number of MiB >= 0, got "
                             f"{setting!r}")
        max_bytes = int(mib * 2**20)
    for weight, after in zip(order, order[1:] + order[:1]):
        rows = min(after.shape[0], max_bytes // (after.shape[1] * after.element_size()))
        # kept on the weight itself: the plan lives and dies with the model's tensors
        setattr(weight, _PREFETCH_ATTR, after[:rows] if rows > 0 else None)


def linear_native(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ weight^T in float32, rounded once to x's dtype (what the kernel computes).

    x: [tokens, in], weight: [out, in], same dtype (bf16, fp16 or fp32), any device.
    Returns y: [tokens, out] of x's dtype, written into `out` when given.
    """
    _check(x, weight)
    y = (x.float() @ weight.float().t()).to(out_dtype or x.dtype)
    if out is None:
        return y
    return out.copy_(y)


def linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, gemv: bool | None = None) -> torch.Tensor:
    """y = x @ weight^T: cuBLAS or the GEMV on CUDA tensors (gemm.cu, gemv.cu), linear_native
    on CPU.

    x: [tokens, in] bf16/fp16/fp32, weight: [out, in] same dtype, both contiguous.
    out: optional [tokens, out] buffer (reuse it to time without allocating).
    out_dtype: x's dtype (default) or torch.float32, which keeps the float32 accumulator:
    the model's logits use it, so two scores closer than a bf16 step are not made equal.
    gemv: None (default) lets the GEMV take one bf16 token, True 1-8 of them (rows 16-byte
    aligned, in % 8 == 0: gemm.cu's gemv_fits decides the rest); False sends every call to
    cuBLAS (to compare the two).
    Returns y: [tokens, out].
    """
    if not x.is_cuda:
        return linear_native(x, weight, out, out_dtype)
    _check(x, weight)
    if out is None:
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=out_dtype or x.dtype,
                          device=x.device)
    use_gemv = x.shape[0] == 1 if gemv is None else gemv
    prefetch = getattr(weight, _PREFETCH_ATTR, None) if use_gemv else None
    parts.kernels().linear(x, weight, out, use_gemv, prefetch)
    return out
