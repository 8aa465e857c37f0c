"""A class graded in shards (`grader class --shard I/N`) and joined (`grader merge`): the same
reports as one run, a shard killed and resumed, and shards that are not one class's run
refused. Grading itself is replaced by a stand-in whose outcome depends on the student's
name (what is tested here is the splitting, the progress files and the merge; the judge is
tested in test_class_corpus.py), so the 12-student class costs seconds."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from course import manifest
from grader import __main__ as grader_cli
from grader import runner
from grader.classroom import grade, shards
from tests.hostile import cases

STUDENTS = [f"student{i:02d}" for i in range(12)]
STAGE = manifest.find("02")
# two students of the skeletons (not i % 3 == 0) who share code, in different shards of 3
COPIERS = next((a, b) for a in STUDENTS[1:] for b in STUDENTS[1:]
               if STUDENTS.index(a) % 3 and STUDENTS.index(b) % 3
               and shards.shard_of(a, 3) < shards.shard_of(b, 3))


def _outcome(student: str, test: str) -> str:
    """A student's stand-in result for a test: fixed by the two names, varied across both."""
    return "passed" if hashlib.sha256(f"{student}/{test}".encode()).digest()[0] % 3 else "failed"


class Graded(list):
    """The names graded, in order; the run is killed when the kill_at-th begins (0: never)."""
    kill_at = 0


@pytest.fixture
def graded(monkeypatch) -> Graded:
    """grade_stage replaced by _outcome."""
    names = Graded()

    def fake(student, stage, stage_cases, settings, workdir):
        names.append(student.name)
        if len(names) == names.kill_at:
            raise KeyboardInterrupt     # the run killed half-way
        return runner.StageResult(stage, "x", [
            runner.TestResult(c.name, _outcome(student.name, c.name), "", c.points, 0.5)
            for c in stage_cases]), []
    monkeypatch.setattr(grade, "grade_stage", fake)
    return names


@pytest.fixture
def class_dir(tmp_path) -> Path:
    """12 students: skeletons, honest copies of the reference, and two who share code."""
    subs = tmp_path / "subs"
    ctx = cases.Context(manifest.ROOT, tmp_path / "hidden", subs / STUDENTS[0])
    for i, name in enumerate(STUDENTS):
        (cases.honest if i % 3 == 0 else cases.skeleton)(subs / name, ctx)
    a, b = COPIERS
    own = subs / a / STAGE.dir / "stopping.py"
    own.write_text(own.read_text() + "".join(f"\ndef helper_{i}(x):\n    return x * {i} + len("
                                              f"str(x))\n" for i in range(12)))
    shutil.copy(own, subs / b / STAGE.dir / "stopping.py")
    return subs


def _run(*argv: str) -> int:
    return grader_cli.main([str(a) for a in argv])


def _reports(prefix: Path) -> list[str]:
    return ["--csv", f"{prefix}.csv", "--json", f"{prefix}.json", "--junit", f"{prefix}.xml",
            "--similarity", f"{prefix}.similar.json"]


def _same_reports(a: Path, b: Path) -> None:
    """CSV, similarity and JUnit equal; JSON equal but for the seconds tests took."""
    for suffix in (".csv", ".similar.json", ".xml"):
        assert Path(f"{a}{suffix}").read_text() == Path(f"{b}{suffix}").read_text(), suffix

    def untimed(path: Path) -> list:
        records = json.loads(Path(f"{path}.json").read_text())
        for r in records:
            for t in r["tests"]:
                t.pop("seconds")
        return records
    assert untimed(a) == untimed(b)


def test_a_student_always_lands_in_the_same_shard():
    assert [shards.shard_of(s, 3) for s in STUDENTS] == [shards.shard_of(s, 3) for s in STUDENTS]
    counts = [sum(shards.shard_of(s, 3) == i for s in STUDENTS) for i in (1, 2, 3)]
    assert all(counts) and sum(counts) == 12, counts
    assert shards.parse(" 2/3 ") == (2, 3)
    for bad in ("0/3", "4/3", "3", "a/b", "1/0"):
        with pytest.raises(shards.ShardError, match="I/N"):
            shards.parse(bad)


def test_three_shards_merged_equal_one_run(tmp_path, class_dir, graded, capsys):
    stage = ["--stages", "02"]
    assert _run("class", class_dir, *stage, "--progress", tmp_path / "one.jsonl",
                *_reports(tmp_path / "one")) == 0
    assert sorted(graded) == STUDENTS
    graded.clear()
    parts = [tmp_path / f"shard-{i}.jsonl" for i in (1, 2, 3)]
    for i, progress in enumerate(parts, 1):
        assert _run("class", class_dir, *stage, "--shard", f"{i}/3", "--progress", progress) == 0
    assert sorted(graded) == STUDENTS, "each student graded once over the three shards"
    # a student added to SUBMISSIONS later changes no one else's shard
    (class_dir / "zz_late").mkdir()
    late = shards.shard_of("zz_late", 3)
    assert _run("class", class_dir, *stage, "--shard", f"{late}/3", "--progress",
                tmp_path / "late.jsonl") == 0
    kept = {s for s in STUDENTS if shards.shard_of(s, 3) == late}
    assert set(shards.load(tmp_path / "late.jsonl").students) == kept | {"zz_late"}
    capsys.readouterr()
    assert _run("merge", *parts, *_reports(tmp_path / "merged")) == 0
    assert "merged 3 shards: 12 students" in capsys.readouterr().out
    _same_reports(tmp_path / "one", tmp_path / "merged")
    similar = json.loads(Path(f"{tmp_path}/merged.similar.json").read_text())
    assert {(p["student"], p["other"]) for p in similar if p["other"] != "reference"} >= {
        COPIERS, COPIERS[::-1]}, "a pair across shards"


