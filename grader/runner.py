"""Run one stage's tests in child processes, with a time limit per test, and score them.

A child runs pytest with grader.pytest_plugin, which first writes the list of tests it
collected, before any test runs: that list is fixed, and the score divides by it. Then it
writes one line per test as it ends. When a test hangs past the limit, or crashes the child (a
segfault, a CUDA error that poisons the context), that test is recorded as such and a fresh
child runs exactly the tests that have not reported yet. A collected test that never reports
scores zero and is named. Nothing a student's code does can stop the rest of the stage from
being graded or shrink what its score is divided by.
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
from grader import children
from grader.pytest_plugin import RESULTS_ENV, SELECT_ENV, STICKY_EXIT

NOT_GRADED = "not graded"
DEFAULT_TEST_TIMEOUT = 300.0


@dataclass
class TestResult:
    name: str
    # passed | failed | todo | not_graded | skipped | timeout | crashed | not_run
    outcome: str
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
    unwritten: list[str] = field(default_factory=list)   # the student's parts still a TODO

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


def hidden_dirs(stage: manifest.Stage, extra_tests: Path | None) -> list[Path]:
    """An instructor's hidden tests for `stage`: DIR/NN_name/ and DIR/NN/, each that exists
    (absolute: the tests run with the course as their working folder)."""
    if not extra_tests:
        return []
    return [d.absolute() for d in (extra_tests / stage.dir, extra_tests / stage.id)
            if d.is_dir()]


def test_paths(stage: manifest.Stage, extra_tests: Path | None) -> list[Path]:
    """The stage's tests, plus an instructor's hidden tests for it."""
    return [stage.tests_dir(), *hidden_dirs(stage, extra_tests)]


def hidden_counts(stage: manifest.Stage, extra_tests: Path | None,
                  names: list[str]) -> list[tuple[Path, int]]:
    """(folder, how many of the tests `names` come from it) for each hidden folder of `stage`.
    A test's name begins with its folder's path in the course, else with the folder's own
    name (grader.pytest_plugin.result_name)."""
    out = []
    for folder in hidden_dirs(stage, extra_tests):
        prefix = (f"{folder.relative_to(manifest.ROOT).as_posix()}/"
                  if folder.is_relative_to(manifest.ROOT) else f"{folder.name}/")
        out.append((folder, sum(n.startswith(prefix) for n in names)))
    return out


def unmatched_hidden(extra_tests: Path) -> list[Path]:
    """The folders of an instructor's hidden tests that name no stage (02_tokenise/, 2/):
    no stage's tests include them."""
    names = {n for s in manifest.stages() for n in (s.dir, s.id)}
    return sorted(d for d in extra_tests.iterdir() if d.is_dir() and d.name not in names
                  and not d.name.startswith((".", "__")))


@dataclass(frozen=True)
class Deadline:
    """When a run of tests must end (time.monotonic()) and why, as its tests will read: a
    test still running then is killed, and those not started are not run (both `timeout`)."""
    at: float
    why: str     # "the student's time for this stage's tests (900 s, --student-timeout) ran out"

    def passed(self) -> bool:
        return time.monotonic() >= self.at


class Listener:
    """Hears a grading run as it happens (the command line prints it live); does nothing here."""

    def stage_started(self, result: StageResult) -> None: ...

    def build_started(self) -> None: ...

    def build_done(self, status: str) -> None: ...

    def collected(self, tests: list[TestResult]) -> None: ...

    def test_done(self, test: TestResult) -> None: ...


def run_stage(stage: manifest.Stage, student_ids: list[str], student_root: Path | None = None,
              extra_tests: Path | None = None, test_timeout: float = DEFAULT_TEST_TIMEOUT,
              verbose: bool = False, listener: Listener | None = None) -> StageResult:
    listener = listener or Listener()
    result = StageResult(stage, selection_label(student_ids, student_root))
    if stage.id in student_ids:
        result.unwritten = unwritten_parts(stage, student_root)
    listener.stage_started(result)
    if any(p.endswith(".cu") for p in stage.parts):
        listener.build_started()
        result.build = build_kernels(stage, student_ids, student_root)
        listener.build_done(result.build)
    result.tests, result.errors = run_tests(test_paths(stage, extra_tests), student_ids,
                                            student_root, test_timeout, verbose,
                                            listener=listener)
    return result


