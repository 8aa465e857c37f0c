"""`python3 -m grader mutants NN`: do stage NN's tests catch the mistakes a learner makes?

Each mutant (grader/mutate.py: the mistakes the lesson names, from the stage's
tests/mutants.toml, and automatic small changes of the Python TODO regions) is one part of
the reference with one change. It is copied with the stage's other parts into a temporary
student folder (solutions/ is never touched) and the stage's tests run against it, as the
grader runs a learner's, stopping at the first failure: a failing, hanging or crashing test
KILLS the mutant; all passing, it SURVIVED (a hole in the tests). A listed mistake must also
be NAMED: its failure message contains the entry's `expect` words.

Kernels (.cu) run in the CPU emulator (tests/test_emulated_kernels.py, as `grader emulate`),
or the stage's GPU tests where a CUDA device is present. `quick` in mutants.toml names test
files that catch most mutants cheaply: they run first, for every Python mutant in one
process (grader/mutants_batch.py), and the whole stage only for a mutant they miss.

Exit status: 0 when every listed mistake is killed and named and at least 90% of the
automatic mutants are killed or argued equivalent; 1 otherwise; 2 bad usage.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from course import manifest
from grader import arguments, emulate, mutate, runner

GOAL = 0.9                 # killed or equivalent, of the automatic mutants
KILLING = ("failed", "timeout", "crashed", "todo")
DEFAULT_TIMEOUT = 600.0    # per test of a full run: a serving soak takes minutes on a busy CPU
QUICK_TIMEOUT = 60.0       # per mutant's quick tests (pure Python, seconds)


@dataclass
class Verdict:
    mutant: mutate.Mutant
    killed: bool
    test: str = ""         # the first test that failed
    message: str = ""
    ran: bool = True       # False: a kernel with no emulator test, on a machine without a GPU

    @property
    def named(self) -> bool:
        return self.killed and self.mutant.expect.lower() in self.message.lower()


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def quick_tests(stage: manifest.Stage) -> list[Path]:
    """The stage's cheap test files (mutants.toml's `quick`), or none."""
    path = mutate.list_file(stage)
    quick = tomllib.loads(path.read_text()).get("quick", []) if path.exists() else []
    return [manifest.ROOT / "stages" / stage.dir / "tests" / q for q in quick]


def full_tests(stage: manifest.Stage, file: str) -> tuple[list[Path], tuple[str, ...]]:
    """The tests that judge a mutant of `file`, with pytest's extra arguments: a kernel's
    emulator tests on a machine without a GPU, else the stage's tests."""
    if file.endswith(".cu") and not _has_gpu():
        return [emulate.TEST_FILE], ("-k", emulate.TESTS[stage.id])
    return runner.test_paths(stage, None), ()


def run(stage: manifest.Stage, mutant: mutate.Mutant, timeout: float = DEFAULT_TIMEOUT
        ) -> Verdict:
    """Run the tests that judge the mutant, in a temporary student folder, until the first
    failure (as the grader runs a learner's: each test in a child process, under a limit)."""
    if mutant.file.endswith(".cu") and stage.id not in emulate.TESTS and not _has_gpu():
        return Verdict(mutant, False, ran=False)
    with tempfile.TemporaryDirectory(prefix="tinyvllm-mutant-") as tmp:
        folder = Path(tmp) / stage.dir
        folder.mkdir()
        for part in stage.parts:
            shutil.copy(stage.solution_dir() / part, folder / part)
        (folder / mutant.file).write_text(mutant.text)
        paths, extra = full_tests(stage, mutant.file)
        tests, errors = runner.run_tests(paths, [stage.id], Path(tmp), timeout,
                                         pytest_args=("-x", *extra))
    if errors:
        return Verdict(mutant, True, "collection", errors[0])
    bad = next((t for t in tests if t.outcome in KILLING), None)
    return Verdict(mutant, True, bad.name, bad.message) if bad else Verdict(mutant, False)


def run_quick(stage: manifest.Stage, mutants: list[mutate.Mutant], tests: list[Path],
              timeout: float) -> dict[str, Verdict]:
    """The quick tests of many Python mutants in one child process (grader/mutants_batch.py);
    a mutant the child did not report (it died) is simply left out."""
    with tempfile.TemporaryDirectory(prefix="tinyvllm-mutants-") as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "out.jsonl"
        job.write_text(json.dumps({
            "stage": stage.id, "tests": [str(t) for t in tests], "timeout": timeout,
            "mutants": [{"id": m.id, "file": m.file, "text": m.text} for m in mutants]}))
        env = {**os.environ, "PYTHONPATH": str(manifest.ROOT)}
        subprocess.run([sys.executable, "-m", "grader.mutants_batch", str(job), str(out)],
                       cwd=manifest.ROOT, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False)
        lines = out.read_text().splitlines() if out.exists() else []
    by_id = {m.id: m for m in mutants}
    return {r["id"]: Verdict(by_id[r["id"]], r["killed"], r["test"], r["message"])
            for r in map(json.loads, lines)}


