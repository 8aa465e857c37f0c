"""Stage 08 op: SwiGLU's activation, silu(gate) * up, on the fused gate_up projection.

Llama's MLP is down_proj(silu(gate_proj(x)) * up_proj(x)). The engine runs gate_proj and
up_proj as one matrix multiply with the weight cat(gate_proj, up_proj), whose output is
[tokens, 2 * inter]: the gate in the first half of each row, up in the second. `silu_mul`
turns that into [tokens, inter].

Rounding follows Hugging Face transformers: silu(gate) is computed in float32 and rounded to
the input dtype, then multiplied by up in float32 and rounded again (two bf16 tensor ops in
HF). In float32 both roundings are exact no-ops, so the twin is plain silu(gate) * up.

`silu_mul` sends CUDA tensors to the kernel in activation.cu (bf16 only) and CPU tensors to
`silu_mul_native`. `linear_silu_mul` is the MLP's first half, the gate_up projection and this
activation: for one bf16 token on CUDA (a batch-1 decode step) stage 06's GEMV computes the
pair of rows of each output and applies the activation in its epilogue, one kernel instead of
two; anywhere else it is `linear` then `silu_mul`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from course import ops, parts
from course.out_buffer import fill

linear = ops.get("linear")   # stage 06's, looked up once (linear_silu_mul runs every layer)


def _split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2 or x.shape[1] % 2 != 0:
        raise ValueError(f"x must be [tokens, 2 * intermediate] (gate, then up), got shape "
                         f"{tuple(x.shape)}")
    inter = x.shape[1] // 2
    return x[:, :inter], x[:, inter:]


def silu_mul_native(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in plain torch (any device), rounded as HF rounds it.

    x: [tokens, 2 * inter] (gate columns, then up columns), any float dtype
    -> [tokens, inter], x's dtype.
    """
    gate, up = _split(x)
    act = F.silu(gate.float()).to(x.dtype)            # HF: act_fn(gate), a tensor of x's dtype
    return (act.float() * up.float()).to(x.dtype)     # HF: act * up, rounded once more


def silu_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up; CUDA tensors go to the kernel, CPU ones to the twin.

    x: [tokens, 2 * inter] bf16 (CUDA) or any float dtype (CPU), contiguous;
    out: optional [tokens, inter] buffer of x's dtype, written and returned.
    """
    if not x.is_cuda:
        result = silu_mul_native(x)
        return fill(out, result, "silu_mul")
    _split(x)
    if x.dtype != torch.bfloat16:
        raise ValueError(f"the CUDA silu_mul supports bfloat16, got {x.dtype}")
    if out is None:
        out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype, device=x.device)
    parts.kernels().silu_mul(x.contiguous(), out)
    return out


def one_token_operands(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether x is one CUDA token and x and the others are bf16, contiguous and 16-byte
    aligned: what stage 06's one-token GEMV kernels read (linear_silu_mul here,
    add_rmsnorm_linear in norm_linear.py)."""
    return x.is_cuda and x.shape[0] == 1 and all(
        t.dtype == torch.bfloat16 and t.is_contiguous() and t.data_ptr() % 16 == 0
        for t in (x, *others))


def linear_silu_mul(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) for the fused weight gate_up = cat(gate, up).

    x: [tokens, H], gate_up: [2 * inter, H], one dtype -> [tokens, inter]. One bf16 token on
    CUDA with 16-byte aligned rows: stage 06's GEMV with the activation in its epilogue
    (gemv.cu, the same roundings as linear then silu_mul); otherwise those two ops.
    """
    gemv_takes = (one_token_operands(x, gate_up) and x.shape[1] % 8 == 0
                  and gate_up.shape[0] % 2 == 0)
    return (_fused if gemv_takes else _two_ops)(x, gate_up)


def _gemv_silu_mul(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    out = torch.empty((1, gate_up.shape[0] // 2), dtype=x.dtype, device=x.device)
    parts.kernels().linear_silu_mul(x, gate_up, out)
    return out


def _two_ops(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    return silu_mul(linear(x, gate_up))


# the fused epilogue lives in stage 06's fast GEMV: while that is a TODO, the two ops
_fused = ops.FirstWritten("linear_silu_mul: stage 06's fast GEMV (gemv.cu)", _gemv_silu_mul,
                          _two_ops)
