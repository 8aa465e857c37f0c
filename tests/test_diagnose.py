"""course/testing/diagnose.py: failures name the shape, the wrong rows and the pattern."""
from __future__ import annotations

import pytest
import torch

from course.testing import diagnose


def _expected() -> torch.Tensor:
    return torch.arange(1, 4 * 3 * 8 + 1, dtype=torch.float32).reshape(4, 3, 8) / 10


def _message(got, expected, **kw) -> str:
    with pytest.raises(AssertionError) as info:
        diagnose.assert_close(got, expected, row_names=("sequence", "head"), **kw)
    return str(info.value)


def test_right_output_passes():
    e = _expected()
    diagnose.assert_close(e.clone(), e, shape="batch 4")


def test_shape_and_wrong_rows_are_named():
    e = _expected()
    got = e.clone()
    got[2, 1, 5] += 1
    text = _message(got, e, what="attention", shape=diagnose.shape(batch=4, head_dim=8,
                                                                     partitions=None))
    assert "attention [batch 4, head dim 8]" in text
    assert "wrong rows: sequence 2 head 1 (1 of 12)" in text


def test_whole_rows_nan():
    e = _expected()
    got = e.clone()
    got[1] = float("nan")
    assert diagnose.WHOLE_ROWS_NAN in _message(got, e)


def test_some_nan_and_zero_rows():
    e = _expected()
    got = e.clone()
    got[0, 0, 3] = float("nan")
    assert diagnose.SOME_NAN in _message(got, e)
    got = e.clone()
    got[3, 2] = 0
    assert diagnose.WHOLE_ROWS_ZERO in _message(got, e)


def test_variant_is_named_only_when_it_differs_from_the_right_output():
    e = _expected()
    wrong = e.clone()
    wrong[:, :, 0] = 7
    text = _message(wrong.clone(), e, variants=[diagnose.Variant(None, "not computable"),
                                                diagnose.Variant(e, "the right one"),
                                                diagnose.Variant(wrong, "column 0 is 7")])
    assert "likely cause: column 0 is 7" in text and "the right one" not in text


def test_suspect_rows():
    e = _expected()
    long_rows = torch.zeros(4, 3, dtype=torch.bool)
    long_rows[1:3] = True
    got = e.clone()
    got[1:3, :, 2] -= 1
    suspects = [diagnose.Suspect(long_rows, "sequences longer than one partition", "merge")]
    assert "only sequences longer than one partition are wrong: merge" in _message(
        got, e, suspects=suspects)
    got[0, 0, 0] += 1   # a row outside the suspect: not that pattern, the hint instead
    assert "likely cause: fallback" in _message(got, e, suspects=suspects, hint="fallback")
