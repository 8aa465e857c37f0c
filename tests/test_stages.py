"""Every solution passes its stage's tests; every skeleton fails them with TODO messages.

This grades each available stage twice through the real grader (child processes and all):
once with the reference everywhere, once with the student's (= the skeleton's) parts.
On a machine without a GPU the kernel tests are 'not graded', never passed.
"""
from __future__ import annotations

import pytest

from course import manifest
from grader import runner

READY = [s for s in manifest.stages() if s.ready]


def _skip_if_nothing_ran(result: runner.StageResult) -> None:
    """A GPU-only stage on a CPU machine: every test 'not graded'. That is not a pass."""
    if all(t.outcome == "not_graded" for t in result.tests):
        pytest.skip(f"not graded: every test of stage {result.stage.id} needs a CUDA device")


@pytest.mark.parametrize("stage", READY, ids=lambda s: s.dir)
def test_solution_passes(stage):
    result = runner.run_stage(stage, [])
    assert not result.errors, "\n".join(result.errors)
    assert result.tests, f"stage {stage.id} has no tests"
    _skip_if_nothing_ran(result)
    bad = [t for t in result.tests if t.outcome not in ("passed", "not_graded")]
    assert not bad, "the reference solution must pass every test:\n" + "\n".join(
        f"{t.name}: {t.outcome}\n{t.message}" for t in bad)


@pytest.mark.parametrize("stage", READY, ids=lambda s: s.dir)
def test_skeleton_fails_with_todo(stage):
    result = runner.run_stage(stage, [stage.id])
    assert not result.errors, "\n".join(result.errors)
    assert result.score == 0, f"the skeleton of stage {stage.id} scored {result.score}"
    passed = [t.name for t in result.tests if t.outcome == "passed"]
    assert not passed, f"tests that pass on the bare skeleton grade nothing: {passed}"
    wrong = [t for t in result.tests if t.outcome not in ("todo", "not_graded")]
    assert not wrong, "a skeleton must fail with 'TODO stage NN: ...', not crash:\n" + "\n".join(
        f"{t.name}: {t.outcome}\n{t.message}" for t in wrong)
    _skip_if_nothing_ran(result)
    ran = [t for t in result.tests if t.outcome == "todo"]
    other = [t.name for t in ran if f"TODO stage {stage.id}" not in t.message]
    assert not other, f"TODOs of other stages fired; only stage {stage.id} is the student's: {other}"
