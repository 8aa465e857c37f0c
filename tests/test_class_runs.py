"""A class run as an instructor drives it: --resume against the grades' own tests and limits,
the student's time limit on the judged CPU tests, and Ctrl-C."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from course import manifest
from grader import runner
from grader.classroom import grade, judge, sandbox, submission
from grader.pytest_plugin import TimedOut
from tests.hostile import cases


@pytest.fixture
def no_grading(monkeypatch):
    """grade_stage replaced: each (student, stage) graded is recorded and scores 0."""
    graded: list[str] = []

    def fake(student, stage, stage_cases, settings, workdir):
        graded.append(student.name)
        return runner.StageResult(stage, "x", [runner.TestResult(c.name, "failed")
                                               for c in stage_cases]), []
    monkeypatch.setattr(grade, "grade_stage", fake)
    return graded


def test_resume_refuses_grades_made_against_other_tests_or_limits(tmp_path, capsys, no_grading):
    """The first run had hidden tests; the resumed one (--extra-tests forgotten, or another
    --timeout) kept the first run's grades and graded the rest without them: one report
    mixing two gradings. Now it is refused, saying what differs and what to do."""
    from grader import __main__ as grader_cli
    (tmp_path / "hidden" / "02").mkdir(parents=True)
    (tmp_path / "hidden" / "02" / "test_h.py").write_text("def test_h():\n    pass\n")
    for name in ("alice", "bob"):
        (tmp_path / "subs" / name).mkdir(parents=True)
    progress = tmp_path / "progress.jsonl"
    first = ["class", str(tmp_path / "subs"), "--stages", "02", "--progress", str(progress),
             "--extra-tests", str(tmp_path / "hidden")]
    assert grader_cli.main(first) == 0
    assert no_grading == ["alice", "bob"]
    lines = progress.read_text().splitlines()
    progress.write_text("\n".join(lines[:2]) + "\n")   # killed after alice
    capsys.readouterr()

    assert grader_cli.main(first[:-2] + ["--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --resume: "), err
    assert "stage 02's tests differ (1 hidden tests then, 0 now)" in err, err
    assert "without --resume" in err

    assert grader_cli.main(first + ["--resume", "--timeout", "60"]) == 2
    assert "--timeout 120 then, 60 now" in capsys.readouterr().err

    # graded on a machine without a GPU (GPU tests 'not graded'), resumed on one with it
    record = json.loads(lines[1])
    record["basis"]["cuda"] = not record["basis"]["cuda"]
    progress.write_text(json.dumps(record) + "\n")
    assert grader_cli.main(first + ["--resume"]) == 2
    assert "a CUDA device then" in capsys.readouterr().err

    record = json.loads(lines[1])
    del record["basis"]   # a progress file of a grader that did not record it
    progress.write_text(json.dumps(record) + "\n")
    assert grader_cli.main(first + ["--resume"]) == 2
    assert "do not say what they were graded against" in capsys.readouterr().err

    progress.write_text("\n".join(lines[:2]) + "\n")
    assert no_grading == ["alice", "bob"], "a refused --resume grades no one"
    assert grader_cli.main(first + ["--resume"]) == 0
    assert no_grading == ["alice", "bob", "bob"], "the same options: only bob is graded"
    assert progress.read_text().splitlines()[:2] == lines[:2]


TIMED = textwrap.dedent('''\
    import time
    from grader.pytest_plugin import TimedOut

    def test_a_first():
        pass

    def test_b_hangs():
        time.sleep(3600)

    def test_c_gave_up_waiting():
        raise TimedOut("the student's code did not answer within 5 s")
    ''')


def test_a_test_that_times_out_says_how_long_it_ran(tmp_path):
    """A killed test recorded 0.0 seconds; a call the judge gave up waiting on read
    `failed`, while the same hang, killed by the grader, read `timeout`."""
    (tmp_path / "test_timed.py").write_text(TIMED)
    tests, errors = runner.run_tests([tmp_path], [], test_timeout=3)
    got = {t.name.split("::")[-1]: t for t in tests}
    assert errors == [] and {k: t.outcome for k, t in got.items()} == {
        "test_a_first": "passed", "test_b_hangs": "timeout",
        "test_c_gave_up_waiting": "timeout"}
    assert 3 <= got["test_b_hangs"].seconds < 30, got["test_b_hangs"]
    assert got["test_c_gave_up_waiting"].message == \
        "the student's code did not answer within 5 s"


def test_the_students_time_ends_the_judged_tests(tmp_path):
    """The budget of all of a student's tests of a stage: the test running when it runs out
    is killed, the rest are not run; all read `timeout`, saying why."""
    (tmp_path / "test_timed.py").write_text(TIMED + "\n\ndef test_e_after():\n    pass\n")
    deadline = runner.Deadline(time.monotonic() + 8, "the student's time ran out (--x)")
    start = time.monotonic()
    tests, _ = runner.run_tests([tmp_path], [], test_timeout=600, deadline=deadline)
    got = {t.name.split("::")[-1]: t for t in tests}
    assert time.monotonic() - start < 60
    assert got["test_a_first"].outcome == "passed"
    assert got["test_b_hangs"].outcome == "timeout" and got["test_b_hangs"].seconds > 1
    assert got["test_b_hangs"].message == "the student's time ran out (--x) while it ran: killed"
    for name in ("test_c_gave_up_waiting", "test_e_after"):
        assert (got[name].outcome, got[name].message) == (
            "timeout", "not run: the student's time ran out (--x)"), got[name]


def test_a_worker_that_hangs_again_and_again_reads_timeout_to_the_end():
    """After its restarts, the worker is not started again: the tests left read the outcome
    of the hangs that stopped it, not `failed`."""
    conn = judge.Connection.__new__(judge.Connection)
    conn.deaths, conn.last_death = judge.MAX_RESTARTS + 1, judge.WorkerTimeout
    with pytest.raises(TimedOut, match="not restarting it again"):
        conn.start()
    conn.last_death = judge.WorkerFailed
    with pytest.raises(judge.WorkerFailed) as raised:
        conn.start()
    assert not isinstance(raised.value, TimedOut), "a crash is not a timeout"


def test_a_busy_loop_costs_the_student_timeout_not_every_tests_timeout(tmp_path):
    """A student's `while True: pass` cost --timeout for every CPU test (14 x 120 s for one
    student on stage 02): --student-timeout applied to GPU tests only."""
    ctx = cases.Context(manifest.ROOT, tmp_path / "hidden", tmp_path / "subs" / "x")
    cases.CHEATS["busy_loop"](tmp_path / "subs" / "loop", ctx)
    student = submission.students(tmp_path / "subs")[0]
    stage = manifest.find("02")
    from grader.classroom import collect
    stage_cases, _ = collect.collect(runner.test_paths(stage, None))
    start = time.monotonic()
    result, _ = grade.grade_stage(student, stage, stage_cases,
                                  grade.Settings(test_timeout=60, student_timeout=10), tmp_path)
    assert time.monotonic() - start < 60, "more than the student's 10 s and a few to start"
    timed_out = [t for t in result.tests if t.outcome == "timeout"]
    assert len(timed_out) > 5 and result.score == 0, result.counts()
    assert all("--student-timeout" in t.message for t in timed_out), \
        [t.message for t in timed_out]


BUSY = textwrap.dedent('''\
    import subprocess
    subprocess.Popen(["sleep", "{mark}"])
    while True:
        pass
    ''')


def test_ctrl_c_stops_a_class_run_in_one_line(tmp_path):
    """Ctrl-C printed a KeyboardInterrupt traceback. Now: one line saying what is kept and
    how to go on, exit 130, and the student's processes end with the run."""
    mark = f"4243.{os.getpid()}"
    folder = tmp_path / "subs" / "alice" / "02_tokenize"
    folder.mkdir(parents=True)
    for part in manifest.find("02").parts:
        (folder / part).write_text((manifest.find("02").skeleton_dir() / part).read_text())
    (folder / "stopping.py").write_text(BUSY.format(mark=mark))
    grader = subprocess.Popen(
        [sys.executable, "-c", "import signal, sys\n"
         "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
         "from grader.__main__ import main\nsys.exit(main(sys.argv[1:]))",
         "class", str(tmp_path / "subs"), "--stages", "02", "--timeout", "300"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(manifest.ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not cases.marked_sleeps(mark):
            assert time.time() < deadline and grader.poll() is None, "the student never ran"
            time.sleep(0.2)
        grader.send_signal(signal.SIGINT)
        out, err = grader.communicate(timeout=60)
        assert grader.returncode == 130, out + err
        assert "Traceback" not in err, err
        assert err.strip().splitlines() == [
            "interrupted: 0 of 1 students graded and kept in "
            f"{tmp_path / 'subs-progress.jsonl'}; run the same command with --resume to go on"]
        if sandbox.bwrap_path():   # without it a process can leave (docs/instructors.md)
            end = time.time() + 10
            while cases.marked_sleeps(mark):
                assert time.time() < end, "the student's process outlived the run"
                time.sleep(0.2)
    finally:
        grader.kill()
        for pid in cases.marked_sleeps(mark):   # this test's own `sleep MARK`, if it got out
            os.kill(pid, signal.SIGKILL)