def unwritten_parts(stage: manifest.Stage, student_root: Path | None) -> list[str]:
    """The student's parts of `stage` not written yet: missing, still the skeleton, or still
    returning or raising their TODO ("TODO stage NN: ..." as a string; a TODO comment left
    above written code does not count). Without a GPU nothing else tells an untouched kernel
    from a finished one: both are 'not graded'."""
    from grader import sync
    folder = (student_root or manifest.ROOT / "stages") / stage.dir
    out = []
    for part in stage.parts:
        try:
            text = (folder / part).read_text(errors="replace")
        except OSError:
            out.append(part)
            continue
        if f'"TODO stage {stage.id}' in text or text == sync.skeleton_text(
                (stage.solution_dir() / part).read_text(), stage.id, part):
            out.append(part)
    return out


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


class _Child:
    """What one pytest child process needs: the command line and the environment."""

    def __init__(self, paths: list[Path], env: dict[str, str], tmp: Path, verbose: bool,
                 pytest_args: tuple[str, ...]):
        self.env, self.tmp, self.verbose = env, tmp, verbose
        # --tb=line when quiet: the messages come from the plugin, and formatting long
        # tracebacks (a cached build error re-raised in every test) only costs time.
        self.cmd = [sys.executable, "-m", "pytest", *map(str, paths), *pytest_args,
                    "-p", "grader.pytest_plugin", "-p", "grader.pytest_setup",
                    "--rootdir", str(manifest.ROOT), "-c", str(manifest.ROOT / "pyproject.toml"),
                    "-q", "--no-header", "-rN", "-p", "no:cacheprovider",
                    "--continue-on-collection-errors", "--tb=short" if verbose else "--tb=line"]
        self.runs = 0

    def start(self, select: list[str] | None) -> tuple[subprocess.Popen, Path]:
        self.runs += 1
        results = self.tmp / f"results-{self.runs}.jsonl"
        env = {**self.env, RESULTS_ENV: str(results)}
        env.pop(SELECT_ENV, None)
        if select is not None:
            chosen = self.tmp / f"select-{self.runs}.txt"
            chosen.write_text("\n".join(select) + "\n")
            env[SELECT_ENV] = str(chosen)
        out = None if self.verbose else subprocess.DEVNULL
        proc = children.track(subprocess.Popen(self.cmd, env=env, cwd=manifest.ROOT, stdout=out,
                                               stderr=out, start_new_session=True))
        return proc, results


def run_tests(paths: list[Path], student_ids: list[str], student_root: Path | None = None,
              test_timeout: float = DEFAULT_TEST_TIMEOUT, verbose: bool = False,
              pytest_args: tuple[str, ...] = (), listener: Listener | None = None,
              deadline: Deadline | None = None) -> tuple[list[TestResult], list[str]]:
    """Collect the tests under `paths`, then run them in child processes until every one has a
    result (or the deadline has passed); return the results in collection order and any
    collection errors."""
    env = {**os.environ, **parts.selection_env(student_ids, student_root)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(manifest.ROOT), env.get("PYTHONPATH")]))
    # torch's OpenMP threads spin while they wait: on a small or loaded machine the spinning
    # takes the CPU the tests need (stage 11's soak: 42.7 s of CPU, 7.1 s with passive waits)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    run = _Run(listener or Listener())
    with tempfile.TemporaryDirectory(prefix="tinyvllm-grade-") as tmp:
        child = _Child(paths, env, Path(tmp), verbose, pytest_args)
        # The first child runs everything; it reports what it collected before any test runs,
        # and that list is fixed. Later children run exactly the tests not yet reported.
        select: list[str] | None = None
        why_stopped = ""
        while True:
            before = len(run.done)
            finished, why_stopped = _run_child(child, select, test_timeout, run, deadline)
            if run.collected is None:
                run.errors.append("pytest stopped before it had collected the tests "
                                  f"({why_stopped}); run with -v to see its output")
                return [], run.errors
            select = run.remaining()
            if finished or not select or len(run.done) == before or \
                    (deadline and deadline.passed()):
                break  # a child that finished, or ran nothing, would not do better again
        for name in run.remaining():
            if deadline and deadline.passed():
                run.record(TestResult(name, "timeout", f"not run: {deadline.why}",
                                      run.points[name]))
            else:
                run.record(TestResult(name, "not_run", "never reported a result"
                                      + (f" ({why_stopped})" if why_stopped else ""),
                                      run.points[name]))
        return [run.done[t.name] for t in run.collected], run.errors


