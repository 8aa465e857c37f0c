"""Restore a stage's skeleton parts (`nox -s reset -- 07`, `python3 -m grader reset 07`).

A student's files are never destroyed silently: every part that differs from its skeleton is
first copied to backups/NN_name-YYYYmmdd-HHMMSS/ beside the stages folder (printed), then the
skeleton is written back.
Given files and tests are left alone (sync regenerates given files; tests are the course's).
"""
from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from course import manifest
from grader import arguments, sync

def reset_stage(stage: manifest.Stage,
                student_root: Path | None = None) -> tuple[Path | None, list[str]]:
    """Back up and restore every part of `stage` that is not its skeleton.

    Returns the backup folder (None when nothing differed) and the restored part names."""
    root = (student_root or manifest.ROOT / "stages").resolve()
    folder, backups = root / stage.dir, root.parent / "backups"
    changed = []
    for part in stage.parts:
        skeleton = sync.skeleton_text((stage.solution_dir() / part).read_text(), stage.id, part)
        current = folder / part
        if not current.exists() or current.read_text() != skeleton:
            changed.append((part, skeleton))
    if not changed:
        return None, []
    backup = backups / f"{stage.dir}-{time.strftime('%Y%m%d-%H%M%S')}"
    suffix = 1
    while backup.exists():  # two resets within a second keep both backups
        suffix += 1
        backup = backups / f"{stage.dir}-{time.strftime('%Y%m%d-%H%M%S')}-{suffix}"
    backup.mkdir(parents=True)
    for part, _ in changed:
        if (folder / part).exists():
            shutil.copy2(folder / part, backup / part)
    folder.mkdir(parents=True, exist_ok=True)
    for part, skeleton in changed:
        (folder / part).write_text(skeleton)
    return backup, [part for part, _ in changed]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python3 -m grader reset",
                                description="Restore a stage's skeleton parts; your files are "
                                            "first copied to a timestamped folder in backups/.")
    p.add_argument("stage", help="stage id, e.g. 07")
    arguments.add_student_root(p)
    args = p.parse_args(argv)
    # a mistyped folder would be created and "reset", and the real one left as it was
    arguments.existing_dirs(p, student_root=args.student_root)
    stage = manifest.find_ready(args.stage)
    backup, restored = reset_stage(stage, args.student_root)
    if backup is None:
        print(f"stage {stage.id}: every part is already the skeleton; nothing to reset")
        return 0
    print(f"stage {stage.id}: your files are saved in {backup}/")
    for part in restored:
        print(f"  restored the skeleton of {part}")
    return 0
