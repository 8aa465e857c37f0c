"""Compile every kernel source, reference and skeleton, for sm_80 and sm_90, and link both.

CI has no GPU, so this is how it knows that every .cu in solutions/ and stages/ compiles
(a skeleton must compile too: students start from it) and that each set links into one
library. Objects land in the build cache, so a later grade reuses them.

    python3 -m grader compile-check [--archs 80,90]
"""
from __future__ import annotations

import argparse
import time

from course import build, manifest


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python3 -m grader compile-check")
    p.add_argument("--archs", default="80,90", help="compute capabilities (default %(default)s)")
    args = p.parse_args(argv)
    archs = [a.strip() for a in args.archs.split(",") if a.strip()]
    variants: dict[str, list] = {"solutions": [], "skeletons": []}
    for stage in manifest.stages():
        if not stage.ready:
            continue
        for src in sorted(stage.solution_dir().glob("*")):
            if src.suffix not in (".cu", ".cpp"):
                continue
            variants["solutions"].append(src)
            skeleton = stage.skeleton_dir() / src.name
            variants["skeletons"].append(skeleton if src.name in stage.parts else src)
    failed = False
    for name, sources in variants.items():
        start = time.time()
        try:
            lib = build.build(sources, archs)
            print(f"ok: {len(sources)} {name} sources compiled for sm_{', sm_'.join(archs)} and "
                  f"linked ({time.time() - start:.1f} s): {lib.name}")
        except build.BuildError as e:
            failed = True
            print(f"FAILED: {name}\n{e}")
    return 1 if failed else 0
