"""What the grader prints and writes: a per-test table and score, JSON, JUnit XML, CSV."""
from __future__ import annotations

import csv
import json
import xml.etree.ElementTree as ET
from pathlib import Path

from grader.runner import StageResult

LABELS = {
    "passed": "passed",
    "failed": "FAILED",
    "todo": "TODO",
    "not_graded": "not graded: no CUDA device",
    "skipped": "skipped (counts zero)",
    "timeout": "TIMED OUT",
    "crashed": "CRASHED",
}


def short_name(test: str) -> str:
    """'stages/01_load/tests/test_bf16.py::test_ties[3]' -> 'test_bf16.py::test_ties[3]'."""
    return test.rsplit("/", 1)[-1]


def first_line(text: str, width: int = 90) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= width else line[: width - 3] + "..."


def render(result: StageResult, details: int = 12) -> str:
    stage = result.stage
    out = [f"Stage {stage.id} -- {stage.title}", f"  using: {result.selection}"]
    if result.build:
        out.append("  kernels: " + result.build.replace("\n", "\n    "))
    out.append("")
    width = max([len(short_name(t.name)) for t in result.tests] + [20])
    for t in result.tests:
        note = ""
        if t.outcome in ("todo", "failed", "timeout", "crashed"):
            note = "  " + first_line(t.message)
        out.append(f"  {short_name(t.name):<{width}}  {LABELS.get(t.outcome, t.outcome)}{note}")
    for err in result.errors:
        out += ["", "  ERROR " + err.replace("\n", "\n    ")]
    failures = [t for t in result.tests if t.outcome in ("failed", "timeout", "crashed")]
    for t in failures[:details]:
        out += ["", f"--- {short_name(t.name)}", *("    " + ln for ln in t.message.splitlines())]
    if len(failures) > details:
        out.append(f"\n({len(failures) - details} more failures not shown; see --json)")
    counts = result.counts()
    summary = ", ".join(f"{n} {LABELS.get(k, k)}" for k, n in sorted(counts.items()))
    out += ["", f"Score: {result.score:g}/{stage.points}  ({summary or 'no tests ran'})"]
    if counts.get("not_graded"):
        out.append("  Tests marked 'not graded' need a CUDA GPU; they count zero here. "
                   "Grade again on a machine with one for full marks.")
    if counts.get("todo"):
        out.append("  TODO: parts of this stage are not written yet; the messages say which.")
    return "\n".join(out)


def as_dict(result: StageResult) -> dict:
    return {
        "stage": result.stage.id, "dir": result.stage.dir, "title": result.stage.title,
        "selection": result.selection, "score": result.score, "max_score": result.stage.points,
        "full_marks": result.full_marks, "counts": result.counts(), "errors": result.errors,
        "build": result.build,
        "tests": [{"name": t.name, "outcome": t.outcome, "points": t.points,
                   "seconds": t.seconds, "message": t.message} for t in result.tests],
    }


def write_json(path: Path, results: list[dict]) -> None:
    Path(path).write_text(json.dumps(results if len(results) != 1 else results[0], indent=2))


def write_junit(path: Path, suites: list[tuple[str, StageResult]]) -> None:
    """One <testsuite> per (student, stage); not-graded tests are <skipped>, never passed."""
    root = ET.Element("testsuites")
    for label, result in suites:
        counts = result.counts()
        suite = ET.SubElement(root, "testsuite", name=f"{label}stage {result.stage.id}",
                              tests=str(len(result.tests)),
                              failures=str(sum(counts.get(k, 0) for k in
                                               ("failed", "todo", "timeout", "crashed"))),
                              errors=str(len(result.errors)),
                              skipped=str(counts.get("not_graded", 0) + counts.get("skipped", 0)))
        ET.SubElement(suite, "properties").extend([
            ET.Element("property", name="score", value=f"{result.score:g}"),
            ET.Element("property", name="max_score", value=str(result.stage.points))])
        for err in result.errors:
            ET.SubElement(suite, "error", message=first_line(err)).text = err
        for t in result.tests:
            case = ET.SubElement(suite, "testcase", name=short_name(t.name),
                                 classname=f"stage{result.stage.id}", time=f"{t.seconds:.3f}")
            if t.outcome in ("not_graded", "skipped"):
                ET.SubElement(case, "skipped", message=t.message)
            elif t.outcome != "passed":
                ET.SubElement(case, "failure", message=first_line(t.message),
                              type=t.outcome).text = t.message
    ET.ElementTree(root).write(path, encoding="unicode", xml_declaration=True)


def write_csv(path: Path, rows: list[dict[str, str]]) -> None:
    fields = list(rows[0]) if rows else ["student"]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
