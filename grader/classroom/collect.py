"""The trusted test list: collected from the course's own tests before any student code runs.

    python3 -m pytest --collect-only -p grader.classroom.collect ...   (with TINYVLLM_COLLECT=F)

writes one JSON line per test: its name (grader.pytest_plugin.result_name), its points (from
the course's markers) and whether it needs a GPU. The class grader scores every stage against
this list.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from course import manifest
from grader.pytest_plugin import result_name

OUT_ENV = "TINYVLLM_COLLECT"


@dataclass(frozen=True)
class Case:
    name: str
    points: float
    gpu: bool


def pytest_collection_finish(session) -> None:
    path = os.environ.get(OUT_ENV)
    if not path:
        return
    with open(path, "w") as f:
        for item in session.items:
            marker = item.get_closest_marker("points")
            f.write(json.dumps({"name": result_name(item),
                                "points": float(marker.args[0]) if marker else 1.0,
                                "gpu": item.get_closest_marker("gpu") is not None}) + "\n")


def collect(paths: list[Path]) -> tuple[list[Case], str]:
    """The tests under `paths` (reference parts only), and pytest's output if it failed."""
    with tempfile.TemporaryDirectory(prefix="tinyvllm-collect-") as tmp:
        out = Path(tmp) / "cases.jsonl"
        env = {**os.environ, OUT_ENV: str(out), "TINYVLLM_STUDENT": "",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(manifest.ROOT),
                                                           os.environ.get("PYTHONPATH")]))}
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", *map(str, paths),
             "-p", "grader.classroom.collect", "-p", "grader.pytest_setup",
             "--rootdir", str(manifest.ROOT), "-c", str(manifest.ROOT / "pyproject.toml"),
             "-p", "no:cacheprovider"], env=env, cwd=manifest.ROOT, capture_output=True,
            text=True)
        cases = [Case(**json.loads(line)) for line in out.read_text().splitlines()] \
            if out.exists() else []
        return cases, "" if proc.returncode == 0 else _errors(proc.stdout + proc.stderr)


def _errors(output: str, limit: int = 3000) -> str:
    """pytest's report of what did not collect: its ERRORS section (the list of the tests
    that did collect comes before it), else the output's end, from a line's start."""
    at = re.search(r"^=+ ERRORS =+$", output, re.MULTILINE)
    if at:
        return output[at.start():at.start() + limit]
    tail = output[-limit:]
    return tail if len(output) <= limit else tail[tail.find("\n") + 1:]
