"""The `out=` buffer every op takes, on the native path: the twin's result is written into it
only when it has the result's shape and dtype, as the CUDA bindings demand. A plain
`out.copy_(result)` would broadcast a [1, H] result over a [4, H] buffer or convert its dtype,
so a caller's mistake would pass on the CPU and fail only on a GPU."""
from __future__ import annotations

import torch


def fill(out: torch.Tensor | None, result: torch.Tensor, op: str) -> torch.Tensor:
    """result if out is None, else out with result copied in; ValueError when they differ in
    shape or dtype."""
    if out is None:
        return result
    if out.shape != result.shape or out.dtype != result.dtype:
        raise ValueError(f"{op}: out must be {list(result.shape)} {result.dtype}, got "
                         f"{list(out.shape)} {out.dtype}")
    return out.copy_(result)
