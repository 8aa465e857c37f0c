"""PNG plots of benchmark results, on any machine (no GPU, no torch): matplotlib only.

    python3 -m bench.plot FILE.json [FILE.json ...] [--out DIR]     (nox -s bench-plot -- ...)

From documents written by `python3 -m bench` (bench.results); several files (a run split over
several calls) are plotted together, each plot from the first file that has its numbers:

  sweep.png     decode sweep: output tokens/s against batch size, ours and transformers (log
                scales), each point's ratio written beside it;
  kernels.png   the kernel table: each kernel's share of the measured ceiling, ours and torch
                (a roofline of the run: the 1 GiB copy's bandwidth and the fastest GEMM's
                TFLOP/s; see kernel_series), FLOP-bound rows labelled with their TFLOP/s.
The data of each plot comes from sweep_series / kernel_series (plain lists, tested without
drawing). matplotlib is imported only to draw.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench import results
from grader import arguments


def sweep_series(doc: dict) -> dict | None:
    """{"batch": [...], "ours": [tok/s or None], "transformers": [...], "ratio": [...],
    "hf_name": str, "gpu": str} of the document's sweep, or None without one."""
    sweep = doc.get("workloads", {}).get("sweep")
    if not sweep or not sweep.get("rows"):
        return None
    rows = sweep["rows"]

    def col(side: str) -> list[float | None]:
        return [(r.get(side) or {}).get("tok_s") for r in rows]
    return {"batch": [r["batch"] for r in rows], "ours": col("ours"),
            "transformers": col("transformers"), "ratio": [r.get("ratio") for r in rows],
            "prompt": sweep["prompt"], "new": sweep["new"],
            "hf_name": (doc.get("transformers_config") or {}).get("name", "transformers"),
            "gpu": (doc.get("environment") or {}).get("gpu")}


def kernel_series(doc: dict) -> dict | None:
    """{"label": [...], "ours": [% of the ceiling or None], "torch": [...], "note": [...]} of
    the document's kernel table, or None without one.

    The ceiling is a roofline measured in the same run: a kernel can take no less time than
    its bytes over the copy bandwidth, nor than its FLOPs over the fastest matrix product
    measured (cuBLAS's best row, ours or torch's); its share is that least time over its
    time. So a memory-bound op reads as a share of the copy bandwidth, a FLOP-bound one (a
    large GEMM, prefill attention) as a share of the best GEMM, and 100% is the limit."""
    kernels = doc.get("kernels")
    if not kernels or not kernels.get("rows"):
        return None
    rows = kernels["rows"]
    peak = max(((r.get(side) or {}).get("TFLOPS") or 0.0 for r in rows if r.get("flops")
                for side in ("ours", "torch")), default=0.0)
    copy = kernels.get("copy_bandwidth_GBps")
    out: dict = {"label": [], "ours": [], "torch": [], "note": [], "copy_GBps": copy,
                 "peak_TFLOPS": peak or None,
                 "gpu": (doc.get("environment") or {}).get("gpu")}

    def share(r: dict, timing: dict) -> float | None:
        if not timing.get("median_us") or not copy:
            return None
        least_s = max(r.get("bytes", 0) / (copy * 1e9),
                      (r.get("flops") or 0) / (peak * 1e12) if peak else 0.0)
        return 100.0 * least_s / (timing["median_us"] * 1e-6)
    for r in rows:
        o, t = r.get("ours") or {}, r.get("torch") or {}
        out["label"].append(f"{r['kernel']} T={r['tokens']}")
        out["ours"].append(share(r, o))
        out["torch"].append(share(r, t))
        note = f"{o['TFLOPS']:.0f} TFLOP/s" if r.get("flops") and o.get("TFLOPS") else ""
        out["note"].append(note if r.get("status") == "ok" else r.get("status", "")[:30])
    return out


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")           # files only: no display on a server or in CI
    import matplotlib.pyplot as plt
    return plt


def plot_sweep(series: dict, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for side, label, marker in (("ours", "tiny-vllm", "o"),
                                ("transformers", f"transformers ({series['hf_name']})", "s")):
        pts = [(b, v) for b, v in zip(series["batch"], series[side]) if v is not None]
        if pts:
            ax.plot(*zip(*pts), marker=marker, label=label)
    for b, v, r in zip(series["batch"], series["ours"], series["ratio"]):
        if v is not None and r is not None:
            ax.annotate(f"{r:.1f}x", (b, v), textcoords="offset points", xytext=(4, 6),
                        fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(series["batch"], [str(b) for b in series["batch"]])
    ax.set_xlabel("batch size (requests decoding together)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"Decode sweep, prompt {series['prompt']}, {series['new']} new tokens"
                 + (f" ({series['gpu']})" if series.get("gpu") else ""), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_kernels(series: dict, path: Path) -> Path:
    plt = _pyplot()
    n = len(series["label"])
    fig, ax = plt.subplots(figsize=(8, 0.32 * n + 1.5))
    ys = list(range(n))
    zero = [v if v is not None else 0.0 for v in series["ours"]]
    ax.barh([y - 0.2 for y in ys], zero, height=0.4, label="tiny-vllm")
    ax.barh([y + 0.2 for y in ys], [v if v is not None else 0.0 for v in series["torch"]],
            height=0.4, label="torch", alpha=0.7)
    for y, v, note in zip(ys, zero, series["note"]):
        if note:
            ax.annotate(note, (v, y - 0.2), textcoords="offset points", xytext=(3, -3),
                        fontsize=7)
    ax.axvline(100, color="black", linewidth=0.8)
    ax.set_yticks(ys, series["label"], fontsize=7)
    ax.invert_yaxis()
    ceiling = [f"{series['copy_GBps']:.0f} GB/s copy" if series.get("copy_GBps") else "",
               f"{series['peak_TFLOPS']:.0f} TFLOP/s best GEMM"
               if series.get("peak_TFLOPS") else ""]
    ax.set_xlabel("% of the roofline measured in the run ("
                  + ", ".join(c for c in ceiling if c) + ")")
    ax.set_title("Kernels: share of the measured ceiling"
                 + (f" ({series['gpu']})" if series.get("gpu") else ""), fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_all(docs: list[dict], out: Path) -> list[Path]:
    """Every plot the documents have numbers for, written into out; their paths."""
    out.mkdir(parents=True, exist_ok=True)
    made = []
    for name, series_of, draw in (("sweep.png", sweep_series, plot_sweep),
                                  ("kernels.png", kernel_series, plot_kernels)):
        series = next((s for s in map(series_of, docs) if s is not None), None)
        if series is not None:
            made.append(draw(series, out / name))
    return made


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", metavar="FILE.json")
    p.add_argument("--out", metavar="DIR", help="where the PNGs go (default: the first "
                                                "file's folder)")
    args = p.parse_args(argv)
    arguments.creatable_dirs(p, out=Path(args.out) if args.out else None)
    try:
        docs = [results.read(f) for f in args.files]
    except (OSError, ValueError) as e:
        print(f"bench.plot: {e}")
        return 1
    measured = [d for d in docs if d.get("measured")]
    out = Path(args.out) if args.out else Path(args.files[0]).parent
    made = plot_all(measured, out)
    if not made:
        print("bench.plot: no sweep and no kernel table in "
              f"{', '.join(args.files)}: nothing to plot")
        return 1
    for path in made:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
