"""`python3 -m grader class SUBMISSIONS`: grade every student, each in isolation.

Each finished (student, stage) is appended to the progress file at once (one JSON line), so
a run that is killed keeps what it did; `--resume` grades only what is missing. Reports
(CSV, JSON, JUnit XML, similarity) are written from the progress file at the end.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from course import manifest
from grader import arguments, environment, report, runner
from grader.classroom import collect, grade, reports, sandbox, shards, similarity, submission
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
    p.add_argument("--extra-tests", type=Path, metavar="DIR", help=arguments.EXTRA_TESTS_HELP)
    p.add_argument("--progress", type=Path, metavar="FILE",
                   help="results appended as each student finishes "
                        "(default: SUBMISSIONS-progress.jsonl beside SUBMISSIONS)")
    p.add_argument("--resume", action="store_true",
                   help="keep the results already in the progress file; grade the rest")
    p.add_argument("--shard", metavar="I/N",
                   help="grade only the I-th of N shards of the class (a student's shard "
                        "depends on the name alone); join them with `grader merge`")
    p.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="seconds one test (or one call into student code) may take (default %(default)s)")
    p.add_argument("--compile-timeout", type=float, default=180.0, metavar="S",
                   help="seconds the compiler may take on one student's kernels (default %(default)s)")
    p.add_argument("--student-timeout", type=float, default=900.0, metavar="S",
                   help="seconds all of one student's tests of a stage (CPU and GPU) may take "
                        "together (default %(default)s)")
    p.add_argument("-v", "--verbose", action="store_true", help="show pytest's own output")
    args = p.parse_args(argv)
    arguments.positive_seconds(p, timeout=args.timeout, compile_timeout=args.compile_timeout,
                               student_timeout=args.student_timeout)
    arguments.existing_dirs(p, extra_tests=args.extra_tests)
    arguments.writable_files(p, csv=args.csv, json=args.json, junit=args.junit,
                             similarity=args.similarity, progress=args.progress)
    arguments.replay_seed(p)
    try:
        args.shard = shards.parse(args.shard) if args.shard else (1, 1)
    except shards.ShardError as e:
        p.error(str(e))
    if args.extra_tests:   # the tests run with the course as their working folder
        args.extra_tests = args.extra_tests.resolve()
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    # torch's OpenMP threads spin for a while after each parallel region; in the judge, which
    # waits for the worker between every call, and on a machine shared with other work, the
    # spinning took the CPU the worker needed (stage 11's soak test on a loaded 2-core
    # machine: 115 s of CPU instead of 13). The instructor's own setting wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if not args.submissions.is_dir():
        raise manifest.UnknownStage(f"{args.submissions} is not a directory of submissions")
    subs = args.submissions.resolve()
    index, count = args.shard
    args.progress = args.progress or subs.with_name(
        subs.name + ("-progress.jsonl" if count == 1 else f"-shard-{index}-of-{count}.jsonl"))
    if args.stages is not None and not args.stages.strip(" ,"):
        raise manifest.UnknownStage(f"--stages {args.stages!r} names no stage")
    chosen = (list(dict.fromkeys(manifest.find_ready(x) for x in args.stages.split(",")
                                 if x.strip()))
              if args.stages is not None else [s for s in manifest.stages() if s.ready])
    students = submission.students(args.submissions, tuple(
        p for p in (args.csv, args.json, args.junit, args.similarity, args.progress) if p))
    if not students:   # a mistyped or one-level-off path: nothing graded must not read as done
        raise manifest.UnknownStage(f"{args.submissions} holds no student folders: nothing to "
                                    "grade (SUBMISSIONS is the folder that holds one folder per "
                                    "student)")
    students = [s for s in students if shards.shard_of(s.name, count) == index]
    if any(s.name == similarity.REFERENCE for s in students):
        raise manifest.UnknownStage(
            f"{subs / similarity.REFERENCE} is a student named {similarity.REFERENCE!r}, the "
            "similarity report's name for the course's solution: rename the folder "
            "(reference_student, say) and run again")
    try:
        return _grade_class(args, chosen, students)
    except KeyboardInterrupt:   # children.install has killed the test and student processes
        kept = load_progress(args.progress) if args.progress.exists() else {}
        graded = sum(all((s.name, stage.id) in kept for stage in chosen) for s in students)
        print(f"\ninterrupted: {graded} of {len(students)} students graded and kept in "
              f"{args.progress}; run the same command with --resume to go on", file=sys.stderr)
        return 130


def _grade_class(args: argparse.Namespace, chosen: list[manifest.Stage],
                 students: list[submission.Student]) -> int:
    subs = args.submissions.resolve()
    print(f"sandbox: {sandbox.mode()}")
    warning = report.unmatched_warning(args.extra_tests) if args.extra_tests else ""
    if warning:
        print(warning, file=sys.stderr)
    cases = {}
    for stage in chosen:
        cases[stage.id], problem = collect.collect(runner.test_paths(stage, args.extra_tests))
        if problem or not cases[stage.id]:
            print(f"error: {_not_collecting(stage, args.extra_tests, problem)}", file=sys.stderr)
            return 2
        if args.extra_tests:
            print(report.hidden_line(stage, args.extra_tests, [c.name for c in cases[stage.id]]))
    basis = {stage.id: grade_basis(stage, cases[stage.id], args) for stage in chosen}
    outputs = [p for p in (args.csv, args.json, args.junit, args.similarity, args.progress) if p]
    hidden = [subs, *(p.resolve().parent for p in outputs),
              *([args.extra_tests] if args.extra_tests else [])]
    settings = grade.Settings(args.extra_tests, args.timeout, args.compile_timeout,
                              args.verbose, args.student_timeout,
                              hidden=[p for p in hidden if p not in SYSTEM])
    done = load_progress(args.progress) if args.resume else {}
    kept_shard = shards.shard_in(args.progress) if args.resume else None
    if kept_shard not in (None, args.shard):
        print(f"error: --resume: {args.progress} holds shard {kept_shard[0]}/{kept_shard[1]}, "
              f"not {args.shard[0]}/{args.shard[1]}: give each shard its own --progress file",
              file=sys.stderr)
        return 2
    mismatch = resume_mismatch(done, basis)
    if mismatch:
        print(f"error: --resume: the grades in {args.progress} {mismatch}", file=sys.stderr)
        return 2
    args.progress.parent.mkdir(parents=True, exist_ok=True)
    head = shards.header(*args.shard, [s.id for s in chosen], [s.name for s in students])
    args.progress.write_text("".join(json.dumps(r) + "\n" for r in [head, *done.values()]))
    shared_tests = [s.tests_dir() for s in chosen] + ([args.extra_tests] if args.extra_tests
                                                      else [])
    guarded = fingerprint(shared_tests)
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
                if fingerprint(shared_tests) != guarded:
                    print(f"error: the course's tests or code changed while {student.name} was "
                          f"graded (stage {stage.id}, not kept): stopping. Restore your copy "
                          "of the course (git status) and run again with --resume.",
                          file=sys.stderr)
                    return 3
                record = {"student": clean(student.name, 200), **report.as_dict(result),
                          "problems": [clean(p, 500) for p in problems],
                          "basis": basis[stage.id], "lines": _lines(student, stage)}
                append(args.progress, record)
                done[student.name, stage.id] = record
                print(f"{clean(student.name, 200):<24} stage {stage.id}: "
                      f"{result.score:g}/{stage.points}"
                      + (f"   ({'; '.join(problems)[:200]})" if problems else ""), flush=True)
    # a report that cannot be written is said, the others are still written, and the results
    # stay in the progress file for --resume
    return 0 if write_reports(args, chosen, students, done) else 2


def _not_collecting(stage: manifest.Stage, extra_tests: Path | None, problem: str) -> str:
    """Whose tests of `stage` do not collect: the hidden ones when the course's own do."""
    hidden = runner.hidden_dirs(stage, extra_tests)
    if hidden:
        own, own_problem = collect.collect([stage.tests_dir()])
        if own and not own_problem:
            return (f"the hidden tests in {' and '.join(map(str, hidden))} (stage {stage.id}) "
                    f"do not collect:\n{problem}")
    return f"the course's tests of stage {stage.id} do not collect:\n{problem}"


