"""pytest plugin for the grader's child processes: one JSON line per test, written as it ends.

A child first writes the list of tests it collected (`collected`, before any test runs: the
grader fixes that list); a child restarted after a crash runs exactly the tests named in a
file (TINYVLLM_SELECT: test names as result_name() gives them, matched exactly, never as
prefixes). The grader reads the results file while a child runs, so a test that hangs or
crashes the process (a kernel that corrupts the CUDA context, a segfault) is known by name,
and the remaining tests run in a fresh process.

The messages are what a student reads first, so they are shaped here: a kernel build error
reads as one short line (the build's errors are printed once, above the table), a TODO from a
part other than the one a test file is about says which part it needs, and a CUDA launch
error gets the mistake that usually causes it.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

RESULTS_ENV = "TINYVLLM_RESULTS"
SELECT_ENV = "TINYVLLM_SELECT"
# After these the CUDA context is unusable: every later test would fail for the same reason.
STICKY_CUDA_ERRORS = ("illegal memory access", "unspecified launch failure", "misaligned address",
                      "device-side assert", "illegal instruction", "CUDA error: unknown error")
STICKY_EXIT = 75
BUILD_FAILED = "kernel build failed (see the compiler's errors above)"
# (what the CUDA error says, the mistake that usually causes it); first match wins.
LIKELY_CAUSES = (
    ("invalid configuration argument",
     "a launch configuration the GPU refuses: a grid rounded down to zero blocks (round up: "
     "(n + threads - 1) / threads) or more than 1024 threads per block"),
    ("invalid argument",
     "a launch configuration the GPU refuses: a grid rounded down to zero blocks (round up: "
     "(n + threads - 1) / threads), more than 1024 threads per block, or more dynamic shared "
     "memory than a block may have without cudaFuncSetAttribute"),
    ("too many resources requested",
     "too many threads per block for this kernel's registers: launch fewer threads per block"),
    ("misaligned address",
     "a vector load or store (a 16-byte pack) at an address that is not a multiple of its size: "
     "an element offset used as a byte offset, or a row length that is not a multiple of the pack"),
    ("illegal memory access",
     "an index past the end of a tensor: a missing bounds check (if (i < n)), a wrong row "
     "stride, or a grid larger than the data"),
)

_state: dict[str, dict] = {}


class TimedOut(Exception):
    """Raised by what a test calls when it gave up waiting (the class judge's call into a
    student's code that never answered): the test reads `timeout`, like one the grader kills."""


def _write(record: dict) -> None:
    path = os.environ.get(RESULTS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _message(excinfo) -> str:
    text = f"{excinfo.typename}: {excinfo.value}".strip()
    lines = text.splitlines()
    return "\n".join(lines[:20]) + ("\n..." if len(lines) > 20 else "")


def likely_cause(message: str) -> str:
    """The usual mistake behind a CUDA error message, or "" (also when one is already given)."""
    if "CUDA error" not in message or "likely cause" in message:
        return ""
    return next((cause for pattern, cause in LIKELY_CAUSES if pattern in message), "")


def _is_build_error(excinfo) -> bool:
    try:
        from course import build
    except ImportError:  # hidden tests run outside the course: nothing of ours was built
        return False
    return excinfo.errisinstance(build.BuildError)


def _part_of(path: Path) -> tuple[str, str] | None:
    """(stage dir, file name) when `path` lies in a stage folder of stages/ or solutions/ (or a
    student's copy of one), else None."""
    from course import manifest
    dirs = {s.dir for s in manifest.stages()}
    if path.parent.name in dirs:
        return path.parent.name, path.name
    return None


def todo_part(item: pytest.Item, excinfo: pytest.ExceptionInfo[BaseException]) -> str | None:
    """The part whose TODO a test ran into, when that is not a part its test file is about.

    A test file `test_<name>.py` is about the parts of its stage named `<name>.*` (the
    checkpoint tests are about checkpoint.py); its TODO is the student's next step. A TODO
    from another part (config.py, which the checkpoint loader calls) is named instead, so
    the student knows which file to finish first. A kernel's TODO is raised from its op module
    (`<op>.py`, a given file): it is the stage's kernel with that name, else its only kernel.
    """
    from course import manifest
    raised = next((_part_of(Path(str(entry.path))) for entry in reversed(excinfo.traceback)
                   if _part_of(Path(str(entry.path)))), None)
    test_file = Path(str(item.path))
    if raised is None or test_file.parent.name != "tests":
        return None
    stage = next(s for s in manifest.stages() if s.dir == raised[0])
    name = raised[1]
    if name not in stage.parts:
        kernels = [p for p in stage.parts if p.endswith(".cu")]
        same = [p for p in kernels if Path(p).stem == Path(name).stem]
        if not (same or len(kernels) == 1):
            return None
        name = (same or kernels)[0]
    about = Path(test_file.name).stem.removeprefix("test_")
    if test_file.parent.parent.name != stage.dir or Path(name).stem != about:
        return name
    return None


def result_name(item: pytest.Item) -> str:
    """A test's name in every result and report: pytest's node id, relative to the course.
    Outside the course (an instructor's hidden tests) pytest names a test relative to the
    folder it was given, so the name keeps that folder: `02_tokenize/test_h.py::test_x`, and
    DIR/02/ and DIR/02_tokenize/ may each hold a test_h.py::test_x of their own."""
    path = Path(str(item.path))
    if path.is_relative_to(item.config.rootpath):
        return item.nodeid
    depth = len(Path(item.nodeid.split("::")[0]).parts)
    return f"{path.parents[depth - 1].name}/{item.nodeid}"


def pytest_configure(config):
    selected = os.environ.get(SELECT_ENV)
    config._tinyvllm_select = (Path(selected).read_text().splitlines() if selected else None)


def pytest_collection_modifyitems(config, items):
    """Keep exactly the tests the grader selected (by node id, never by prefix)."""
    wanted = config._tinyvllm_select
    if wanted is None:
        return
    keep = set(wanted)
    chosen = [it for it in items if result_name(it) in keep]
    dropped = [it for it in items if result_name(it) not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = chosen


def pytest_collection_finish(session):
    _write({"event": "collected",
            "tests": [{"test": result_name(it), "points": _points(it)} for it in session.items]})


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    _write({"event": "start", "test": result_name(item), "time": time.time()})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    state = _state.setdefault(result_name(item), {"outcome": "passed", "message": "",
                                            "points": _points(item)})
    if report.skipped and call.when in ("setup", "call"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        state["outcome"] = "skipped"
        state["message"] = reason.removeprefix("Skipped: ")
    elif report.failed and state["outcome"] != "failed":
        _record_failure(item, call, report, state)
    if call.when == "teardown":
        sticky = any(s in state["message"] for s in STICKY_CUDA_ERRORS)
        if sticky:
            state["outcome"] = "crashed"
            state["message"] += ("\n  this left the CUDA context unusable: the tests after it "
                                 "ran in a fresh process")
        _write({"event": "end", "test": result_name(item), "time": time.time(), **state})
        if sticky:
            os._exit(STICKY_EXIT)


def _record_failure(item, call, report, state: dict) -> None:
    excinfo = call.excinfo
    if excinfo is None:
        state["outcome"], state["message"] = "failed", str(report.longrepr)[-2000:]
        return
    if excinfo.errisinstance(TimedOut):
        state["outcome"], state["message"] = "timeout", str(excinfo.value)
        return
    if _is_build_error(excinfo):
        state["outcome"], state["message"] = "failed", BUILD_FAILED
        return
    if excinfo.errisinstance(NotImplementedError) and "TODO" in str(excinfo.value):
        state["outcome"] = "todo"
        needs = todo_part(item, excinfo)
        state["message"] = (f"needs {needs} (TODO)\n" if needs else "") + str(excinfo.value)
        return
    message = _message(excinfo)
    cause = likely_cause(message)
    state["outcome"] = "failed"
    state["message"] = message + (f"\n  likely cause: {cause}" if cause else "")


def _points(item) -> float:
    marker = item.get_closest_marker("points")
    return float(marker.args[0]) if marker else 1.0


def pytest_collectreport(report):
    if report.failed:
        _write({"event": "collect_error", "test": report.nodeid,
                "message": str(report.longrepr)[-3000:]})


def pytest_sessionfinish(session, exitstatus):
    _write({"event": "finished", "exitstatus": int(exitstatus)})
