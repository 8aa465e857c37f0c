"""Compile every kernel source, reference and skeleton, for sm_80 and sm_90, and link both;
then again for sm_75 (a T4) with the stages that claim it (those without a min_cc above 7.5).

CI has no GPU, so this is how it knows that every .cu in solutions/ and stages/ compiles
(a skeleton must compile too: students start from it) and that each set links into one
library. sm_75 is built as machine code, so ptxas rejects what a T4 lacks (cp.async, bf16
mma.sync) at compile time. Objects land in the build cache, so a later grade reuses them.

    python3 -m grader compile-check [--archs 80,90] [--also 75]
"""
from __future__ import annotations

import argparse
import time

from course import build, manifest


def variants(arch_list: list[str]) -> dict[str, list]:
    """The solutions' and the skeletons' sources of the stages whose kernels run on arch_list."""
    target = build.target_capability(arch_list)
    out: dict[str, list] = {"solutions": [], "skeletons": []}
    for stage in manifest.stages():
        if not stage.ready or not stage.runs_on(target):
            continue
        for src in sorted(stage.solution_dir().glob("*")):
            if src.suffix not in (".cu", ".cpp"):
                continue
            out["solutions"].append(src)
            skeleton = stage.skeleton_dir() / src.name
            out["skeletons"].append(skeleton if src.name in stage.parts else src)
    return out


def label(arch_list: list[str]) -> str:
    return ", ".join(a if a.startswith("compute_") else f"sm_{a}" for a in arch_list)


def left_out(arch_list: list[str]) -> str:
    target = build.target_capability(arch_list)
    late = [s for s in manifest.stages() if s.ready and not s.runs_on(target)]
    return (f" (left out: stage {', '.join(s.id for s in late)}, needing compute capability "
            f"{'/'.join(sorted({s.min_cc for s in late}))})" if late else "")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python3 -m grader compile-check")
    p.add_argument("--archs", default="80,90", help="compute capabilities (default %(default)s)")
    p.add_argument("--also", default="75", help="then build for these alone, with the stages that "
                   "claim them (default %(default)s, a T4; --also '' skips)")
    args = p.parse_args(argv)
    try:
        groups = [[build.normalize_arch(a) for a in g.split(",") if a.strip()]
                  for g in (args.archs, args.also)]
    except build.BuildError as e:   # a typo: a usage error, before minutes of compiling
        p.error(str(e).replace(f" ({build.ARCHS_ENV})", ""))
    if not any(groups):
        p.error("--archs and --also name no architecture: nothing to compile")
    failed = False
    for arch_list in filter(None, groups):
        for name, sources in variants(arch_list).items():
            start = time.time()
            try:
                lib = build.build(sources, arch_list)
                print(f"ok: {len(sources)} {name} sources compiled for {label(arch_list)} "
                      f"and linked ({time.time() - start:.1f} s){left_out(arch_list)}: {lib.name}")
            except build.BuildError as e:
                failed = True
                print(f"FAILED: {name} for {label(arch_list)}\n{e}")
    return 1 if failed else 0
