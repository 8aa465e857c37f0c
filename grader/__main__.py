"""The grader's command line: `python3 -m grader 07` (nox -s grade -- 07 calls this).

    python3 -m grader NN                 grade your stage NN (reference for every other stage)
    python3 -m grader NN --cumulative    grade NN using your stages 01..NN together
    python3 -m grader NN --solution      grade the reference solution itself
    python3 -m grader NN --bench         time your kernels of NN beside the reference and torch
    python3 -m grader all                grade every available stage, then the course map
    python3 -m grader next               the first stage without full marks, with its report
    python3 -m grader reset NN           restore stage NN's skeleton (your files are backed up)
    python3 -m grader emulate NN         run your kernel of NN on the CPU in the emulator (no grade)
    python3 -m grader mutants NN         (maintainers) do NN's tests catch the lesson's mistakes
                                         and automatic mutants of the reference?
    python3 -m grader list               the stages, from the manifest
    python3 -m grader class DIR          grade every student directory under DIR (--shard I/N: part)
    python3 -m grader merge SHARD...     one class's reports from the shards' progress files
    python3 -m grader verify             the GPU suite: build, test every stage, engine, benchmarks,
                                         and the sm_75 stages built as compute_75 PTX
    python3 -m grader compile-check      compile every kernel (solutions and skeletons), sm_80+sm_90,
                                         then sm_75 for the stages that claim it

Exit status: 0 full marks, 1 anything less (failed, TODO, or not graded here), 2 bad usage
or a report (--json, --junit) that could not be written, 130 stopped by Ctrl-C.
`class`: 0 the reports are written, 2 bad usage, tests that do not collect or a report that
could not be written, 3 the course's tests changed while a student was graded, 130 Ctrl-C.
`merge`: 0 the reports are written, 2 shards that are not one class's run (said in one line)
or a report that could not be written.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from course import manifest
from grader import arguments, capability, children, report, runner


def _grade_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--extra-tests", type=Path, metavar="DIR", help=arguments.EXTRA_TESTS_HELP)
    p.add_argument("--json", type=Path, metavar="FILE", help="write the results as JSON")
    p.add_argument("--junit", type=Path, metavar="FILE", help="write the results as JUnit XML")
    arguments.add_test_timeout(p, runner.DEFAULT_TEST_TIMEOUT)
    p.add_argument("-v", "--verbose", action="store_true", help="show pytest's own output")


def grade_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python3 -m grader", description="Grade one stage.")
    p.add_argument("stage", help="stage id, e.g. 01 or 7 or 07_attention; `all` grades every "
                                 "stage and prints the course map; `next` finds the first stage "
                                 "without full marks and shows its report")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--cumulative", action="store_true",
                      help="use your parts of stages 01..NN, not only NN")
    mode.add_argument("--solution", action="store_true", help="grade the reference solution")
    arguments.add_student_root(p)
    p.add_argument("--bench", action="store_true",
                   help="not graded: time your kernels of the stage beside the reference's and "
                        "torch's (GB/s or TFLOP/s, share of a same-bytes copy); needs a GPU")
    _grade_args(p)
    args = p.parse_args(argv)
    _check_args(p, args)
    if args.stage in ("all", "next"):
        if not args.solution:   # a root one level off would fail every stage's every test
            first = next(s for s in manifest.stages() if s.ready)
            arguments.student_stage_dir(p, args.student_root, first.dir)
        return course_main(args)
    stage = manifest.find_ready(args.stage)
    if not args.solution:
        arguments.student_stage_dir(p, args.student_root, stage.dir)
    if args.bench:
        from grader import bench
        too_old = capability.too_old(stage)
        if too_old:
            print(f"{too_old}: not measured.")
            return 0
        return bench.main(stage, args.student_root, solution=args.solution, json_path=args.json)
    with capability.check(stage):
        result = runner.run_stage(stage, _student_ids(stage, args), args.student_root,
                                  args.extra_tests, args.timeout, args.verbose,
                                  listener=report.LivePrinter(extra_tests=args.extra_tests))
    print("\n".join(report.footer(result)))
    if not _write_reports(args, [result]):
        return 2
    return 0 if result.full_marks else 1


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors now, not after minutes of grading (grader/arguments.py says why)."""
    arguments.positive_seconds(p, timeout=args.timeout)
    arguments.existing_dirs(p, student_root=args.student_root, extra_tests=args.extra_tests)
    arguments.writable_files(p, json=args.json, junit=args.junit)
    arguments.replay_seed(p)
    if args.extra_tests:   # the tests run with the course as their working folder
        args.extra_tests = args.extra_tests.resolve()
        warning = report.unmatched_warning(args.extra_tests)
        if warning:
            print(warning, file=sys.stderr)


