"""The mutation suite's own machinery (grader/mutate.py, grader/mutants.py), cheaply: every
stage's mutant list still fits its reference, automatic mutants stay inside the SOLUTION
regions, and one listed mistake is killed and named while one equivalent mutant survives
(one child process running stage 11's quick tests twice). The whole suite is
`python3 -m grader mutants NN`: minutes per stage, too slow for CI."""
from __future__ import annotations

import ast

import pytest

from course import manifest
from grader import mutants, mutate

STAGES = [s for s in manifest.stages() if s.ready and mutate.list_file(s).exists()]


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.id)
def test_every_listed_mistake_applies_to_the_reference(stage):
    listed = mutate.listed(stage)   # MutantListError when a pattern no longer occurs once
    assert listed, f"{mutate.list_file(stage)} lists no mistake"
    for m in listed:
        assert m.text != (stage.solution_dir() / m.file).read_text(), f"{m.id} changes nothing"
        if m.file.endswith(".py"):
            ast.parse(m.text)
    ids = set(mutate.equivalents(stage))
    auto = {m.id for m in mutate.automatic(stage)}
    assert ids <= auto, f"equivalent mutants that no longer exist: {sorted(ids - auto)}"


def test_automatic_mutants_change_only_solution_regions():
    stage = manifest.find("11")
    for m in mutate.automatic(stage):
        ref = (stage.solution_dir() / m.file).read_text()
        inside = {i for a, b in mutate.regions(ref) for i in range(a, b + 1)}
        old, new = ref.splitlines(), m.text.splitlines()
        first = next(i for i, (x, y) in enumerate(zip(old, new)) if x != y) + 1
        assert first in inside, f"{m.id} changes line {first}, outside a SOLUTION region"


def test_a_listed_mistake_is_killed_and_named_and_an_equivalent_survives():
    stage = manifest.find("11")
    mistake = next(m for m in mutate.listed(stage) if "empty chunk" in m.id)
    equivalent = next(m for m in mutate.automatic(stage)
                      if m.id in mutate.equivalents(stage) and "budget" in m.id)
    got = mutants.run_quick(stage, [mistake, equivalent], mutants.quick_tests(stage), 60)
    assert got[mistake.id].killed and got[mistake.id].named, (
        f"'{mistake.id}' should fail a test that names it: {got[mistake.id]}")
    assert not got[equivalent.id].killed, (
        f"'{equivalent.id}' is listed as equivalent, yet a test failed: {got[equivalent.id]}")
