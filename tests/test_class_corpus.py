"""Class grading against a hostile class (grader/classroom/).

One class run of stage 02: an honest student (the reference parts), an untouched skeleton,
and hostile submissions from tests/hostile/cases.py, with hidden tests. CI grades a
representative slice; TINYVLLM_FULL_CORPUS=1 (nox -s class-corpus) grades every case.
"""
from __future__ import annotations

import csv
import hashlib
import json
import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from course import manifest
from grader import environment
from grader.classroom import sandbox
from tests.hostile import cases

FULL = os.environ.get("TINYVLLM_FULL_CORPUS") == "1"
CHOSEN = [name for name in (sorted(cases.CHEATS) if FULL else cases.CI_SUBSET)
          if sandbox.bwrap_path() or name not in cases.SANDBOX_ONLY]
# Limits for runs of honest and untouched submissions only (nothing that hangs): far above
# any honest test on a loaded 2-core machine (stage 11's soak test, the slowest, ran 93 s
# through the judge there with a load average of 12), so that no pass depends on the
# machine's speed. The hostile corpus keeps --timeout 90: its hanging cases cost 4 x that.
HONEST_LIMITS = ("--timeout", "900", "--student-timeout", "3600")
HIDDEN_TEST = '''
from course import parts

def test_hidden_eos():
    stop = parts.load("02", "stopping").StopChecker({2}, [], max_tokens=5)
    assert stop.check(2, "hi") == "eos"
'''