def _student_ids(stage: manifest.Stage, args: argparse.Namespace) -> list[str]:
    """Whose parts stand for which stage: the student's NN (or 01..NN), or none."""
    if args.solution:
        return []
    if args.cumulative:
        return [s.id for s in manifest.upto(stage) if s.ready]
    return [stage.id]


def _write_reports(args: argparse.Namespace, results: list[runner.StageResult]) -> bool:
    """Each report on its own: one that cannot be written (a full disk) is said in one line
    and does not cost the other. False if any failed."""
    writers = [(args.json, lambda: report.write_json(args.json,
                                                     [report.as_dict(r) for r in results])),
               (args.junit, lambda: report.write_junit(args.junit, [("", r) for r in results]))]
    return report.write_each([(path, write) for path, write in writers if path])


def course_main(args: argparse.Namespace) -> int:
    """`all`: every ready stage, then the course map. `next`: stages in order until the first
    one that is not done, whose full report is shown. Without a GPU a stage whose only misses
    are 'not graded' kernel tests counts as done here (it cannot do better on this machine)."""
    results: list[runner.StageResult] = []
    for stage in (s for s in manifest.stages() if s.ready):
        with capability.check(stage):
            print(f"grading stage {stage.id} ({stage.dir})...", end=" ", flush=True)
            result = runner.run_stage(stage, _student_ids(stage, args), args.student_root,
                                      args.extra_tests, args.timeout, args.verbose)
        results.append(result)
        print(report.score_line(result), flush=True)
        if args.extra_tests:
            print("  " + report.hidden_line(stage, args.extra_tests,
                                            [t.name for t in result.tests]), flush=True)
        if args.stage == "next" and not report.done_here(result):
            print("\n" + report.render(result))
            print(f"\nNext: stage {stage.id}, {stage.title}. "
                  f"The lesson is stages/{stage.dir}/README.md; "
                  f"grade it alone with `nox -s grade -- {stage.id}`.")
            return 1 if _write_reports(args, results) else 2
    print("\n" + report.course_map(results))
    if args.stage == "next":
        print("\nEvery available stage is done on this machine.")
    if not _write_reports(args, results):
        return 2
    return 0 if all(r.full_marks for r in results) else 1


def list_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python3 -m grader list",
                                description="The stages, from the manifest.")
    p.parse_args(argv)   # takes no arguments: an extra one is a usage error
    for s in manifest.stages():
        flag = "gpu" if s.gpu else "cpu"
        status = "" if s.ready else "  (planned: not available yet)"
        print(f"{s.id}  {s.dir:<24} {flag}  {s.points:>3} pts  {s.title}{status}")
    return 0


def class_main(argv: list[str]) -> int:
    """Grade a whole class, each student sandboxed and judged apart (grader/classroom/)."""
    from grader.classroom import cli
    return cli.main(argv)


def merge_main(argv: list[str]) -> int:
    """One class's reports from the progress files of its shards."""
    from grader.classroom import merge
    return merge.main(argv)


def main(argv: list[str]) -> int:
    children.install()   # test and student processes end with the grader (grader/children.py)
    commands = {"list": list_main, "class": class_main, "merge": merge_main}
    try:
        if argv and argv[0] in ("verify", "compile-check", "reset", "emulate", "mutants"):
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
    except KeyboardInterrupt:   # the test processes end with the grader (children.install)
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
