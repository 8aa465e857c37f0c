"""What the grader prints and writes: a per-test table and score, JSON, JUnit XML, CSV."""
from __future__ import annotations

import csv
import io
import json
import os
import secrets
import stat
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Callable, TextIO

from course import manifest
from grader.pytest_plugin import BUILD_FAILED
from grader.runner import Listener, StageResult, TestResult, hidden_counts, unmatched_hidden

LABELS = {
    "passed": "passed",
    "failed": "FAILED",
    "todo": "TODO",
    "not_graded": "not graded: no CUDA device",
    "skipped": "skipped (counts zero)",
    "timeout": "TIMED OUT",
    "crashed": "CRASHED",
    "not_run": "NOT RUN",
}
NOTED = ("todo", "failed", "skipped", "timeout", "crashed", "not_run")   # first line in the table
DETAILED = ("failed", "timeout", "crashed", "not_run")          # full message below it


def short_name(test: str) -> str:
    """'stages/01_load/tests/test_bf16.py::test_ties[3]' -> 'test_bf16.py::test_ties[3]'; a
    hidden test keeps its folder ('02_tokenize/test_h.py::test_x'): DIR/02/ may hold a test
    of the same file and name."""
    file, sep, rest = test.partition("::")
    if file.startswith(("stages/", "tests/")):
        file = file.rsplit("/", 1)[-1]
    return file + sep + rest


def first_line(text: str, width: int = 90) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= width else line[: width - 3] + "..."


def header(stage: manifest.Stage, selection: str) -> list[str]:
    return [f"Stage {stage.id} -- {stage.title}", f"  using: {selection}"]


def build_lines(status: str) -> list[str]:
    return ["  kernels: " + status.replace("\n", "\n    ")] if status else []


def table_width(names: list[str]) -> int:
    return max([len(short_name(n)) for n in names] + [20])


def test_lines(t: TestResult, width: int) -> list[str]:
    """A test's line in the table; a known cause of its failure goes on the line below it."""
    note = ""
    if t.outcome in NOTED:
        note = "  " + first_line(t.message)
    label = LABELS.get(t.outcome, t.outcome)
    if t.outcome == "not_graded" and t.message.startswith("not graded: "):
        label = first_line(t.message)  # "no CUDA device", or the compute capability it needs
    lines = [f"  {short_name(t.name):<{width}}  {label}{note}"]
    cause = next((ln.strip() for ln in t.message.splitlines()
                  if ln.strip().startswith("likely cause:")), "")
    if t.outcome in NOTED and cause:
        lines.append(f"  {'':<{width}}    {first_line(cause, 110)}")
    return lines


def failure_details(result: StageResult, details: int = 12) -> list[str]:
    """Errors, then each distinct failure's details once."""
    out: list[str] = []
    for err in result.errors:
        out += ["", "  ERROR " + err.replace("\n", "\n    ")]
    # Tests that fail with the same message (a missing part, a build error) are shown once.
    groups: dict[str, list[TestResult]] = {}
    for t in result.tests:
        if t.outcome in DETAILED and t.message != BUILD_FAILED:
            groups.setdefault(t.message, []).append(t)
    for message, tests in list(groups.items())[:details]:
        names = short_name(tests[0].name) + (f" (and {len(tests) - 1} more with the same failure)"
                                              if len(tests) > 1 else "")
        out += ["", f"--- {names}", *("    " + ln for ln in message.splitlines())]
    if len(groups) > details:
        out.append(f"\n({len(groups) - details} more failures not shown; see --json)")
    return out


def footer(result: StageResult, details: int = 12) -> list[str]:
    """Errors, each distinct failure's details once, the score and what to do next."""
    out = failure_details(result, details)
    counts = result.counts()
    out += ["", f"Score: {score_line(result)}"]
    if counts.get("not_graded"):
        out.append("  Tests marked 'not graded' need a CUDA GPU; they count zero here. "
                   "Grade again on a machine with one for full marks.")
    if counts.get("todo"):
        out.append("  TODO: parts of this stage are not written yet; the messages say which.")
    if counts.get("not_run"):
        out.append("  NOT RUN: these tests were collected but never reported (they count zero); "
                   "the message says why.")
    if result.unwritten and not counts.get("todo"):   # no test could say it
        hint = gpu_only(result)
        out.append(f"  Not written yet: {', '.join(result.unwritten)} (still the skeleton, or "
                   "still returns or raises its TODO)." + (f" {hint}." if hint else ""))
    return out


def gpu_only(result: StageResult) -> str:
    """For a stage none of whose tests this machine can grade: that, and what can be done
    here instead; else ""."""
    if not result.tests or any(t.outcome != "not_graded" for t in result.tests):
        return ""
    from grader.emulate import TESTS
    if result.stage.id in TESTS:
        return f"GPU-only: `grader emulate {result.stage.id}` runs your kernel on the CPU"
    return "GPU-only: its tests need a CUDA device"


