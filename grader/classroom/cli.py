"""`python3 -m grader class SUBMISSIONS`: grade every student, each in isolation.

Each finished (student, stage) is appended to the progress file at once (one JSON line), so
a run that is killed keeps what it did; `--resume` grades only what is missing. Reports
(CSV, JSON, JUnit XML, similarity) are written from the progress file at the end.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

from course import manifest
from grader import arguments, report, runner
from grader.classroom import collect, grade, sandbox, similarity, submission
from grader.classroom.text import clean


# never hidden from the sandbox, even when a report is written there (the system must run)
SYSTEM = {Path(p) for p in ("/", "/usr", "/bin", "/lib", "/lib64", "/etc", "/opt", "/var")}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python3 -m grader class",
        description="Grade a class: every directory under SUBMISSIONS is one student (a clone "
                    "of the course repo, or a folder of NN_name/ stage directories). Each "
                    "student is graded in a sandbox, apart from the tests that judge them.")
    p.add_argument("submissions", type=Path)
    p.add_argument("--stages", default=None,
                   help="comma-separated stage ids (default: every available stage)")
    p.add_argument("--csv", type=Path, metavar="FILE", help="one row per student, a column per stage")
    p.add_argument("--json", type=Path, metavar="FILE", help="every result, test by test")
    p.add_argument("--junit", type=Path, metavar="FILE", help="JUnit XML, a suite per student and stage")
    p.add_argument("--similarity", type=Path, metavar="FILE",
                   help="suspicious pairs (shared lines with the reference or a classmate) as JSON")
    p.add_argument("--extra-tests", type=Path, metavar="DIR",
                   help="instructor's hidden tests: DIR/NN_name/ (or DIR/NN/) is added to stage NN")
    p.add_argument("--progress", type=Path, metavar="FILE",
                   help="results appended as each student finishes "
                        "(default: SUBMISSIONS-progress.jsonl beside SUBMISSIONS)")
    p.add_argument("--resume", action="store_true",
                   help="keep the results already in the progress file; grade the rest")
    p.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="seconds one test (or one call into student code) may take (default %(default)s)")
    p.add_argument("--compile-timeout", type=float, default=180.0, metavar="S",
                   help="seconds the compiler may take on one student's kernels (default %(default)s)")
    p.add_argument("--student-timeout", type=float, default=900.0, metavar="S",
                   help="seconds all of one student's GPU tests of a stage may take together "
                        "(default %(default)s)")
    p.add_argument("-v", "--verbose", action="store_true", help="show pytest's own output")
    args = p.parse_args(argv)
    arguments.positive_seconds(p, timeout=args.timeout, compile_timeout=args.compile_timeout,
                               student_timeout=args.student_timeout)
    arguments.existing_dirs(p, extra_tests=args.extra_tests)
    arguments.writable_files(p, csv=args.csv, json=args.json, junit=args.junit,
                             similarity=args.similarity, progress=args.progress)
    arguments.replay_seed(p)
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    if not args.submissions.is_dir():
        raise manifest.UnknownStage(f"{args.submissions} is not a directory of submissions")
    subs = args.submissions.resolve()
    args.progress = args.progress or subs.with_name(subs.name + "-progress.jsonl")
    if args.stages is not None and not args.stages.strip(" ,"):
        raise manifest.UnknownStage(f"--stages {args.stages!r} names no stage")
    chosen = (list(dict.fromkeys(manifest.find_ready(x) for x in args.stages.split(",")
                                 if x.strip()))
              if args.stages is not None else [s for s in manifest.stages() if s.ready])
    students = submission.students(args.submissions)
    if not students:   # a mistyped or one-level-off path: nothing graded must not read as done
        raise manifest.UnknownStage(f"{args.submissions} holds no student folders: nothing to "
                                    "grade (SUBMISSIONS is the folder that holds one folder per "
                                    "student)")
    print(f"sandbox: {sandbox.mode()}")
    cases = {}
    for stage in chosen:
        cases[stage.id], problem = collect.collect(runner.test_paths(stage, args.extra_tests))
        if problem or not cases[stage.id]:
            print(f"error: the course's tests of stage {stage.id} do not collect:\n{problem}",
                  file=sys.stderr)
            return 2
    outputs = [p for p in (args.csv, args.json, args.junit, args.similarity, args.progress) if p]
    hidden = [subs, *(p.resolve().parent for p in outputs),
              *([args.extra_tests.resolve()] if args.extra_tests else [])]
    settings = grade.Settings(args.extra_tests, args.timeout, args.compile_timeout,
                              args.verbose, args.student_timeout,
                              hidden=[p for p in hidden if p not in SYSTEM])
    done = load_progress(args.progress) if args.resume else {}
    args.progress.write_text("".join(json.dumps(r) + "\n" for r in done.values()))
    guarded = fingerprint(chosen, args.extra_tests)
    with tempfile.TemporaryDirectory(prefix="tinyvllm-class-") as work:
        os.chmod(work, 0o755)
        for student in students:
            for stage in chosen:
                if (student.name, stage.id) in done:
                    continue
                result, problems = grade.grade_stage(student, stage, cases[stage.id], settings,
                                                     Path(work))
                # checked before the record is kept: --resume must not keep a grade made
                # against changed tests
                if fingerprint(chosen, args.extra_tests) != guarded:
                    print(f"error: the course's tests or code changed while {student.name} was "
                          f"graded (stage {stage.id}, not kept): stopping. Restore your copy "
                          "of the course (git status) and run again with --resume.",
                          file=sys.stderr)
                    return 3
                record = {"student": clean(student.name, 200), **report.as_dict(result),
                          "problems": [clean(p, 500) for p in problems]}
                append(args.progress, record)
                done[student.name, stage.id] = record
                print(f"{clean(student.name, 200):<24} stage {stage.id}: "
                      f"{result.score:g}/{stage.points}"
                      + (f"   ({'; '.join(problems)[:200]})" if problems else ""), flush=True)
    # a report that cannot be written is said, the others are still written, and the results
    # stay in the progress file for --resume
    return 0 if write_reports(args, chosen, students, done) else 2


def load_progress(path: Path) -> dict[tuple[str, str], dict]:
    done = {}
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
                done[record["student"], record["stage"]] = record
            except (ValueError, KeyError, TypeError):
                continue   # the line being written when the run was killed
    return done


def append(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def fingerprint(stages: list[manifest.Stage], extra: Path | None) -> str:
    """A hash of the tests, the hidden tests and the pytest setup that every student shares
    (the last line of defence where no sandbox hides them)."""
    h = hashlib.sha256()
    roots = [s.tests_dir() for s in stages] + ([extra] if extra else [])
    files = [manifest.ROOT / "conftest.py", manifest.ROOT / "pyproject.toml"]
    for root in roots:
        files += sorted(p for p in Path(root).rglob("*") if p.is_file()
                        and "__pycache__" not in p.parts)
    for f in files:
        h.update(str(f).encode() + b"\0" + (f.read_bytes() if f.exists() else b"-") + b"\0")
    return h.hexdigest()


def _result(record: dict) -> runner.StageResult:
    result = runner.StageResult(manifest.find(record["stage"]), record["selection"],
                                errors=record["errors"], build=record["build"])
    result.tests = [runner.TestResult(**t) for t in record["tests"]]
    return result


def write_reports(args: argparse.Namespace, chosen: list[manifest.Stage],
                  students: list[submission.Student], done: dict[tuple[str, str], dict]
                  ) -> bool:
    """The CSV, JSON, JUnit and similarity reports, each on its own; False if one failed."""
    pairs = []
    for stage in chosen:
        files = {s.name: submission.read_parts(s, stage).files for s in students if not s.invalid}
        pairs += similarity.report(stage, files)
    flagged: dict[tuple[str, str], list[dict]] = {}
    for pair in pairs:
        flagged.setdefault((pair.a, pair.stage), []).append(pair.as_dict())
    rows, records, suites = [], [], []
    for student in students:
        row = {"student": clean(student.name, 200)}
        for stage in chosen:
            record = done[student.name, stage.id]
            record["similar"] = flagged.get((student.name, stage.id), [])
            records.append(record)
            suites.append((f"{record['student']} ", _result(record)))
            row[f"stage_{stage.id}"] = f"{record['score']:g}"
        row["total"] = f"{sum(float(row[f'stage_{s.id}']) for s in chosen):g}"
        rows.append(row)
    for p in pairs:
        print(f"similar: {p.a} stage {p.stage}: {p.share:.0%} of {p.lines} lines also in "
              f"{p.b}'s")
    writers = [
        (args.csv, lambda: report.write_csv(args.csv, rows)),
        (args.json, lambda: report.write_json(args.json, records, always_list=True)),
        (args.junit, lambda: report.write_junit(args.junit, suites)),
        (args.similarity, lambda: report.write_text(
            args.similarity, json.dumps([p.as_dict() for p in pairs], indent=2))),
    ]
    return report.write_each([(path, write) for path, write in writers if path])
