"""The GPU suite, one command on a bare CUDA machine (nothing to install, no nox):

    PYTHONUNBUFFERED=1 python3 -m grader verify [--out DIR] [--no-bench] [--no-skeletons]

1. builds every solution kernel for the local GPU (and times a one-kernel rebuild);
2. grades every available stage against the reference solutions (must be full marks);
3. grades every skeleton (must score 0, failing with TODO messages, never crashing);
4. runs the project tests that need a GPU (engine equivalence with transformers);
5. runs the kernel benchmark and the serving benchmark (bench.throughput);
and prints a summary table last. With --out, logs and JSON go to DIR.
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from course import build, manifest, parts
from grader import report, runner


def environment() -> dict[str, str]:
    import torch
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "torch cuda": str(torch.version.cuda)}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = f"{props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, " \
                     f"{props.total_memory / 2**30:.0f} GiB)"
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True) if shutil.which("nvidia-smi") else None
    if smi and smi.returncode == 0:
        env["driver"] = smi.stdout.strip()
    try:
        nvcc = subprocess.run([str(build.cuda_home() / "bin" / "nvcc"), "--version"],
                              capture_output=True, text=True).stdout.strip().splitlines()[-1]
        env["nvcc"] = nvcc
    except build.BuildError as e:
        env["nvcc"] = f"not found ({e})"
    for name in ("transformers", "tokenizers", "safetensors"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            env[name] = "not installed"
    return env


def timed_builds() -> dict[str, float]:
    """Build the solutions (cold on a fresh machine), then rebuild after a one-kernel edit."""
    out = {}
    sources = parts.kernel_sources()
    start = time.time()
    build.build(sources)
    out["build of every solution kernel (s)"] = round(time.time() - start, 1)
    edited = next(s for s in sources if s.suffix == ".cu")
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / edited.name
        copy.write_text(edited.read_text() + "\n// edited\n")
        start = time.time()
        build.build([copy if s == edited else s for s in sources])
        out[f"rebuild after editing {edited.name} (s)"] = round(time.time() - start, 1)
    return out


def grade_all(student: bool, timeout: float) -> list[runner.StageResult]:
    results = []
    for stage in manifest.stages():
        if stage.ready:
            r = runner.run_stage(stage, [stage.id] if student else [], test_timeout=timeout)
            print(f"  {'skeleton' if student else 'solution'} {stage.id}: {r.score:g}/{stage.points}"
                  f"  {r.counts()}{'  ERRORS' if r.errors else ''}", flush=True)
            results.append(r)
    return results


def run_bench(module: str, out_dir: Path | None) -> str:
    args = [sys.executable, "-m", module]
    if out_dir:
        args += ["--json", str(out_dir / f"{module.replace('.', '_')}.json")]
    try:
        proc = subprocess.run(args, cwd=manifest.ROOT, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        return f"[{module} still running after 300 s: stopped]\n{e.stdout or ''}"
    text = proc.stdout + (f"\n[{module} exited {proc.returncode}]\n{proc.stderr[-3000:]}"
                          if proc.returncode else "")
    return text


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python3 -m grader verify")
    p.add_argument("--out", type=Path, help="directory for logs and JSON")
    p.add_argument("--no-bench", action="store_true")
    p.add_argument("--no-skeletons", action="store_true")
    p.add_argument("--timeout", type=float, default=runner.DEFAULT_TEST_TIMEOUT)
    args = p.parse_args(argv)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"environment": environment()}
    print("environment:", json.dumps(summary["environment"], indent=1), flush=True)
    try:
        summary["builds"] = timed_builds()
    except build.BuildError as e:
        print(f"BUILD FAILED:\n{e}")
        summary["builds"] = {"error": str(e)}
    print("builds:", summary["builds"], flush=True)

    solutions = grade_all(student=False, timeout=args.timeout)
    skeletons = [] if args.no_skeletons else grade_all(student=True, timeout=args.timeout)
    project_tests, project_errors = runner.run_tests(
        [manifest.ROOT / "tests"], [], test_timeout=args.timeout, pytest_args=("-m", "gpu"))
    bench = {} if args.no_bench else {m: run_bench(m, args.out)
                                      for m in ("bench.kernels", "bench.throughput")}

    failures = [t for r in solutions for t in r.tests if t.outcome != "passed"]
    failures += [t for t in project_tests if t.outcome not in ("passed",)]
    bad_skeletons = [t for r in skeletons for t in r.tests if t.outcome not in ("todo", "not_graded")]
    lines = ["", "| check | result |", "| --- | --- |"]
    for key, val in summary["environment"].items():
        lines.append(f"| {key} | {val} |")
    for key, val in summary["builds"].items():
        lines.append(f"| {key} | {val} |")
    for r in solutions:
        lines.append(f"| stage {r.stage.id} solution | {r.score:g}/{r.stage.points} {r.counts()} |")
    for r in skeletons:
        todo = r.counts().get("todo", 0)
        lines.append(f"| stage {r.stage.id} skeleton | {r.score:g}/{r.stage.points}, "
                     f"{todo} TODO of {len(r.tests)} |")
    counts: dict[str, int] = {}
    for t in project_tests:
        counts[t.outcome] = counts.get(t.outcome, 0) + 1
    lines.append(f"| project GPU tests (tests/ -m gpu) | {counts}{' ERRORS' if project_errors else ''} |")
    report_lines = []
    for t in failures:
        report_lines += [f"--- {t.name}: {t.outcome}", t.message]
    for t in bad_skeletons:
        report_lines += [f"--- skeleton {t.name}: {t.outcome} (expected TODO)", t.message]
    for err in project_errors + [e for r in solutions + skeletons for e in r.errors]:
        report_lines += ["--- error", err]
    text = "\n".join(report_lines + [b for b in bench.values()] + lines)
    print(text)
    if args.out:
        (args.out / "summary.md").write_text(text + "\n")
        (args.out / "results.json").write_text(json.dumps({
            "summary": summary,
            "solutions": [report.as_dict(r) for r in solutions],
            "skeletons": [report.as_dict(r) for r in skeletons],
            "project": [t.__dict__ for t in project_tests], "project_errors": project_errors,
        }, indent=1))
    ok = not failures and not bad_skeletons and not project_errors
    print("\nVERIFY:", "all checks passed" if ok else f"{len(failures) + len(bad_skeletons)} problems")
    return 0 if ok else 1

