"""A hostile class for the GPU: stage 03's kernel (embedding.cu), graded by `grader class`.

Each hostile student is graded before an honest one (the reference kernel, must keep 100)
and an untouched skeleton (must keep 0), in that order, so a student who hangs or poisons the
GPU would show up in the grades of those graded after them. `python3 -m grader verify` runs
`check()` on a GPU machine and fails if any expectation is wrong; without a CUDA device every
GPU test is "not graded" (never passed) and what can be checked without one still is (the
submission problems, the builds where a CUDA toolkit exists, nobody above 0).

    python3 -m tests.hostile.gpu_class [--out DIR] [--only NAME,NAME]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from course import manifest
from grader import children

STAGE = "03"
PART = "embedding.cu"
# The limits the check grades under (seconds): small, so the endless kernel costs little.
LIMITS = {"--timeout": "20", "--student-timeout": "40", "--compile-timeout": "30"}


def _source(kind: str) -> str:
    stage = manifest.find(STAGE)
    folder = stage.solution_dir() if kind == "solution" else stage.skeleton_dir()
    return (folder / PART).read_text()


def _honest_with(helpers: str, at_launch: str = "", in_kernel: str = "") -> str:
    """The reference kernel with something added: helper code before the launcher, a
    statement at the top of launch_embedding, a statement at the top of the kernel."""
    text = _source("solution")
    head = "tvllm_status launch_embedding("
    guard = 'if (tokens > INT32_MAX) return "more than 2^31 - 1 tokens in one call";'
    body = "  // BEGIN SOLUTION: look up this block's id"
    assert text.count(head) == 1 and guard in text and body in text
    text = text.replace(head, helpers + "\n" + head)
    text = text.replace(guard, guard + "\n  " + at_launch)
    return text.replace(body, "  " + in_kernel + "\n" + body)


def endless(root: Path, classmate: Path) -> str:
    # spins on a flag nothing sets (an atomic read: the loop cannot be optimised away)
    return _honest_with("", in_kernel="while (atomicAdd(error, 0) == 0) { }")


def sticky_fault(root: Path, classmate: Path) -> str:
    # one shape only (1031 tokens of 576 bf16: 1152-byte rows) writes to address 16
    return _honest_with("__global__ void hostile_poke(int* p) { *p = 1; }",
                        "if (tokens == 1031 && row_bytes == 1152) "
                        "hostile_poke<<<1, 1, 0, stream>>>(reinterpret_cast<int*>(16));")


def printf_flood(root: Path, classmate: Path) -> str:
    # the reference's result, plus about a megabyte of device printf on every launch
    return _honest_with(
        "#include <cstdio>\n__global__ void hostile_flood() {\n"
        '  printf("%d:%d flooding the grader\'s output with a line per thread ..........'
        '......................................................\\n", blockIdx.x, threadIdx.x);\n}',
        "hostile_flood<<<64, 256, 0, stream>>>();")


def include_solution(root: Path, classmate: Path) -> str:
    return f'#include "{root}/solutions/03_embedding/embedding.cu"\n'


def include_classmate(root: Path, classmate: Path) -> str:
    return (f'#define CLASSMATE "{classmate}/03_embedding/embedding.cu"\n'
            "#include CLASSMATE\n")


def include_bomb(root: Path, classmate: Path) -> str:
    # includes itself twice at every level: 2^200 includes before the depth limit ends any
    return '#include "embedding.cu"\n#include "embedding.cu"\n' + _source("skeleton")


@dataclass
class Expect:
    """What grading must give. `outcome` for every test but those named (by a part of their
    node id) in `except_`; the score is what those outcomes are worth. `problem` must be in
    the submission's problems, `build` in the build status (on a GPU machine)."""
    outcome: str
    except_: dict[str, str] = field(default_factory=dict)
    problem: str = ""
    build: str = ""     # alternatives separated by " | ": any one of them


def _has_one_of(status: str, alternatives: str) -> bool:
    return any(alt in status for alt in alternatives.split(" | "))


HONEST, SKELETON = "z_honest", "z_skeleton"     # graded after every hostile student
CLASS: dict[str, tuple] = {
    "h_endless_kernel": (endless, Expect("timeout", build="ok")),
    "h_sticky_fault": (sticky_fault, Expect(
        "passed", {"test_embedding_matches_torch[1031-576-bf16]": "crashed"}, build="ok")),
    "h_printf_flood": (printf_flood, Expect("passed", build="ok")),
    "h_include_solution": (include_solution, Expect(
        "failed", problem="a path outside the course's headers", build="FAILED")),
    "h_include_classmate": (include_classmate, Expect(
        "failed", problem="a computed include", build="FAILED")),
    # The bomb ends one of two ways, both a failed build that grades 0 and stops nothing: the
    # grader kills the compiler at its timeout (2 cores), or the compiler gives up at the
    # include-depth limit after millions of errors (16 cores, the H200 machine), whose output
    # the build status cuts to its first lines.
    "h_include_bomb": (include_bomb, Expect(
        "failed", build="did not finish within | #include nested depth 200 exceeds")),
    HONEST: (lambda root, classmate: _source("solution"), Expect("passed", build="ok")),
    SKELETON: (lambda root, classmate: _source("skeleton"), Expect("todo", build="ok")),
}
# A slice for CI (no GPU there): the rejected includes and, with a CUDA toolkit, the compile
# timeout; nothing else compiles, so it stays quick. The whole class: nox -s class-corpus.
CPU_SUBSET = ["h_include_solution", "h_include_classmate", "h_include_bomb"]


