"""The two-part stages share their points as their lessons say: the simple kernel most.

A stage's score is its tests' passed share of their weights (`@pytest.mark.points`, grader/
runner.py); each part's tests share its points (stage 06: a test file a part, each file's tests
one weight; stage 12: every test runs both kernels, each with its part's weight). Collected as the grader collects them (a subprocess with the
grader's plugin, no test runs, ~3 s a stage).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import defaultdict

import pytest

from course import manifest
from grader.pytest_plugin import RESULTS_ENV

# stage -> part -> its share of the stage's points; a test belongs to the part whose pattern
# its name matches (stage 06: one test file a part; stage 12: every test runs both kernels)
SHARES = {
    "06": {r"test_gemm\.py::": 40, r"test_gemv_simple\.py::": 40, r"test_gemv\.py::": 20},
    "12": {r"\[simple[-\]]": 65, r"\[fast[-\]]": 35},
}


@pytest.mark.parametrize("stage_id", sorted(SHARES))
def test_each_part_carries_its_share(stage_id, tmp_path):
    stage = manifest.find(stage_id)
    results = tmp_path / "results.jsonl"
    subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                    str(manifest.ROOT / "stages" / stage.dir / "tests"),
                    "-p", "grader.pytest_plugin", "-p", "grader.pytest_setup",
                    "-p", "no:cacheprovider", "-c", str(manifest.ROOT / "pyproject.toml"),
                    "--rootdir", str(manifest.ROOT)],
                   cwd=manifest.ROOT, env={**os.environ, RESULTS_ENV: str(results)},
                   capture_output=True, check=True)
    tests = next(json.loads(line)["tests"] for line in results.read_text().splitlines()
                 if json.loads(line)["event"] == "collected")
    weight = defaultdict(float)
    for t in tests:
        parts_of = [part for part in SHARES[stage_id] if re.search(part, t["test"])]
        assert len(parts_of) == 1, f"{t['test']} belongs to {parts_of}, not to one part"
        weight[parts_of[0]] += t["points"]
    total = sum(weight.values())
    shares = {name: round(100 * w / total, 1) for name, w in weight.items()}
    assert shares == {name: float(s) for name, s in SHARES[stage_id].items()}, (
        f"stage {stage_id}: the test files' shares of the points are {shares}, the lesson says "
        f"{SHARES[stage_id]}; a test file's TESTS count must match its tests")
