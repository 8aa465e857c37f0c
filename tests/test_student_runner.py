"""The grader's runner as a student meets it: a test list fixed before the tests run, a sticky CUDA
error that reads CRASHED while the rest still run, exact deselection, never-reported tests named
and scored zero, short messages for build errors, TODOs that name the part they need, likely
causes of launch errors, and results that arrive while the run goes on.

Everything here runs without a GPU: a sticky CUDA error is a RuntimeError with the same text.
"""
from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest

from course import manifest
from grader import pytest_plugin, report, runner

STICKY = textwrap.dedent('''\
    import os, time, pytest
    from course import build

    @pytest.mark.parametrize("n", [1, 10])
    def test_x(n):
        pass

    def test_a():
        pass

    def test_misaligned():
        raise RuntimeError("CUDA error: misaligned address")

    def test_a_b():
        # its name extends test_a's: deselecting test_a must not drop it
        pass

    def test_launch():
        raise RuntimeError("rmsnorm: CUDA error: invalid argument")

    def test_build_error():
        raise build.BuildError("x.cu(3): error: expected an expression\\n" * 40)

    @pytest.mark.points(2)
    def test_slow_last():
        time.sleep(1.5)

    # Collected under one name, run under another: it never reports a result.
    @pytest.mark.parametrize("where", ["run" if os.environ.get("TINYVLLM_SELECT") else "collect"])
    def test_renamed(where):
        pass
    ''')


class Recorder(runner.Listener):
    def __init__(self):
        self.collected_names: list[str] = []
        self.done: list[tuple[str, float]] = []

    def collected(self, tests):
        self.collected_names = [t.name for t in tests]

    def test_done(self, test):
        self.done.append((test.name, time.time()))


@pytest.fixture(scope="module")
def sticky_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("sticky")
    (d / "test_sticky.py").write_text(STICKY)
    recorder = Recorder()
    tests, errors = runner.run_tests([d], [], test_timeout=30, listener=recorder)
    return tests, errors, recorder, time.time()


def by_name(tests):
    return {t.name.split("::")[-1]: t for t in tests}


def test_sticky_cuda_error_is_crashed_and_the_rest_run(sticky_run):
    tests, errors, _, _ = sticky_run
    got = by_name(tests)
    assert errors == []
    assert {k: t.outcome for k, t in got.items()} == {
        "test_x[1]": "passed", "test_x[10]": "passed", "test_a": "passed",
        "test_misaligned": "crashed", "test_a_b": "passed", "test_launch": "failed",
        "test_build_error": "failed", "test_slow_last": "passed",
        "test_renamed[collect]": "not_run"}
    crash = got["test_misaligned"].message
    assert "misaligned address" in crash and "CUDA context unusable" in crash
    assert "likely cause: a vector load" in crash


def test_score_divides_by_the_collected_list(sticky_run):
    tests, _, recorder, _ = sticky_run
    assert recorder.collected_names == [t.name for t in tests]
    never = by_name(tests)["test_renamed[collect]"]
    assert never.message.startswith("never reported a result")
    result = runner.StageResult(manifest.find("02"), "x", tests)
    # passed: x[1], x[10], a, a_b (1 each) and slow_last (2) = 6 of 10 points
    assert result.weight == 10 and result.score == 60
    text = report.render(result)
    assert "test_renamed[collect]" in text and "NOT RUN" in text


def test_results_arrive_while_the_run_goes_on(sticky_run):
    _, _, recorder, finished = sticky_run
    first = dict(recorder.done)
    assert len(recorder.done) == 9
    # test_slow_last sleeps 1.5 s; the tests before it were reported before it finished
    assert first[next(n for n in first if n.endswith("test_a"))] < finished - 1.0


def test_a_cached_build_error_is_one_short_line_printed_once(sticky_run):
    tests, _, _, _ = sticky_run
    failed = by_name(tests)["test_build_error"]
    assert failed.message == pytest_plugin.BUILD_FAILED
    result = runner.StageResult(manifest.find("02"), "x", tests)
    assert report.render(result).count("expected an expression") == 0
    assert report.render(result).count(pytest_plugin.BUILD_FAILED) == 1


def test_launch_error_names_its_likely_cause(sticky_run):
    tests, _, _, _ = sticky_run
    message = by_name(tests)["test_launch"].message
    assert "likely cause: a launch configuration the GPU refuses: a grid rounded down to zero" \
        in message
    line = report.test_lines(by_name(tests)["test_launch"], 30)
    assert len(line) == 2 and "likely cause" in line[1]
    assert pytest_plugin.likely_cause("ValueError: x must be contiguous") == ""
    assert pytest_plugin.likely_cause("CUDA error: invalid argument\n  likely cause: mine") == ""


