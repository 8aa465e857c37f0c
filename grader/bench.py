"""`python3 -m grader NN --bench`: your kernels of stage NN timed beside the reference and torch.

Not graded (no points). The cases are bench/cases.py's (the lesson's sizes, the bytes and
FLOPs each must move or do); the timing is pytest-benchmark's, run by grader/bench_student.py
in two child processes, because one process loads one kernel library:

    student    TINYVLLM_STUDENT=NN: your ops of stage NN (checked against torch before timing)
    reference  the solutions' ops, torch's equivalent and a plain copy of the same bytes

Each round flushes the L2 and rotates the input set outside the timed region, then times one
call and a torch.cuda.synchronize() (launch included): warm-up rounds, then many rounds; the
median is reported as GB/s (TFLOP/s for GEMM and attention) and as a share of the same-bytes
copy's time (the ceiling of a memory-bound op of that size). Without a CUDA device nothing is
measured: the grader says so and exits 0.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from course import manifest, ops, parts
from grader import environment, report

NO_CUDA = "not measured: no CUDA device"
BENCH_FILE = Path(__file__).with_name("bench_student.py")
STAGE_ENV = "TINYVLLM_BENCH_STAGE"
SIDE_ENV = "TINYVLLM_BENCH_SIDE"
NOTES_ENV = "TINYVLLM_BENCH_NOTES"
CHILD_TIMEOUT_S = 900

# bench.cases.FAMILIES name -> the ops (course/ops.py names) its rows time. The "attention"
# family times whichever stage provides prefill_attention; "flash_attention" names stages 12
# and 07 apart (its rows end "(12)" or "(07)"), so a stage's rows are taken from it.
FAMILY_OPS: dict[str, tuple[str, ...]] = {
    "embedding": ("embedding",),
    "rmsnorm": ("rmsnorm",),
    "fused_add_rmsnorm": ("fused_add_rmsnorm",),
    "rope": ("apply_rope_",),
    "rope_cache_write": ("rope_cache_write",),
    "silu_mul": ("silu_mul",),
    "argmax": ("argmax",),
    "linear": ("linear",),
    "flash_attention": ("prefill_attention",),
    "decode_attention": ("decode_attention",),
    "paged_decode_attention": ("paged_decode_attention",),
    "paged_decode_attention_simple": ("paged_decode_attention",),
}


def _providers(op: str) -> list[str]:
    choice = ops.OPS[op]
    return [s for s, _ in (choice if isinstance(choice, list) else [choice])]


def families(stage_id: str) -> list[str]:
    """The bench.cases families that time an op of stage `stage_id`, in FAMILIES order."""
    sid = manifest.normalize_id(stage_id)
    return [f for f, names in FAMILY_OPS.items() if any(sid in _providers(n) for n in names)]


def case_of_stage(family: str, kernel: str, stage_id: str) -> bool:
    """Whether a row of `family` (named `kernel`) times stage `stage_id`'s op."""
    if family == "flash_attention":
        return kernel.endswith(f"({manifest.normalize_id(stage_id)})")
    return True


def stage_cases(stage_id: str) -> list:
    """The stage's bench.cases.Case rows (on the GPU: they allocate their buffers)."""
    from bench.cases import FAMILIES, Ops
    o = Ops()
    return [c for f in families(stage_id) for c in FAMILIES[f](o)
            if case_of_stage(f, c.kernel, stage_id)]


def _benchmark_rows(out_json: Path) -> list[dict]:
    """pytest-benchmark's rows, or none when the child left no readable file (pytest-benchmark
    opens it at start and fills it at the end: a child that crashed or was stopped leaves it
    empty). The caller then prints the child's output instead."""
    try:
        return json.loads(out_json.read_text())["benchmarks"]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _run_side(stage: manifest.Stage, side: str, student_ids: list[str],
              student_root: Path | None, tmp: Path) -> tuple[list[dict], list[dict], str]:
    """One child: pytest-benchmark's rows, the notes (skips, WRONG), and its output's tail."""
    out_json, notes = tmp / f"{side}.json", tmp / f"{side}.notes"
    env = {**os.environ, **parts.selection_env(student_ids, student_root),
           STAGE_ENV: stage.id, SIDE_ENV: side, NOTES_ENV: str(notes)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(manifest.ROOT),
                                                      env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pytest", str(BENCH_FILE), "-q", "-p", "no:cacheprovider",
           "--benchmark-json", str(out_json), "--benchmark-disable-gc",
           "--benchmark-columns=median,min,max,rounds"]
    print(f"timing the {side}'s ops of stage {stage.id}...", flush=True)
    try:
        proc = subprocess.run(cmd, env=env, cwd=manifest.ROOT, capture_output=True, text=True,
                              timeout=CHILD_TIMEOUT_S)
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
    except subprocess.TimeoutExpired:
        tail = f"stopped after {CHILD_TIMEOUT_S} s"
    rows = _benchmark_rows(out_json)
    noted = ([json.loads(line) for line in notes.read_text().splitlines() if line.strip()]
             if notes.exists() else [])
    return rows, noted, tail