def load_progress(path: Path) -> dict[tuple[str, str], dict]:
    done = {}
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
                done[record["student"], record["stage"]] = record   # the header: KeyError
            except (ValueError, KeyError, TypeError):
                continue   # the line being written when the run was killed
    return done


def append(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def fingerprint(roots: list[Path], cases: list[collect.Case] | None = None) -> str:
    """A hash of the tests under `roots`, the pytest setup that every student shares and (when
    given) the test list with its points: what a grade is made against (the last line of
    defence where no sandbox hides them). Files count by their path below their root, so a
    copy of the course or of the hidden tests moved elsewhere hashes the same."""
    h = hashlib.sha256()
    files = [(f.name, f) for f in (manifest.ROOT / "conftest.py", manifest.ROOT / "pyproject.toml")]
    for root in roots:
        files += [(f"{root.name}/{p.relative_to(root).as_posix()}", p)
                  for p in sorted(Path(root).rglob("*"))
                  if p.is_file() and "__pycache__" not in p.parts]
    for name, f in files:
        h.update(name.encode() + b"\0" + (f.read_bytes() if f.exists() else b"-") + b"\0")
    for c in cases or []:
        h.update(json.dumps([c.name, c.points, c.gpu]).encode() + b"\0")
    return h.hexdigest()


LIMITS = shards.LIMITS


def grade_basis(stage: manifest.Stage, cases: list[collect.Case],
                args: argparse.Namespace) -> dict:
    """What a grade of `stage` depends on besides the student's files, kept in its progress
    record: its tests (the course's and the hidden ones), the time limits, and whether this
    machine has a CUDA device (without one the GPU tests read 'not graded')."""
    hidden = runner.hidden_counts(stage, args.extra_tests, [c.name for c in cases])
    return {"tests": fingerprint(runner.test_paths(stage, args.extra_tests), cases),
            "hidden_tests": sum(n for _, n in hidden), "cuda": environment.has_cuda(),
            "device": device_kind(), **{limit: getattr(args, limit) for limit in LIMITS}}


@functools.lru_cache(maxsize=1)
def device_kind() -> str:
    """The GPU the GPU tests run on ("none" without one): shards graded on different GPUs
    are not one class's run. Asked in a child process: a CUDA context here would hold GPU
    memory for the whole run, beside every student's tests."""
    if not environment.has_cuda():
        return "none"
    name = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda."
                           "get_device_name(0))"], capture_output=True, text=True, timeout=120)
    return name.stdout.strip() or "cuda"


