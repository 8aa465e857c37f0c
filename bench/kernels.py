"""Kernel benchmark: every op of stages 03-14 beside its torch equivalent, at Llama-3.2-1B sizes.

    python3 -m bench.kernels [--json FILE] [--quick]

Needs a CUDA GPU; without one it says so and exits 0, having measured nothing.

Method (llm.c's dev/cuda, and the course's METHOD):
  - the copy bandwidth is measured first (a 1 GiB device-to-device copy, bytes read + written):
    it is the ceiling of every memory-bound kernel here; beside each op, a plain copy moving
    the same number of bytes is timed the same way ("same-bytes copy"), because at a few MB
    no kernel, copy included, reaches the 1 GiB copy's rate;
  - each op's output is checked once against torch (course.testing.checks tolerances) before it is
    timed; a wrong op is reported WRONG and not timed;
  - timing uses CUDA events around one call, after a warm-up, and reports the median of many
    runs; inputs rotate among several freshly drawn sets and the L2 cache is flushed (a read
    of twice its size, which leaves it clean: bench.timing says why not a write) before every
    run, outside the timed region, so no run reads warm data;
  - before each run the GPU is also kept busy (torch.cuda._sleep) for longer than the host
    needs to launch the op, so the events time the device work, not Python's launch overhead
    (which is reported separately as "host us per call");
  - GB/s counts the bytes that must move: each input read once, each output written once;
    GEMM and attention are also reported in TFLOP/s.

Ours calls the op modules through the parts resolver (the selected stage files), with their
out= buffers so allocation is not timed; embedding and rope call their torch.ops kernels
directly, because their Python wrappers allocate (and may wait on) an error flag per call.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.cases import FAMILIES, Case, Ops, Outputs
from bench.results import write_json
from bench.timing import (COPY_BYTES, DEVICE, FLUSHES, Timer, Timing, copy_bandwidth,
                          report_no_cuda)
from grader import arguments

# ------------------------------------------------------------------------------ correctness

def _as_outputs(result: Any) -> Outputs:
    if isinstance(result, torch.Tensor):
        return (result,)
    return tuple(t for t in result if isinstance(t, torch.Tensor))


def _clone_set(s: dict) -> dict:
    return {k: v.clone() for k, v in s.items()}


def check(case: Case, s: dict) -> str | None:
    """None when ours matches the oracle on set s, else why not (the first lines of it)."""
    from course.testing import checks
    for buf in case.outs:
        checks.poison(buf)
    got = tuple(t.clone() for t in _as_outputs(case.ours_fn(_clone_set(s))))
    expected = _as_outputs((case.reference or case.torch_fn)(_clone_set(s)))
    torch.cuda.synchronize()
    if len(got) != len(expected):
        return f"ours returned {len(got)} tensors, torch {len(expected)}"
    try:
        for i, (g, e) in enumerate(zip(got, expected)):
            what = f"{case.kernel} output {i}" if len(got) > 1 else f"{case.kernel} output"
            if case.compare == "argmax":
                _check_argmax(g, e, s["logits"], what)
            elif case.compare == "equal":
                _check_rows(g, e, what, exact=True)
            else:
                _check_rows(g, e, what, exact=False)
    except AssertionError as err:
        return "\n".join(str(err).splitlines()[:4])
    return None


def _check_rows(got: torch.Tensor, expected: torch.Tensor, what: str, exact: bool) -> None:
    """checks.assert_close / assert_equal, prefiltered on the GPU so 1 GB outputs stay fast.

    course.testing.checks compares in float64 on the CPU; for outputs of millions of elements the
    same criterion runs on the GPU first, and only the rows around the first mismatch go
    through course.testing.checks to produce its message.
    """
    from course.testing import checks
    if got.shape != expected.shape or got.dtype != expected.dtype:
        raise AssertionError(f"{what}: expected {expected.dtype} {tuple(expected.shape)}, "
                             f"got {got.dtype} {tuple(got.shape)}")
    if got.numel() <= 4 * 2**20:
        if exact:
            checks.assert_equal(got, expected, what=what)
        else:
            checks.assert_close(got, expected, what=what)
        return
    if exact:
        bad = got != expected
        if got.is_floating_point():
            bad &= ~(got.isnan() & expected.isnan())
    else:
        atol, rtol = checks.TOLERANCES.get(expected.dtype, (0.0, 0.0))
        g, e = got.float(), expected.float()
        bad = ~((g - e).abs() <= atol + rtol * e.abs()) & ~(g == e)
    if not bool(bad.any()):
        return
    row = int(bad.reshape(got.shape[0], -1).any(dim=1).nonzero()[0])
    rows = slice(row, min(row + 8, got.shape[0]))
    n_bad = int(bad.sum())
    try:
        if exact:
            checks.assert_equal(got[rows], expected[rows], what=f"{what} rows {row}..")
        else:
            checks.assert_close(got[rows], expected[rows], what=f"{what} rows {row}..")
    except AssertionError as err:
        raise AssertionError(f"{what}: {n_bad} of {got.numel()} elements differ; {err}") from None
    raise AssertionError(f"{what}: {n_bad} of {got.numel()} elements differ (first in row {row})")


def _check_argmax(got: torch.Tensor, expected: torch.Tensor, logits: torch.Tensor,
                  what: str) -> None:
    """Exactly torch.argmax (ties to the lowest index), saying so when only ties differ."""
    from course.testing import checks
    if got.shape != expected.shape or got.dtype != expected.dtype:
        raise AssertionError(f"{what}: expected {expected.dtype} {tuple(expected.shape)}, "
                             f"got {got.dtype} {tuple(got.shape)}")
    bad = got != expected
    if not bool(bad.any()):
        return
    valid = (got >= 0) & (got < logits.shape[1])
    picked = logits.gather(1, got.clamp(0, logits.shape[1] - 1)[:, None])[:, 0]
    is_max = valid & (picked == logits.max(dim=1).values)
    hint = ("only ties differ: each picked value is its row's maximum, but torch.argmax "
            "returns the LOWEST index among equal maxima" if bool(is_max[bad].all()) else
            "some picked indices are not their row's maximum")
    checks.assert_equal(got, expected, what=what, hint=hint)


# ------------------------------------------------------------------------------------- run

@dataclass
class Row:
    kernel: str
    tokens: str
    bytes: int
    flops: int
    status: str                 # "ok", "WRONG: ...", "skipped: ...", "error: ..."
    via: str = ""
    ours: Timing | None = None
    torch: Timing | None = None
    torch_status: str = "ok"
    copy: Timing | None = None  # a plain copy moving the same bytes (half read, half written)


def _n_sets(set_bytes: int, l2_bytes: int) -> int:
    # Enough sets that together they are several times the L2 (2 to 8 of them).
    return max(2, min(8, math.ceil(3 * l2_bytes / max(set_bytes, 1))))


def _is_fatal(err: BaseException) -> bool:
    text = str(err)
    return any(s in text for s in ("illegal memory access", "unspecified launch failure",
                                   "misaligned address", "device-side assert",
                                   "an illegal instruction"))


def run_case(case: Case, timer: Timer, seed: int) -> Row:
    row = Row(case.kernel, case.tokens, case.bytes, case.flops, "ok", via=case.via)
    g = torch.Generator(device=DEVICE)
    g.manual_seed(seed)
    sets = [case.make_set(g)]
    set_bytes = sum(t.numel() * t.element_size() for t in sets[0].values())
    sets += [case.make_set(g) for _ in range(_n_sets(set_bytes, timer.l2_bytes) - 1)]
    try:
        if case.ours_fn is None:
            row.status = case.skip or "skipped: op not available"
        else:
            try:
                problem = check(case, sets[0])
            except Exception as e:  # a crash is a result to report
                if _is_fatal(e):
                    raise
                problem = None
                row.status = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            if problem:
                row.status = f"WRONG: {problem}"
            elif row.status == "ok":
                row.ours = timer.measure(lambda i: case.ours_fn(sets[i]), len(sets))
                row.copy = same_bytes_copy(case.bytes, timer)
        try:
            row.torch = timer.measure(lambda i: case.torch_fn(sets[i]), len(sets))
        except Exception as e:  # likewise for torch
            if _is_fatal(e):
                raise
            row.torch_status = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    finally:
        sets.clear()
        case.outs.clear()
        try:
            torch.cuda.empty_cache()
        except RuntimeError:
            pass    # a broken context: the caller reports it
    return row


def same_bytes_copy(moved: int, timer: Timer) -> Timing:
    """A device-to-device copy of moved/2 bytes, timed like the ops.

    Small transfers never reach the 1 GiB copy's bandwidth (the launch, the ramp-up and the
    tail of one wave are a large share of a few microseconds), so this is the ceiling an op of
    that size can really be held to.
    """
    src = torch.randint(0, 256, (max(moved // 2, 1),), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return timer.measure(lambda i: dst.copy_(src), 1)


# ---------------------------------------------------------------------------------- report

def _rate(row: Row, t: Timing | None) -> str:
    if t is None:
        return "-"
    if row.flops:
        return f"{row.flops / (t.median_us * 1e6):.1f} TFLOP/s"
    return f"{row.bytes / (t.median_us * 1e3):.0f} GB/s"


def _pct(row: Row, t: Timing | None, copy_gbs: float) -> str:
    if t is None:
        return "-"
    return f"{100 * row.bytes / (t.median_us * 1e3) / copy_gbs:.0f}%"


def _of_copy(r: Row) -> list[str]:
    if r.ours is None or r.copy is None:
        return ["-", "-"]
    return [f"{r.copy.median_us:.1f}", f"{100 * r.copy.median_us / r.ours.median_us:.0f}%"]


def markdown(rows: list[Row], copy_gbs: float) -> str:
    lines = [("| kernel | T | ours us | ours rate | ours % copy bw | same-bytes copy us "
              "| ours % of that copy | torch us | torch rate | speedup |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.ours is not None:
            ours = [f"{r.ours.median_us:.1f}", _rate(r, r.ours), _pct(r, r.ours, copy_gbs)]
        else:
            ours = [r.status.splitlines()[0][:70].replace("|", "/"), "", ""]
        ours += _of_copy(r)
        torch_cols = ([f"{r.torch.median_us:.1f}", _rate(r, r.torch)] if r.torch is not None
                      else [r.torch_status[:40].replace("|", "/"), ""])
        speed = (f"{r.torch.median_us / r.ours.median_us:.2f}x"
                 if r.ours is not None and r.torch is not None else "-")
        lines.append(f"| {r.kernel} | {r.tokens} | " + " | ".join(ours + torch_cols + [speed])
                     + " |")
    return "\n".join(lines)


def row_dict(r: Row, copy_gbs: float) -> dict:
    d = {"kernel": r.kernel, "tokens": r.tokens, "bytes": r.bytes, "flops": r.flops,
         "status": r.status, "via": r.via, "torch_status": r.torch_status}
    for name, t in (("ours", r.ours), ("torch", r.torch)):
        if t is None:
            d[name] = None
            continue
        d[name] = t.as_dict()
        d[name]["GBps"] = r.bytes / (t.median_us * 1e3)
        d[name]["pct_copy_bw"] = 100 * d[name]["GBps"] / copy_gbs
        if r.flops:
            d[name]["TFLOPS"] = r.flops / (t.median_us * 1e6)
    d["same_bytes_copy"] = r.copy.as_dict() if r.copy is not None else None
    d["pct_of_same_bytes_copy"] = (100 * r.copy.median_us / r.ours.median_us
                                   if r.copy is not None and r.ours is not None else None)
    d["speedup"] = (r.torch.median_us / r.ours.median_us
                    if r.ours is not None and r.torch is not None else None)
    return d


def run_families(families: list[str], ops: Ops, timer: Timer, seed: int
                 ) -> tuple[list[Row], str | None]:
    """Every case of the families, checked then timed, printing a line each; (rows, what broke
    the CUDA context or None). A broken context stops the run: later rows would all fail."""
    rows: list[Row] = []
    fatal: str | None = None
    for fam in families:
        cases = FAMILIES[fam](ops)
        while True:
            if fatal:
                break
            try:
                case = next(cases)
            except StopIteration:
                break
            except Exception as e:  # setting up failed: report it, go on
                if _is_fatal(e):
                    fatal = f"{fam}: {e}"
                rows.append(Row(fam, "-", 0, 0, f"error: setting up: {type(e).__name__}: {e}",
                                torch_status="not run"))
                break
            try:
                row = run_case(case, timer, seed)
            except Exception as e:  # report it, go on
                if _is_fatal(e):
                    fatal = f"{case.kernel} T={case.tokens}: {str(e).splitlines()[0]}"
                row = Row(case.kernel, case.tokens, case.bytes, case.flops,
                          f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}",
                          via=case.via, torch_status="not run")
                traceback.print_exc()
            rows.append(row)
            ours = f"{row.ours.median_us:9.1f} us ({row.ours.host_us:.0f} us host)" \
                if row.ours else row.status.splitlines()[0][:90]
            torch_s = f"{row.torch.median_us:9.1f} us" if row.torch else row.torch_status
            print(f"  {row.kernel:22s} T={row.tokens:6s} ours {ours:40s} torch {torch_s}",
                  flush=True)
        if fatal:
            break
    if fatal:
        print(f"\nSTOPPED: a kernel broke the CUDA context ({fatal}); the rows after it were "
              "not run. Rerun with --only to measure the others.")
    for r in rows:
        if r.status.startswith("WRONG"):
            print(f"\n{r.kernel} T={r.tokens} is WRONG (not timed):\n{r.status[7:]}")
    return rows, fatal


def table_dict(rows: list[Row], fatal: str | None, ops: Ops, timer: Timer, copy_gbs: float,
               copy_t: Timing, seed: int, quick: bool) -> dict:
    """The kernel table as JSON: every row's times, GB/s (TFLOP/s) and share of the ceiling."""
    return {"seed": seed, "quick": quick, "l2_bytes": timer.l2_bytes,
            "l2_flush": timer.flush_mode,
            "copy_bandwidth_GBps": copy_gbs, "copy": copy_t.as_dict(),
            "kernels_build": ops.build_error or "ok", "stopped": fatal,
            "rows": [row_dict(r, copy_gbs) for r in rows]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, metavar="FILE", help="write every number to FILE")
    parser.add_argument("--quick", action="store_true", help="fewer runs per measurement")
    parser.add_argument("--only", metavar="NAMES",
                        help=f"comma-separated subset of: {', '.join(FAMILIES)}")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the random inputs")
    parser.add_argument("--flush", choices=FLUSHES, default="read",
                        help="empty the L2 before each run by reading (default) or writing "
                             "twice its size (the older method, for figures taken with it)")
    args = parser.parse_args(argv)
    # Usage errors first, also on a machine without a GPU (and before minutes of timing on one,
    # whose JSON would then be lost).
    arguments.writable_files(parser, json=args.json)
    families = list(FAMILIES)
    if args.only is not None:
        families = [f.strip() for f in args.only.split(",") if f.strip()]
        unknown = [f for f in families if f not in FAMILIES]
        if unknown or not families:
            parser.error(f"unknown --only name(s) {unknown}; choose from {list(FAMILIES)}"
                         if unknown else f"--only names no kernel; choose from {list(FAMILIES)}")
    if not torch.cuda.is_available():
        return report_no_cuda("bench.kernels", args.json, "rows")

    started = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False
    name = torch.cuda.get_device_name(0)
    print(f"bench.kernels on {name}, torch {torch.__version__}, seed {args.seed}"
          f"{', quick' if args.quick else ''}", flush=True)
    t0 = time.perf_counter()
    ops = Ops()
    print(f"kernels: {ops.build_error or 'built and loaded'} "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    timer = Timer(args.quick, args.flush)
    copy_gbs, copy_t = copy_bandwidth(timer)
    print(f"L2 {timer.l2_bytes / 2**20:.0f} MiB ({args.flush} flush {timer.flush_us:.1f} us); "
          f"copy bandwidth {copy_gbs:.0f} GB/s ({COPY_BYTES / 2**30:g} GiB device-to-device, "
          f"read + write, median of {copy_t.runs})", flush=True)

    rows, fatal = run_families(families, ops, timer, args.seed)
    elapsed = time.perf_counter() - started
    print(f"\nDevice: {name}; copy bandwidth {copy_gbs:.0f} GB/s; medians of CUDA-event "
          f"timings, cold L2, {elapsed:.0f} s in all. speedup = torch us / ours us (above 1: "
          "ours is faster).\n")
    print(markdown(rows, copy_gbs))
    if args.json:
        report = {"measured": True, "device": name, "torch": torch.__version__,
                  **table_dict(rows, fatal, ops, timer, copy_gbs, copy_t, args.seed, args.quick),
                  "elapsed_s": elapsed}
        write_json(args.json, report)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
