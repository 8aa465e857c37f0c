"""Stage 03: the embedding gather kernel (embedding.cu), through the op in embedding.py.

A lookup copies rows, so the result must equal torch.nn.functional.embedding (the oracle) and
the plain-torch twin bit for bit, in bf16 and float32. Shapes: token counts 1, 7, 127, 129
and 1031 (not multiples of a block), hidden sizes 576 (SmolLM2), 2048 (Llama-3.2-1B), 320,
and 100 (rows of 200 bytes in bf16: not a whole number of 16-byte vectors). The ids include
the first and last rows of the table and repeats. An id outside the vocabulary must raise,
not read memory past the table.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course import parts
from course.testing import checks

VOCAB = 5003
TOKENS = [1, 7, 127, 129, 1031]
HIDDEN = [576, 2048, 320, 100]


def op():
    return parts.load("03", "embedding")


def random_ids(tokens: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    ids = torch.randint(0, vocab, (tokens,), generator=gen, device="cuda")
    ids[0] = vocab - 1          # the last row: an off-by-one in the bounds check drops it
    if tokens > 2:
        ids[-1] = 0             # the first row
        ids[tokens // 2] = ids[1]  # a repeated id
    return ids


def run(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The op with a poisoned out buffer, checking that the inputs are only read."""
    out = checks.poison(torch.empty(ids.shape[0], table.shape[1], dtype=table.dtype,
                                    device=table.device))
    ids_before, table_before = ids.clone(), table.clone()
    result = op().embedding(ids, table, out=out)
    torch.cuda.synchronize()
    assert result is out, "embedding(..., out=out) must write into out and return it"
    checks.assert_unmodified(ids_before, ids, "ids")
    checks.assert_unmodified(table_before, table, "table")
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("tokens", TOKENS)
def test_embedding_matches_torch(tokens, hidden, dtype, seed):
    gen = checks.generator("cuda", seed)
    table = checks.randn((VOCAB, hidden), dtype, device="cuda", gen=gen)
    ids = random_ids(tokens, VOCAB, gen)
    out = run(ids, table)
    checks.assert_finite(out, "embedding output")
    checks.assert_equal(out, F.embedding(ids, table), what=f"embedding [{tokens}, {hidden}]",
                        hint="row t of out must be row ids[t] of the table, copied exactly: "
                             "check the row offsets (id * hidden), the loop stride, and the "
                             "copy unit when hidden * element size is not a multiple of 16")
    checks.assert_equal(out, op().embedding_native(ids, table), what="embedding vs the twin")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_embedding_unaligned_table(dtype, seed):
    """A contiguous table that starts one element past a 16-byte boundary."""
    gen = checks.generator("cuda", seed)
    hidden, vocab = 2048, 301
    flat = checks.randn((vocab * hidden + 1,), dtype, device="cuda", gen=gen)
    table = flat[1:].view(vocab, hidden)
    ids = random_ids(129, vocab, gen)
    out = run(ids, table)
    checks.assert_equal(out, F.embedding(ids, table), what="embedding of an unaligned table",
                        hint="16-byte loads need a 16-byte aligned address: check the pointers' "
                             "alignment, not only the row size, before choosing the copy unit")


@pytest.mark.gpu
@pytest.mark.parametrize("bad_id", [VOCAB, VOCAB + 1000, -1, 2**32 + 5])
def test_out_of_range_id_raises(bad_id, seed):
    gen = checks.generator("cuda", seed)
    table = checks.randn((VOCAB, 576), torch.bfloat16, device="cuda", gen=gen)
    ids = random_ids(127, VOCAB, gen)
    ids[77] = bad_id
    with pytest.raises(IndexError) as info:
        op().embedding(ids, table)
    message = str(info.value)
    assert str(bad_id) in message and str(VOCAB) in message, (
        f"the error must name the bad id ({bad_id}) and the vocabulary size ({VOCAB}); "
        f"got: {message}")


@pytest.mark.gpu
def test_out_of_range_row_is_poisoned_and_others_are_right(seed):
    """check=False skips the synchronization; the bad row is NaN, never another row's data."""
    gen = checks.generator("cuda", seed)
    table = checks.randn((VOCAB, 2048), torch.bfloat16, device="cuda", gen=gen)
    ids = random_ids(129, VOCAB, gen)
    ids[5], ids[100] = VOCAB, -3
    out = op().embedding(ids, table, check=False)
    torch.cuda.synchronize()
    bad_rows = out[[5, 100]]
    assert bad_rows.isnan().all(), (
        "a token whose id is outside the vocabulary must get a row of NaN (all bits set), so a "
        f"skipped check cannot pass for a real embedding; got {bad_rows[:, :4].tolist()}")
    good = torch.ones(129, dtype=torch.bool, device="cuda")
    good[[5, 100]] = False
    checks.assert_equal(out[good], F.embedding(ids[good], table), what="the valid rows",
                        hint="an invalid id must only affect its own row")