def collect(results: list[dict], noted: list[dict]) -> list[dict]:
    """Rows of the table, one per (kernel, tokens), from pytest-benchmark's JSON rows (their
    extra_info says which case and column) and the notes of rows that were not timed."""
    table: dict[tuple[str, str], dict] = {}

    def row(info: dict) -> dict:
        key = (info["kernel"], info["tokens"])
        return table.setdefault(key, {"kernel": key[0], "tokens": key[1], "bytes": info["bytes"],
                                      "flops": info["flops"], "median_s": {}, "status": {}})
    for r in results:
        info = r["extra_info"]
        row(info)["median_s"][info["column"]] = r["stats"]["median"]
    for n in noted:
        row(n)["status"][n["column"]] = n["status"]
    return list(table.values())


def _rate(r: dict, seconds: float) -> str:
    if r["flops"]:
        return f"{r['flops'] / seconds / 1e12:.1f} TFLOP/s"
    return f"{r['bytes'] / seconds / 1e9:.0f} GB/s"


def _cell(r: dict, column: str) -> str:
    t = r["median_s"].get(column)
    copy = r["median_s"].get("copy")
    if t is None:
        return r["status"].get(column, "not measured").splitlines()[0][:60]
    share = f" ({100 * copy / t:.0f}% of copy)" if copy and column != "copy" else ""
    return f"{_rate(r, t)}{share}"


def render(rows: list[dict], columns: tuple[str, ...]) -> str:
    head = ["op", "size", *columns]
    lines = [[r["kernel"], r["tokens"], *(_cell(r, c) for c in columns)] for r in rows]
    widths = [max(len(x[i]) for x in [head, *lines]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*x).rstrip() for x in [head, *lines])


def main(stage: manifest.Stage, student_root: Path | None = None, solution: bool = False,
         json_path: Path | None = None, cuda: bool | None = None) -> int:
    """Time stage `stage`'s ops; print the table. Exit 0 (a benchmark grades nothing), or 2
    when --json cannot be written."""
    fams = families(stage.id)
    if not fams:
        print(f"stage {stage.id} has no kernel benchmark (bench/cases.py times the ops of "
              "stages " + ", ".join(sorted({s for n in FAMILY_OPS.values() for op in n
                                             for s in _providers(op)})) + ")")
        return 0
    if not (environment.has_cuda() if cuda is None else cuda):
        print(f"stage {stage.id} benchmark: {NO_CUDA}")
        return 0
    sides = [("reference", [])] if solution else [("student", [stage.id]), ("reference", [])]
    results, noted = [], []
    with tempfile.TemporaryDirectory(prefix="tinyvllm-bench-") as tmp:
        for side, ids in sides:
            rows, notes, tail = _run_side(stage, side, ids, student_root, Path(tmp))
            results += rows
            noted += notes
            if not rows and not notes:
                print(f"the {side} run measured nothing; its output ends:\n{tail}")
    rows = collect(results, noted)
    columns = (("yours",) if not solution else ()) + ("reference", "torch", "copy")
    print(f"\nStage {stage.id} kernels (not graded): median of many rounds, each one call + "
          "cuda synchronize on a cold L2; % of copy = a plain copy of the same bytes' time / "
          "the op's time\n")
    print(render(rows, columns))
    if json_path:
        text = json.dumps({"stage": stage.id, "rows": rows}, indent=2)
        if not report.write_each([(json_path, lambda: report.write_text(json_path, text))]):
            return 2
    return 0
