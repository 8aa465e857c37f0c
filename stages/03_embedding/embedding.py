# GIVEN FILE: generated from solutions/03_embedding/embedding.py by `nox -s sync-stages`.
# Read it; do not edit it. It is not graded (the grader uses the reference
# copy), and any edit here is overwritten.
"""Stage 03 op: the embedding lookup, token ids -> hidden vectors (rows of a table).

`embedding` sends CUDA tensors to the kernel in embedding.cu and CPU tensors to
`embedding_native`, the plain-torch twin that states the math.

An id outside [0, vocab) is an error on both paths, raised as IndexError naming the id, its
position and the vocabulary size. On CUDA the kernel cannot raise: it poisons that row with
NaN and sets a flag on the device, and `embedding` reads the flag after the launch. Reading it
is one host-device synchronization per call (the CPU waits for the kernel); `check=False`
skips it where a caller cannot afford to wait (inside a CUDA graph) and has validated its ids;
such calls share one flag per device that nobody reads (course/error_flags.py), so a decode
graph holds the lookup alone, not also a kernel that zeroes a new flag.
"""
from __future__ import annotations

import torch

from course import parts
from course.out_buffer import fill
from course.error_flags import error_flag

SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)


def _check_args(ids: torch.Tensor, table: torch.Tensor) -> None:
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise ValueError(f"ids must be a 1-D int64 tensor of token ids, got {ids.dtype} with "
                         f"shape {tuple(ids.shape)}")
    if table.dim() != 2:
        raise ValueError(f"table must be [vocab, hidden], got shape {tuple(table.shape)}")
    if ids.device != table.device:
        raise ValueError(f"ids are on {ids.device} but the table is on {table.device}")


def out_of_range_error(ids: torch.Tensor, vocab: int) -> IndexError | None:
    """The error for the first id outside [0, vocab), or None when every id is valid."""
    bad = (ids < 0) | (ids >= vocab)
    if not bool(bad.any()):
        return None
    where = bad.nonzero().flatten().cpu()
    pos = int(where[0])
    return IndexError(f"token id {int(ids[pos])} at position {pos} is out of range: the "
                      f"vocabulary has {vocab} ids (0..{vocab - 1}); {len(where)} of "
                      f"{ids.numel()} ids are out of range")


def embedding_native(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rows of `table` picked by `ids` (plain torch, any device).

    ids: [tokens] int64; table: [vocab, hidden] any dtype -> [tokens, hidden], table's dtype.
    """
    _check_args(ids, table)
    error = out_of_range_error(ids, table.shape[0])
    if error is not None:
        raise error
    return table.index_select(0, ids)


def embedding(ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor | None = None, *,
              check: bool = True) -> torch.Tensor:
    """Rows of `table` picked by `ids`; CUDA tensors go to the kernel, CPU ones to the twin.

    ids: [tokens] int64; table: [vocab, hidden] bf16 or float32 (CUDA), any dtype (CPU);
    out: optional [tokens, hidden] buffer of the table's dtype, written and returned (so a
    benchmark or a decode loop allocates nothing). Returns [tokens, hidden], table's dtype.
    check: on CUDA, wait for the kernel and raise IndexError for an out-of-range id (the
    row is NaN either way); check=False skips that host synchronization.
    """
    if not ids.is_cuda:
        result = embedding_native(ids, table)
        return fill(out, result, "embedding")
    _check_args(ids, table)
    if table.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"the CUDA embedding supports {SUPPORTED_DTYPES}, got {table.dtype}")
    if out is None:
        out = torch.empty((ids.shape[0], table.shape[1]), dtype=table.dtype, device=table.device)
    error = error_flag(ids.device, check)
    parts.kernels().embedding(ids, table, out, error)
    if check and bool(error.item()):  # .item() waits for the kernel: the one sync per call
        raise out_of_range_error(ids, table.shape[0]) or RuntimeError(
            "the embedding kernel flagged an out-of-range id, but every id is in [0, vocab): "
            "its bounds check is wrong")
    return out