def _digest(*paths: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        files = sorted(p.rglob("*")) if p.is_dir() else [p]
        for f in files:
            if f.is_file() and "__pycache__" not in f.parts:
                h.update(str(f).encode() + f.read_bytes())
    return h.hexdigest()


def grade_class(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(manifest.ROOT)}
    return subprocess.run([sys.executable, "-m", "grader", "class", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=3000)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("class")
    subs, extra = tmp / "submissions", tmp / "hidden"
    (extra / "02_tokenize").mkdir(parents=True)
    (extra / "02_tokenize" / "test_hidden.py").write_text(HIDDEN_TEST)
    ctx = cases.Context(manifest.ROOT, extra, subs / "aaa_honest")
    cases.honest(subs / "aaa_honest", ctx)
    cases.skeleton(subs / "aaa_skeleton", ctx)
    for name in CHOSEN:
        cases.CHEATS[name](subs / name, ctx)
    guarded = [manifest.ROOT / "conftest.py", manifest.find("02").tests_dir(), extra,
               subs / "aaa_honest"]
    before = _digest(*guarded)
    out = tmp / "grades"
    proc = grade_class(str(subs), "--stages", "02", "--csv", f"{out}.csv", "--json",
                       f"{out}.json", "--junit", f"{out}.xml", "--similarity",
                       f"{out}.similar.json", "--extra-tests", str(extra), "--timeout", "90",
                       "--progress", str(tmp / "progress.jsonl"), cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    scores = {row["student"]: float(row["stage_02"])
              for row in csv.DictReader(open(f"{out}.csv"))}
    yield {"tmp": tmp, "out": out, "proc": proc, "scores": scores, "subs": subs,
           "records": {r["student"]: r for r in json.loads(Path(f"{out}.json").read_text())},
           "untouched": _digest(*guarded) == before}
    _kill_marked_sleeps()


def _kill_marked_sleeps() -> None:
    """End this run's `sleep SLEEP_MARK` processes, after the tests have looked for them:
    without the sandbox they outlive grading (the documented gap), and would linger for 70
    minutes."""
    for pid in cases.marked_sleeps(cases.SLEEP_MARK):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass    # gone already, or not ours to end


def test_honest_scores_full_and_skeleton_zero(graded):
    assert graded["scores"]["aaa_honest"] == 100, graded["records"]["aaa_honest"]["tests"]
    assert graded["scores"]["aaa_skeleton"] == 0


@pytest.mark.parametrize("name", CHOSEN)
def test_no_cheat_scores(graded, name):
    record = graded["records"][name]
    passed = [t["name"] for t in record["tests"] if t["outcome"] == "passed"]
    assert graded["scores"][name] == 0, f"{name} passed {passed}"
    # the hidden test and every course test are in the list whatever the child did
    assert len(record["tests"]) == len(graded["records"]["aaa_honest"]["tests"])
    assert any("test_hidden.py" in t["name"] for t in record["tests"])


@pytest.mark.skipif(not sandbox.bwrap_path(), reason="without bubblewrap student code can "
                    "write what the grader's user can (docs/instructors.md)")
def test_course_hidden_tests_and_classmates_untouched(graded):
    assert graded["untouched"]


@pytest.mark.skipif(not sandbox.bwrap_path(), reason="without bubblewrap a process can leave "
                    "its session (docs/instructors.md)")
def test_no_process_outlives_grading(graded):
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert f"sleep {cases.SLEEP_MARK}" not in ps


def test_invalid_and_rejected_files_are_reported(graded):
    """Each case with a rejected file that this run graded (CI grades a subset; the unit test
    of submission.read_parts covers every case) names it under `problems`."""
    records = graded["records"]
    expected = {"plain_file": ["plain file"], "symlink_part": ["symbolic link", "bytecode"],
                "pyc_beside_skeleton": ["bytecode"]}
    here = [name for name in expected if name in records]
    assert here, "none of the cases with rejected files was graded: nothing checked"
    for name in here:
        for needle in expected[name]:
            assert needle in " ".join(records[name]["problems"]), (name, records[name]["problems"])


def test_csv_json_and_junit_reports(graded):
    """One row, one record and one JUnit suite per student, in name order."""
    out, names = graded["out"], sorted(graded["records"])
    rows = Path(f"{out}.csv").read_text().splitlines()
    assert rows[0] == "student,stage_02,total"
    assert rows[1:3] == ["aaa_honest,100,100", "aaa_skeleton,0,0"]
    assert [r.split(",")[0] for r in rows[1:]] == names
    assert graded["records"]["aaa_honest"]["full_marks"] is True
    assert graded["records"]["aaa_skeleton"]["full_marks"] is False
    suites = ET.parse(f"{out}.xml").getroot().findall("testsuite")
    assert [s.get("name") for s in suites] == [f"{n} stage 02" for n in names]


def test_reports_are_valid_and_small(graded):
    out = graded["out"]
    ET.parse(f"{out}.xml")                      # control characters would make this fail
    assert Path(f"{out}.json").stat().st_size < 4 << 20
    for record in graded["records"].values():
        for t in record["tests"]:
            assert len(t["message"].encode()) <= 4000


def test_similarity_flags_a_copy_of_the_reference(graded):
    pairs = json.loads(Path(f"{graded['out']}.similar.json").read_text())
    assert any(p["student"] == "aaa_honest" and p["other"] == "reference" and p["share"] > 0.95
               for p in pairs), pairs
    assert not any(p["student"] == "aaa_skeleton" for p in pairs)


def test_resume_grades_only_what_is_missing(graded):
    """A run killed mid-way: the last record lost, a half-written line left behind."""
    tmp, progress = graded["tmp"], graded["tmp"] / "progress.jsonl"
    lines = progress.read_text().splitlines()
    kept = [ln for ln in lines if json.loads(ln).get("student") != "plain_file"]   # header kept
    progress.write_text("\n".join(kept) + '\n{"student": "half-writ')
    proc = grade_class(str(graded["subs"]), "--stages", "02", "--csv", str(tmp / "again.csv"),
                       "--progress", str(progress), "--resume", "--timeout", "90",
                       "--extra-tests", str(tmp / "hidden"), cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-2000:]
    graded_now = [ln for ln in proc.stdout.splitlines()
                  if " stage 02: " in ln and not ln.startswith("similar:")]
    assert [ln.split()[0] for ln in graded_now] == ["plain_file"]
    assert (tmp / "again.csv").read_text() == Path(f"{graded['out']}.csv").read_text()


def test_stage_01_through_the_judge(tmp_path):
    """Stage 01's CPU tests pass through the worker for the reference parts (zero-copy views
    of the mapped file, tied embeddings, exceptions with two bases) and fail for the skeleton;
    GPU tests are 'not graded' here, never passed."""
    subs = tmp_path / "submissions"
    ctx = cases.Context(manifest.ROOT, tmp_path / "hidden", subs / "honest")
    cases.honest(subs / "honest", ctx, "01")
    cases.skeleton(subs / "skeleton", ctx, "01")
    proc = grade_class(str(subs), "--stages", "01", "--json", str(tmp_path / "g.json"),
                       *HONEST_LIMITS, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = {r["student"]: r for r in json.loads((tmp_path / "g.json").read_text())}
    gpu_free = "not_graded" if not environment.has_cuda() else "passed"
    for t in records["honest"]["tests"]:
        assert t["outcome"] in ("passed", gpu_free), t
    assert any("test_tensors_are_views_of_the_mapped_file" in t["name"] and
               t["outcome"] == "passed" for t in records["honest"]["tests"])
    assert not any(t["outcome"] == "passed" for t in records["skeleton"]["tests"])


@pytest.mark.parametrize("stage_id", ["08", "11", "13"])
def test_stages_through_the_judge(tmp_path, stage_id):
    """Stages that hand more than tensors back and forth: the student's model tells the test
    its torch.device (08); the test's allocator, called back by the student's scheduler, sets
    the student's seq.block_table (11); stage 11's reference Sequences are changed by the
    student's BlockManager and checked by the test, and a test patches a lambda into the
    student's module (13). The reference passes every CPU test, as in a local run; the
    skeleton passes none."""
    subs = tmp_path / "submissions"
    ctx = cases.Context(manifest.ROOT, tmp_path / "hidden", subs / "honest")
    cases.honest(subs / "honest", ctx, stage_id)
    cases.skeleton(subs / "skeleton", ctx, stage_id)
    proc = grade_class(str(subs), "--stages", stage_id, "--json", str(tmp_path / "g.json"),
                       *HONEST_LIMITS, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = {r["student"]: r for r in json.loads((tmp_path / "g.json").read_text())}
    gpu_free = "not_graded" if not environment.has_cuda() else "passed"
    for t in records["honest"]["tests"]:
        assert t["outcome"] in ("passed", gpu_free), t
    assert sum(t["outcome"] == "passed" for t in records["honest"]["tests"]) >= 9
    assert not any(t["outcome"] == "passed" for t in records["skeleton"]["tests"])
    assert any(t["outcome"] == "todo" for t in records["skeleton"]["tests"]), \
        "an unwritten part reads TODO through the judge, as in a local run"
