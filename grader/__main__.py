"""The grader's command line: `python3 -m grader 07` (nox -s grade -- 07 calls this).

    python3 -m grader NN                 grade your stage NN (reference for every other stage)
    python3 -m grader NN --cumulative    grade NN using your stages 01..NN together
    python3 -m grader NN --solution      grade the reference solution itself
    python3 -m grader list               the stages, from the manifest
    python3 -m grader class DIR          grade every student directory under DIR
    python3 -m grader verify             the GPU suite: build, test every stage, engine, benchmarks
    python3 -m grader compile-check      compile every kernel (solutions and skeletons), sm_80+sm_90

Exit status: 0 full marks, 1 anything less (failed, TODO, or not graded here), 2 bad usage.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from course import manifest
from grader import report, runner


def _grade_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--extra-tests", type=Path, metavar="DIR",
                   help="instructor's hidden tests: DIR/NN_name/ (or DIR/NN/) is added to stage NN")
    p.add_argument("--json", type=Path, metavar="FILE", help="write the results as JSON")
    p.add_argument("--junit", type=Path, metavar="FILE", help="write the results as JUnit XML")
    p.add_argument("--timeout", type=float, default=runner.DEFAULT_TEST_TIMEOUT, metavar="S",
                   help="seconds one test may run before it is killed (default %(default)s)")
    p.add_argument("-v", "--verbose", action="store_true", help="show pytest's own output")


def grade_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python3 -m grader", description="Grade one stage.")
    p.add_argument("stage", help="stage id, e.g. 01 or 7 or 07_attention")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--cumulative", action="store_true",
                      help="use your parts of stages 01..NN, not only NN")
    mode.add_argument("--solution", action="store_true", help="grade the reference solution")
    p.add_argument("--student-root", type=Path, metavar="DIR",
                   help="directory holding your NN_name/ stage folders (default: stages/)")
    _grade_args(p)
    args = p.parse_args(argv)
    stage = manifest.find_ready(args.stage)
    if args.solution:
        ids: list[str] = []
    elif args.cumulative:
        ids = [s.id for s in manifest.upto(stage) if s.ready]
    else:
        ids = [stage.id]
    result = runner.run_stage(stage, ids, args.student_root, args.extra_tests, args.timeout,
                              args.verbose, listener=report.LivePrinter())
    print("\n".join(report.footer(result)))
    if args.json:
        report.write_json(args.json, [report.as_dict(result)])
    if args.junit:
        report.write_junit(args.junit, [("", result)])
    return 0 if result.full_marks else 1


def list_main(argv: list[str]) -> int:
    for s in manifest.stages():
        flag = "gpu" if s.gpu else "cpu"
        status = "" if s.ready else "  (planned: not available yet)"
        print(f"{s.id}  {s.dir:<24} {flag}  {s.points:>3} pts  {s.title}{status}")
    return 0


def class_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python3 -m grader class",
                                description="Grade a class: every directory under SUBMISSIONS is "
                                            "one student (a clone of the course repo, or a "
                                            "folder of NN_name/ stage directories).")
    p.add_argument("submissions", type=Path)
    p.add_argument("--stages", default=None,
                   help="comma-separated stage ids (default: every available stage)")
    p.add_argument("--csv", type=Path, metavar="FILE", help="one row per student, a column per stage")
    _grade_args(p)
    args = p.parse_args(argv)
    if not args.submissions.is_dir():
        raise manifest.UnknownStage(f"{args.submissions} is not a directory of submissions")
    chosen = ([manifest.find_ready(x) for x in args.stages.split(",")] if args.stages
              else [s for s in manifest.stages() if s.ready])
    rows, suites, records = [], [], []
    for student in sorted(d for d in args.submissions.iterdir() if d.is_dir()):
        root = student / "stages" if (student / "stages").is_dir() else student
        row = {"student": student.name}
        for stage in chosen:
            result = runner.run_stage(stage, [stage.id], root, args.extra_tests, args.timeout,
                                      args.verbose)
            row[f"stage_{stage.id}"] = f"{result.score:g}"
            suites.append((f"{student.name} ", result))
            records.append({"student": student.name, **report.as_dict(result)})
            print(f"{student.name:<24} stage {stage.id}: {result.score:g}/{stage.points}")
        row["total"] = f"{sum(float(row[f'stage_{s.id}']) for s in chosen):g}"
        rows.append(row)
    if args.csv:
        report.write_csv(args.csv, rows)
    if args.json:
        report.write_json(args.json, records)
    if args.junit:
        report.write_junit(args.junit, suites)
    return 0


def main(argv: list[str]) -> int:
    commands = {"list": list_main, "class": class_main}
    try:
        if argv and argv[0] in ("verify", "compile-check"):
            module = importlib.import_module("grader." + argv[0].replace("-", "_"))
            return module.main(argv[1:])
        if argv and argv[0] in commands:
            return commands[argv[0]](argv[1:])
        if not argv or argv[0] in ("-h", "--help"):
            print(__doc__)
            return 0 if argv else 2
        return grade_main(argv)
    except (manifest.UnknownStage, manifest.StageNotAvailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
