# GIVEN FILE: generated from solutions/08_forward/activation.py by `nox -s sync-stages`.
# Read it; do not edit it. It is not graded (the grader uses the reference
# copy), and any edit here is overwritten.
"""Stage 08 op: SwiGLU's activation, silu(gate) * up, on the fused gate_up projection.

Llama's MLP is down_proj(silu(gate_proj(x)) * up_proj(x)). The engine runs gate_proj and
up_proj as one matrix multiply with the weight cat(gate_proj, up_proj), whose output is
[tokens, 2 * inter]: the gate in the first half of each row, up in the second. `silu_mul`
turns that into [tokens, inter].

Rounding follows Hugging Face transformers: silu(gate) is computed in float32 and rounded to
the input dtype, then multiplied by up in float32 and rounded again (two bf16 tensor ops in
HF). In float32 both roundings are exact no-ops, so the twin is plain silu(gate) * up.

`silu_mul` sends CUDA tensors to the kernel in activation.cu (bf16 only) and CPU tensors to
`silu_mul_native`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from course import parts


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
        return result if out is None else out.copy_(result)
    _split(x)
    if x.dtype != torch.bfloat16:
        raise ValueError(f"the CUDA silu_mul supports bfloat16, got {x.dtype}")
    if out is None:
        out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype, device=x.device)
    parts.kernels().silu_mul(x.contiguous(), out)
    return out
