# GIVEN FILE: generated from solutions/05_rope/rope.py by `nox -s sync-stages`.
# Read it; do not edit it. It is not graded (the grader uses the reference
# copy), and any edit here is overwritten.
"""Stage 05 op: rotary position embedding, applied in place to q and k.

`apply_rope_` sends CUDA tensors to the kernel in rope.cu and CPU tensors to
`apply_rope_native`, the plain-torch twin: HF's `q * cos + rotate_half(q) * sin`, with cos and
sin cast to q's dtype first as HF does.

The cos/sin table comes from rope_tables.cos_sin_cache (built once per model). Positions index
it, so prefill (positions 0..T-1) and decode (one position per sequence) share this code.

A position outside the table is an error on both paths (IndexError naming it). On CUDA the
kernel cannot raise: it writes NaN into that token's q and k and sets a device flag, and
`apply_rope_` reads the flag after the launch -- one host synchronization per call.
check=False skips it (inside a CUDA graph, or when the caller validated the positions once
per step, which is cheaper than once per layer); those calls share one flag per device that
nobody reads (course/error_flags.py), so they launch the kernel alone.
"""
from __future__ import annotations

import torch

from course import parts
from course.error_flags import error_flag

SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)


def _check_args(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                cos_sin: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be [tokens, heads, head_dim], got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.dtype != k.dtype:
        raise ValueError(f"q {q.dtype} {tuple(q.shape)} and k {k.dtype} {tuple(k.shape)} must "
                         "share tokens, head_dim and dtype")
    if not q.is_floating_point():
        raise ValueError(f"q and k must be floating-point tensors, got {q.dtype}")
    if positions.dtype != torch.int64 or positions.shape != (q.shape[0],):
        raise ValueError(f"positions must be [tokens] = [{q.shape[0]}] int64, got "
                         f"{positions.dtype} {tuple(positions.shape)}")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != q.shape[2] or cos_sin.dtype != torch.float32:
        raise ValueError(f"cos_sin must be [max_positions, head_dim={q.shape[2]}] float32, got "
                         f"{cos_sin.dtype} {tuple(cos_sin.shape)}")
    if q.shape[2] % 2:
        raise ValueError(f"head_dim must be even, got {q.shape[2]}")


def out_of_range_error(positions: torch.Tensor, max_positions: int) -> IndexError | None:
    """The error for the first position outside [0, max_positions), or None if all are inside."""
    bad = (positions < 0) | (positions >= max_positions)
    if not bool(bad.any()):
        return None
    where = bad.nonzero().flatten().cpu()
    t = int(where[0])
    return IndexError(f"position {int(positions[t])} of token {t} is outside the cos/sin table, "
                      f"which has {max_positions} rows (0..{max_positions - 1}); build the table "
                      f"for max_position_embeddings positions. {len(where)} of "
                      f"{positions.numel()} positions are out of range")


def apply_rope_native(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                      cos_sin: torch.Tensor) -> None:
    """Rotate q and k in place (plain torch, any device), rotate-half pairing (i, i + d/2).

    q: [tokens, q_heads, d], k: [tokens, k_heads, d], any float dtype, views allowed;
    positions: [tokens] int64; cos_sin: [max_positions, d] float32 (cos | sin).
    """
    _check_args(q, k, positions, cos_sin)
    error = out_of_range_error(positions, cos_sin.shape[0])
    if error is not None:
        raise error
    half = q.shape[2] // 2
    cos, sin = cos_sin[positions].to(q.dtype).split(half, dim=-1)  # [tokens, d/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]                   # broadcast over heads
    for x in (q, k):
        x1, x2 = x[..., :half], x[..., half:]
        # HF: x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1)
        x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))


def apply_rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                cos_sin: torch.Tensor, *, check: bool = True) -> None:
    """Rotate q and k in place; CUDA tensors go to the kernel, CPU ones to the twin.

    q: [tokens, q_heads, d], k: [tokens, k_heads, d], bf16 or float32 on CUDA. Views with a
    token stride are fine (q = qkv[:, :nh*d].view(T, nh, d)) as long as each token's heads
    are contiguous. positions: [tokens] int64; cos_sin: [max_positions, d] float32.
    check: on CUDA, wait for the kernel and raise IndexError for a position outside the
    table (that token's q and k are NaN either way); check=False skips the synchronization.
    """
    if not q.is_cuda:
        apply_rope_native(q, k, positions, cos_sin)
        return
    _check_args(q, k, positions, cos_sin)
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"the CUDA rope supports {SUPPORTED_DTYPES}, got {q.dtype}")
    error = error_flag(q.device, check)
    parts.kernels().apply_rope(q, k, positions, cos_sin, error)
    if check and bool(error.item()):  # .item() waits for the kernel: the one sync per call
        raise out_of_range_error(positions, cos_sin.shape[0]) or RuntimeError(
            "the rope kernel flagged a position outside the table, but every position is "
            "inside: its bounds check is wrong")
