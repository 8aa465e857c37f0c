"""Serving benchmark: the reference engine beside transformers on the same random weights.

    python3 -m bench.throughput [--json FILE] [--quick] [--skip-hf]

Needs a CUDA GPU; without one it says so and exits 0, having measured nothing.

Random bf16 weights with Llama-3.2-1B's exact shapes (bench.engine.SHAPES), built in this
process. Random weights never stop early: every request runs to its max tokens (EOS ignored).

  offline throughput   nano-vllm's workload: 256 requests, prompt and output lengths
                       uniform in [100, 1024], seed 0; output tokens per second. Ours: every
                       request added to the engine at once (continuous batching).
                       transformers: generate() on all 256 left-padded prompts in one batch
                       (its dynamic cache; each request's own output length counts, the
                       padding work does not), or fewer with --quick.
  batch-1 decode       a 32-token prompt, 256 new tokens: ms per output token after the first
                       (ours: decode steps replayed from CUDA graphs).
  shared prefix        256 requests: the same 1,000-token system prompt, then a question of
                       16-64 tokens; 64 new tokens each. Ours with prefix caching on and off:
                       on, the system prompt's blocks are computed once and shared.
Every engine run is preceded by a warm-up on other prompts, so no measured prompt is cached
before it is measured.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bench import workloads
from bench.engine import SHAPES, build_models
from bench.ours import new_engine, release, run_ours
from bench.results import write_json
from bench.timing import report_no_cuda
from grader import arguments

if TYPE_CHECKING:   # transformers loads when a model is made
    from transformers import PreTrainedModel

NUM_REQUESTS = workloads.OFFLINE_REQUESTS
LENGTHS = workloads.OFFLINE_LENGTHS
BATCH1_PROMPT, BATCH1_NEW = workloads.BATCH1_PROMPT, workloads.BATCH1_NEW
workload = workloads.offline
shared_prefix_workload = workloads.shared_prefix


def run_hf(hf: PreTrainedModel, requests: list[workloads.Request]) -> tuple[float, int]:
    """transformers generate() on all requests in one left-padded batch (dynamic cache)."""
    from bench.hf import Transformers
    return Transformers(hf, cache="dynamic", log=lambda _: None).serve(requests, max_len=0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.throughput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, metavar="FILE")
    p.add_argument("--quick", action="store_true", help="64 requests instead of 256")
    p.add_argument("--skip-hf", action="store_true", help="measure this engine only")
    args = p.parse_args(argv)
    arguments.writable_files(p, json=args.json)
    if not torch.cuda.is_available():
        return report_no_cuda("bench.throughput", args.json, "results")
    import transformers
    transformers.logging.set_verbosity_error()
    shape = SHAPES["Llama-3.2-1B"]
    hf, model, _ = build_models(shape, seed=0, max_positions=2 * LENGTHS[1])
    n = 64 if args.quick else NUM_REQUESTS
    requests = workload(n, shape["vocab_size"])
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "transformers": transformers.__version__, "requests": n}

    t = time.perf_counter()
    engine, params_type = new_engine(model, max_model_len=2 * LENGTHS[1])
    print(f"engine ready in {time.perf_counter() - t:.1f} s: {engine.runner.describe()}",
          flush=True)
    warmup = workload(8, shape["vocab_size"], seed=99)
    run_ours(engine, params_type, warmup)
    seconds, tokens = run_ours(engine, params_type, requests)
    result["ours_tok_s"] = tokens / seconds
    print(f"ours: {n} requests, {tokens} output tokens in {seconds:.2f} s = "
          f"{tokens / seconds:,.0f} tok/s", flush=True)

    prompt = requests[0][0][:BATCH1_PROMPT]
    times = []
    for _ in range(3):
        t1, _ = run_ours(engine, params_type, [(prompt, 1)])
        tn, _ = run_ours(engine, params_type, [(prompt, BATCH1_NEW)])
        times.append((tn - t1) / (BATCH1_NEW - 1))
    result["ours_batch1_ms"] = sorted(times)[1] * 1e3
    print(f"ours: batch-1 decode {result['ours_batch1_ms']:.3f} ms per token (median of 3)",
          flush=True)

    del engine
    release()
    shared = shared_prefix_workload(n, shape["vocab_size"])
    for caching in (True, False):
        engine, params_type = new_engine(model, 2 * LENGTHS[1], prefix_caching=caching)
        run_ours(engine, params_type, warmup)
        seconds, tokens = run_ours(engine, params_type, shared)
        result[f"shared_prefix_caching_{'on' if caching else 'off'}_tok_s"] = tokens / seconds
        print(f"ours, shared 1,000-token prefix, prefix caching {'on' if caching else 'off'}: "
              f"{tokens / seconds:,.0f} tok/s", flush=True)
        del engine
        release()
    result["prefix_caching_speedup"] = (result["shared_prefix_caching_on_tok_s"]
                                        / result["shared_prefix_caching_off_tok_s"])
    print(f"prefix caching: {result['prefix_caching_speedup']:.2f}x", flush=True)

    if not args.skip_hf:
        seconds, tokens = run_hf(hf, requests)
        result["hf_tok_s"] = tokens / seconds
        result["ratio"] = result["ours_tok_s"] / result["hf_tok_s"]
        print(f"transformers (dynamic cache, one padded batch of {n}): {seconds:.1f} s = "
              f"{tokens / seconds:,.0f} useful tok/s; ours / transformers = "
              f"{result['ratio']:.1f}x", flush=True)
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
