"""Stage 08: the argmax kernel (argmax.cu): a block per piece of a row, a row in several pieces
when there are fewer rows than SMs (the last block of a row merges them).

The oracle is torch.argmax and its documented contract: the FIRST index of the maximum, NaN
counted as the maximum. Ties, NaNs and the ends of the row are built by hand, so the expected
index is known without running anything.
"""
from __future__ import annotations

import pytest
import torch

from course import parts
from course.testing import checks

DTYPES = [torch.bfloat16, torch.float32]
# Llama 3's and SmolLM2's vocabularies, LLaMA-2's, and odd sizes (no 16-byte packs); with 600
# rows every row is one piece (up to 2 x 132 rows on an H200, rows are cut into pieces).
SHAPES = [(1, 128256), (4, 49152), (33, 32000), (7, 1001), (3, 211), (2, 1), (5, 7),
          (600, 4100)]
TIE_HINT = ("of equal values the LOWER index must win, in the per-thread scan, in the warp "
            "shuffles and in the final combine (torch.argmax returns the first maximum)")


def op():
    return parts.reference("08", "argmax")


def run(logits: torch.Tensor) -> torch.Tensor:
    before = logits.clone()
    out = checks.poison(torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device))
    op().argmax(logits, out)
    torch.cuda.synchronize()
    checks.assert_unmodified(before, logits, "logits")
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,vocab", SHAPES)
def test_argmax_random(rows, vocab, dtype, seed):
    logits = checks.randn((rows, vocab), dtype, "cuda", scale=3.0)
    got = run(logits)
    checks.assert_equal(got, torch.argmax(logits.cpu(), dim=-1), what=f"argmax [{rows}, {vocab}]",
                        hint="every element of the row must be scanned once; -1 means the "
                             "kernel never wrote that row (with a row in pieces: no block "
                             "saw itself as the last, or a ticket was left above 0)")


def tie_rows(vocab: int, gen: torch.Generator, dtype: torch.dtype):
    """Rows with hand-made maxima and the index torch.argmax must return for each."""
    rows, expected = [], []

    def add(row: torch.Tensor, index: int) -> None:
        rows.append(row)
        expected.append(index)

    def base():
        return torch.randn(vocab, generator=gen) * 3.0

    # many equal maxima at random places: the first one wins
    r = base()
    where = torch.randperm(vocab, generator=gen)[:min(vocab, 97)]
    r[where] = 100.0
    add(r, int(where.min()))
    # the maximum at index 0 and at vocab - 1 (a tie between the two ends): 0
    r = base()
    r[0] = r[-1] = 100.0
    add(r, 0)
    # the maximum only at the last index (in the last pack, or the scalar tail)
    r = base()
    r[-1] = 100.0
    add(r, vocab - 1)
    # the maximum only at index 0
    r = base()
    r[0] = 100.0
    add(r, 0)
    # a constant row: every element is a maximum
    add(torch.full((vocab,), 1.5), 0)
    # every element -inf (a fully masked row): still 0, never an index past the row
    add(torch.full((vocab,), float("-inf")), 0)
    # +inf twice: the first
    r = base()
    a, b = sorted(torch.randperm(vocab, generator=gen)[:2].tolist()) if vocab > 1 else (0, 0)
    r[b] = r[a] = float("inf")
    add(r, a)
    # two maxima 1 apart, at the end of one block-stride chunk and the start of the next
    r = base()
    p = min(vocab - 1, 8 * 1024)
    r[p] = 100.0
    r[p - 1 if p > 0 else p] = 100.0
    add(r, max(p - 1, 0))
    return torch.stack(rows).to(dtype), torch.tensor(expected)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", [128256, 49152, 1001, 8, 1])
def test_argmax_ties_and_ends(vocab, dtype, seed):
    logits, expected = tie_rows(vocab, checks.generator("cpu"), dtype)
    assert torch.equal(torch.argmax(logits, dim=-1), expected)  # the contract, on the CPU
    got = run(logits.cuda())
    checks.assert_equal(got, expected, what=f"argmax with ties, vocab {vocab}", hint=TIE_HINT)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", [128256, 49152, 1001])
