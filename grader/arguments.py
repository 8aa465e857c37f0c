"""Argument checks the grader's commands share: usage errors at once, not after minutes of
grading (a negative timeout would time out every test, a mistyped folder fail every one or
leave hidden tests out unseen, and a report path that cannot be written lose the report)."""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path


def positive_seconds(p: argparse.ArgumentParser, **flags: float) -> None:
    """Each flag's value must be a finite number of seconds above 0 (flag names as keywords:
    student_timeout=... stands for --student-timeout)."""
    for name, seconds in flags.items():
        if not (math.isfinite(seconds) and seconds > 0):
            p.error(f"--{name.replace('_', '-')} must be a positive number of seconds, got "
                    f"{seconds}")


def existing_dirs(p: argparse.ArgumentParser, **flags: Path | None) -> None:
    """Each given folder must exist."""
    for name, folder in flags.items():
        if folder is not None and not folder.is_dir():
            p.error(f"--{name.replace('_', '-')} {folder} is not a directory")


def writable_files(p: argparse.ArgumentParser, **flags: Path | None) -> None:
    """Each given report path must be a file in an existing folder."""
    for name, path in flags.items():
        if path is not None and (path.is_dir() or not path.absolute().parent.is_dir()):
            p.error(f"--{name.replace('_', '-')} {path} cannot be written: "
                    + ("it is a directory" if path.is_dir() else
                       f"the folder {path.absolute().parent} does not exist"))


def replay_seed(p: argparse.ArgumentParser) -> None:
    """TINYVLLM_SEED, read with int() inside each test (grader/checks.py), must be an integer."""
    seed = os.environ.get("TINYVLLM_SEED")
    if seed:
        try:
            int(seed)
        except ValueError:
            p.error(f"TINYVLLM_SEED={seed!r} is not an integer (it replays a test's random "
                    "inputs; unset it for a fresh seed)")
