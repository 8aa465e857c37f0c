"""A student's progress through the course: `grade all` (the course map), `grade next`, and
`reset` (the skeleton back, the student's files kept in a timestamped backup)."""
from __future__ import annotations

import dataclasses
import shutil

import pytest

from course import manifest
from grader import __main__ as cli
from grader import report, reset, runner, sync

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


def test_an_untouched_part_is_unwritten_and_a_written_one_is_not(tmp_path):
    """What tells an untouched kernel from a finished one where neither can be tested: the
    skeleton itself, or a TODO still returned or raised (a TODO comment left above written
    code does not count)."""
    stage = manifest.find("03")
    assert runner.unwritten_parts(stage, None) == ["embedding.cu"], "the repo's skeleton"
    folder = tmp_path / stage.dir
    folder.mkdir()
    assert runner.unwritten_parts(stage, tmp_path) == ["embedding.cu"], "a missing part"
    solution = (stage.solution_dir() / "embedding.cu").read_text()
    (folder / "embedding.cu").write_text("// TODO stage 03: done, comment kept\n" + solution)
    assert runner.unwritten_parts(stage, tmp_path) == []
    (folder / "embedding.cu").write_text(solution + '\nconst char* f() { return "TODO stage 03: '
                                         'x (about 1 line)"; }\n')
    assert runner.unwritten_parts(stage, tmp_path) == ["embedding.cu"]


def test_an_untouched_gpu_only_stage_is_not_done_on_a_cpu(monkeypatch, capsys):
    """Without a GPU, stages with no CPU test (03, 04, ...) read '0/100 done here' while still
    the skeleton, and `next` went past them. A stage whose parts are not written is not done
    here, and the map says what this machine can do instead."""
    gpu_only = [s for s in READY if s.id in ("03", "04")]
    graded: list[str] = []

    def run(stage, student_ids, student_root=None, extra_tests=None, test_timeout=0.0,
            verbose=False, listener=None):
        graded.append(stage.id)
        outcome = "not_graded" if stage in gpu_only else "passed"
        result = runner.StageResult(stage, "x", [runner.TestResult("t.py::test_k", outcome)])
        result.unwritten = list(stage.parts) if stage in gpu_only else []
        return result
    monkeypatch.setattr(runner, "run_stage", run)
    assert cli.main(["all"]) == 1
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()
             if ln.startswith("  ") and ln.split()}
    for stage in gpu_only:
        assert "done here" not in lines[stage.dir] and "not started" in lines[stage.dir]
    assert "(GPU-only: its tests need a CUDA device)" in lines["03_embedding"]
    assert "(GPU-only: `grader emulate 04` runs your kernel on the CPU)" in lines["04_rmsnorm"]
    graded.clear()
    assert cli.main(["next"]) == 1
    out = capsys.readouterr().out
    assert graded[-1] == gpu_only[0].id and f"Next: stage {gpu_only[0].id}" in out
    assert "Not written yet: embedding.cu" in out


def test_a_stage_with_every_part_written_is_done_here():
    """The control: the same not-graded tests with the parts written read 'done here'."""
    stage = manifest.find("03")
    result = runner.StageResult(stage, "x", [runner.TestResult("t.py::test_k", "not_graded")])
    assert report.standing(result) == "done here"
    result.unwritten = ["embedding.cu"]
    assert report.standing(result) == "not started"
