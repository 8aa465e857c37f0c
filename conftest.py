"""pytest setup shared by the stage tests and the project tests.

`@pytest.mark.gpu` marks a test that needs a CUDA device. On a machine without one it is
skipped with the reason "not graded: no CUDA device", which the grader reports as such and
scores zero: a GPU test that did not run is never counted as passed.
"""
from __future__ import annotations

import pytest

NO_CUDA = "not graded: no CUDA device"


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed() -> int:
    """A fresh seed for this test; printed, so a failure can be replayed with TINYVLLM_SEED."""
    from grader import checks
    s = checks.fresh_seed()
    print(f"seed {s} (replay: TINYVLLM_SEED={s})")
    return s
