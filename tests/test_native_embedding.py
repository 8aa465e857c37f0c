"""The torch-native twin of stage 03 (solutions/03_embedding/embedding.py) against
torch.nn.functional.embedding, on the CPU, and the CPU path of the dispatching op."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course import parts
from course.testing import checks


def emb():
    return parts.reference("03", "embedding")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens,hidden", [(1, 576), (7, 2048), (129, 320), (1031, 100)])
def test_native_matches_functional_embedding(tokens, hidden, dtype, seed):
    gen = checks.generator(seed=seed)
    vocab = 1009
    table = checks.randn((vocab, hidden), dtype, gen=gen)
    ids = torch.randint(0, vocab, (tokens,), generator=gen)
    ids[0] = vocab - 1
    checks.assert_equal(emb().embedding_native(ids, table), F.embedding(ids, table))


def test_cpu_op_writes_out(seed):
    gen = checks.generator(seed=seed)
    table = checks.randn((50, 64), torch.bfloat16, gen=gen)
    ids = torch.randint(0, 50, (9,), generator=gen)
    out = checks.poison(torch.empty(9, 64, dtype=torch.bfloat16))
    assert emb().embedding(ids, table, out=out) is out
    checks.assert_equal(out, F.embedding(ids, table))


@pytest.mark.parametrize("bad", [50, 51, -1])
def test_native_out_of_range_names_the_id(bad):
    table = torch.randn(50, 8)
    ids = torch.tensor([3, bad, 7])
    with pytest.raises(IndexError, match=rf"token id {bad} at position 1 .*50 ids"):
        emb().embedding_native(ids, table)
    with pytest.raises(IndexError, match=rf"token id {bad}"):
        emb().embedding(ids, table)


def test_native_rejects_bad_arguments():
    with pytest.raises(ValueError, match="int64"):
        emb().embedding_native(torch.tensor([1, 2], dtype=torch.int32), torch.randn(5, 4))
    with pytest.raises(ValueError, match=r"\[vocab, hidden\]"):
        emb().embedding_native(torch.tensor([1]), torch.randn(5))
