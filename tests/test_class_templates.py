"""The templates instructors copy (grader/classroom/templates/): the workflows parse, and the
commands the Slurm scripts and the GitHub Actions matrix run grade a class here and merge it
into the reports one run writes (grading itself is the stand-in of test_class_shards.py:
what is tested is the templates' commands, not the judge)."""
from __future__ import annotations

import csv
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from course import manifest
from grader import __main__ as grader_cli
from grader import runner
from grader.classroom import autograde
from tests.test_class_shards import STUDENTS, class_dir, graded  # noqa: F401 (fixtures)

TEMPLATES = manifest.ROOT / "grader" / "classroom" / "templates"
GRADE_CLASS = TEMPLATES / "github-actions" / "grade-class.yml"
CLASSROOM = TEMPLATES / "classroom" / ".github" / "workflows" / "classroom.yml"
FAKE_GRADER = '''
import sys
sys.path[:0] = [{root!r}]
from grader import runner
from grader.classroom import grade
from grader.__main__ import main
from tests.test_class_shards import _outcome

def fake(student, stage, cases, settings, workdir):
    return runner.StageResult(stage, "x", [runner.TestResult(
        c.name, _outcome(student.name, c.name), "", c.points, 0.5) for c in cases]), []
grade.grade_stage = fake
assert sys.argv[1:3] == ["-m", "grader"], sys.argv
sys.exit(main(sys.argv[3:]))
'''


def _steps(path: Path, job: str) -> dict[str, dict]:
    steps = yaml.safe_load(path.read_text())["jobs"][job]["steps"]
    return {s.get("name", s.get("uses")): s for s in steps}


def _grader_args(command: str, values: dict[str, str]) -> list[str]:
    """The grader's arguments of a workflow's `nox -s grade -- ...` command, its expressions
    and variables replaced by `values` (an expression Actions would leave empty: removed)."""
    for expression, value in values.items():
        command = command.replace(expression, value)
    command = re.sub(r"\$\{\{.*?\}\}", "", command)
    argv = shlex.split(os.path.expandvars(command))
    return argv[argv.index("--") + 1:]


def test_the_workflows_parse_and_name_their_steps():
    workflow = yaml.safe_load(GRADE_CLASS.read_text())
    assert workflow["jobs"]["merge"]["needs"] == "grade"
    shards = workflow["jobs"]["grade"]["strategy"]["matrix"]["shard"]
    assert shards == list(range(1, workflow["env"]["SHARDS"] + 1))
    classroom = yaml.safe_load(CLASSROOM.read_text())
    steps = classroom["jobs"]["grade"]["steps"]
    ids = [s["id"] for s in steps if "id" in s]
    assert ids == [f"stage{s.id}" for s in manifest.stages() if s.ready]
    reporter = steps[-1]
    assert reporter["uses"].startswith("education/autograding-grading-reporter@")
    assert reporter["with"]["runners"].split(",") == ids
    assert set(reporter["env"]) == {f"{i.upper()}_RESULTS" for i in ids}


def test_the_actions_matrix_commands_grade_and_merge_a_class(tmp_path, class_dir, graded,
                                                             monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SUBMISSIONS", str(class_dir))
    workflow = yaml.safe_load(GRADE_CLASS.read_text())
    grade = _steps(GRADE_CLASS, "grade")["grade shard ${{ matrix.shard }}"]["run"]
    for shard in workflow["jobs"]["grade"]["strategy"]["matrix"]["shard"]:
        argv = _grader_args(grade, {"${{ matrix.shard }}": str(shard),
                                    "${{ env.SHARDS }}": str(workflow["env"]["SHARDS"]),
                                    "${{ inputs.stages && format('--stages {0}', "
                                    "inputs.stages) || '' }}": "--stages 02"})
        assert grader_cli.main(argv) == 0
    assert sorted(graded) == STUDENTS
    merge = _grader_args(_steps(GRADE_CLASS, "merge")["merge"]["run"], {})
    files = sorted(str(p) for p in (tmp_path / "out").glob("shard-*.jsonl"))
    assert len(files) == len(workflow["jobs"]["grade"]["strategy"]["matrix"]["shard"])
    merge = [a for a in merge if a != "out/shard-*.jsonl"]
    assert grader_cli.main([merge[0], *files, *merge[1:]]) == 0
    rows = list(csv.DictReader(open(tmp_path / "reports" / "grades.csv")))
    assert [r["student"] for r in rows] == STUDENTS
    assert (tmp_path / "reports" / "grades.xml").exists()


def test_the_slurm_scripts_grade_and_merge_a_class(tmp_path, class_dir):
    fake = tmp_path / "fake_grader.py"
    fake.write_text(FAKE_GRADER.format(root=str(manifest.ROOT)))
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {fake} "$@"\n')
    python.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "SUBMISSIONS": str(class_dir), "OUT": str(out), "STAGES": "02",
           "TINYVLLM_PYTHON": str(python), "SLURM_ARRAY_TASK_COUNT": "2"}
    for script in ("grade-shard.sbatch", "merge.sbatch", "submit.sh"):
        subprocess.run(["bash", "-n", TEMPLATES / "slurm" / script], check=True)
    for task in ("1", "2"):
        proc = subprocess.run(["bash", TEMPLATES / "slurm" / "grade-shard.sbatch"],
                              env={**env, "SLURM_ARRAY_TASK_ID": task}, cwd=tmp_path,
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    proc = subprocess.run(["bash", TEMPLATES / "slurm" / "merge.sbatch"], env=env, cwd=tmp_path,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = list(csv.DictReader(open(out / "grades.csv")))
    assert [r["student"] for r in rows] == STUDENTS


def test_classroom_points_are_the_stages_points_and_leave_gpu_tests_out():
    """Classroom's reporter scores a runner by the share of its tests that passed: a test
    worth p points is p entries, so that share is the stage's share of points; GPU tests that
    did not run are not in max_score (and not passed)."""
    stage = manifest.find("11")
    result = runner.StageResult(stage, "x", [
        runner.TestResult("a", "passed", "", 6.0), runner.TestResult("b", "failed", "no", 1.0),
        runner.TestResult("c", "passed", "", 1.0),
        runner.TestResult("g", "not_graded", "no CUDA device", 2.0)])
    got = autograde.classroom_result(result)
    passed = sum(t["status"] == "pass" for t in got["tests"])
    assert len(got["tests"]) == 8 and passed == 7 and got["status"] == "fail"
    assert got["max_score"] == 80.0   # 8 of the 10 points can be graded here
    assert passed / len(got["tests"]) * got["max_score"] == result.score == 70.0
