"""Argument checks the grader's commands share: usage errors at once, not after minutes of
grading (a negative timeout would time out every test, a mistyped folder fail every one or
leave hidden tests out unseen, and a report path that cannot be written lose the report)."""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path


EXTRA_TESTS_HELP = ("instructor's hidden tests: DIR/NN_name/ and DIR/NN/, each one that "
                    "exists, are added to stage NN's tests")


def add_student_root(p: argparse.ArgumentParser) -> None:
    """--student-root, as every command that reads a student's stage folders takes it."""
    p.add_argument("--student-root", type=Path, metavar="DIR",
                   help="directory holding your NN_name/ stage folders (default: stages/)")


def add_test_timeout(p: argparse.ArgumentParser, default: float) -> None:
    """--timeout, the seconds one test may run (check it with positive_seconds)."""
    p.add_argument("--timeout", type=float, default=default, metavar="S",
                   help="seconds one test may run before it is killed (default %(default)s)")


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


def student_stage_dir(p: argparse.ArgumentParser, root: Path | None, stage_dir: str) -> None:
    """--student-root must hold the stage's folder: a root one level off (the folder above
    stages/) would build nothing and fail every test with a 'missing' file."""
    if root is None or (root / stage_dir).is_dir():
        return
    hint = next((f"; did you mean {d}?" for d in (root / "stages", root.parent)
                 if (d / stage_dir).is_dir()), "")
    p.error(f"--student-root {root} has no {stage_dir}/ folder: it names the folder that holds "
            f"your NN_name/ stage folders (a copy of the course's stages/){hint}")


def creatable_dirs(p: argparse.ArgumentParser, **flags: Path | None) -> None:
    """Each given output folder must be a directory or one that can be made (with its parents):
    a file in the way would fail only when the results are written, after the whole run."""
    for name, folder in flags.items():
        if folder is None:
            continue
        existing = _nearest_existing(folder.absolute())
        if not existing.is_dir():
            p.error(f"--{name.replace('_', '-')} {folder} cannot be a folder: {existing} is a "
                    "file")


def writable_files(p: argparse.ArgumentParser, **flags: Path | None) -> None:
    """Each given report path must be a file whose folder exists or can be made (it is made
    when the report is written: report.write_text)."""
    for name, path in flags.items():
        if path is None:
            continue
        existing = _nearest_existing(path.absolute().parent)
        if path.is_dir() or not existing.is_dir():
            p.error(f"--{name.replace('_', '-')} {path} cannot be written: "
                    + ("it is a directory" if path.is_dir() else f"{existing} is a file"))


def _nearest_existing(path: Path) -> Path:
    """`path` or the nearest folder above it that exists."""
    return next(d for d in (path, *path.parents) if d.exists())


def replay_seed(p: argparse.ArgumentParser) -> None:
    """TINYVLLM_SEED, read with int() inside each test (course/testing/checks.py), must be an
    integer."""
    seed = os.environ.get("TINYVLLM_SEED")
    if seed:
        try:
            int(seed)
        except ValueError:
            p.error(f"TINYVLLM_SEED={seed!r} is not an integer (it replays a test's random "
                    "inputs; unset it for a fresh seed)")
