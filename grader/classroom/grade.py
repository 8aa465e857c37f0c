"""Grade one student's stage: compile check, judged tests, GPU tests, score from the course.

    CPU tests   run by the judge (judge.py) in a pytest process with no student code; the
                student's parts run in a sandboxed worker (harness.py) and only answer calls.
    GPU tests   need the student's kernels in the process that launches them, so they run
                with the student's code in a sandbox (only on a machine with a CUDA device;
                elsewhere they are 'not graded'), under watch (gpu.py): a time limit per
                test and per student, a fresh process after a crash or a sticky CUDA error.
                Their outcomes come from that process and are only as trustworthy as it is:
                see docs/instructors.md.
    Time        each test has --timeout (a call into the student's code that does not answer
                within it ends the test as `timeout`); all of a student's tests of a stage,
                CPU then GPU, have --student-timeout together: when it runs out, the test in
                progress is killed and those not started read `timeout` without running.
    Kernels     the student's .cu parts are compiled in the sandbox under a time limit (an
                include bomb ends as a timeout, not as a hung class); on a GPU machine the
                whole kernel library is built there, so the tests only load it. A build that
                fails or times out fails every GPU test without running it.

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
from grader import environment, runner
from grader.classroom import gpu as gpu_tests
from grader.classroom import sandbox, submission
from grader.classroom.collect import Case
from grader.classroom.judge import CONFIG_ENV
from grader.classroom.text import clean

OUTCOMES = gpu_tests.OUTCOMES
JUDGE_GRACE = 15.0   # seconds a judged test may run past --timeout (see _judged)


@dataclass
class Settings:
    extra_tests: Path | None = None
    test_timeout: float = 120.0
    compile_timeout: float = 180.0
    verbose: bool = False
    student_timeout: float = 900.0     # all of one student's tests (CPU and GPU) of one stage
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
        gpu_cases = [c for c in cases if c.gpu]
        on_gpu = bool(gpu_cases) and environment.has_cuda()
        view = gpu_tests.course_view(stage, workdir) if on_gpu else None
        if any(p.endswith(".cu") for p in stage.parts):
            if on_gpu:
                gpu_tests.seed_cache(gpu_tests.reference_objects(
                    stage, workdir, max(600.0, settings.compile_timeout)), shared / ".cache")
                result.build = compile_parts(stage, student_root, view, shared, settings,
                                             whole_library=True)
            else:
                result.build = compile_parts(stage, student_root, worker_root, shared, settings)
        deadline = gpu_tests.student_deadline(settings)
        judged, errors = _judged(stage, [c for c in cases if not c.gpu], student_root,
                                 worker_root, shared, settings, ws, deadline)
        # a test file that did not collect (a part that fails to import) is said, not only
        # its tests 'missing'; like any collection error it scores the stage zero
        result.errors += [clean(e) for e in errors]
        gpu = {c.name: runner.TestResult(c.name, "not_graded", runner.NOT_GRADED +
                                         ": no CUDA device", c.points) for c in gpu_cases}
        if on_gpu and result.build.startswith("FAILED"):
            gpu = {c.name: runner.TestResult(c.name, "failed", "not run: the kernels did not "
                                             "build (see the build)", c.points)
                   for c in gpu_cases}
        elif on_gpu:
            env = {**_sandbox_env(manifest.ROOT, shared), "TINYVLLM_STUDENT": stage.id,
                   "TINYVLLM_STUDENT_ROOT": str(student_root)}
            gpu.update(gpu_tests.run_tests(stage, gpu_cases, student_root, shared, view, env,
                                           settings, deadline=deadline))
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


def _judged(stage, cases, student_root, worker_root, shared, settings, ws, deadline
            ) -> tuple[dict[str, runner.TestResult], list[str]]:
    """The CPU tests' results, by name, judged against the student's parts in the worker;
    and the collection errors. A test may run JUDGE_GRACE seconds past --timeout, so that a
    call into the student's code that hangs is ended by the judge (at --timeout: the test
    reads `timeout`), which counts the worker's restarts, rather than with the judge's
    process, which would start the count again for every test."""
    if not cases:
        return {}, []
    config = {"student_stages": [stage.id], "student_root": str(student_root),
              "worker_root": str(worker_root), "shared": str(shared),
              "call_timeout": settings.test_timeout,
              "hidden": [str(p) for p in [manifest.ROOT, *settings.hidden]],
              "extra_tests": [str(settings.extra_tests)] if settings.extra_tests else []}
    path = ws / "judge.json"
    path.write_text(json.dumps(config))
    saved = os.environ.get(CONFIG_ENV)
    os.environ[CONFIG_ENV] = str(path)
    try:
        tests, errors = runner.run_tests(
            runner.test_paths(stage, settings.extra_tests), [], None,
            settings.test_timeout + JUDGE_GRACE, settings.verbose,
            pytest_args=("-m", "not gpu", "--basetemp", str(shared / "tmp"),
                         "-p", "grader.classroom.judge"), deadline=deadline)
    finally:
        if saved is None:
            os.environ.pop(CONFIG_ENV, None)
        else:
            os.environ[CONFIG_ENV] = saved
    return {t.name: t for t in tests}, errors


def compile_parts(stage: manifest.Stage, student_root: Path, course: Path, shared: Path,
                  settings: Settings, whole_library: bool = False) -> str:
    """Compile the student's kernels in the sandbox, under a time limit. `course` is the
    course the compiler sees: the worker's copy, or (whole_library, on a GPU machine) the
    GPU tests' view, placed where they will see it, so that the library built here, with
    the student's kernel and the reference's others, is the one the tests load."""
    # A stage whose kernels need more than this machine's GPU (stage 12 on a T4) is compiled
    # for the capability it needs: its compile errors are still caught; its tests say why
    # they are not graded here.
    script = ("import sys; from pathlib import Path; from course import build, manifest, parts\n"
              "try:\n    arch = build.archs()\n"
              "except Exception as e:\n    print('not built here:', e); sys.exit(3)\n"
              "stage = manifest.find(sys.argv[2])\n"
              "if not stage.runs_on(build.target_capability(arch)):\n"
              "    arch = [stage.min_cc.replace('.', '')]\n"
              "if sys.argv[1] == 'library':\n    build.build(parts.kernel_sources(), arch)\n"
              "else:\n    for src in sys.argv[3:]:\n        build.compile_object(Path(src), arch)\n")
    sources = [str(student_root / stage.dir / p) for p in stage.parts if p.endswith(".cu")
               and (student_root / stage.dir / p).exists()]
    if not sources or len(sources) < sum(p.endswith(".cu") for p in stage.parts):
        return "FAILED\nno kernel source to compile (see the submission problems)"
    missing = _toolchain_missing()
    if missing:
        return f"not built here ({missing})"
    placed = whole_library and course != manifest.ROOT
    seen = manifest.ROOT if whole_library else course
    env = {**_sandbox_env(seen, shared), "TINYVLLM_STUDENT": stage.id,
           "TINYVLLM_STUDENT_ROOT": str(student_root)}
    mounts = sandbox.Mounts([student_root] + ([] if placed else [course]), [shared],
                            [manifest.ROOT, *settings.hidden],
                            [(course, manifest.ROOT)] if placed else [])
    argv = [sys.executable, "-c", script, "library" if whole_library else "objects", stage.id,
            *sources]
    code, output = sandbox.run(argv, mounts, shared, env, settings.compile_timeout)
    if code is None:
        return (f"FAILED\nthe compiler did not finish within {settings.compile_timeout:.0f} s "
                "(an include bomb? an endless template?): killed")
    if code == 3 or "ToolchainMissing" in output:
        return clean("not built here (" + output.strip().splitlines()[-1][:300] + ")")
    return "ok" if code == 0 else clean("FAILED\n" + output, 6000)


def _toolchain_missing() -> str:
    """Why no kernel can be compiled on this machine (no toolkit, a CPU-only torch), or ""."""
    from course import build
    try:
        build.cuda_home()
        import torch
        if torch.version.cuda is None:
            return f"torch {torch.__version__} is a CPU-only build"
    except build.ToolchainMissing as e:
        return str(e)
    return ""


def _sandbox_env(python_root: Path, shared: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in (
        "PATH", "CUDA_HOME", "CUDA_PATH", "TINYVLLM_CUDA_ARCHS", "LANG",
        # where the driver's libcuda is found, and which GPUs the instructor chose
        "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
    return {**env, "HOME": str(shared), "PYTHONPATH": str(python_root),
            "PYTHONDONTWRITEBYTECODE": "1", "TINYVLLM_CACHE": str(shared / ".cache")}


def remove(tree: Path) -> None:
    """rmtree that also works on the read-only trees built here."""
    def retry(func, path, _):
        os.chmod(os.path.dirname(path), 0o755)
        func(path)
    for dirpath, dirnames, _ in os.walk(tree):
        os.chmod(dirpath, 0o755)
    shutil.rmtree(tree, onerror=retry)