class _Run:
    """The state of one grading run across its child processes."""

    def __init__(self, listener: Listener):
        self.listener = listener
        self.collected: list[TestResult] | None = None
        self.points: dict[str, float] = {}
        self.done: dict[str, TestResult] = {}
        self.errors: list[str] = []

    def set_collected(self, tests: list[dict]) -> None:
        if self.collected is None:  # only the first child's collection counts
            self.collected = [TestResult(t["test"], "not_run", points=t["points"]) for t in tests]
            self.points = {t.name: t.points for t in self.collected}
            self.listener.collected(self.collected)

    def remaining(self) -> list[str]:
        return [t.name for t in self.collected or [] if t.name not in self.done]

    def record(self, test: TestResult) -> None:
        if test.name in self.points:  # a test that was not collected first does not count
            self.done[test.name] = test
            self.listener.test_done(test)


def _run_child(child: _Child, select: list[str] | None, test_timeout: float, run: _Run,
               deadline: Deadline | None = None) -> tuple[bool, str]:
    """Run the selected tests (all when None) in one child; return (it finished normally,
    why it stopped)."""
    proc, results_file = child.start(select)
    running: tuple[str, float] | None = None
    offset = 0
    finished = False
    while True:
        code = proc.poll()
        offset, events = _read_events(results_file, offset)
        for ev in events:
            if ev["event"] == "collected":
                run.set_collected(ev["tests"])
            elif ev["event"] == "collect_error" and select is None:
                run.errors.append(f"could not collect {ev['test']}:\n{ev['message']}")
            elif ev["event"] == "start":
                running = (ev["test"], ev["time"])
            elif ev["event"] == "end":
                started = running[1] if running and running[0] == ev["test"] else ev["time"]
                run.record(_test_result(ev, ev["time"] - started))
                running = None
            elif ev["event"] == "finished":
                finished = True
        if code is not None:
            break
        too_long = running and time.time() - running[1] > test_timeout
        out_of_time = deadline and deadline.passed() and run.collected is not None
        if too_long or out_of_time:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if not running:
                return False, deadline.why
            why = (f"still running after {test_timeout:.0f} s: killed (an infinite loop? a "
                   "kernel that never returns?)" if too_long else
                   f"{deadline.why} while it ran: killed")
            run.record(TestResult(running[0], "timeout", why, run.points.get(running[0], 1.0),
                                  round(time.time() - running[1], 3)))
            return False, f"the test process was killed after {running[0]} timed out"
        time.sleep(0.1)
    if finished:
        return True, "it was collected, but the test run did not reach it"
    if running is None:
        if code == STICKY_EXIT:
            return False, "the CUDA context was left unusable"
        run.errors.append(f"pytest exited with status {code}{_signal_name(code)} before finishing")
        return False, f"pytest exited with status {code}{_signal_name(code)}"
    why = f"the test process died (exit status {code}{_signal_name(code)})"
    run.record(TestResult(running[0], "crashed", why, run.points.get(running[0], 1.0),
                          round(time.time() - running[1], 3)))
    return False, why


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
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    complete = data[: data.rfind(b"\n") + 1]
    events = [json.loads(line) for line in complete.decode().splitlines() if line.strip()]
    return offset + len(complete), events


def _test_result(ev: dict, seconds: float) -> TestResult:
    outcome = ev["outcome"]
    if outcome == "skipped" and ev["message"].startswith(NOT_GRADED):
        outcome = "not_graded"
    return TestResult(ev["test"], outcome, ev["message"], ev.get("points", 1.0), round(seconds, 3))