def test_argmax_nan_is_the_maximum(vocab, dtype, seed):
    """torch.argmax treats NaN as larger than every number: the first NaN's index."""
    gen = checks.generator("cpu")
    logits = torch.randn(4, vocab, generator=gen) * 3.0
    p, q = sorted(torch.randperm(vocab, generator=gen)[:2].tolist())
    logits[0, q] = float("nan")                      # one NaN
    logits[1, q] = logits[1, p] = float("nan")       # two: the first
    logits[2, 0] = float("inf")                      # +inf loses to a NaN
    logits[2, -1] = float("nan")
    logits[3, p] = 100.0                             # a NaN after the maximum still wins
    logits[3, q] = float("nan")
    expected = torch.tensor([q, p, vocab - 1, q])
    logits = logits.to(dtype)
    assert torch.equal(torch.argmax(logits, dim=-1), expected)  # the contract, on the CPU
    got = run(logits.cuda())
    checks.assert_equal(got, expected, what="argmax of rows holding NaN",
                        hint="a comparison with NaN is always false, so `v > best` never "
                             "picks a NaN: test isnan() explicitly (NaN beats numbers; two "
                             "NaNs: the lower index)")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_argmax_unaligned(dtype, seed):
    """Logits that start one element past a 16-byte boundary (a view into a bigger buffer)."""
    rows, vocab = 6, 49152
    buf = checks.randn((rows * vocab + 1,), dtype, "cuda", scale=3.0)
    logits = buf[1:].view(rows, vocab)
    got = run(logits)
    checks.assert_equal(got, torch.argmax(logits.cpu(), dim=-1), what="argmax, unaligned rows",
                        hint="16-byte loads need 16-byte-aligned rows: fall back to one "
                             "element per load otherwise")


@pytest.mark.gpu
def test_argmax_launch_after_launch(seed):
    """One row of Llama 3's vocabulary, its maximum moved between launches: a row in pieces is
    merged by the block that draws its row's last ticket, which must set the counter back to 0
    or the next launch's merge never happens (or happens too early)."""
    logits = checks.randn((1, 128256), torch.float32, "cuda", scale=3.0)
    for i, where in enumerate((128255, 0, 70000, 4095, 4096)):
        logits[0, where] = 100.0 * (i + 1)      # larger than every maximum before it
        got = run(logits)
        checks.assert_equal(got, torch.tensor([where]), what=f"argmax, maximum at {where}",
                            hint="the block that merges a row's pieces resets its ticket")


@pytest.mark.gpu
@pytest.mark.parametrize("rows,vocab", [(1, 128256), (3, 1001), (600, 4100)])
def test_argmax_stores_the_answers_in_host_memory(rows, vocab, seed):
    """argmax(logits, out, host, host_slot): the answers also go to row host_slot[0] of a pinned
    host buffer (what a decode graph hands the engine's host without a copy): that row's first
    `rows` entries, nothing else -- both for a row in pieces (the merging block stores) and for
    rows of one piece. Your launch_argmax must pass `host` on to the kernel."""
    logits = checks.randn((rows, vocab), torch.float32, "cuda", scale=3.0)
    host = torch.full((3, rows + 2), -1, dtype=torch.int64, pin_memory=True)
    out = torch.empty(rows, dtype=torch.int64, device="cuda")
    expected = torch.argmax(logits.cpu(), dim=-1)
    for slot in (2, 0):
        op().argmax(logits, out, host, torch.tensor([slot], device="cuda"))
        torch.cuda.synchronize()
        checks.assert_equal(out.cpu(), expected, what="argmax's out beside the host copy")
        checks.assert_equal(host[slot, :rows], expected, what=f"the host row {slot}",
                            hint="launch_argmax passes `host` (a HostRows) on to the kernel")
    assert (host[1] == -1).all() and (host[[0, 2], rows:] == -1).all(), (
        "only the slot's first `rows` entries may be written")
    host[2] = -1
    op().argmax(logits, out, host[:2], torch.tensor([2], device="cuda"))   # past its 2 slots
    torch.cuda.synchronize()
    assert (host[2] == -1).all(), "a slot outside the host buffer must store nothing"
    with pytest.raises(ValueError, match="together"):
        op().argmax(logits, out, host)