def build_class(subs: Path, names: list[str]) -> None:
    stage = manifest.find(STAGE)
    for name in names:
        folder = subs / name / stage.dir
        folder.mkdir(parents=True)
        make = CLASS[name][0]
        (folder / PART).write_text(make(manifest.ROOT, subs / HONEST))


def compare(name: str, record: dict, on_gpu: bool, toolchain: bool) -> list[str]:
    """What differs from the expectation (empty: as expected)."""
    expect = CLASS[name][1]
    wrong = []
    if expect.problem and expect.problem not in " ".join(record.get("problems", [])):
        wrong.append(f"problems {record.get('problems')} lack {expect.problem!r}")
    tests = record["tests"]
    if not tests:
        return wrong + ["no tests"]
    if on_gpu:
        for t in tests:
            want = next((o for key, o in expect.except_.items() if key in t["name"]),
                        expect.outcome)
            if t["outcome"] != want:
                wrong.append(f"{t['name']}: {t['outcome']}, expected {want} "
                             f"({t['message'][:200]})")
        if not _has_one_of(record.get("build", ""), expect.build):
            wrong.append(f"build {record.get('build', '')[:200]!r} lacks {expect.build!r}")
        passed = sum(t["points"] for t in tests
                     if next((o for k, o in expect.except_.items() if k in t["name"]),
                             expect.outcome) == "passed")
        want_score = round(100 * passed / sum(t["points"] for t in tests), 1)
    else:
        wrong += [f"{t['name']}: {t['outcome']} without a CUDA device"
                  for t in tests if t["outcome"] != "not_graded"][:3]
        # the build is checked here too: with a CUDA toolkit it is the same as on a GPU
        # machine; without one, rejected sources fail and the others are not built
        build = record.get("build", "")
        want = expect.build if toolchain or expect.build == "FAILED" else "not built here"
        if not _has_one_of(build, want):
            wrong.append(f"build {build[:200]!r} lacks {want!r}")
        want_score = 0.0
    if record["score"] != want_score:
        wrong.append(f"score {record['score']}, expected {want_score}")
    if any(len(t["message"].encode()) > 4000 for t in tests):
        wrong.append("a message over 4000 bytes")
    if len(json.dumps(record)) > 256 << 10:
        wrong.append(f"the record is {len(json.dumps(record))} bytes")
    return wrong


def check(out: Path | None = None, only: list[str] | None = None, stream=sys.stdout,
          limits: dict[str, str] | None = None) -> tuple[bool | None, list[str]]:
    """Grade the class and compare. Returns (True: every expectation met on a GPU; False:
    something is wrong; None: not graded, no CUDA device, though what could be checked
    without one was), and the table's lines."""
    import torch
    from grader.classroom import grade
    on_gpu = torch.cuda.is_available()
    toolchain = not grade._toolchain_missing()
    names = only or list(CLASS)
    with tempfile.TemporaryDirectory(prefix="tinyvllm-gpu-class-") as tmp:
        subs, report = Path(tmp) / "class", Path(tmp) / "reports" / "grades.json"
        report.parent.mkdir()
        build_class(subs, names)
        args = [sys.executable, "-m", "grader", "class", str(subs), "--stages", STAGE,
                "--json", str(report), "--progress", str(report.parent / "progress.jsonl"),
                *[x for kv in {**LIMITS, **(limits or {})}.items() for x in kv]]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(manifest.ROOT), os.environ.get("PYTHONPATH")]))}
        start = time.time()
        proc = subprocess.Popen(args, cwd=manifest.ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        log = []
        for line in proc.stdout:
            log.append(line)
            print("  " + line, end="", file=stream, flush=True)
        proc.wait()
        seconds = time.time() - start
        if out:
            out.mkdir(parents=True, exist_ok=True)
            (out / "gpu_class.log").write_text("".join(log))
            if report.exists():
                (out / "gpu_class.json").write_text(report.read_text())
        if proc.returncode != 0 or not report.exists():
            return False, [f"| GPU class (stage {STAGE}) | grader class exited "
                           f"{proc.returncode} |"] + ["".join(log)[-3000:]]
        records = {r["student"]: r for r in json.loads(report.read_text())}
    lines = [f"| GPU class (stage {STAGE}, {len(names)} students, {seconds:.0f} s, "
             f"{'CUDA' if on_gpu else 'no CUDA device'}) | expected | got |", "| --- | --- | --- |"]
    ok = True
    for name in names:
        record = records.get(name)
        wrong = ["not graded at all"] if record is None else compare(name, record, on_gpu,
                                                                     toolchain)
        ok = ok and not wrong
        expect = CLASS[name][1]
        want = expect.outcome + "".join(f", {o} for {k}" for k, o in expect.except_.items())
        counts: dict[str, int] = {}
        for t in (record or {}).get("tests", []):
            counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
        got = f"{(record or {}).get('score', '-')} {counts}"
        lines.append(f"| {name} | {want if on_gpu else 'not graded'} | {got} "
                     f"{'ok' if not wrong else 'WRONG: ' + '; '.join(wrong)[:600]} |")
    if not on_gpu:
        lines.append("| GPU class | not graded: no CUDA device (never passed) | |")
        return (None if ok else False), lines
    return ok, lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tests.hostile.gpu_class")
    p.add_argument("--out", type=Path)
    p.add_argument("--only", help="comma-separated students of CLASS")
    args = p.parse_args(argv)
    children.install()
    ok, lines = check(args.out, args.only.split(",") if args.only else None)
    print("\n".join(lines))
    print("GPU CLASS:", {True: "as expected", None: "not graded (no CUDA device)",
                         False: "WRONG"}[ok])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