def resume_mismatch(done: dict[tuple[str, str], dict], basis: dict[str, dict]) -> str:
    """Why the grades kept for --resume were made against other tests or limits than this
    run's, as the end of a sentence about them; "" when they were not (or there are none)."""
    differ: list[str] = []
    for (_, stage_id), record in done.items():
        then, now = record.get("basis"), basis.get(stage_id)
        if now is None:
            continue     # a stage this run does not grade: kept, not reported
        if not isinstance(then, dict):
            return ("do not say what they were graded against (an older grader wrote them): "
                    "run without --resume to grade afresh")
        differ += shards.basis_differences(stage_id, then, now)
    if not differ:
        return ""
    return (f"were made against other tests or limits ({'; '.join(dict.fromkeys(differ))}): "
            "run the first run's command (the same --extra-tests and timeouts) with --resume, "
            "or this one without --resume to grade afresh")


def _lines(student: submission.Student, stage: manifest.Stage) -> list[list[str]]:
    return [] if student.invalid else reports.lines_of(
        submission.read_parts(student, stage).files, stage)


def write_reports(args: argparse.Namespace, chosen: list[manifest.Stage],
                  students: list[submission.Student], done: dict[tuple[str, str], dict]
                  ) -> bool:
    """The CSV, JSON, JUnit and similarity reports, each on its own; False if one failed.
    Grades kept from an older progress file get their lines from the submission."""
    for student in students:
        for stage in chosen:
            if "lines" not in done[student.name, stage.id]:
                done[student.name, stage.id]["lines"] = _lines(student, stage)
    outputs = reports.Outputs(args.csv, args.json, args.junit, args.similarity)
    return reports.write(outputs, chosen, [s.name for s in students], done)
