"""A student's GPU tests: run with their kernels in a sandbox, a test at a time under watch.

GPU tests need the student's kernels in the process that launches them, so the student's
code and the tests share a process (unlike the CPU tests, judged apart). What the grader
still controls, from outside that process:

    time      each test has --timeout from the moment it is seen to start; the student's
              tests of the stage have --student-timeout together (what the CPU tests left of
              it: grade.py). A test past its limit is killed with its
              process (and, with bubblewrap, its PID namespace), which releases the GPU; the
              tests not yet run go on in a fresh process.
    crashes   a test that kills its process, or leaves the CUDA context unusable (the
              plugin ends the process after a sticky CUDA error), is `crashed`; the rest run
              in a fresh process, exactly the ones without a result (by node id).
    results   read defensively as they come: only tests of the course's list, known
              outcomes, at most 8 MiB per student; points always come from the course.
    the view  the course the process sees (with bubblewrap, a copy placed at the course's
              own path) has no reference kernel of the graded stage: a stub stands in, so
              neither an #include nor a runtime compile of it finds the solution.
    builds    the reference kernels of every other stage are compiled once per class run
              and copied into each student's build cache (each student compiles only their
              own kernel), so a student's first test is not a whole-course build.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from course import manifest
from grader import runner
from grader.classroom import sandbox
from grader.classroom.text import clean

if TYPE_CHECKING:   # grade.py imports this module
    from grader.classroom.grade import Settings

OUTCOMES = frozenset(("passed", "failed", "todo", "not_graded", "skipped", "timeout", "crashed"))
READ_LIMIT = 8 << 20
QUIET = 60.0    # seconds a process may go without starting a test (start-up: torch, CUDA)
STUB = ("// The reference of this part is not available while a student is graded "
        "(grader/classroom/gpu.py).\n")

_views: dict[tuple[str, str], Path] = {}
_objects: dict[tuple[str, str], list[Path]] = {}


def course_view(stage: manifest.Stage, workdir: Path) -> Path:
    """The course as the student's GPU process sees it. With bubblewrap: one read-only copy
    per class run and stage, without .git and the virtual environments, the graded stage's
    kernel sources stubbed, bound at the course's own path. Without bubblewrap nothing can be
    placed or hidden, so the view is the course itself (docs/instructors.md)."""
    if not sandbox.bwrap_path():
        return manifest.ROOT
    key = (stage.id, str(workdir))
    if key in _views:
        return _views[key]
    copy = workdir / f"course-{stage.id}"
    shutil.copytree(manifest.ROOT, copy, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".nox", ".venv", "__pycache__", "*.pyc", "*.so", "*.o", ".pytest_cache"))
    for part in stage.parts:
        if part.endswith((".cu", ".cpp")):
            (copy / "solutions" / stage.dir / part).write_text(STUB)
    for p in sandbox.python_paths():   # mount points for an interpreter inside the course
        if p.is_relative_to(manifest.ROOT) and p != manifest.ROOT:
            (copy / p.relative_to(manifest.ROOT)).mkdir(parents=True, exist_ok=True)
    from grader.classroom.submission import _publish
    _publish(copy)
    _views[key] = copy
    return copy


_PREBUILD = """\
import json, sys
from concurrent.futures import ThreadPoolExecutor
from course import build, parts
graded = set(sys.argv[1:])
sources = [s for s in parts.kernel_sources() if str(s) not in graded]
arch = build.archs()
with ThreadPoolExecutor(max_workers=8) as pool:
    objects = list(pool.map(lambda s: build.compile_object(s, arch), sources))
print("OBJECTS " + json.dumps([str(o) for o in objects]))
"""


def reference_objects(stage: manifest.Stage, workdir: Path, timeout: float) -> list[Path]:
    """The compiled reference kernels of every stage but the graded one's parts, as the
    student's process will look them up (same paths, so the same cache keys), built once per
    class run in the grader's own build cache (trusted code, no sandbox). [] if they do not
    build here: then each student builds them (slower, same grades)."""
    key = (stage.id, str(workdir))
    if key not in _objects:
        graded = [str(stage.solution_dir() / p) for p in stage.parts
                  if p.endswith((".cu", ".cpp"))]
        env = {**os.environ, "PYTHONPATH": str(manifest.ROOT), "TINYVLLM_STUDENT": ""}
        try:
            proc = subprocess.run([sys.executable, "-c", _PREBUILD, *graded], env=env,
                                  cwd=manifest.ROOT, capture_output=True, text=True,
                                  timeout=timeout)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("OBJECTS ")), "")
            _objects[key] = [Path(p) for p in json.loads(line[8:])] if line else []
            if not line:
                print(f"warning: the reference kernels do not build here; every student will "
                      f"build them:\n{(proc.stdout + proc.stderr)[-2000:]}", flush=True)
        except subprocess.TimeoutExpired:
            _objects[key] = []
    return _objects[key]


def seed_cache(objects: list[Path], cache: Path) -> None:
    """Copies (never links: the student's process may write its cache) of the reference
    objects in the student's build cache."""
    dest = cache / "build" / "obj"
    dest.mkdir(parents=True, exist_ok=True)
    for obj in objects:
        shutil.copyfile(obj, dest / obj.name)


class _Reader:
    """New complete lines of a results file the student's process can write, read with care."""

    def __init__(self, budget: list[int]):
        self.offset, self.partial, self.budget = 0, b"", budget

    def events(self, path: Path) -> list[dict]:
        if not path.exists() or self.budget[0] <= 0:
            return []
        with open(path, "rb") as f:
            f.seek(self.offset)
            data = f.read(self.budget[0])
        self.offset += len(data)
        self.budget[0] -= len(data)
        data = self.partial + data
        cut = data.rfind(b"\n") + 1
        lines, self.partial = data[:cut], data[cut:][-(1 << 20):]
        out = []
        for line in lines.decode("utf-8", errors="replace").splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict) and isinstance(ev.get("test"), str):
                out.append(ev)
        return out


