"""`python3 -m grader merge SHARD... --csv --json --junit --similarity`: one class's reports
from the progress files of its shards (`grader class --shard I/N`), as one run would write
them; the similarity report compares every pair of the whole class."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from course import manifest
from grader import arguments
from grader.classroom import reports, shards


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python3 -m grader merge",
        description="Join the shards of a class (the progress files of `grader class --shard "
                    "I/N`) into the class's reports. Refused when a shard is missing or given "
                    "twice, a student is graded twice or not at all, or the shards were "
                    "graded against different tests, limits or devices.")
    p.add_argument("shards", type=Path, nargs="+", metavar="SHARD",
                   help="a shard's progress file (all N of them)")
    p.add_argument("--csv", type=Path, metavar="FILE",
                   help="one row per student, a column per stage")
    p.add_argument("--json", type=Path, metavar="FILE", help="every result, test by test")
    p.add_argument("--junit", type=Path, metavar="FILE",
                   help="JUnit XML, a suite per student and stage")
    p.add_argument("--similarity", type=Path, metavar="FILE",
                   help="suspicious pairs across the whole class as JSON")
    args = p.parse_args(argv)
    arguments.writable_files(p, csv=args.csv, json=args.json, junit=args.junit,
                             similarity=args.similarity)
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    try:
        stage_ids, done = shards.check([shards.load(path) for path in args.shards])
        stages = [manifest.find(s) for s in stage_ids]
    except (shards.ShardError, manifest.UnknownStage) as e:
        print(f"error: cannot merge: {e}", file=sys.stderr)
        return 2
    students = sorted({name for name, _ in done})
    print(f"merged {len(args.shards)} shards: {len(students)} students, stages "
          f"{', '.join(stage_ids)}")
    outputs = reports.Outputs(args.csv, args.json, args.junit, args.similarity)
    return 0 if reports.write(outputs, stages, students, done) else 2
