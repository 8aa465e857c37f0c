"""`python3 -m grader.classroom.autograde NN`: grade the stage in a student's repository and
hand GitHub Classroom its points (the template: templates/classroom/).

Classroom's reporter (education/autograding-grading-reporter) reads, for each runner named in
its `runners` input, the environment variable RUNNER_RESULTS: base64 of a JSON object
{version, status, max_score, tests: [{name, status, ...}]}, and scores a runner as the share
of its tests that passed times max_score. It counts tests, not points, so a test worth p
points is listed as p one-point entries: the share of entries passed is the stage's share of
points, as `grader NN` scores it. Tests that cannot run here (GPU tests on a runner without a
CUDA device) are left out of max_score and said so in the log: they are "not graded", never
passed, and the instructor's central grading runs them. The result goes to GITHUB_OUTPUT as
`result`; the exit status is 0 whenever a result was written (the reporter fails the run
when a stage is not complete).
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import sys

from course import manifest
from grader import report, runner


def classroom_result(result: runner.StageResult) -> dict:
    """The reporter's form of one stage's result."""
    graded = [t for t in result.tests if t.outcome != "not_graded"]
    tests = []
    for t in graded:
        units = max(1, round(t.points))
        status = "pass" if t.outcome == "passed" and not result.errors else "fail"
        for k in range(units):
            tests.append({"name": t.name if units == 1 else f"{t.name} [{k + 1}/{units}]",
                          "status": status, "message": t.message[:500], "line_no": 0,
                          "execution_time": f"{t.seconds:.1f}s"})
    for error in result.errors:
        tests.append({"name": "(submission)", "status": "fail", "message": error[:500],
                      "line_no": 0, "execution_time": "0s"})
    if not tests:   # nothing gradable here: no points either way, and the log says why
        tests.append({"name": "not graded on this runner (GPU tests need a CUDA device)",
                      "status": "fail", "message": "", "line_no": 0, "execution_time": "0s"})
    passed = all(t["status"] == "pass" for t in tests)
    max_score = result.stage.points * sum(t.points for t in graded) / (result.weight or 1)
    return {"version": 1, "status": "pass" if passed else "fail",
            "max_score": round(max_score, 1) if graded else 0, "tests": tests}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python3 -m grader.classroom.autograde",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("stage", help="stage id, e.g. 02")
    args = p.parse_args(argv)
    try:
        stage = manifest.find_ready(args.stage)
    except (manifest.UnknownStage, manifest.StageNotAvailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = runner.run_stage(stage, [stage.id], listener=report.LivePrinter())
    print("\n".join(report.footer(result)))
    skipped = [t for t in result.tests if t.outcome == "not_graded"]
    if skipped:
        print(f"not graded on this runner: {len(skipped)} tests "
              f"({sum(t.points for t in skipped):g} points) need a CUDA device; your "
              "instructor's grading runs them")
    encoded = base64.b64encode(json.dumps(classroom_result(result)).encode()).decode()
    out = os.environ.get("GITHUB_OUTPUT")
    if out:
        with open(out, "a") as f:
            f.write(f"result={encoded}\n")
    else:
        print(f"result={encoded}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