def render(result: StageResult, details: int = 12) -> str:
    out = header(result.stage, result.selection) + build_lines(result.build) + [""]
    width = table_width([t.name for t in result.tests])
    for t in result.tests:
        out += test_lines(t, width)
    return "\n".join(out + footer(result, details))


class LivePrinter(Listener):
    """Prints a grading run as it happens: the build's status, then the table line by line."""

    def __init__(self, stream: TextIO = sys.stdout, extra_tests: Path | None = None):
        self.stream, self.width, self.extra_tests = stream, 20, extra_tests
        self.stage: manifest.Stage | None = None

    def _print(self, lines: list[str], end: str = "\n") -> None:
        print("\n".join(lines), end=end, file=self.stream, flush=True)

    def stage_started(self, result: StageResult) -> None:
        self.stage = result.stage
        self._print(header(result.stage, result.selection))

    def build_started(self) -> None:
        self._print(["  kernels: building..."], end=" ")

    def build_done(self, status: str) -> None:
        self._print([status.replace("\n", "\n    ")])

    def collected(self, tests: list[TestResult]) -> None:
        self.width = table_width([t.name for t in tests])
        if self.extra_tests:
            self._print(["  " + hidden_line(self.stage, self.extra_tests,
                                            [t.name for t in tests])])
        self._print([""])

    def test_done(self, test: TestResult) -> None:
        self._print(test_lines(test, self.width))


def summary(result: StageResult) -> str:
    """'50 passed, 14 not graded: no CUDA device' (counts by outcome)."""
    return ", ".join(f"{n} {LABELS.get(k, k)}" for k, n in sorted(result.counts().items()))


def score_line(result: StageResult) -> str:
    errors = f", {len(result.errors)} collection error(s)" if result.errors else ""
    return f"{result.score:g}/{result.stage.points}  ({summary(result) or 'no tests ran'}{errors})"


def done_here(result: StageResult) -> bool:
    """Everything this machine can grade passed (kernel tests may be 'not graded' without a GPU)
    and every part is written: an untouched kernel's tests are 'not graded' too."""
    return (not result.errors and bool(result.tests) and not result.unwritten
            and all(t.outcome in ("passed", "not_graded") for t in result.tests))


def standing(result: StageResult) -> str:
    """What the course map says beside a stage's score: 'full marks', 'done here', 'not
    started' (every part still a TODO), 'TODO left in X', or nothing (the score says it)."""
    if result.full_marks:
        return "full marks"
    if done_here(result):
        return "done here"
    if result.unwritten and set(result.unwritten) == set(result.stage.parts):
        return "not started"
    return f"TODO left in {', '.join(result.unwritten)}" if result.unwritten else ""


def hidden_line(stage: manifest.Stage, extra_tests: Path, names: list[str]) -> str:
    """'stage 02: +3 hidden tests from /abs/hidden/02_tokenize': which of the instructor's
    hidden tests this stage's run includes, from which folder (names: the tests collected)."""
    counts = hidden_counts(stage, extra_tests, names)
    if not counts:
        return (f"stage {stage.id}: no hidden tests (no {extra_tests.absolute()}/{stage.dir}/ "
                f"or {extra_tests.absolute()}/{stage.id}/)")
    total = sum(n for _, n in counts)
    plural = "s" if total != 1 else ""
    if len(counts) == 1:
        return f"stage {stage.id}: +{total} hidden test{plural} from {counts[0][0]}"
    return (f"stage {stage.id}: +{total} hidden test{plural}: "
            + ", ".join(f"{n} from {d}" for d, n in counts))


def unmatched_warning(extra_tests: Path) -> str:
    """One line for the folders of the hidden tests that name no stage, or ""."""
    stray = unmatched_hidden(extra_tests)
    if not stray:
        return ""
    return (f"warning: --extra-tests {extra_tests.absolute()}: "
            f"{', '.join(d.name + '/' for d in stray)} name{'s' if len(stray) == 1 else ''} "
            "no stage and will not run (a stage's hidden tests go in DIR/NN_name/ or DIR/NN/, "
            "e.g. 02_tokenize/ or 02/)")


def course_map(results: list[StageResult]) -> str:
    """Every stage of the course in order, with the score of those graded."""
    graded = {r.stage.id: r for r in results}
    rows = [("stage", "score", "title")]
    for stage in manifest.stages():
        r = graded.get(stage.id)
        title = stage.title
        if r is None:
            score = "planned" if not stage.ready else "-"
        else:
            mark = standing(r)
            score = f"{r.score:g}/{stage.points}" + (f" {mark}" if mark else "")
            if r.unwritten and gpu_only(r):
                title += f" ({gpu_only(r)})"
        rows.append((stage.dir, score, title))
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    lines = [f"  {a:<{widths[0]}}  {b:<{widths[1]}}  {c}" for a, b, c in rows]
    total = sum(r.score for r in results)
    lines.append(f"\n  total: {total:g}/{sum(r.stage.points for r in results)} over "
                 f"{len(results)} available stage(s)")
    if any(r.counts().get("not_graded") for r in results):
        lines.append("  'done here': every part written and every test this machine can grade "
                     "passed; the kernel tests need a CUDA GPU for full marks.")
    return "\n".join(["Course map"] + lines)