def test_a_killed_shard_resumes_and_merges(tmp_path, class_dir, graded, capsys):
    mine = [s for s in STUDENTS if shards.shard_of(s, 2) == 1]
    progress = tmp_path / "shard-1.jsonl"
    graded.kill_at = 3
    assert _run("class", class_dir, "--stages", "02", "--shard", "1/2", "--progress",
                progress) == 130
    assert _run("class", class_dir, "--stages", "02", "--shard", "2/2", "--progress",
                tmp_path / "shard-2.jsonl") == 0
    capsys.readouterr()
    assert _run("merge", progress, tmp_path / "shard-2.jsonl", "--csv", tmp_path / "m.csv") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot merge: ") and "did not finish" in err, err
    assert mine[2] in err and "--resume" in err
    graded.clear()
    graded.kill_at = 0
    assert _run("class", class_dir, "--stages", "02", "--shard", "1/2", "--progress", progress,
                "--resume") == 0
    assert graded == mine[2:], "the resumed shard grades only what it had not kept"
    assert _run("merge", progress, tmp_path / "shard-2.jsonl", "--csv", tmp_path / "m.csv") == 0
    rows = (tmp_path / "m.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == STUDENTS


def test_merge_refuses_shards_that_are_not_one_class(tmp_path, class_dir, graded, capsys):
    parts = [tmp_path / f"shard-{i}.jsonl" for i in (1, 2)]
    for i, progress in enumerate(parts, 1):
        assert _run("class", class_dir, "--stages", "02", "--shard", f"{i}/2", "--progress",
                    progress, "--timeout", "100") == 0
    lines = parts[1].read_text().splitlines()

    def refused(*files: Path) -> str:
        capsys.readouterr()
        assert _run("merge", *files, "--csv", tmp_path / "m.csv") == 2
        err = capsys.readouterr().err
        assert err.startswith("error: cannot merge: ") and err.count("\n") == 1, err
        return err

    assert "shard 2 of 2 missing" in refused(parts[0])
    assert "shard 1 given twice" in refused(parts[0], parts[0], parts[1])
    odd = tmp_path / "odd.jsonl"
    for change, expected in [
            (lambda b: b.update(timeout=60), "--timeout 100 in"),
            (lambda b: b.update(hidden_tests=2, tests="x"), "0 hidden tests in"),
            (lambda b: b.update(device="NVIDIA H100"), "graded on none in"),
            (lambda b: b.update(tests="other"), "stage 02's tests differ")]:
        record = json.loads(lines[1])
        change(record["basis"])
        odd.write_text("\n".join([lines[0], json.dumps(record), *lines[2:]]) + "\n")
        assert expected in refused(parts[0], odd)
    twice = json.loads(parts[0].read_text().splitlines()[1])
    odd.write_text("\n".join([*lines, json.dumps(twice)]) + "\n")
    assert f"graded in more than one shard: {twice['student']}" in refused(parts[0], odd)
    stray = tmp_path / "notes.txt"
    stray.write_text("x\n")
    assert "is not a shard's progress file" in refused(parts[0], stray)
    assert not (tmp_path / "m.csv").exists(), "a refused merge writes no report"


def test_a_shard_with_no_students_is_a_shard_all_the_same(tmp_path, class_dir, graded):
    """More shards than students (a Slurm array of 40 for 12): an empty shard grades no one,
    exits 0 and writes its header, so that merge finds every shard."""
    empty = next(i for i in range(1, 41) if all(shards.shard_of(s, 40) != i for s in STUDENTS))
    progress = tmp_path / "empty.jsonl"
    assert _run("class", class_dir, "--stages", "02", "--shard", f"{empty}/40", "--progress",
                progress) == 0
    assert not graded
    shard = shards.load(progress)
    assert (shard.index, shard.count, shard.students, shard.records) == (empty, 40, [], [])


def test_resuming_another_shards_file_is_refused(tmp_path, class_dir, graded, capsys):
    progress = tmp_path / "shard.jsonl"
    assert _run("class", class_dir, "--stages", "02", "--shard", "1/2", "--progress",
                progress) == 0
    before = progress.read_text()
    capsys.readouterr()
    assert _run("class", class_dir, "--stages", "02", "--shard", "2/2", "--progress", progress,
                "--resume") == 2
    assert capsys.readouterr().err == (f"error: --resume: {progress} holds shard 1/2, not 2/2: "
                                       "give each shard its own --progress file\n")
    assert progress.read_text() == before, "a refused --resume loses nothing"
