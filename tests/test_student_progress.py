"""A student's progress through the course: `grade all` (the course map), `grade next`, and
`reset` (the skeleton back, the student's files kept in a timestamped backup)."""
from __future__ import annotations

import dataclasses
import shutil

import pytest

from course import manifest
from grader import __main__ as cli
from grader import reset, runner, sync

READY = [s for s in manifest.stages() if s.ready]


def fake_run_stage(outcomes: dict[str, list[str]], graded: list[str]):
    """A stand-in for runner.run_stage: stage id -> test outcomes, recording the order graded."""
    def run(stage, student_ids, student_root=None, extra_tests=None, test_timeout=0.0,
            verbose=False, listener=None):
        graded.append(stage.id)
        tests = [runner.TestResult(f"t.py::test_{i}", o, "TODO stage x: y" if o == "todo" else "")
                 for i, o in enumerate(outcomes.get(stage.id, ["passed"]))]
        return runner.StageResult(stage, "x", tests)
    return run


def test_grade_all_prints_the_course_map(monkeypatch, capsys):
    graded: list[str] = []
    second = READY[1].id
    stages = manifest.stages()   # and one planned stage, as when the course grows
    planned = dataclasses.replace(stages[-1], id="99", dir="99_future", status="planned")
    monkeypatch.setattr(manifest, "stages", lambda: (*stages, planned))
    monkeypatch.setattr(runner, "run_stage",
                        fake_run_stage({second: ["passed", "todo"]}, graded))
    assert cli.main(["all"]) == 1
    out = capsys.readouterr().out
    assert graded == [s.id for s in READY]
    assert "Course map" in out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("  ") and ln.split()}
    assert "100/100 full marks" in lines[READY[0].dir]
    assert "50/100" in lines[READY[1].dir] and "full marks" not in lines[READY[1].dir]
    assert "planned" in lines[planned.dir], "a planned stage is on the map, not graded"
    assert f"total: {100 * len(READY) - 50:g}/{100 * len(READY)}" in out


def test_grade_next_stops_at_the_first_stage_not_done(monkeypatch, capsys):
    graded: list[str] = []
    # The first stage's kernel tests are not graded (no GPU): done here, not a stop.
    monkeypatch.setattr(runner, "run_stage", fake_run_stage(
        {READY[0].id: ["passed", "not_graded"], READY[2].id: ["failed"]}, graded))
    assert cli.main(["next"]) == 1
    out = capsys.readouterr().out
    assert graded == [s.id for s in READY[:3]]
    assert f"Next: stage {READY[2].id}" in out and f"stages/{READY[2].dir}/README.md" in out


def test_reset_backs_up_then_restores_the_skeleton(tmp_path, capsys):
    stage = manifest.find("02")
    root = tmp_path / "stages"
    shutil.copytree(stage.skeleton_dir(), root / stage.dir)
    work = root / stage.dir / "stopping.py"
    work.write_text("# my work\n")
    (root / stage.dir / "detokenizer.py").unlink()
    assert reset.main(["02", "--student-root", str(root)]) == 0
    out = capsys.readouterr().out
    backups = list((tmp_path / "backups").iterdir())
    assert len(backups) == 1 and backups[0].name.startswith("02_tokenize-")
    assert (backups[0] / "stopping.py").read_text() == "# my work\n"
    for part in stage.parts:
        expected = sync.skeleton_text((stage.solution_dir() / part).read_text(), stage.id, part)
        assert (root / stage.dir / part).read_text() == expected
    assert "restored the skeleton of stopping.py" in out
    assert "restored the skeleton of detokenizer.py" in out
    # Nothing left to reset: no second, empty backup.
    assert reset.main(["02", "--student-root", str(root)]) == 0
    assert "nothing to reset" in capsys.readouterr().out
    assert len(list((tmp_path / "backups").iterdir())) == 1


def test_reset_of_an_unknown_stage_is_one_line(capsys):
    assert cli.main(["reset", "42"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: there is no stage '42'") and len(err.splitlines()) == 1


@pytest.mark.parametrize("word", ["all", "next"])
def test_course_commands_are_in_the_help(word, capsys):
    assert cli.main(["--help"]) == 0
    assert f"python3 -m grader {word}" in capsys.readouterr().out