def test_same_failure_details_are_printed_once():
    stage = manifest.find("02")
    tests = [runner.TestResult(f"t.py::test_{i}", "failed", "AssertionError: same\n  where: 0")
             for i in range(5)]
    text = report.render(runner.StageResult(stage, "x", tests))
    assert text.count("where: 0") == 1
    assert "--- t.py::test_0 (and 4 more with the same failure)" in text


def test_todo_of_another_part_names_that_part(tmp_path):
    """A student's checkpoint tests that run into config.py's TODO say 'needs config.py'."""
    stage = tmp_path / "01_load"
    (stage / "tests").mkdir(parents=True)
    (stage / "config.py").write_text(
        'def load_config():\n    raise NotImplementedError("TODO stage 01: read it (about 3 lines)")\n')
    caller = textwrap.dedent(f'''\
        import importlib.util
        def load():
            spec = importlib.util.spec_from_file_location("cfg", {str(stage / "config.py")!r})
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod
        def test_it():
            load().load_config()
        ''')
    (stage / "tests" / "test_checkpoint.py").write_text(caller)
    (stage / "tests" / "test_config.py").write_text(caller)
    tests, errors = runner.run_tests([stage / "tests"], [], test_timeout=30)
    got = {Path(t.name.split("::")[0]).name: t for t in tests}
    assert errors == [] and {t.outcome for t in tests} == {"todo"}
    assert got["test_checkpoint.py"].message.splitlines()[0] == "needs config.py (TODO)"
    assert "TODO stage 01: read it" in got["test_checkpoint.py"].message
    assert got["test_config.py"].message == "TODO stage 01: read it (about 3 lines)"


def test_a_child_that_dies_before_any_test_names_every_test(tmp_path):
    """The first child crashes in test_one; the restarted child dies at import: test_two is
    named and scores zero, nothing is silently dropped."""
    (tmp_path / "test_dies.py").write_text(textwrap.dedent('''\
        import os, signal
        if os.environ.get("TINYVLLM_SELECT"):
            os._exit(3)
        def test_one(): os.kill(os.getpid(), signal.SIGSEGV)
        def test_two(): pass
        '''))
    tests, errors = runner.run_tests([tmp_path], [], test_timeout=30)
    assert [t.outcome for t in tests] == ["crashed", "not_run"]
    assert "exited with status 3" in tests[1].message
    assert any("exited with status 3" in e for e in errors)


def test_stopping_the_grader_stops_its_test_processes(tmp_path):
    """Test processes run in sessions of their own (so a timeout can kill all they started),
    out of reach of Ctrl-C: when the grader is stopped (SIGTERM, as `timeout` does, or
    SIGINT) the one still running a test must end with it, not go on holding the GPU."""
    import os
    import signal
    import subprocess
    import sys
    pid_file = tmp_path / "pid"
    (tmp_path / "test_slow.py").write_text(textwrap.dedent(f'''\
        import os, time
        def test_slow():
            open({str(pid_file)!r}, "w").write(str(os.getpid()))
            time.sleep(120)
        '''))
    # Ctrl-C's handler, as a grader started from a terminal has it: a process started in the
    # background by a shell without job control (`cmd &` in a script) inherits SIGINT ignored,
    # and this test may run under one.
    for sig in (signal.SIGTERM, signal.SIGINT):
        pid_file.unlink(missing_ok=True)
        grader = subprocess.Popen(
            [sys.executable, "-c", "import signal, sys\nfrom grader import children, runner\n"
             "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
             "children.install()\n"
             "runner.run_tests([__import__('pathlib').Path(sys.argv[1])], "
             "[], test_timeout=300)", str(tmp_path)],
            cwd=manifest.ROOT, env={**os.environ, "PYTHONPATH": str(manifest.ROOT)})
        deadline = time.time() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.time() < deadline and grader.poll() is None, "the test never started"
            time.sleep(0.1)
        child = int(pid_file.read_text())
        grader.send_signal(sig)
        grader.wait(timeout=30)
        deadline = time.time() + 10
        while True:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            # a zombie whose parent has gone is reaped by init; still running is the failure
            assert time.time() < deadline, (
                f"the test process {child} still runs after the grader got {sig.name}")
            time.sleep(0.1)
