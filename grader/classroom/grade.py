"""Grade one student's stage: compile check, judged tests, GPU tests, score from the course.

    CPU tests   run by the judge (judge.py) in a pytest process with no student code; the
                student's parts run in a sandboxed worker (harness.py) and only answer calls.
    GPU tests   need the student's kernels in the process that launches them, so they run
                with the student's code in a sandbox (only on a machine with a CUDA device;
                elsewhere they are 'not graded'). Their outcomes come from that process and
                are only as trustworthy as it is: see docs/instructors.md.
    Kernels     the student's .cu parts are compiled in the sandbox under a time limit
                (a FIFO or /dev/zero #include ends as a timeout, not as a hung class).

The list of tests and their points come from the course (collect.py), never from a child;
a test with no result scores zero and is named.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from course import manifest
from grader import runner
from grader.classroom import sandbox, submission
from grader.classroom.collect import Case
from grader.classroom.judge import CONFIG_ENV
from grader.classroom.text import clean

OUTCOMES = frozenset(("passed", "failed", "todo", "not_graded", "skipped", "timeout", "crashed"))


@dataclass
class Settings:
    extra_tests: Path | None = None
    test_timeout: float = 120.0
    compile_timeout: float = 180.0
    verbose: bool = False
    hidden: list[Path] = field(default_factory=list)   # never visible to student code


def grade_stage(student: submission.Student, stage: manifest.Stage, cases: list[Case],
                settings: Settings, workdir: Path) -> tuple[runner.StageResult, list[str]]:
    """The student's result for `stage` and what was wrong with their files."""
    result = runner.StageResult(stage, f"student parts of stage {stage.id}, graded in "
                                       f"isolation ({sandbox.mode().split(':')[0]})")
    if student.invalid:
        result.errors.append(student.invalid)
        result.tests = [runner.TestResult(c.name, "not_run", "invalid submission", c.points)
                        for c in cases]
        return result, [student.invalid]
    found = submission.read_parts(student, stage)
    ws = Path(tempfile.mkdtemp(prefix=f"{stage.id}-", dir=workdir))
    os.chmod(ws, 0o755)
    try:
        student_root = submission.write_student(ws / "student", stage, found.files)
        worker_root = submission.write_worker_root(ws / "course", stage)
        shared = ws / "shared"
        shared.mkdir(mode=0o777)
        if any(p.endswith(".cu") for p in stage.parts):
            result.build = compile_parts(stage, student_root, worker_root, shared, settings)
        judged = _judged(stage, [c for c in cases if not c.gpu], student_root, worker_root,
                         shared, settings, ws)
        gpu = {c.name: runner.TestResult(c.name, "not_graded", runner.NOT_GRADED +
                                         ": no CUDA device", c.points)
               for c in cases if c.gpu}
        if gpu and _has_cuda():
            gpu.update(_in_sandbox(stage, [c for c in cases if c.gpu], student_root, shared,
                                   settings, ws))
        merged = {**judged, **gpu}
        result.tests = [_trusted(merged.get(c.name), c) for c in cases]
    except Exception as e:   # one student's trouble never stops the class
        result.errors.append(clean(f"grading failed: {type(e).__name__}: {e}"))
    finally:
        remove(ws)
    return result, found.problems


def _trusted(got: runner.TestResult | None, case: Case) -> runner.TestResult:
    """The child's outcome for a test in the course's list, with the course's points."""
    if got is None:
        return runner.TestResult(case.name, "missing", "no result: the test never reported "
                                 "(it scores zero)", case.points)
    outcome = got.outcome if got.outcome in OUTCOMES else "failed"
    return runner.TestResult(case.name, outcome, clean(got.message), case.points,
                             float(got.seconds) if isinstance(got.seconds, (int, float)) else 0)


def _judged(stage, cases, student_root, worker_root, shared, settings, ws) -> dict:
    if not cases:
        return {}
    config = {"student_stages": [stage.id], "student_root": str(student_root),
              "worker_root": str(worker_root), "shared": str(shared),
              "call_timeout": settings.test_timeout,
              "hidden": [str(p) for p in [manifest.ROOT, *settings.hidden]]}
    path = ws / "judge.json"
    path.write_text(json.dumps(config))
    saved = os.environ.get(CONFIG_ENV)
    os.environ[CONFIG_ENV] = str(path)
    try:
        tests, errors = runner.run_tests(
            runner.test_paths(stage, settings.extra_tests), [], None, settings.test_timeout,
            settings.verbose, pytest_args=("-m", "not gpu", "--basetemp", str(shared / "tmp"),
                                           "-p", "grader.classroom.judge"))
    finally:
        if saved is None:
            os.environ.pop(CONFIG_ENV, None)
        else:
            os.environ[CONFIG_ENV] = saved
    return {t.name: t for t in tests}


