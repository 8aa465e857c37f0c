"""The two-part stages share their points as their lessons say: the simple kernel most.

A stage's score is its tests' passed share of their weights (`@pytest.mark.points`, grader/
runner.py); each test file of a two-part stage gives its tests one weight, so that the file's
tests together carry its share. Collected as the grader collects them (a subprocess with the
grader's plugin, no test runs, ~3 s a stage).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict

import pytest

from course import manifest
from grader.pytest_plugin import RESULTS_ENV

# stage -> test file -> its share of the stage's points
SHARES = {
    "06": {"test_gemm.py": 40, "test_gemv_simple.py": 40, "test_gemv.py": 20},
    "12": {"test_flash_attention_simple.py": 65, "test_flash_attention.py": 35},
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
        weight[t["test"].split("::")[0].rsplit("/", 1)[-1]] += t["points"]
    total = sum(weight.values())
    shares = {name: round(100 * w / total, 1) for name, w in weight.items()}
    assert shares == {name: float(s) for name, s in SHARES[stage_id].items()}, (
        f"stage {stage_id}: the test files' shares of the points are {shares}, the lesson says "
        f"{SHARES[stage_id]}; a file's TESTS count must match its tests")
