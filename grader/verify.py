"""The GPU suite, one command on a bare CUDA machine (nothing to install, no nox):

    PYTHONUNBUFFERED=1 python3 -m grader verify [--out DIR] [--no-bench] [--no-skeletons]
                                                [--no-compute75 | --only-compute75]

1. builds every solution kernel for the local GPU (and times a one-kernel rebuild);
2. grades every available stage against the reference solutions (must be full marks);
3. grades every skeleton (must score 0, failing with TODO messages, never crashing);
4. runs the project tests that need a GPU (engine equivalence with transformers);
5. builds the stages that claim sm_75 (a T4: no min_cc above 7.5) as PTX for compute_75 only,
   which the driver compiles for this GPU at load, and grades their solutions and the GPU
   engine tests against that build (stages 12 and 14 left out, as on a T4);
6. runs the kernel benchmark and the serving benchmark (bench.throughput);
and prints a summary table last. With --out, logs and JSON go to DIR.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from course import build, manifest, parts
from grader import arguments, capability, report, runner


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


PTX_ARCH = "compute_75"   # a T4's capability, as PTX the driver compiles at load
ENGINE_GPU_TESTS = "tests/test_equivalence_gpu.py"


def compute75_stages() -> list[manifest.Stage]:
    """The ready stages with GPU tests whose kernels claim sm_75 (no min_cc above 7.5)."""
    cc = build.arch_capability(PTX_ARCH)
    return [s for s in manifest.stages() if s.ready and s.gpu and s.runs_on(cc)]


@contextmanager
def building_for(arch: str) -> Iterator[None]:
    """Builds in this process and its children target `arch` (build.ARCHS_ENV), then restored."""
    saved = os.environ.get(build.ARCHS_ENV)
    os.environ[build.ARCHS_ENV] = arch
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(build.ARCHS_ENV, None)
        else:
            os.environ[build.ARCHS_ENV] = saved


def fatbin_codes(lib: Path) -> list[tuple[str, int]]:
    """The device codes in a library's .nv_fatbin section: ('ptx', 75), ('sass', 90), ...
    (fatbin container: magic 0xBA55ED50, then entries of kind 1 = PTX, 2 = ELF, and an arch)."""
    import struct
    data = lib.read_bytes()
    magic = struct.pack("<I", 0xBA55ED50)
    codes = []
    start = data.find(magic)
    while start >= 0:
        header_size, fat_size = struct.unpack_from("<HQ", data, start + 6)
        at, end = start + header_size, min(start + header_size + fat_size, len(data))
        while at + 32 <= end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, at)
            arch = struct.unpack_from("<I", data, at + 28)[0]
            if kind in (1, 2):
                codes.append(("ptx" if kind == 1 else "sass", arch))
            if entry_header == 0:
                break
            at += entry_header + payload
        start = data.find(magic, max(end, start + 1))
    return codes


def ptx_only(lib: Path, arch: int = 75) -> str:
    """'PTX for compute_75 only' when the library can only run through the driver's JIT."""
    codes = fatbin_codes(lib)
    other = sorted({f"{k} {a}" for k, a in codes if (k, a) != ("ptx", arch)})
    if not codes:
        return "NO device code found"
    if other:
        return f"NOT PTX only: also {', '.join(other)}"
    return f"PTX for compute_{arch} only ({len(codes)} entries): the driver JIT-compiles it at load"


@dataclass
class Compute75:
    """Step 5's outcome: the compute_75 build and the grades run against it."""
    info: dict[str, str] = field(default_factory=dict)
    stages: list[runner.StageResult] = field(default_factory=list)
    engine: list[runner.TestResult] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def failures(self) -> list[runner.TestResult]:
        tests = [t for r in self.stages for t in r.tests] + self.engine
        return [runner.TestResult(f"compute_75: {t.name}", t.outcome, t.message)
                for t in tests if t.outcome != "passed"]

    def all_errors(self) -> list[str]:
        return self.errors + [f"compute_75: {e}" for r in self.stages for e in r.errors]

    def lines(self) -> list[str]:
        """The summary's compute_75 section (table rows)."""
        claim = compute75_stages()
        left = [s.id for s in manifest.stages() if s.ready and s not in claim]
        lines = [f"| **compute_75: the T4 build as PTX, JIT-compiled on this GPU** | stages "
                 f"{', '.join(s.id for s in claim)} (not built: {', '.join(left)}) |"]
        lines += [f"| {key} | {val} |" for key, val in self.info.items()]
        for r in self.stages:
            lines.append(f"| stage {r.stage.id} solution on compute_75 | "
                         f"{r.score:g}/{r.stage.points} {r.counts()} |")
        counts: dict[str, int] = {}
        for t in self.engine:
            counts[t.outcome] = counts.get(t.outcome, 0) + 1
        lines.append(f"| engine GPU tests on compute_75 ({ENGINE_GPU_TESTS}) | {counts} |")
        return lines