def compile_parts(stage, student_root: Path, worker_root: Path, shared: Path,
                  settings: Settings) -> str:
    """Compile the student's kernels in the sandbox, under a time limit."""
    script = ("import sys; from pathlib import Path; from course import build\n"
              "try:\n    arch = build.archs()\n"
              "except Exception as e:\n    print('not built here:', e); sys.exit(3)\n"
              "for src in sys.argv[1:]:\n    build.compile_object(Path(src), arch)\n")
    sources = [str(student_root / stage.dir / p) for p in stage.parts if p.endswith(".cu")
               and (student_root / stage.dir / p).exists()]
    if not sources:
        return "FAILED\nno kernel source to compile (see the submission problems)"
    env = _sandbox_env(worker_root, shared)
    mounts = sandbox.Mounts([worker_root, student_root], [shared],
                            [manifest.ROOT, *settings.hidden])
    code, output = sandbox.run([sys.executable, "-c", script, *sources], mounts, shared, env,
                               settings.compile_timeout)
    if code is None:
        return (f"FAILED\nthe compiler did not finish within {settings.compile_timeout:.0f} s "
                "(an #include of a FIFO or a device? an endless template?): killed")
    if code == 3 or "ToolchainMissing" in output:
        return clean("not built here (" + output.strip().splitlines()[-1][:300] + ")")
    return "ok" if code == 0 else clean("FAILED\n" + output, 6000)


def _sandbox_env(python_root: Path, shared: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "CUDA_HOME", "CUDA_PATH",
                                                        "TINYVLLM_CUDA_ARCHS", "LANG")}
    return {**env, "HOME": str(shared), "PYTHONPATH": str(python_root),
            "PYTHONDONTWRITEBYTECODE": "1", "TINYVLLM_CACHE": str(shared / ".cache")}


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _in_sandbox(stage, cases, student_root, shared, settings, ws) -> dict:
    """GPU tests: pytest with the student's kernels, in the sandbox, on a private copy of the
    course placed at the course's own path (so test ids match the course's list)."""
    from grader.pytest_plugin import RESULTS_ENV
    copy = ws / "tier1"
    shutil.copytree(manifest.ROOT, copy, symlinks=True,
                    ignore=shutil.ignore_patterns(".git", ".nox", "__pycache__", "*.pyc"))
    for p in sandbox.python_paths():   # mount points for an interpreter inside the course
        if p.is_relative_to(manifest.ROOT) and p != manifest.ROOT:
            (copy / p.relative_to(manifest.ROOT)).mkdir(parents=True, exist_ok=True)
    submission._publish(copy)
    out = shared / "results.jsonl"
    env = {**_sandbox_env(manifest.ROOT, shared), RESULTS_ENV: str(out),
           "TINYVLLM_STUDENT": stage.id, "TINYVLLM_STUDENT_ROOT": str(student_root)}
    if not sandbox.bwrap_path():
        env["PYTHONPATH"] = str(copy)   # no way to place the copy: ids of hidden tests may differ
    paths = [str(p) for p in runner.test_paths(stage, settings.extra_tests)]
    mounts = sandbox.Mounts([student_root, *(p for p in [settings.extra_tests] if p)], [shared],
                            [manifest.ROOT, *settings.hidden], [(copy, manifest.ROOT)])
    argv = [sys.executable, "-m", "pytest", *paths, "-m", "gpu", "-p", "grader.pytest_plugin",
            "-p", "grader.pytest_setup", "--rootdir", str(manifest.ROOT), "-c",
            str(manifest.ROOT / "pyproject.toml"), "-q", "-p", "no:cacheprovider",
            "--basetemp", str(shared / "tmp")]
    sandbox.run(argv, mounts, shared, env, settings.test_timeout * max(1, len(cases)))
    return read_results(out, {c.name for c in cases})


def read_results(path: Path, wanted: set[str], limit: int = 8 << 20) -> dict:
    """Outcomes a sandboxed child reported, read defensively: only tests of the course's
    list, only known outcomes, bad lines skipped, at most `limit` bytes read."""
    got: dict[str, runner.TestResult] = {}
    if not path.exists():
        return got
    with open(path, "rb") as f:
        data = f.read(limit)
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if not isinstance(ev, dict) or ev.get("event") != "end" or ev.get("test") not in wanted:
            continue
        outcome = ev.get("outcome")
        message = str(ev.get("message", ""))
        if outcome == "skipped" and message.startswith(runner.NOT_GRADED):
            outcome = "not_graded"
        got[ev["test"]] = runner.TestResult(ev["test"], outcome if outcome in OUTCOMES
                                            else "failed", clean(message))
    return got


def remove(tree: Path) -> None:
    """rmtree that also works on the read-only trees built here."""
    def retry(func, path, _):
        os.chmod(os.path.dirname(path), 0o755)
        func(path)
    for dirpath, dirnames, _ in os.walk(tree):
        os.chmod(dirpath, 0o755)
    shutil.rmtree(tree, onerror=retry)
