"""Run one stage's tests in child processes, with a time limit per test, and score them.

A child runs pytest with grader.pytest_plugin, which writes one line per test as it ends.
When a test hangs past the limit, or crashes the child (a segfault, a CUDA error that poisons
the context), that test is recorded as such and the child is restarted on the tests that
have not run yet. Nothing a student's code does can stop the rest of the stage from being graded.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from course import manifest, parts
from grader.pytest_plugin import RESULTS_ENV, STICKY_EXIT

NOT_GRADED = "not graded"
DEFAULT_TEST_TIMEOUT = 300.0


@dataclass
class TestResult:
    name: str
    outcome: str          # passed | failed | todo | not_graded | skipped | timeout | crashed
    message: str = ""
    points: float = 1.0
    seconds: float = 0.0


@dataclass
class StageResult:
    stage: manifest.Stage
    selection: str
    tests: list[TestResult] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    build: str = ""       # the kernel build under this selection: "ok ...", "FAILED ..." or why not

    @property
    def weight(self) -> float:
        return sum(t.points for t in self.tests)

    @property
    def score(self) -> float:
        """Passed tests' share of the stage's points; a collection error scores zero."""
        if self.errors or not self.tests:
            return 0.0
        passed = sum(t.points for t in self.tests if t.outcome == "passed")
        return round(self.stage.points * passed / self.weight, 1)

    @property
    def full_marks(self) -> bool:
        return not self.errors and bool(self.tests) and all(t.outcome == "passed" for t in self.tests)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tests:
            out[t.outcome] = out.get(t.outcome, 0) + 1
        return out


def selection_label(student_ids: list[str], root: Path | None) -> str:
    if not student_ids:
        return "reference solutions only"
    where = root or manifest.ROOT / "stages"
    return f"student parts of stage(s) {', '.join(student_ids)} from {where}; reference for the rest"


def test_paths(stage: manifest.Stage, extra_tests: Path | None) -> list[Path]:
    """The stage's tests, plus an instructor's hidden tests for it (DIR/NN_name or DIR/NN)."""
    paths = [stage.tests_dir()]
    if extra_tests:
        for candidate in (extra_tests / stage.dir, extra_tests / stage.id):
            if candidate.is_dir():
                paths.append(candidate)
    return paths


def run_stage(stage: manifest.Stage, student_ids: list[str], student_root: Path | None = None,
              extra_tests: Path | None = None, test_timeout: float = DEFAULT_TEST_TIMEOUT,
              verbose: bool = False) -> StageResult:
    result = StageResult(stage, selection_label(student_ids, student_root))
    result.build = build_kernels(stage, student_ids, student_root)
    result.tests, result.errors = run_tests(test_paths(stage, extra_tests), student_ids,
                                            student_root, test_timeout, verbose)
    return result


def build_kernels(stage: manifest.Stage, student_ids: list[str],
                  student_root: Path | None) -> str:
    """Compile the kernels as the tests will see them, so a compile error is shown even on a
    machine without a GPU, where the kernel tests themselves are not graded."""
    if not any(p.endswith(".cu") for p in stage.parts):
        return ""
    from course import build
    saved = {k: os.environ.get(k) for k in (parts.STUDENT_ENV, parts.STUDENT_ROOT_ENV)}
    os.environ.update(parts.selection_env(student_ids, student_root))
    try:
        start = time.time()
        build.build(parts.kernel_sources())
        return f"ok ({time.time() - start:.1f} s)"
    except (build.ToolchainMissing, ImportError) as e:
        return f"not built here ({e})"
    except build.BuildError as e:
        return f"FAILED\n{e}"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_tests(paths: list[Path], student_ids: list[str], student_root: Path | None = None,
              test_timeout: float = DEFAULT_TEST_TIMEOUT, verbose: bool = False,
              pytest_args: tuple[str, ...] = ()) -> tuple[list[TestResult], list[str]]:
    """Run pytest on `paths` in child processes until every test has a result."""
    env = {**os.environ, **parts.selection_env(student_ids, student_root)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(manifest.ROOT), env.get("PYTHONPATH")]))
    done: dict[str, TestResult] = {}
    errors: list[str] = []
    with tempfile.TemporaryDirectory(prefix="tinyvllm-grade-") as tmp:
        for attempt in range(10_000):
            results_file = Path(tmp) / f"results-{attempt}.jsonl"
            env[RESULTS_ENV] = str(results_file)
            cmd = [sys.executable, "-m", "pytest", *map(str, paths), *pytest_args,
                   "-p", "grader.pytest_plugin", "-p", "grader.pytest_setup", "--rootdir", str(manifest.ROOT),
                   "-c", str(manifest.ROOT / "pyproject.toml"), "-q", "--no-header", "-rN",
                   "-p", "no:cacheprovider", *(f"--deselect={name}" for name in done)]
            finished, crashed_in = _run_child(cmd, env, results_file, test_timeout, verbose, done,
                                              errors)
            if finished or crashed_in is None:
                break
    return list(done.values()), errors


def _run_child(cmd, env, results_file: Path, test_timeout: float, verbose: bool,
               done: dict[str, TestResult], errors: list[str]) -> tuple[bool, str | None]:
    """Run one child; return (finished normally, name of the test it died in, if any)."""
    out = None if verbose else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, env=env, cwd=manifest.ROOT, stdout=out, stderr=out,
                            start_new_session=True)
    running: tuple[str, float] | None = None
    offset = 0
    finished = False
    while True:
        code = proc.poll()
        offset, events = _read_events(results_file, offset)
        for ev in events:
            if ev["event"] == "start":
                running = (ev["test"], ev["time"])
            elif ev["event"] == "end":
                started = running[1] if running and running[0] == ev["test"] else ev["time"]
                done[ev["test"]] = _test_result(ev, ev["time"] - started)
                running = None
            elif ev["event"] == "collect_error":
                errors.append(f"could not collect {ev['test']}:\n{ev['message']}")
            elif ev["event"] == "finished":
                finished = True
        if code is not None:
            break
        if running and time.time() - running[1] > test_timeout:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            done[running[0]] = TestResult(running[0], "timeout",
                                          f"still running after {test_timeout:.0f} s: killed "
                                          "(an infinite loop? a kernel that never returns?)")
            return False, running[0]
        time.sleep(0.2)
    if finished or running is None:
        if not finished and code not in (0, STICKY_EXIT):
            errors.append(f"pytest exited with status {code} before finishing")
        return finished, None
    why = ("the CUDA context was left unusable (see the message above)" if code == STICKY_EXIT
           else f"the test process died (exit status {code}{_signal_name(code)})")
    if running[0] not in done:
        done[running[0]] = TestResult(running[0], "crashed", why)
    return False, running[0]


def _signal_name(code: int) -> str:
    if code < 0:
        try:
            return f", {signal.Signals(-code).name}"
        except ValueError:
            return ""
    return ""


def _read_events(path: Path, offset: int) -> tuple[int, list[dict]]:
    if not path.exists():
        return offset, []
    with open(path) as f:
        f.seek(offset)
        data = f.read()
    complete = data[: data.rfind("\n") + 1]
    events = [json.loads(line) for line in complete.splitlines() if line.strip()]
    return offset + len(complete.encode()), events


def _test_result(ev: dict, seconds: float) -> TestResult:
    outcome = ev["outcome"]
    if outcome == "skipped" and ev["message"].startswith(NOT_GRADED):
        outcome = "not_graded"
    return TestResult(ev["test"], outcome, ev["message"], ev.get("points", 1.0), round(seconds, 3))