def compute75(timeout: float) -> Compute75:
    """Step 5: the stages that claim sm_75, built as compute_75 PTX, graded on this GPU."""
    out = Compute75()
    with building_for(PTX_ARCH):
        start = time.time()
        try:
            lib = build.build(parts.kernel_sources())
        except build.BuildError as e:
            out.info["compute_75 build"] = "FAILED"
            out.errors.append(f"compute_75 build failed:\n{e}")
            return out
        out.info["compute_75 build (s)"] = f"{time.time() - start:.1f}"
        out.info["compute_75 library"] = ptx_only(lib)
        if not out.info["compute_75 library"].startswith("PTX"):
            out.errors.append(f"compute_75 library {lib}: {out.info['compute_75 library']}")
        print(f"  compute_75: {out.info['compute_75 library']}", flush=True)
        for stage in compute75_stages():
            r = runner.run_stage(stage, [], test_timeout=timeout)
            print(f"  compute_75 solution {stage.id}: {r.score:g}/{stage.points}  {r.counts()}"
                  f"{'  ERRORS' if r.errors else ''}", flush=True)
            out.stages.append(r)
        out.engine, errors = runner.run_tests([manifest.ROOT / ENGINE_GPU_TESTS], [],
                                              test_timeout=timeout, pytest_args=("-m", "gpu"))
        out.errors += errors
    return out


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
    t4 = p.add_mutually_exclusive_group()
    t4.add_argument("--no-compute75", action="store_true",
                    help="skip the T4 check (the sm_75 stages built as compute_75 PTX)")
    t4.add_argument("--only-compute75", action="store_true", help="run the T4 check alone")
    p.add_argument("--no-class", action="store_true",
                   help="skip the hostile GPU class (tests/hostile/gpu_class.py, ~3-4 minutes)")
    arguments.add_test_timeout(p, runner.DEFAULT_TEST_TIMEOUT)
    args = p.parse_args(argv)
    arguments.positive_seconds(p, timeout=args.timeout)
    arguments.creatable_dirs(p, out=args.out)
    if capability.device_capability() is None:
        # Without a GPU every step would run for minutes and end in a pile of 'not graded'.
        print("error: `grader verify` is the GPU suite, and torch sees no CUDA device here: "
              "nothing was checked. Without a GPU: `python3 -m grader NN` grades a stage (its "
              "GPU tests are not graded), `python3 -m grader emulate NN` runs a kernel on the "
              "CPU, `python3 -m grader compile-check` builds every kernel.", file=sys.stderr)
        return 2
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"environment": environment()}
    print("environment:", json.dumps(summary["environment"], indent=1), flush=True)
    everything = not args.only_compute75
    try:
        summary["builds"] = timed_builds() if everything else {}
    except build.BuildError as e:
        print(f"BUILD FAILED:\n{e}")
        summary["builds"] = {"error": str(e)}
    print("builds:", summary["builds"], flush=True)

    solutions = grade_all(student=False, timeout=args.timeout) if everything else []
    skeletons = [] if args.no_skeletons or not everything else grade_all(student=True,
                                                                          timeout=args.timeout)
    project_tests, project_errors = runner.run_tests(
        [manifest.ROOT / "tests"], [], test_timeout=args.timeout,
        pytest_args=("-m", "gpu")) if everything else ([], [])
    t4 = None if args.no_compute75 else compute75(args.timeout)
    from tests.hostile import gpu_class   # a hostile class on stage 03's kernel
    if args.no_class or not everything:
        class_ok, class_lines = True, (["| GPU class | skipped (--no-class) |"]
                                       if args.no_class else [])
    else:
        class_ok, class_lines = gpu_class.check(args.out / "gpu_class" if args.out else None)
    bench = {} if args.no_bench or not everything else {
        m: run_bench(m, args.out) for m in ("bench.kernels", "bench.throughput")}

    failures = [t for r in solutions for t in r.tests if t.outcome != "passed"]
    failures += [t for t in project_tests if t.outcome not in ("passed",)]
    failures += t4.failures() if t4 else []
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
    if everything:
        lines.append(f"| project GPU tests (tests/ -m gpu) | {counts}"
                     f"{' ERRORS' if project_errors else ''} |")
    lines += t4.lines() if t4 else ["| compute_75 (T4 build) | skipped (--no-compute75) |"]
    lines += class_lines
    t4_errors = t4.all_errors() if t4 else []
    report_lines = []
    for t in failures:
        report_lines += [f"--- {t.name}: {t.outcome}", t.message]
    for t in bad_skeletons:
        report_lines += [f"--- skeleton {t.name}: {t.outcome} (expected TODO)", t.message]
    for err in project_errors + [e for r in solutions + skeletons for e in r.errors] + t4_errors:
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
            "compute75": t4 and {"info": t4.info, "stages": [report.as_dict(r) for r in t4.stages],
                                 "engine": [t.__dict__ for t in t4.engine], "errors": t4_errors},
        }, indent=1))
    ok = not failures and not bad_skeletons and not project_errors and not t4_errors
    ok = ok and class_ok is True   # None: not graded (no CUDA device), never passed
    problems = len(failures) + len(bad_skeletons) + len(project_errors) + len(t4_errors)
    problems += class_ok is not True
    print("\nVERIFY:", "all checks passed" if ok else f"{problems} problems")
    return 0 if ok else 1

