"""The class's reports (CSV, JSON, JUnit XML, similarity), written from the grades alone.

One writer serves `grader class` (from its progress file) and `grader merge` (from the shards'
files): a class graded in shards and merged gets the reports one run would have written.
Each grade carries its submission's meaningful lines (similarity.meaningful), so the
similarity report compares every pair of the whole class without the submissions at hand.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from course import manifest
from grader import report, runner
from grader.classroom import similarity

PRIVATE = ("basis", "lines")    # what a grade line holds for the grader, not for the reports


@dataclass
class Outputs:
    csv: Path | None = None
    json: Path | None = None
    junit: Path | None = None
    similarity: Path | None = None


def lines_of(files: dict[str, bytes], stage: manifest.Stage) -> list[list[str]]:
    """A submission's meaningful lines, as a grade line keeps them (JSON: [part, line])."""
    return sorted([part, line] for part, line in similarity.meaningful(files, stage))


def _result(record: dict) -> runner.StageResult:
    result = runner.StageResult(manifest.find(record["stage"]), record["selection"],
                                errors=record["errors"], build=record["build"])
    result.tests = [runner.TestResult(**t) for t in record["tests"]]
    return result


def write(outputs: Outputs, stages: list[manifest.Stage], students: list[str],
          done: dict[tuple[str, str], dict]) -> bool:
    """Every report asked for, each on its own; False if one could not be written. `students`
    in report order; `done` by (student, stage id)."""
    pairs = []
    for stage in stages:
        lines = {name: {tuple(x) for x in done[name, stage.id].get("lines") or ()}
                 for name in students}
        pairs += similarity.report_lines(stage, lines)
    flagged: dict[tuple[str, str], list[dict]] = {}
    for pair in pairs:
        flagged.setdefault((pair.a, pair.stage), []).append(pair.as_dict())
    rows, records, suites = [], [], []
    for name in students:
        row = {"student": done[name, stages[0].id]["student"]} if stages else {"student": name}
        for stage in stages:
            record = {k: v for k, v in done[name, stage.id].items() if k not in PRIVATE}
            record["similar"] = flagged.get((name, stage.id), [])
            records.append(record)
            suites.append((record["student"], _result(record)))
            row[f"stage_{stage.id}"] = f"{record['score']:g}"
        row["total"] = f"{sum(float(row[f'stage_{s.id}']) for s in stages):g}"
        rows.append(row)
    for p in pairs:
        print(f"similar: {p.a} stage {p.stage}: {p.share:.0%} of {p.lines} lines also in "
              f"{p.b}'s")
    writers = [
        (outputs.csv, lambda: report.write_csv(outputs.csv, rows)),
        (outputs.json, lambda: report.write_json(outputs.json, records, always_list=True)),
        (outputs.junit, lambda: report.write_junit(outputs.junit, suites)),
        (outputs.similarity, lambda: report.write_text(
            outputs.similarity, json.dumps([p.as_dict() for p in pairs], indent=2))),
    ]
    return report.write_each([(path, w) for path, w in writers if path])
