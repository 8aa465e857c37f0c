"""An instructor's hidden tests (`--extra-tests DIR`), for the local grader and a class run:
a relative DIR works from any folder, DIR/NN/ and DIR/NN_name/ tests of one file and name stay
two tests in every report, each stage says what it added, and a folder of DIR that names no
stage is warned about."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from course import manifest
from grader import report, runner
from grader.classroom import collect

PASSES = "def test_same():\n    assert True\n"
FAILS = "def test_same():\n    assert False, 'the DIR/02 copy fails'\n"


def hidden_tests(tmp: Path) -> Path:
    """DIR/02_tokenize/ and DIR/02/ each with a test_h.py::test_same (one passes, one fails),
    and two folders that name no stage."""
    extra = tmp / "hidden"
    for folder, text in (("02_tokenize", PASSES), ("02", FAILS)):
        (extra / folder).mkdir(parents=True)
        (extra / folder / "test_h.py").write_text(text)
    (extra / "02_tokenise").mkdir()
    (extra / "2").mkdir()
    return extra


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """`grader 02 --solution --extra-tests hidden/`, run from the folder that holds hidden/
    (not the course), with its reports in a folder that does not exist yet."""
    tmp = tmp_path_factory.mktemp("local")
    hidden_tests(tmp)
    proc = subprocess.run(
        [sys.executable, "-m", "grader", "02", "--solution", "--extra-tests", "hidden/",
         "--json", "out/r.json", "--junit", "out/r.xml"], cwd=tmp, capture_output=True,
        text=True, env={**os.environ, "PYTHONPATH": str(manifest.ROOT)}, timeout=600)
    return tmp, proc


def test_a_relative_extra_tests_folder_is_found_from_any_folder(local_run):
    """The path reached pytest unresolved, which runs in the course's folder: no test ran
    ('Score: 0/100 (no tests ran)', even for the reference) and nothing said why."""
    tmp, proc = local_run
    assert "no tests ran" not in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((tmp / "out" / "r.json").read_text())
    hidden = {t["name"]: t["outcome"] for t in data["tests"] if "test_h.py" in t["name"]}
    assert len(hidden) == 2, f"the hidden tests did not run:\n{proc.stdout[-2000:]}"


def test_same_named_hidden_tests_in_both_folders_stay_apart(local_run):
    """Both folders' test_h.py::test_same had the name 'test_h.py::test_same': one result
    overwrote the other, so the table said one passed while the score counted both failed."""
    tmp, proc = local_run
    data = json.loads((tmp / "out" / "r.json").read_text())
    hidden = {t["name"]: t["outcome"] for t in data["tests"] if "test_h.py" in t["name"]}
    assert hidden == {"02_tokenize/test_h.py::test_same": "passed",
                      "02/test_h.py::test_same": "failed"}, hidden
    failed = [t["name"] for t in data["tests"] if t["outcome"] != "passed"]
    assert failed == ["02/test_h.py::test_same"], "only the DIR/02 copy fails"
    weight = sum(t["points"] for t in data["tests"])
    assert data["score"] == round(100 * (weight - 1) / weight, 1), "scored as the table says"
    assert "02/test_h.py::test_same" in proc.stdout and \
        "02_tokenize/test_h.py::test_same" in proc.stdout, "the table names both"
    cases = ET.parse(tmp / "out" / "r.xml").getroot().iter("testcase")
    junit = {c.get("name"): c.find("failure") is not None for c in cases
             if "test_h.py" in c.get("name")}
    assert junit == {"02_tokenize/test_h.py::test_same": False,
                     "02/test_h.py::test_same": True}, junit


def test_the_hidden_tests_are_confirmed_and_strays_warned_about(local_run):
    tmp, proc = local_run
    hidden = (tmp / "hidden").resolve()
    assert (f"stage 02: +2 hidden tests: 1 from {hidden}/02_tokenize, 1 from {hidden}/02"
            in proc.stdout), proc.stdout[:2000]
    warning = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warning) == 1 and "02_tokenise/, 2/ name no stage" in warning[0], proc.stderr


def test_the_hidden_line_says_where_and_how_many(tmp_path):
    stage = manifest.find("02")
    extra = tmp_path / "hidden"
    (extra / "02_tokenize").mkdir(parents=True)
    names = ["stages/02_tokenize/tests/test_stopping.py::test_eos",
             "02_tokenize/test_h.py::test_a", "02_tokenize/sub/test_h.py::test_b"]
    assert report.hidden_line(stage, extra, names) == \
        f"stage 02: +2 hidden tests from {extra}/02_tokenize"
    assert report.hidden_line(manifest.find("05"), extra, names) == \
        f"stage 05: no hidden tests (no {extra}/05_rope/ or {extra}/05/)"
    assert report.unmatched_warning(extra) == "", "02_tokenize/ names a stage"
    (extra / "__pycache__").mkdir()
    (extra / ".git").mkdir()
    assert report.unmatched_warning(extra) == "", "caches and dot-folders are no stage's"
    (extra / "2").mkdir()
    assert "2/ names no stage" in report.unmatched_warning(extra)


def test_class_collects_same_named_hidden_tests_as_two(tmp_path):
    extra = hidden_tests(tmp_path)
    cases, problem = collect.collect(runner.test_paths(manifest.find("02"), extra))
    names = [c.name for c in cases if "test_h.py" in c.name]
    assert problem == "" and sorted(names) == ["02/test_h.py::test_same",
                                               "02_tokenize/test_h.py::test_same"], names


@pytest.fixture
def no_grading(monkeypatch):
    """The class command up to grading: each (student, stage) the grader would grade is
    recorded with its test list, and scores 0."""
    from grader.classroom import grade
    graded: list[tuple[str, list[str]]] = []

    def fake(student, stage, cases, settings, workdir):
        graded.append((student.name, [c.name for c in cases]))
        return runner.StageResult(stage, "x", [runner.TestResult(c.name, "failed")
                                               for c in cases]), []
    monkeypatch.setattr(grade, "grade_stage", fake)
    return graded


def test_class_takes_a_relative_extra_tests_folder(tmp_path, monkeypatch, capsys, no_grading):
    """`class SUB --extra-tests hidden/` from the folder that holds hidden/ failed with exit 2,
    blaming 'the course's tests of stage 02' for 'file or directory not found'. (Its reports
    go to folders that do not exist yet: they are made.)"""
    from grader import __main__ as grader_cli
    hidden_tests(tmp_path)
    (tmp_path / "subs" / "alice").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert grader_cli.main(["class", "subs", "--stages", "02", "--extra-tests", "hidden/",
                            "--csv", "reports/g.csv", "--progress", "state/p.jsonl"]) == 0, \
        capsys.readouterr().err
    out, err = capsys.readouterr()
    assert (tmp_path / "reports" / "g.csv").is_file() and (tmp_path / "state" / "p.jsonl").is_file()
    hidden = (tmp_path / "hidden").resolve()
    assert f"stage 02: +2 hidden tests: 1 from {hidden}/02_tokenize, 1 from {hidden}/02" in out
    assert "02_tokenise/, 2/ name no stage" in err
    [(student, names)] = no_grading
    assert {"02/test_h.py::test_same", "02_tokenize/test_h.py::test_same"} <= set(names)


def test_hidden_tests_that_do_not_collect_are_named_as_such(tmp_path, monkeypatch, capsys,
                                                             no_grading):
    """The course's own tests collect: the error names the hidden folder, not the course."""
    from grader import __main__ as grader_cli
    extra = tmp_path / "hidden" / "02_tokenize"
    extra.mkdir(parents=True)
    (extra / "test_broken.py").write_text("def test_x(:\n    pass\n")
    (tmp_path / "subs" / "alice").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert grader_cli.main(["class", "subs", "--stages", "02", "--extra-tests", "hidden"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: the hidden tests in {extra.resolve()} (stage 02) do not "
                          "collect"), err[:500]
    assert "course's tests" not in err and no_grading == []
