"""Where a decode step's time goes: the GPU time of each kernel, the graph, and the host.

    python3 -m bench.profile [--batch 1 256] [--context 512] [--json FILE]

Needs a CUDA GPU; without one it says so and exits 0, having measured nothing.

Random bf16 weights with Llama-3.2-1B's shapes. For each batch size, B sequences with
`context` cached tokens each (filled by one packed prefill), then:

  kernels        one eager decode step under torch.profiler: GPU time per kernel name,
                 summed over the step's launches, largest first;
  chain          one graph replay under torch.profiler: what each kernel adds to the
                 step, its end minus the end of the kernel before (under PDL a kernel
                 starts early and waits, so its own duration overstates it; these add up
                 to the replay), per kernel name and place in the layer, largest first;
  graph replay   the captured decode graph alone, CUDA events around replay() (the step's
                 GPU time without launch overhead);
  engine step    whole engine steps (schedule, inputs, replay with the logits and the
                 greedy argmax inside, the copy of the tokens back, detokenizing nothing) in
                 a row: wall time per step, the host preparing each step while the GPU runs
                 the one before; and where the host's time went (host_breakdown):
                 launching steps, scheduling, collecting tokens, and the rest, mostly
                 waiting for the GPU's tokens. Near-zero waiting means the host, not the
                 GPU, sets the pace.
The floor is (weight bytes + K/V bytes read) over the copy bandwidth measured in the run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bench import floor as floor_mod
from bench import report
from bench.engine import SHAPES, build_models
from bench.results import write_json
from bench.timing import Timer, copy_bandwidth, report_no_cuda
from grader import arguments

if TYPE_CHECKING:   # the engine loads when used; parts.load names a stage folder's types
    from course import parts
    from solutions.engine.llm_engine import LLMEngine
    LlamaModel = parts.load("08", "model").LlamaModel


def gpu_kernels(fn: Callable[[], object]) -> list:
    """The GPU kernel events (torch.profiler's) of one call of fn(), after a warm-up call."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type.name == "CUDA"]


def largest_first(rows: dict[str, tuple[float, int]], top: int) -> list[tuple[str, float, int]]:
    """{name: (us, launches)} as (name, us, launches) rows, the most microseconds first."""
    return sorted(((k, us, n) for k, (us, n) in rows.items()), key=lambda r: -r[1])[:top]


def kernel_table(step: Callable[[], object], top: int = 12) -> list[tuple[str, float, int]]:
    """(kernel name, GPU microseconds, launches) of one call of step(), largest first."""
    rows: dict[str, tuple[float, int]] = {}
    for e in gpu_kernels(step):
        name = e.name[:70]
        us, n = rows.get(name, (0.0, 0))
        rows[name] = (us + e.device_time, n + 1)
    return largest_first(rows, top)


def replay_spans(replay: Callable[[], object]) -> list[tuple[str, float, float]]:
    """(kernel name, start us, end us) of every GPU kernel of one call of replay()."""
    return [(e.name[:70], e.time_range.start, e.time_range.end) for e in gpu_kernels(replay)]


def chain_table(spans: list[tuple[str, float, float]], layers: int,
                top: int = 12) -> list[tuple[str, float, int]]:
    """(kernel, microseconds it adds to the step, launches), largest first.

    A kernel adds its end minus the end of the kernel before (the first: its duration), so the
    rows add up to the whole span. A name launched k > 1 times a layer is told apart by its
    place in the layer ("[0]" .. "[k-1]": the decode GEMVs are QKV, o_proj, gate_up, down in
    that order); its launches past the layers' (the lm_head's GEMV after the last layer) are
    "[after]"."""
    spans = sorted(spans, key=lambda s: s[2])
    counts = Counter(name for name, _, _ in spans)
    seen: Counter[str] = Counter()
    rows: dict[str, tuple[float, int]] = {}
    prev_end = spans[0][1] if spans else 0.0
    for name, _, end in spans:
        per_layer = counts[name] // layers
        label = name
        if per_layer > 1:
            place = seen[name] % per_layer if seen[name] < per_layer * layers else "after"
            label = f"{name} [{place}]"
        seen[name] += 1
        us, n = rows.get(label, (0.0, 0))
        rows[label] = (us + end - prev_end, n + 1)
        prev_end = end
    return largest_first(rows, top)


def host_breakdown(engine: LLMEngine, steps: int) -> dict[str, float]:
    """Run `steps` engine steps; microseconds per step: "step" (wall time), and of it "launch"
    (runner.launch: inputs, graph replay, logits and sampling queued), "schedule", "collect"
    (tokens into requests: detokenizing, stop checks) and "wait_and_rest" (the remainder:
    mostly the wait for a step's tokens to come back from the GPU)."""
    spent = {"launch": 0.0, "schedule": 0.0, "collect": 0.0}
    owners = {"launch": engine.runner, "schedule": engine.scheduler, "collect": engine}
    attrs = {"launch": "launch", "schedule": "schedule", "collect": "_collect"}

    def timed(name: str, fn):
        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t
        return call
    for name, owner in owners.items():        # instance attributes shadow the methods
        setattr(owner, attrs[name], timed(name, getattr(owner, attrs[name])))
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        total = time.perf_counter() - t0
    finally:
        for name, owner in owners.items():
            delattr(owner, attrs[name])
    out = {name: t / steps * 1e6 for name, t in spent.items()}
    out["step"] = total / steps * 1e6
    out["wait_and_rest"] = out["step"] - sum(spent.values()) / steps * 1e6
    return out


def profile_batch(model: LlamaModel, batch: int, context: int, bandwidth: float) -> dict:
    from course import parts
    from solutions.engine.llm_engine import LLMEngine
    from solutions.engine.model_runner import EngineConfig
    SamplingParams = parts.load("11", "sampling_params").SamplingParams
    engine = LLMEngine(model, None, (), EngineConfig(max_model_len=context + 64,
                                                     max_num_seqs=max(batch, 1)))
    g = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        prompt = torch.randint(3, model.config.vocab_size, (context,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=60, ignore_eos=True))
    while not (engine._inflight and engine._inflight[2]):   # the prefills, to a decode step
        engine.step()
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    # The decode buffers now hold a real decode step of every sequence: replaying it, or
    # running it eagerly, rewrites the same cache rows with the same values.
    decoder = engine.runner.decoder
    size = decoder.padded_size(batch)
    # the keys that step reads: its sequences' context lengths, as its buffers hold them
    replayed_keys = int(decoder.context_lens[:batch].sum())
    kernels = kernel_table(lambda: decoder._step(size))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays = []
    for _ in range(30):
        start.record()
        decoder.graphs[size].replay() if decoder.use_graphs else decoder._step(size)
        end.record()
        end.synchronize()
        replays.append(start.elapsed_time(end) * 1e3)
    torch.cuda.synchronize()
    chain, chain_skipped = [], "eager decode: no graph"
    if decoder.use_graphs:
        try:    # a diagnostic: should the profiler fail on a replay, the rest still runs
            chain = chain_table(replay_spans(decoder.graphs[size].replay),
                                model.config.num_hidden_layers)
            chain_skipped = None if chain else "the profiler saw no kernel in the graph replay"
        except RuntimeError as e:
            chain_skipped = f"the profiler failed on a graph replay: {e}"
    host = host_breakdown(engine, 30)        # steady state: the host runs one step ahead
    step_us = host["step"]
    # the floor of the replayed step, whose keys were counted above (the engine's steps after
    # it each read a few more: about 15 a sequence more on average over host_breakdown's 30)
    floor = floor_mod.step_floor_s(floor_mod.weight_bytes(model),
                                   floor_mod.kv_bytes_per_token(model),
                                   replayed_keys, bandwidth) * 1e6
    return {"batch": batch, "context": context, "replayed_keys": replayed_keys,
            "graph_replay_us": statistics.median(replays),
            "engine_step_us": step_us, "floor_us": floor,
            "host_us": {k: round(v, 1) for k, v in host.items()},
            "kernels": [{"name": k, "us": round(us, 1), "launches": n} for k, us, n in kernels],
            "chain": [{"name": k, "us": round(us, 1), "launches": n} for k, us, n in chain],
            "chain_skipped": chain_skipped}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--json", type=Path, metavar="FILE")
    args = p.parse_args(argv)
    arguments.writable_files(p, json=args.json)
    if min(args.batch) < 1 or args.context < 1:
        p.error(f"--batch and --context must be at least 1, got --batch "
                f"{' '.join(map(str, args.batch))} --context {args.context}")
    if not torch.cuda.is_available():
        return report_no_cuda("bench.profile", args.json, "results")
    _, model, _ = build_models(SHAPES["Llama-3.2-1B"], seed=0, max_positions=args.context + 64)
    bandwidth = copy_bandwidth(Timer(quick=True))[0] * 1e9   # bytes per second
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    results = []
    for batch in args.batch:
        r = profile_batch(model, batch, args.context, bandwidth)
        results.append(r)
        print("\n" + report.profile_table({"profile": {"results": [r]}}, top=len(r["kernels"])))
    if args.json:
        write_json(args.json, {"bandwidth": bandwidth, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
