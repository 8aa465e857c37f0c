"""pytest plugin for the grader's child process: one JSON line per test, written as it ends.

The grader reads the file while the child runs, so a test that hangs or crashes the process
(a kernel that corrupts the CUDA context, a segfault) is known by name, and the remaining
tests run in a fresh process.
"""
from __future__ import annotations

import json
import os
import time

import pytest

RESULTS_ENV = "TINYVLLM_RESULTS"
# After these the CUDA context is unusable: every later test would fail for the same reason.
STICKY_CUDA_ERRORS = ("illegal memory access", "unspecified launch failure", "misaligned address",
                      "device-side assert", "illegal instruction", "CUDA error: unknown error")
STICKY_EXIT = 75

_state: dict[str, dict] = {}


def _write(record: dict) -> None:
    path = os.environ.get(RESULTS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _message(excinfo) -> str:
    text = f"{excinfo.typename}: {excinfo.value}".strip()
    lines = text.splitlines()
    return "\n".join(lines[:20]) + ("\n..." if len(lines) > 20 else "")


def pytest_runtest_logstart(nodeid, location):
    _write({"event": "start", "test": nodeid, "time": time.time()})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    state = _state.setdefault(item.nodeid, {"outcome": "passed", "message": "",
                                            "points": _points(item)})
    if report.skipped and call.when in ("setup", "call"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        state["outcome"] = "skipped"
        state["message"] = reason.removeprefix("Skipped: ")
    elif report.failed and state["outcome"] != "failed":
        todo = (call.excinfo is not None and call.excinfo.errisinstance(NotImplementedError)
                and "TODO" in str(call.excinfo.value))
        state["outcome"] = "todo" if todo else "failed"
        state["message"] = _message(call.excinfo) if call.excinfo else str(report.longrepr)[-2000:]
    if call.when == "teardown":
        _write({"event": "end", "test": item.nodeid, "time": time.time(), **state})
        if any(s in state["message"] for s in STICKY_CUDA_ERRORS):
            os._exit(STICKY_EXIT)


def _points(item) -> float:
    marker = item.get_closest_marker("points")
    return float(marker.args[0]) if marker else 1.0


def pytest_collectreport(report):
    if report.failed:
        _write({"event": "collect_error", "test": report.nodeid,
                "message": str(report.longrepr)[-3000:]})


def pytest_sessionfinish(session, exitstatus):
    _write({"event": "finished", "exitstatus": int(exitstatus)})
