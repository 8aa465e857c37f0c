# GIVEN FILE: generated from solutions/04_rmsnorm/rmsnorm.py by `nox -s sync-stages`.
# Read it; do not edit it. It is not graded (the grader uses the reference
# copy), and any edit here is overwritten.
"""Stage 04 ops: RMSNorm, and RMSNorm fused with the residual add before it.

`rmsnorm` / `fused_add_rmsnorm` send CUDA tensors to the kernel in rmsnorm.cu and CPU tensors
to the plain-torch twins `rmsnorm_native` / `fused_add_rmsnorm_native`, which are HF's
LlamaRMSNorm and decoder-layer residual add, rounding for rounding.

fused_add_rmsnorm works IN PLACE on both paths (as vLLM's does): `residual` is overwritten
with x + residual (the new residual stream) and `x` with the normalized output; it returns
(x, residual), the same two buffers. A decoder layer then reads

    h, residual = fused_add_rmsnorm(attn_out, residual, post_attention_layernorm, eps)
"""
from __future__ import annotations

import torch

from course import parts
from course.out_buffer import fill

SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)


def _check_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden], got shape {tuple(x.shape)}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"weight must be [hidden] = [{x.shape[1]}], got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight is {weight.dtype} but x is {x.dtype}: give both the same dtype")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")


def rmsnorm_native(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: weight * (x / sqrt(mean(x^2) + eps)), in float32, rounded before the weight.

    x: [tokens, hidden] any float dtype; weight: [hidden], x's dtype -> [tokens, hidden], x's dtype.
    """
    _check_args(x, weight)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)  # rounding to x's dtype first is what HF does


def fused_add_rmsnorm_native(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual), the sum rounded to x's dtype as HF adds it.

    x, residual: [tokens, hidden]; weight: [hidden]; all one dtype. New tensors; inputs untouched.
    """
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {residual.dtype} {tuple(residual.shape)} must match x "
                         f"{x.dtype} {tuple(x.shape)}")
    new_residual = x + residual  # HF: hidden_states = residual + hidden_states, in the dtype
    return rmsnorm_native(new_residual, weight, eps), new_residual


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of each row; CUDA tensors go to the kernel, CPU ones to the twin.

    x: [tokens, hidden] bf16 or float32; weight: [hidden], x's dtype; eps: the config's
    rms_norm_eps. out: optional [tokens, hidden] buffer (x's dtype), written and returned.
    """
    if not x.is_cuda:
        result = rmsnorm_native(x, weight, eps)
        return fill(out, result, "rmsnorm")
    _check_args(x, weight)
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"the CUDA rmsnorm supports {SUPPORTED_DTYPES}, got {x.dtype}")
    if out is None:
        out = torch.empty_like(x)
    parts.kernels().rmsnorm(x, weight, float(eps), out)
    return out


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual <- x + residual; x <- rmsnorm(residual). Returns (x, residual).

    x, residual: [tokens, hidden] bf16 or float32 (CUDA: contiguous, distinct buffers);
    weight: [hidden]. Both x and residual are overwritten, on CPU as on CUDA.
    """
    if not x.is_cuda:
        out, new_residual = fused_add_rmsnorm_native(x, residual, weight, eps)
        residual.copy_(new_residual)
        x.copy_(out)
        return x, residual
    _check_args(x, weight)
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"the CUDA fused_add_rmsnorm supports {SUPPORTED_DTYPES}, got {x.dtype}")
    parts.kernels().fused_add_rmsnorm(x, residual, weight, float(eps))
    return x, residual