def _line(v: Verdict, equivalent: str | None = None) -> str:
    if equivalent is not None:
        return f"  equivalent  {v.mutant.id}\n              ({equivalent})"
    if not v.ran:
        return f"  not run     {v.mutant.id} (its kernel needs a GPU: no emulator test)"
    if not v.killed:
        return f"  SURVIVED    {v.mutant.id}"
    first = v.message.strip().splitlines()[0] if v.message.strip() else ""
    named = "" if not (v.mutant.listed and v.mutant.expect) else (
        "  named" if v.named else f"  NOT NAMED (no '{v.mutant.expect}')")
    return f"  killed      {v.mutant.id}{named}\n              by {v.test}: {first[:150]}"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python3 -m grader mutants", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", help="stage id, e.g. 11")
    p.add_argument("--listed", action="store_true", help="only the mistakes mutants.toml names")
    p.add_argument("--auto", action="store_true", help="only the automatic mutants")
    p.add_argument("--match", metavar="TEXT", default="",
                   help="only the mutants whose name contains TEXT")
    p.add_argument("--list", action="store_true", help="print the mutants, run nothing")
    p.add_argument("--quick", action="store_true",
                   help="a first pass: only the quick tests (a mutant they miss is reported as "
                        "surviving them, without running the whole stage)")
    arguments.add_test_timeout(p, DEFAULT_TIMEOUT)
    args = p.parse_args(argv)
    arguments.positive_seconds(p, timeout=args.timeout)
    stage = manifest.find_ready(args.stage)
    try:
        listed = [] if args.auto else mutate.listed(stage)
    except mutate.MutantListError as e:
        p.error(str(e))
    auto = [] if args.listed else mutate.automatic(stage)
    equivalent = mutate.equivalents(stage)
    chosen = [m for m in listed + auto if args.match in m.id]
    if args.list:
        for m in chosen:
            print(("listed  " if m.listed else "auto    ") + m.id)
        return 0
    start = time.time()
    print(f"stage {stage.id}: {sum(m.listed for m in chosen)} listed mistakes, "
          f"{sum(not m.listed for m in chosen)} automatic mutants", flush=True)
    quick = quick_tests(stage)
    to_run = [m for m in chosen if m.listed or m.id not in equivalent]
    done = run_quick(stage, [m for m in to_run if m.file.endswith(".py")], quick,
                     min(QUICK_TIMEOUT, args.timeout)) if quick else {}
    verdicts = []
    for m in chosen:
        if m not in to_run:
            verdicts.append(Verdict(m, False))
            print(_line(verdicts[-1], equivalent[m.id]), flush=True)
            continue
        verdict = done.get(m.id)
        if not (verdict and (verdict.killed or args.quick)):
            verdict = run(stage, m, args.timeout)
        verdicts.append(verdict)
        print(_line(verdicts[-1]), flush=True)
    return _summary(verdicts, equivalent, time.time() - start)


def _summary(verdicts: list[Verdict], equivalent: dict[str, str], seconds: float) -> int:
    listed = [v for v in verdicts if v.mutant.listed]
    auto = [v for v in verdicts if not v.mutant.listed]
    ok = True
    if listed:
        ran = [v for v in listed if v.ran]
        expecting = [v for v in ran if v.mutant.expect]
        named = sum(v.named for v in expecting)
        print(f"\nlisted mistakes: {sum(v.killed for v in ran)} of {len(ran)} killed; {named} of "
              f"the {len(expecting)} with an `expect` named by the failure"
              + (f"; {len(listed) - len(ran)} not run here (need a GPU)" if len(ran) < len(listed)
                 else ""))
        ok = all(v.killed for v in ran) and named == len(expecting)
    if auto:
        killed = sum(v.killed for v in auto)
        eq = sum(v.mutant.id in equivalent for v in auto)
        share = (killed + eq) / len(auto)
        print(f"automatic mutants: {killed} killed, {eq} equivalent, "
              f"{len(auto) - killed - eq} survived of {len(auto)}: {share:.0%} killed or "
              f"equivalent (goal {GOAL:.0%})")
        ok = ok and share >= GOAL
    print(f"({seconds:.0f} s)")
    return 0 if ok else 1