def as_dict(result: StageResult) -> dict:
    return {
        "stage": result.stage.id, "dir": result.stage.dir, "title": result.stage.title,
        "selection": result.selection, "score": result.score, "max_score": result.stage.points,
        "full_marks": result.full_marks, "counts": result.counts(), "errors": result.errors,
        "build": result.build,
        "tests": [{"name": t.name, "outcome": t.outcome, "points": t.points,
                   "seconds": t.seconds, "message": t.message} for t in result.tests],
    }


def write_json(path: Path, results: list[dict], always_list: bool = False) -> None:
    """The results as JSON: a list, or one result alone as its object (`grader NN --json`);
    always_list: a list even of one (a class report is read as one)."""
    bare = len(results) == 1 and not always_list
    write_text(path, json.dumps(results[0] if bare else results, indent=2))


def write_junit(path: Path, suites: list[tuple[str, StageResult]]) -> None:
    """One <testsuite> per (student, stage; student "" for your own grade). A test case is
    named by its full test name and classed "STUDENT.stageNN" (dots in the name become "_"),
    so that a CI viewer, which keys on classname and name, keeps students and test files
    apart. Not-graded tests are <skipped>, never passed; the stage's own errors (a test file
    that did not collect, an invalid submission) are one more test case, "(submission)",
    with an <error>."""
    root = ET.Element("testsuites")
    for student, result in suites:
        counts = result.counts()
        classname = (f"{student.replace('.', '_')}." if student else "") + f"stage{result.stage.id}"
        suite = ET.SubElement(root, "testsuite",
                              name=f"{student} stage {result.stage.id}".lstrip(),
                              tests=str(len(result.tests) + bool(result.errors)),
                              failures=str(sum(counts.get(k, 0) for k in
                                               ("failed", "todo", "timeout", "crashed",
                                                "not_run", "missing"))),
                              errors=str(int(bool(result.errors))),
                              skipped=str(counts.get("not_graded", 0) + counts.get("skipped", 0)),
                              time=f"{sum(t.seconds for t in result.tests):.3f}")
        ET.SubElement(suite, "properties").extend([
            ET.Element("property", name="score", value=f"{result.score:g}"),
            ET.Element("property", name="max_score", value=str(result.stage.points))])
        if result.errors:
            case = ET.SubElement(suite, "testcase", name="(submission)", classname=classname,
                                 time="0.000")
            text = "\n\n".join(result.errors)
            ET.SubElement(case, "error", message=first_line(text), type="error").text = text
        for t in result.tests:
            case = ET.SubElement(suite, "testcase", name=t.name, classname=classname,
                                 time=f"{t.seconds:.3f}")
            if t.outcome in ("not_graded", "skipped"):
                ET.SubElement(case, "skipped", message=t.message)
            elif t.outcome != "passed":
                ET.SubElement(case, "failure", message=first_line(t.message),
                              type=t.outcome).text = t.message
    write_text(path, ET.tostring(root, encoding="unicode", xml_declaration=True))


def write_csv(path: Path, rows: list[dict[str, str]]) -> None:
    fields = list(rows[0]) if rows else ["student"]
    out = io.StringIO(newline="")
    writer = csv.DictWriter(out, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
    write_text(path, out.getvalue())


def write_text(path: Path, text: str) -> None:
    """Write a report whole or not at all: a full disk or a killed run must not leave half a
    report over the last good one. A regular path gets a temporary file beside it, renamed
    over it; anything else (/dev/stdout, a pipe, a symlink) is written through as it is.
    Missing folders above it are made. OSError when it cannot be written (the temporary
    file is removed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        old = path.lstat()
    except FileNotFoundError:
        old = None
    if old is not None and not stat.S_ISREG(old.st_mode):
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        return
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)   # 0o666: the umask applies
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        if old is not None:   # a report rewritten keeps the permissions it was given
            os.chmod(tmp, stat.S_IMODE(old.st_mode))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_each(writers: list[tuple[Path, Callable[[], None]]]) -> bool:
    """Run each (path, write) on its own: one that fails prints `error: cannot write PATH:
    REASON` on stderr and the rest still run. False if any failed."""
    ok = True
    for path, write in writers:
        try:
            write()
        except OSError as e:
            print(f"error: cannot write {path}: {e.strerror or e}", file=sys.stderr)
            ok = False
    return ok
