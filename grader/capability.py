"""A stage that needs a newer GPU than this one says so, and its GPU tests are not graded.

stages.toml's `min_cc = "8.0"` (stage 12: mma.sync on bf16 and cp.async; stage 14: cp.async)
is read by course/manifest.py. On a GPU below it the grader prints one line, e.g.

    stage 12 needs compute capability 8.0; this GPU is 7.5

and runs the stage's tests with NOT_GRADED_ENV set: grader/pytest_setup.py then skips every
`gpu` test as "not graded: ..." (scored zero, never passed), as it does without a CUDA device.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

from course import manifest

NOT_GRADED_ENV = "TINYVLLM_GPU_NOT_GRADED"


def _parse(cc: str) -> tuple[int, int]:
    major, _, minor = cc.partition(".")
    return int(major), int(minor or 0)


def device_capability() -> tuple[int, int] | None:
    """(major, minor) of CUDA device 0, or None without one."""
    try:
        import torch
        if not torch.cuda.is_available():
            return None
        return tuple(torch.cuda.get_device_capability(0))
    except Exception:  # no torch, or a driver that cannot answer: nothing to say
        return None


def too_old(stage: manifest.Stage, capability: tuple[int, int] | None = None) -> str | None:
    """'stage 12 needs compute capability 8.0; this GPU is 7.5', or None when this GPU (or the
    absence of one: then the GPU tests are not graded anyway) is no reason to say anything."""
    cc = device_capability() if capability is None else capability
    if not stage.min_cc or cc is None or tuple(cc) >= _parse(stage.min_cc):
        return None
    return (f"stage {stage.id} needs compute capability {stage.min_cc}; "
            f"this GPU is {cc[0]}.{cc[1]}")


@contextmanager
def gpu_tests_not_graded(reason: str | None) -> Iterator[None]:
    """While grading one stage: its gpu tests are 'not graded: <reason>' (when reason is set)."""
    saved = os.environ.pop(NOT_GRADED_ENV, None)
    if reason:
        os.environ[NOT_GRADED_ENV] = reason
    try:
        yield
    finally:
        os.environ.pop(NOT_GRADED_ENV, None)
        if saved is not None:
            os.environ[NOT_GRADED_ENV] = saved


def check(stage: manifest.Stage, capability: tuple[int, int] | None = None
          ) -> AbstractContextManager[None]:
    """Print the line when this GPU is too old; the context to grade the stage in."""
    reason = too_old(stage, capability)
    if reason:
        print(f"{reason}: its GPU tests are not graded here (they count zero).", flush=True)
    return gpu_tests_not_graded(reason)
