"""Many mutants' quick tests in one process: `python3 -m grader.mutants_batch IN OUT`.

Starting a test process costs seconds (torch is imported); a pure-Python mutant's quick
tests take a fraction of that. So the quick phase of every Python mutant runs here, in one
child process: each mutant gets its own temporary student folder (the parts resolver keys
its modules by path, so no mutant sees another's code), pytest runs in-process with -x, and
an alarm turns a mutant that loops forever into a failed test. IN: JSON {"stage", "tests",
"timeout", "mutants": [{"id", "file", "text"}]}; OUT: one JSON line per mutant, {"id",
"killed", "test", "message"}, written as each ends.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest

from course import manifest, parts


class _Timeout(Exception):
    """The mutant's tests ran past the time limit: it loops forever, a kill."""


class _FirstFailure:
    """A pytest plugin that keeps the first failing test's name and message."""

    def __init__(self):
        self.test, self.message = "", ""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if report.failed and not self.test:
            self.test = item.nodeid
            exc = call.excinfo
            self.message = (f"{exc.typename}: {exc.value}" if exc else str(report.longrepr))


def _alarm(signum, frame):
    raise _Timeout("the tests ran past the time limit (an infinite loop?)")


def run_one(stage: manifest.Stage, mutant: dict, tests: list[str], timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="tinyvllm-mutant-") as tmp:
        folder = Path(tmp) / stage.dir
        folder.mkdir()
        for part in stage.parts:
            shutil.copy(stage.solution_dir() / part, folder / part)
        (folder / mutant["file"]).write_text(mutant["text"])
        os.environ.update(parts.selection_env([stage.id], Path(tmp)))
        first = _FirstFailure()
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            code = pytest.main([*tests, "-x", "-q", "--no-header", "-p", "no:cacheprovider",
                                "--tb=no", "-W", "ignore"], plugins=[first])
        except _Timeout as e:
            code, first.test, first.message = 1, first.test or "(collection)", str(e)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    killed = code not in (0, 5)   # 5: no tests collected, as for a filter that matches none
    return {"id": mutant["id"], "killed": killed, "test": first.test or "(collection)",
            "message": first.message}


def main(argv: list[str]) -> int:
    job = json.loads(Path(argv[0]).read_text())
    stage = manifest.find(job["stage"])
    signal.signal(signal.SIGALRM, _alarm)
    with open(argv[1], "a") as out:
        for mutant in job["mutants"]:
            out.write(json.dumps(run_one(stage, mutant, job["tests"], job["timeout"])) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