def run_tests(stage: manifest.Stage, cases: list, student_root: Path, shared: Path,
              view: Path, env: dict[str, str], settings: Settings, marker: str = "gpu",
              paths: list[Path] | None = None,
              deadline: runner.Deadline | None = None) -> dict[str, runner.TestResult]:
    """Run `cases` (the course's GPU tests of `stage`) with the student's kernels, until the
    deadline (default: --student-timeout from now); return a result for each test that got
    one (a test without one scores zero, named missing). (`marker` and `paths` let the
    tests of this module watch CPU tests.)"""
    from grader.pytest_plugin import RESULTS_ENV, SELECT_ENV
    wanted = [c.name for c in cases]
    got: dict[str, runner.TestResult] = {}
    deadline = deadline or student_deadline(settings)
    budget = [READ_LIMIT]
    extra = [p for p in [settings.extra_tests] if p]
    mounts = sandbox.Mounts([student_root, *extra], [shared], [manifest.ROOT, *settings.hidden],
                            [(view, manifest.ROOT)] if view != manifest.ROOT else [])
    paths = [str(p) for p in paths or runner.test_paths(stage, settings.extra_tests)]
    argv = [sys.executable, "-m", "pytest", *paths, "-m", marker, "-p", "grader.pytest_plugin",
            "-p", "grader.pytest_setup", "--rootdir", str(manifest.ROOT), "-c",
            str(manifest.ROOT / "pyproject.toml"), "-q", "-p", "no:cacheprovider",
            "--basetemp", str(shared / "tmp"), "--tb=line"]
    runs = 0
    while True:
        remaining = [name for name in wanted if name not in got]
        if not remaining:
            break
        if deadline.passed():
            _out_of_time(remaining, got, deadline)
            break
        runs += 1
        select = shared / f"gpu-select-{runs}.txt"
        select.write_text("\n".join(remaining) + "\n")
        results = shared / f"gpu-results-{runs}.jsonl"
        run_env = {**env, RESULTS_ENV: str(results), SELECT_ENV: str(select)}
        before = len(got)
        with open(shared / f"gpu-output-{runs}.log", "wb") as log:
            proc = sandbox.popen(argv, mounts, shared, run_env, stdout=log,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            try:
                _watch(proc, results, set(remaining), got, settings, deadline, budget)
            finally:
                sandbox.kill(proc)
        if len(got) == before:
            break   # a fresh process would not get further
    return got


def student_deadline(settings: Settings) -> runner.Deadline:
    """--student-timeout from now: when all of one student's tests of a stage must end."""
    return runner.Deadline(time.monotonic() + settings.student_timeout,
                           f"the student's time for this stage's tests "
                           f"({settings.student_timeout:.0f} s, --student-timeout) ran out")


def _watch(proc, results: Path, wanted: set[str], got: dict, settings,
           deadline: runner.Deadline, budget: list[int]) -> None:
    """Follow one process until it ends or a limit ends it."""
    reader = _Reader(budget)
    running: tuple[str, float] | None = None
    quiet_since = time.monotonic()
    while True:
        code = proc.poll()
        for ev in reader.events(results):
            name = ev["test"]
            if name not in wanted or name in got:
                continue
            quiet_since = time.monotonic()
            if ev.get("event") == "start":
                running = (name, time.monotonic())
            elif ev.get("event") == "end":
                got[name] = _result(ev)
                if running and running[0] == name:
                    got[name].seconds = round(time.monotonic() - running[1], 3)
                running = None
        now = time.monotonic()
        if code is not None:
            if running:
                got[running[0]] = runner.TestResult(
                    running[0], "crashed", f"the test process died (exit status {code}): the "
                    "tests after it ran in a fresh process", seconds=round(now - running[1], 3))
            return
        if running and now - running[1] > settings.test_timeout:
            got[running[0]] = runner.TestResult(
                running[0], "timeout", f"still running after {settings.test_timeout:.0f} s: "
                "killed (an infinite loop? a kernel that never returns?); the tests after it "
                "ran in a fresh process", seconds=round(now - running[1], 3))
            return
        if deadline.passed():
            if running:
                got[running[0]] = runner.TestResult(
                    running[0], "timeout", f"{deadline.why} while it ran: killed",
                    seconds=round(now - running[1], 3))
            _out_of_time([n for n in wanted if n not in got], got, deadline)
            return
        if not running and now - quiet_since > max(settings.test_timeout, QUIET):
            return   # stuck outside any test (collection, teardown): a fresh process, if any
        time.sleep(0.1)


def _out_of_time(names: list[str], got: dict, deadline: runner.Deadline) -> None:
    for name in names:
        got[name] = runner.TestResult(name, "timeout", f"not run: {deadline.why}")


def _result(ev: dict) -> runner.TestResult:
    outcome = ev.get("outcome")
    message = str(ev.get("message", ""))
    if outcome == "skipped" and message.startswith(runner.NOT_GRADED):
        outcome = "not_graded"
    return runner.TestResult(ev["test"], outcome if outcome in OUTCOMES else "failed",
                             clean(message))
