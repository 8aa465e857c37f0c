"""Stage 08 op: argmax over the vocabulary, the token that greedy decoding picks.

The contract is torch.argmax's, which the kernel in argmax.cu reproduces exactly:
  - ties go to the LOWEST index (the first maximum);
  - NaN counts as larger than any number: a row holding a NaN returns its first NaN's index
    (a NaN logit means the forward pass is broken; the index at least points at it);
  - -0.0 equals +0.0; a row of -inf returns 0.

`argmax` sends CUDA tensors to the kernel (bf16 or float32) and CPU tensors to
`argmax_native`.
"""
from __future__ import annotations

import torch

from course import parts
from course.out_buffer import fill

SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)


def _check(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [rows, vocab] with vocab >= 1, got shape "
                         f"{tuple(logits.shape)}")


def argmax_native(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's maximum (plain torch: torch.argmax, any device).

    logits: [rows, vocab] float -> [rows] int64
    """
    _check(logits)
    return torch.argmax(logits, dim=-1)


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None,
           host: torch.Tensor | None = None, host_slot: torch.Tensor | None = None
           ) -> torch.Tensor:
    """The index of each row's maximum; CUDA tensors go to the kernel, CPU ones to the twin.

    logits: [rows, vocab] bf16 or float32 (CUDA), any float dtype (CPU);
    out: optional [rows] int64 buffer, written and returned. Returns [rows] int64.
    host, host_slot (optional, together): [slots, >= rows] int64 (pinned CPU memory when
    logits are on CUDA) and [1] int64 on logits' device: the answers also go to
    host[host_slot[0], :rows], stored by the kernel itself, so that a CUDA graph holding the
    argmax hands its tokens to the host with no copy after it (stage 10's decode graphs; the
    slot is read on the device when the kernel runs, and a slot outside [0, slots) stores
    nothing: the kernel cannot raise, and host memory past the buffer must stay untouched).
    """
    if (host is None) != (host_slot is None):
        raise ValueError("argmax: host and host_slot come together")
    if not logits.is_cuda:
        result = argmax_native(logits)
        if host is not None:
            slot = int(host_slot[0])
            if 0 <= slot < host.shape[0]:
                host[slot, : result.shape[0]] = result
        return fill(out, result, "argmax")
    _check(logits)
    if logits.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"the CUDA argmax supports {SUPPORTED_DTYPES}, got {logits.dtype}")
    if out is None:
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    parts.kernels().argmax(logits.contiguous(), out, host, host_slot)
    return out
