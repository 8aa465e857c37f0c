# GIVEN FILE: generated from solutions/08_forward/norm_linear.py by `nox -s sync-stages`.
# Read it; do not edit it. It is not graded (the grader uses the reference
# copy), and any edit here is overwritten.
"""A decoder layer's norm and the projection after it, as one op (given code, read it):

    stream = x + residual                          (the residual add; x itself at layer 0)
    y      = linear(rmsnorm(stream), weight)       (or linear_silu_mul: the MLP's gate_up)

Each of a Llama layer's two blocks starts this way: the input norm before the qkv projection,
the post-attention norm before gate_up. For one bf16 token on an sm_90 GPU (a batch-1 decode
step) stage 06's bulk-copy GEMV computes the norm in its prologue (gemv.cu, `Prologue`):
each block normalizes the row itself while its first weights are in flight, so the step has
no RMSNorm kernel between two projections (32 kernels fewer per Llama-3.2-1B token). Anywhere
else it is the ops it stands for, stage 04's fused_add_rmsnorm (or rmsnorm) then stage 06's
linear (or linear_silu_mul), with the same roundings on both paths.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from course import ops, parts

rmsnorm, fused_add_rmsnorm = ops.get("rmsnorm"), ops.get("fused_add_rmsnorm")
linear, linear_silu_mul = ops.get("linear"), ops.get("linear_silu_mul")
argmax = ops.get("argmax")
one_token_operands = parts.load("08", "activation").one_token_operands


@lru_cache(maxsize=None)
def _gemv_takes(in_features: int, out_features: int) -> bool:
    return bool(parts.kernels().rmsnorm_linear_fits(in_features, out_features))


def _one_token_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm: torch.Tensor,
                    weight: torch.Tensor, silu_mul: bool) -> bool:
    others = (norm, weight) if residual is None else (norm, weight, residual)
    # an odd gate_up goes the two-op way, whose linear_silu_mul says what is wrong with it
    return (one_token_operands(x, *others) and not (silu_mul and weight.shape[0] % 2)
            and _gemv_takes(x.shape[1], weight.shape[0]))


def add_rmsnorm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm: torch.Tensor,
                       eps: float, weight: torch.Tensor, silu_mul: bool = False,
                       out_dtype: torch.dtype | None = None, pick: torch.Tensor | None = None,
                       host: torch.Tensor | None = None, host_slot: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, stream): stream = x + residual (x itself when residual is None), y = the projection
    of rmsnorm(stream, norm, eps) by weight: linear, or linear_silu_mul when silu_mul.

    x, residual: [T, H]; norm: [H]; weight: [out, H] ([2 I, H], gate rows then up rows, with
    silu_mul) -> y: [T, out] ([T, I]), stream: [T, H]; one dtype, but y in out_dtype when given
    (torch.float32: the logits, the lm_head after the model's final norm; not with silu_mul).
    pick (optional, [T] int64; host, host_slot as argmax takes them): each row's argmax of y
    goes there too, the greedy token -- argmax(y, pick, host, host_slot), which the one-token
    GEMV does in its epilogue (gemv.cu, `Pick`): no argmax kernel after the lm_head.
    Like fused_add_rmsnorm it may overwrite x and residual (the two-op path works in place):
    use what it returns.
    """
    if silu_mul and (out_dtype not in (None, x.dtype) or pick is not None):
        raise ValueError("add_rmsnorm_linear: silu_mul gives y in x's dtype, with no pick; "
                         "out_dtype and pick are for a plain projection (the logits)")
    if _one_token_gemv(x, residual, norm, weight, silu_mul) and (
            pick is None or out_dtype == torch.float32):
        inter = weight.shape[0] // 2 if silu_mul else 0     # 0: a plain projection
        y = torch.empty((1, inter or weight.shape[0]), dtype=out_dtype or x.dtype,
                        device=x.device)
        stream = x if residual is None else torch.empty_like(x)
        parts.kernels().rmsnorm_linear(x, residual, None if residual is None else stream, norm,
                                       float(eps), weight, y, inter, pick, host, host_slot)
        return y, stream
    if residual is None:
        stream, normed = x, rmsnorm(x, norm, eps)
    else:
        normed, stream = fused_add_rmsnorm(x, residual, norm, eps)
    if silu_mul:
        return linear_silu_mul(normed, weight), stream
    y = linear(normed, weight, out_dtype=out_dtype)
    if pick is not None:
        argmax(y, pick, host, host_slot)
    return y, stream
