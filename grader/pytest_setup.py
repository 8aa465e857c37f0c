"""pytest setup shared by the stage tests, the project tests and instructors' hidden tests.

`@pytest.mark.gpu` marks a test that needs a CUDA device. On a machine without one it is
skipped with the reason "not graded: no CUDA device", which the grader reports as such and
scores zero: a GPU test that did not run is never counted as passed.
Loaded by the top-level conftest.py and, for tests outside the repo, by the grader (-p).
"""
from __future__ import annotations

import os

import pytest

from grader import environment

NO_CUDA = "not graded: no CUDA device"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (not graded without one)")
    config.addinivalue_line("markers", "points(n): weight of a graded test (default 1)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds on a CPU")


def pytest_collection_modifyitems(config, items):
    if environment.has_cuda():
        # a GPU below the stage's min_cc (grader/capability.py names it in this variable)
        below = os.environ.get("TINYVLLM_GPU_NOT_GRADED")
        if below:
            skip = pytest.mark.skip(reason=f"not graded: {below}")
            for item in items:
                if "gpu" in item.keywords:
                    item.add_marker(skip)
        return
    skip = pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed() -> int:
    """A fresh seed for this test; printed, so a failure can be replayed with TINYVLLM_SEED."""
    from course.testing import checks
    s = checks.fresh_seed()
    print(f"seed {s} (replay: TINYVLLM_SEED={s})")
    return s
