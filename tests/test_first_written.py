"""course.ops.FirstWritten: a two-part stage runs its fast kernel once written, else the simple."""
import pytest

from course.ops import FirstWritten


def test_a_todo_fast_kernel_hands_over_to_the_simple_one_once(capsys):
    calls = []

    def fast(x):
        calls.append("fast")
        raise NotImplementedError("TODO stage 14: the fast kernel")

    def simple(x):
        calls.append("simple")
        return x + 1

    kernel = FirstWritten("paged attention", fast, simple)
    assert [kernel(1), kernel(2)] == [2, 3]
    assert calls == ["fast", "simple", "simple"], "the fast kernel's TODO is found out once"
    assert "TODO stage 14" in capsys.readouterr().err, "the hand-over is said, not silent"


def test_a_written_fast_kernel_runs_and_the_simple_one_never_does():
    def simple(x):
        raise AssertionError("the simple kernel ran although the fast one is written")

    assert FirstWritten("gemv", lambda x: x * 2, simple)(4) == 8


@pytest.mark.parametrize("error", [NotImplementedError("bf16 only"), RuntimeError("CUDA")])
def test_other_errors_are_not_a_reason_to_switch(error):
    def fast(x):
        raise error

    with pytest.raises(type(error)):
        FirstWritten("gemv", fast, lambda x: x)(1)


def test_the_last_kernels_todo_reaches_the_caller():
    def only(x):
        raise NotImplementedError("TODO stage 06: the simple GEMV")

    with pytest.raises(NotImplementedError, match="TODO stage 06"):
        FirstWritten("gemv", only)(1)
