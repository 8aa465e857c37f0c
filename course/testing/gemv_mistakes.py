"""The known mistakes of stage 06's GEMVs, as course.testing.diagnose patterns.

A GEMV's output y: [tokens, out] is checked as rows of outputs by tokens, so a failure names
the outputs and tokens that are wrong, and, when the output is what a known mistake computes
(a row's last columns dropped, a reduction short of its 32 lanes, y written transposed, every
token reading token 0's x) or the wrong entries are the ones such a mistake spoils (only the
tokens after the first, only the last outputs of the grid), that mistake:

    gemv_mistakes.assert_gemv(y, x, w, what="gemv_simple", warps_per_block=8)
"""
from __future__ import annotations

import torch

from course.testing import checks, diagnose

LANES = 32
PIECE = 8  # bf16 per 16-byte piece
FAST_UNIT = 1024  # gemv.cu's columns per unit (kUnit pieces)

SIMPLE_HINT = (
    "warp w of the grid owns output w; lane l reads the row's 16-byte pieces l, l + 32, ... "
    "(in / 8 of them) and the same pieces of each token's x; float32 sums, one per token; "
    "a butterfly of __shfl_xor_sync (16, 8, 4, 2, 1); lane 0 writes y[t * out + w]")
FAST_HINT = (
    "a warp's units i = 0, 1, ... run through its rows gw, gw + W, ...; unit i sits in slot "
    "i % kStages once copies_wait<kStages - 1>() returns after fetching unit i + kStages - 1; "
    "lane l's pieces are slot[p * 32 + l] (columns u.first + p * 32 + l, none past in / 8), each "
    "times the same pieces of every token's x (x + t * in / 8 pieces); at a row's last unit a "
    "butterfly sum, lane 0 writes y[t * out + row], and acc goes back to 0. Did you skip a "
    "partly empty unit, keep a row's sums for the next row, or mix two tokens' sums?")


def operands(gen: torch.Generator, tokens: int, in_features: int, out_features: int,
             dtype: torch.dtype = torch.bfloat16, device: str = "cuda"):
    """x [tokens, in] and w [out, in] with standard deviation 1/sqrt(in), as a trained
    Linear's weights: every output is O(1), so the bf16 tolerance applies whatever in is."""
    x = checks.randn((tokens, in_features), dtype, device, gen)
    w = checks.randn((out_features, in_features), dtype, device, gen, scale=in_features ** -0.5)
    return x, w


def _product(x: torch.Tensor, w: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w^T in float32 over the input columns where `columns` is True (all: None)."""
    xf, wf = x.float().cpu(), w.float().cpu()
    if columns is not None:
        xf, wf = xf * columns, wf * columns
    return xf @ wf.t()


def variants(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype,
             unit: int | None = None) -> list[diagnose.Variant]:
    """What the usual mistakes write, each as [out, tokens] like the checked view. unit: the
    columns of the fast GEMV's unit (its tail mistake drops a partly empty unit), or None
    (the simple GEMV's drops a partial sweep of 32 pieces)."""
    tokens, in_features = x.shape
    piece = torch.arange(in_features) // PIECE
    found = []

    def add(y: torch.Tensor | None, cause: str) -> None:
        found.append(diagnose.Variant(None if y is None else y.to(out_dtype).t(), cause))

    if unit is None:
        full = (in_features // PIECE) // LANES * LANES
        if full * PIECE < in_features:
            add(_product(x, w, piece < full),
                f"the row's last {in_features - full * PIECE} columns are missing: the loop over "
                f"a row's 16-byte pieces stopped at a multiple of 32 pieces (in / 256 steps); "
                f"lane l takes pieces l, l + 32, ... while the piece < in / 8")
    elif in_features % unit:
        kept = in_features // unit * unit
        add(_product(x, w, torch.arange(in_features) < kept),
            f"the row's last, partly empty unit of {unit} columns is missing (its "
            f"{in_features - kept} columns): a row of in columns has ceil(in / {unit}) units, "
            f"the last one cut at in / 8 pieces")
    add(_product(x, w, piece % LANES < 16),
        "each output holds the sum of lanes 0-15 only: the butterfly must start at offset 16 "
        "(16, 8, 4, 2, 1) so that lane 0 ends with all 32 lanes' sums")
    add(_product(x, w, piece % LANES == 0),
        "each output holds lane 0's own sum: the lanes' sums were never added (the butterfly "
        "of __shfl_xor_sync, offsets 16 to 1, before lane 0 writes)")
    if tokens > 1:
        right = _product(x, w)
        add(right.t().contiguous().view(tokens, -1),
            "y was written as [out, tokens] (y[row * tokens + t]); y is [tokens, out]: "
            "y[t * out + row]")
        add(_product(x[:1], w).expand(tokens, -1),
            "every token read token 0's x: token t's pieces start t * in / 8 pieces further")
    return found


def suspects(tokens: int, out_features: int, warps_per_block: int | None) -> list[diagnose.Suspect]:
    """Row sets of the [out, tokens] view that a known mistake spoils, and no others."""
    found = []
    if tokens > 1:
        later = torch.zeros(out_features, tokens, dtype=torch.bool)
        later[:, 1:] = True
        found.append(diagnose.Suspect(
            later, "the tokens after the first",
            "each token needs its own sum (acc[t]), its own x (t * in / 8 pieces on) and its "
            "own row of y (t * out); a loop over tokens that stops at 1, or a shared sum"))
    if warps_per_block and out_features % warps_per_block:
        last = torch.zeros(out_features, tokens, dtype=torch.bool)
        last[out_features // warps_per_block * warps_per_block:] = True
        found.append(diagnose.Suspect(
            last, f"the last {out_features % warps_per_block} outputs (past the last full block "
                  f"of {warps_per_block} warps)",
            "the grid was rounded down: (out + warps - 1) / warps blocks cover every output"))
    return found


def assert_gemv(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, *, what: str,
                warps_per_block: int | None = None, unit: int | None = None,
                hint: str = "") -> None:
    """y: [tokens, out] from a GEMV of x: [tokens, in] and w: [out, in] (bf16) against the
    float32 product, rounded to y's dtype; a failure names the shape, the wrong outputs and
    tokens, and the mistake their pattern points to (else `hint`). warps_per_block: the
    simple GEMV's (a grid rounded down); unit: the fast GEMV's columns per unit."""
    tokens, in_features = x.shape
    out_features = w.shape[0]
    expected = _product(x, w).to(y.dtype)
    diagnose.assert_close(
        y.cpu().t(), expected.t(), what=what, row_names=("output", "token"), hint=hint,
        shape=diagnose.shape(tokens=tokens, weight=f"{out_features} x {in_features}",
                             out=str(y.dtype).removeprefix("torch.")),
        variants=variants(x, w, y.dtype, unit), suspects=suspects(tokens, out_features, warps_per_block))
