"""Where a kernel's output is wrong, and which known mistake it looks like.

A bare "Tensor-likes are not close!" tells a learner nothing. The stages' GPU tests and the
emulator's checks pass their output through `assert_close` here, which fails with the case's
shape, the rows that are wrong (not only the first elements), the pattern they make, and the
mistake that pattern usually comes from:

    from course.testing import diagnose
    diagnose.assert_close(
        out, expected, what="paged attention",
        shape=diagnose.shape(batch=2, lengths=[1, 300], heads="32/8", head_dim=64),
        row_names=("sequence", "head"),           # out: [batch, heads, head_dim]
        variants=[diagnose.Variant(wrong_out, "k_end unclipped: ...")],
        suspects=[diagnose.Suspect(long_rows, "sequences longer than one partition", "...")])

Patterns, checked in this order (the first that fits is named):
  Variant   the output a known mistake produces (the caller computes it, e.g. the reference
            run with one key too many): the kernel's output matches it, the right one differs;
  Suspect   a set of rows a known mistake spoils, and no others (the sequences longer than
            one split-K partition): the wrong rows lie inside it and cover most of it;
  built-in  whole rows NaN; NaN in rows that are otherwise right; whole rows of zeros.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from course.testing import checks

WHOLE_ROWS_NAN = ("whole rows are NaN: a state that saw no key became NaN (exp(-inf - -inf), "
                  "or 0 / 0 when l = 0), or the row read memory it must not read (the tests "
                  "fill it with NaN)")
SOME_NAN = ("NaN inside rows that are otherwise right: some elements were never written, or "
            "read memory they must not read (the tests fill it with NaN)")
WHOLE_ROWS_ZERO = ("whole rows are zeros where the reference is not: those rows took the "
                   "padding (length 0) path, or accumulated nothing")


@dataclass(frozen=True)
class Variant:
    """The output `output` (None: not computable for this case) of a known mistake, `cause`.
    slack: the share of rows the kernel's output may differ from it in and still be named
    (a causal mask one key off in a kernel also misses, or reads, a key across a tile's edge
    that the plain computation has: a few rows of a long sequence differ)."""
    output: torch.Tensor | None
    cause: str
    slack: float = 0.0


@dataclass(frozen=True)
class Suspect:
    """The rows a known mistake spoils: `rows`, a bool tensor over the row dims; `what` names
    them ("sequences longer than one partition"), `cause` the mistake."""
    rows: torch.Tensor
    what: str
    cause: str


def shape(**fields) -> str:
    """The case's sizes as one line: shape(batch=2, head_dim=64) -> "batch 2, head dim 64".
    A field that is None is left out."""
    return ", ".join(f"{name.replace('_', ' ')} {value}" for name, value in fields.items()
                     if value is not None)


def wrong_rows(got: torch.Tensor, expected: torch.Tensor, row_dims: int = 1, *,
               dtype: torch.dtype | None = None, atol: float | None = None,
               rtol: float | None = None) -> torch.Tensor:
    """A bool tensor over got's first `row_dims` dims: True where any element of that row
    differs beyond the tolerance (atol, rtol; by default dtype's in checks.TOLERANCES)."""
    atol, rtol = checks.tolerance(dtype or got.dtype, atol, rtol)
    bad = checks.mismatch(got, expected, atol=atol, rtol=rtol)
    return bad.reshape(*got.shape[:row_dims], -1).any(-1)


def _rows_text(rows: torch.Tensor, names: Sequence[str], limit: int = 6) -> str:
    """"sequence 1 head 3, sequence 1 head 4, ... (12 of 64)" for the True entries of rows."""
    index = rows.nonzero().tolist()
    shown = [" ".join(f"{n} {i}" for n, i in zip(names, ix)) if names else str(tuple(ix))
             for ix in index[:limit]]
    more = ", ..." if len(index) > limit else ""
    return f"{', '.join(shown)}{more} ({len(index)} of {rows.numel()})"


def _matches(got: torch.Tensor, other: torch.Tensor, atol: float, rtol: float) -> bool:
    return got.shape == other.shape and not checks.mismatch(got, other, atol=atol,
                                                            rtol=rtol).any()


def _close_to(got: torch.Tensor, v: Variant, row_dims: int, atol: float, rtol: float) -> bool:
    """got matches v's output, but for at most v.slack of its rows."""
    if v.slack == 0 or got.shape != v.output.shape:
        return _matches(got, v.output, atol, rtol)
    off = wrong_rows(got, v.output, row_dims, atol=atol, rtol=rtol)
    return int(off.sum()) <= v.slack * off.numel()


def likely_cause(got: torch.Tensor, expected: torch.Tensor, *, row_dims: int = 1,
                 variants: Sequence[Variant] = (), suspects: Sequence[Suspect] = (),
                 dtype: torch.dtype | None = None, atol: float | None = None,
                 rtol: float | None = None) -> str:
    """The pattern the wrong output makes and its usual cause ("" when it is right, or fits
    no pattern); see the top for the order. Tolerances as wrong_rows'."""
    atol, rtol = checks.tolerance(dtype or got.dtype, atol, rtol)
    bad = wrong_rows(got, expected, row_dims, atol=atol, rtol=rtol)
    if not bad.any():
        return ""
    for v in variants:
        if v.output is not None and not _matches(v.output, expected, atol, rtol) \
                and _close_to(got, v, row_dims, atol, rtol):
            return v.cause
    for s in suspects:
        rows = s.rows.cpu().bool()
        inside = not (bad & ~rows).any()
        if inside and int(bad.sum()) * 2 >= int(rows.sum()):
            return f"only {s.what} are wrong: {s.cause}"
    flat = got.detach().cpu().reshape(*got.shape[:row_dims], -1)
    want = expected.detach().cpu().reshape(*got.shape[:row_dims], -1)
    nan_rows = flat.isnan().all(-1) & ~want.isnan().all(-1)
    if nan_rows.any() and not (bad & ~nan_rows).any():
        return WHOLE_ROWS_NAN
    if (flat.isnan() & ~want.isnan()).any():
        return SOME_NAN
    zero_rows = (flat == 0).all(-1) & (want != 0).any(-1)
    if zero_rows.any() and not (bad & ~zero_rows).any():
        return WHOLE_ROWS_ZERO
    return ""


def assert_close(got: torch.Tensor, expected: torch.Tensor, *, what: str = "output",
                 shape: str = "", row_names: Sequence[str] = ("row",),
                 variants: Sequence[Variant] = (), suspects: Sequence[Suspect] = (),
                 dtype: torch.dtype | None = None, atol: float | None = None,
                 rtol: float | None = None, hint: str = "") -> None:
    """checks.assert_close, whose message also gives the case's shape, the wrong rows (over
    got's first len(row_names) dims) and the likely cause: the pattern's, else `hint`.
    Tolerances as wrong_rows'."""
    dtype = dtype or got.dtype
    if got.shape != expected.shape:
        checks.assert_close(got, expected, what=what, dtype=dtype)
    atol, rtol = checks.tolerance(dtype, atol, rtol)
    row_dims = len(row_names)
    bad = wrong_rows(got, expected, row_dims, atol=atol, rtol=rtol)
    if not bad.any():
        return
    cause = likely_cause(got, expected, row_dims=row_dims, variants=variants,
                         suspects=suspects, atol=atol, rtol=rtol) or hint
    label = f"{what} [{shape}]" if shape else what
    try:
        checks.assert_close(got, expected, what=label, dtype=dtype, atol=atol, rtol=rtol,
                            hint=cause)
    except AssertionError as e:
        first, _, rest = str(e).partition("\n")
        rows = f"  wrong rows: {_rows_text(bad, row_names)}"
        raise AssertionError("\n".join(filter(None, [first, rows, rest]))) from None
