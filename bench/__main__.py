"""The benchmark: this engine beside transformers on the same weights, the same GPU, one run.

    python3 -m bench [--out DIR] [--json FILE] [--only W1,W2] [--skip-hf] [--quick]
                     [--hf-cache static|dynamic] [--shape NAME | --model DIR] [--budget S]
    nox -s bench -- ...                   (the same, in the course's environment)
    nox -s bench-plot -- DIR/bench.json   (PNG plots of it, on any machine)

Needs a CUDA GPU; without one it says so and exits 0, having measured nothing.

Model: random bf16 weights with Llama-3.2-1B-Instruct's exact shapes, or another model's with
--shape (bench.engine.SHAPES: qwen3-0.6b is nano-vllm's benchmark model, qwen2.5-0.5b,
smollm2-135m, mistral-7b), or a real checkpoint with --model DIR. Random weights never stop
early; every side ignores EOS anyway, so every request runs to its max tokens. Workloads
(--only picks; bench.workloads defines them):

  offline   nano-vllm's workload: 256 requests, prompt and output lengths uniform in
            [100, 1024]; output tok/s. Ours: all requests added at once (continuous batching).
            transformers: one left-padded batch (with the dynamic cache, each request's first
            256 new tokens only, or it would take minutes; the output says so).
  batch1    a 32-token prompt, 256 new tokens alone: ms per token after the first, and its
            share of the bandwidth floor (bench.floor: weight + K/V bytes per step over the
            copy bandwidth measured in this run).
  sweep     B requests of a 128-token prompt, 128 new tokens each, B = 1 ... 256: tok/s.
  ttft      time to first token of a 4,096-token prompt (median of 3 prompts).
  prefix    256 requests sharing a 1,000-token system prompt, 64 new tokens each: ours with
            prefix caching on and off (the median of 3 runs, each with its own system
            prompt), transformers in one padded batch.
  serve     offline's requests as concurrent streaming clients of the OpenAI-compatible
            server (bench.serve): output tok/s and its share of offline's in the same run,
            time to first token and inter-token latency (p50, p99).
  kernels   bench.kernels' table: every op beside torch's, GB/s or TFLOP/s, share of the
            measured copy bandwidth and of a copy of the same bytes.
  profile   bench.profile at batch 1 and 256: each kernel's GPU time in one decode step, what
            each adds to a graph replay, the replay, a whole engine step, the floor.

transformers runs its fastest configuration that works (bench.hf): static cache + compile,
else the dynamic cache; the output names which. Compile and CUDA-graph capture happen in
warm-ups, never timed, and --budget stops starting transformers' workloads once the run has
taken that long (the summary says which were skipped). Results go to JSON (bench.results):
GPU, driver, torch, CUDA and transformers versions, date, commit, every number; the summary
(bench.report) prints each workload as ours vs transformers and says, for each of the engine's
goals (bench.targets), the figure and by how much it is met or missed.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from bench import results, runs, targets
from bench import workloads as W

if TYPE_CHECKING:   # torch loads when a run starts; parts.load names a stage folder's types
    from bench.hf import Transformers
    from bench.timing import Timer, Timing
    from course import parts
    LlamaModel = parts.load("08", "model").LlamaModel

ENGINE_WORKLOADS = ("offline", "batch1", "sweep", "ttft", "prefix")
ALL = ENGINE_WORKLOADS + ("serve", "kernels", "profile")
HF_ORDER = ("batch1", "offline", "sweep", "ttft", "prefix")  # skipped from the end first
HF_DYNAMIC_OFFLINE_NEW = 256      # the dynamic cache is host-bound: cap each request there
MAX_POSITIONS = W.TTFT_PROMPT + 64
PROFILE_BATCHES = (1, 256)
PROFILE_CONTEXT = 512


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", metavar="DIR", help="folder for the JSON (bench.json in it)")
    p.add_argument("--json", metavar="FILE", help="the JSON's path (default DIR/bench.json)")
    p.add_argument("--only", metavar="W[,W...]", help=f"workloads to run, of {', '.join(ALL)}")
    p.add_argument("--skip-hf", action="store_true", help="measure this engine only")
    p.add_argument("--hf-cache", choices=("static", "dynamic"), default="static",
                   help="transformers' cache: static + compile (falls back to dynamic if it "
                        "fails), or dynamic")
    p.add_argument("--hf-compile-limit", type=float, default=240.0, metavar="S",
                   help="seconds transformers' compile may take before falling back (0: no "
                        "limit)")
    p.add_argument("--budget", type=float, default=480.0, metavar="S",
                   help="start no transformers workload after S seconds of the run")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 64 requests, fewer tokens and repetitions")
    p.add_argument("--model", metavar="DIR", help="a real checkpoint (HF layout) instead of "
                                                  "random weights")
    p.add_argument("--shape", metavar="NAME",
                   help="the random weights' model shape (bench.engine.SHAPES): llama-3.2-1b "
                        "(default), qwen3-0.6b, qwen2.5-0.5b, smollm2-135m, mistral-7b")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--flush", choices=("read", "write"), default="read",
                   help="empty the L2 before each kernel-table run by reading (default) or "
                        "writing twice its size (bench.timing says why)")
    args = p.parse_args(argv)
    chosen = [w.strip() for w in (args.only if args.only is not None else ",".join(ALL))
              .split(",") if w.strip()]
    unknown = [w for w in chosen if w not in ALL]
    if unknown:
        p.error(f"unknown workload(s) {unknown}; choose from {', '.join(ALL)}")
    if not chosen:   # "--only ''" would otherwise load the model and measure nothing
        p.error(f"--only names no workload; choose from {', '.join(ALL)}")
    args.workloads = [w for w in ALL if w in chosen]
    # Checked here, so that a typo is an error also on a machine without a GPU (and before
    # minutes of model loading on one). NaN would pass every `elapsed > limit` test.
    for flag, seconds in (("--budget", args.budget), ("--hf-compile-limit",
                                                      args.hf_compile_limit)):
        if math.isnan(seconds) or seconds < 0:
            p.error(f"{flag} must be a number of seconds >= 0, got {seconds}")
    if args.shape is not None and args.model is not None:
        p.error("--shape and --model: give one (random weights of a shape, or a checkpoint)")
    from bench.engine import shape_named
    try:
        args.shape = shape_named(args.shape or "llama-3.2-1b")
    except ValueError as e:
        p.error(f"--shape: {e}")
    if args.model is not None and not Path(args.model).is_dir():
        p.error(f"--model {args.model} is not a directory (a Hugging Face checkpoint folder)")
    if args.json is None and args.out is not None:
        args.json = str(Path(args.out) / "bench.json")
    if args.json is not None:
        # results.write creates missing folders; a file in the way would fail only at the end.
        path = Path(args.json).absolute()
        blocker = path if path.is_dir() else next(d for d in path.parents if d.exists())
        if not blocker.is_dir() or blocker == path:
            p.error(f"the JSON cannot be written to {args.json}: {blocker} is "
                    f"{'a directory' if blocker == path else 'not a directory'}")
    return args


class Plan:
    """The sizes of one run (--quick shrinks them)."""

    def __init__(self, quick: bool):
        self.requests = 64 if quick else W.OFFLINE_REQUESTS
        self.batch1_new = 64 if quick else W.BATCH1_NEW
        self.sweep_new = 32 if quick else W.SWEEP_NEW
        self.reps = 2 if quick else 3


def log(text: str) -> None:
    print(text, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        reason = "bench: no CUDA device here; nothing was measured (run it on a GPU machine)."
        print(reason)
        if args.json:
            results.write(args.json, results.not_measured(reason))
        return 0
    started = time.perf_counter()
    doc = run(args, started)
    doc["elapsed_s"] = time.perf_counter() - started
    doc["targets"] = targets.check(doc)
    from bench import report
    print("\n" + report.summary(doc) + "\n")
    print(f"{doc['elapsed_s']:.0f} s in all.")
    if args.json:
        print(f"wrote {results.write(args.json, doc)}")
    return 0


def run(args: argparse.Namespace, started: float) -> dict:
    """Every selected workload, ours then transformers'; the result document."""
    import torch
    import transformers

    from bench.engine import SHAPES, build_models, load_models
    from bench.ours import release
    from bench.timing import Timer, copy_bandwidth
    transformers.logging.set_verbosity_error()
    torch.backends.cuda.matmul.allow_tf32 = False
    plan = Plan(args.quick)
    env = results.environment()
    random_weights = args.model is None
    model_info = {
        "source": f"random weights, {args.shape}'s shapes" if random_weights
        else f"checkpoint {args.model}", "dtype": "bfloat16",
        "eos": ("random weights never stop early: every request runs to its max tokens (EOS "
                "ignored)" if random_weights else
                "EOS ignored: every request runs to its max tokens, on both sides")}
    doc = results.new_document(env, model_info, {k: v for k, v in vars(args).items()})
    log(f"python3 -m bench on {env['gpu']}, torch {env['torch']}, transformers "
        f"{env['transformers']}, commit {env['commit']}: {', '.join(args.workloads)}"
        f"{'' if not args.skip_hf else ' (this engine only)'}{', quick' if args.quick else ''}")
    log(f"model: {model_info['source']}, bf16; {model_info['eos']}")

    t0 = time.perf_counter()
    if random_weights:
        hf, model, _ = build_models(SHAPES[args.shape], seed=args.seed,
                                    max_positions=MAX_POSITIONS)
    else:
        hf, model = load_models(args.model, MAX_POSITIONS)
    log(f"models ready in {time.perf_counter() - t0:.1f} s")
    timer = Timer(args.quick, args.flush)
    copy_gbs, copy_t = copy_bandwidth(timer)
    doc["copy_bandwidth_GBps"] = copy_gbs
    log(f"copy bandwidth {copy_gbs:.0f} GB/s (1 GiB device-to-device, read + write, median of "
        f"{copy_t.runs})")

    if "kernels" in args.workloads:
        doc["kernels"] = kernel_table(timer, copy_gbs, copy_t, args.quick)
    engine_work = [w for w in args.workloads if w in ENGINE_WORKLOADS]
    measured = measure_ours(model, engine_work, plan, copy_gbs * 1e9)
    served = measure_serve(args, model.config.vocab_size, plan, measured.get("offline")) \
        if "serve" in args.workloads else None
    if "profile" in args.workloads:
        doc["profile"] = profile(model, copy_gbs * 1e9)
        release()       # the profile's engines: their pools go back before transformers runs
    if args.skip_hf or not engine_work:
        theirs: dict = {}
        skipped = "not run (--skip-hf)" if args.skip_hf else None
        del hf
    else:
        from bench.hf import Transformers
        side = Transformers(hf, args.hf_cache, args.hf_compile_limit, log)
        theirs, skipped_hf = measure_hf(side, model.config.vocab_size, engine_work, plan,
                                        lambda: time.perf_counter() - started, args.budget)
        doc["transformers_config"] = side.describe()
        measured["skipped_hf"] = skipped_hf
        skipped = None
    doc["workloads"] = sections(engine_work, plan, measured, theirs, skipped)
    if served is not None:
        doc["workloads"]["serve"] = served
    return doc


def measure_serve(args: argparse.Namespace, vocab: int, plan: Plan,
                  offline: tuple[float, int] | None) -> dict:
    """The serve section: offline's requests through the HTTP server (bench.serve), its
    engine process holding the same model as this process's."""
    from functools import partial

    from bench import serve
    log("\nthe OpenAI-compatible server (bench.serve):")
    reqs = W.offline(plan.requests, vocab)
    why = serve.not_runnable()
    if why is not None:
        log(f"  serve: {why}")
        return serve.skipped_section(len(reqs), why)
    build = partial(serve.engine_of, 2 * W.OFFLINE_LENGTHS[1], MAX_POSITIONS, args.shape,
                    args.seed, args.model)
    raw = serve.measure(build, reqs, describe=lambda s: log("  " + s))
    section = serve.section(reqs, raw, offline and offline[1] / offline[0],
                            serve.transformers_skipped())
    o, share = section["ours"], section["share_of_offline"]
    log(f"  serve: {o['tokens']} tokens in {o['seconds']:.2f} s = {o['tok_s']:,.0f} tok/s"
        + ("" if share is None else f", {100 * share:.0f}% of offline")
        + f"; TTFT p50 {o['ttft_ms']['p50']:.1f} ms, ITL p50 {o['itl_ms']['p50']:.1f} ms")
    return section


def kernel_table(timer: Timer, copy_gbs: float, copy_t: Timing, quick: bool) -> dict:
    from bench import kernels
    from bench.cases import FAMILIES, Ops
    log("\nkernel table (bench.kernels):")
    ops = Ops()
    rows, fatal = kernels.run_families(list(FAMILIES), ops, timer, seed=1234)
    return kernels.table_dict(rows, fatal, ops, timer, copy_gbs, copy_t, 1234, quick)


def profile(model: LlamaModel, bandwidth: float) -> dict:
    from bench.profile import profile_batch
    log("\nprofile of a decode step (bench.profile):")
    out = []
    for batch in PROFILE_BATCHES:
        r = profile_batch(model, batch, PROFILE_CONTEXT, bandwidth)
        log(f"  batch {batch}: graph replay {r['graph_replay_us']:.0f} us, engine step "
            f"{r['engine_step_us']:.0f} us, floor of the replayed step {r['floor_us']:.0f} us")
        out.append(r)
    return {"bandwidth": bandwidth, "results": out}


# ----------------------------------------------------------------------------- measuring

def measure_ours(model: LlamaModel, work: list[str], plan: Plan, bandwidth: float) -> dict:
    """{workload: raw timings} of this engine, a fresh engine per workload."""
    from bench import floor
    from bench.ours import engine_session
    vocab = model.config.vocab_size
    m: dict = {}
    if work:
        log("\nthis engine:")
    if "offline" in work:
        reqs = W.offline(plan.requests, vocab)
        with engine_session(model, 2 * W.OFFLINE_LENGTHS[1], prefix_caching=True,
                            describe=lambda s: log("  " + s)) as serve:
            m["offline"] = serve(reqs)
        log(f"  offline: {m['offline'][1]} tokens in {m['offline'][0]:.2f} s = "
            f"{m['offline'][1] / m['offline'][0]:,.0f} tok/s")
    if "batch1" in work:
        request = W.fixed(1, W.BATCH1_PROMPT, plan.batch1_new, vocab, seed=2)[0]
        with engine_session(model, W.BATCH1_PROMPT + plan.batch1_new) as serve:
            m["batch1"] = runs.decode_ms_per_token(serve, request, plan.reps)
        floor_s = floor.decode_floor_s(floor.weight_bytes(model), floor.kv_bytes_per_token(model),
                                       1, W.BATCH1_PROMPT, plan.batch1_new, bandwidth)
        m["floor_ms"] = floor_s * 1e3
        log(f"  batch-1 decode: {statistics.median(m['batch1']):.3f} ms per token "
            f"(floor {m['floor_ms']:.3f} ms)")
    if "sweep" in work:
        m["sweep"] = {}
        with engine_session(model, W.SWEEP_PROMPT + plan.sweep_new) as serve:
            for batch in W.SWEEP_BATCHES:
                reqs = W.fixed(batch, W.SWEEP_PROMPT, plan.sweep_new, vocab, seed=batch)
                m["sweep"][batch] = runs.first_token_and_all(serve, reqs)
                log(f"  sweep batch {batch}: "
                    f"{batch * plan.sweep_new / m['sweep'][batch][1]:,.0f} tok/s")
    if "ttft" in work:
        prompts = [p for p, _ in W.fixed(plan.reps, W.TTFT_PROMPT, 1, vocab, seed=3)]
        with engine_session(model, W.TTFT_PROMPT + 16) as serve:
            m["ttft"] = runs.first_token_ms(serve, prompts)
        log(f"  TTFT {W.TTFT_PROMPT} tokens: {statistics.median(m['ttft']):.1f} ms")
    if "prefix" in work:
        # A run takes ~0.5 s with caching on: the median of reps runs, each with a system
        # prompt of its own (seeds 1, 2, ...), so that no run finds the one before it cached.
        runs_of = [W.shared_prefix(plan.requests, vocab, seed=1 + r) for r in range(plan.reps)]
        for caching in (True, False):
            with engine_session(model, max(map(W.context_len, runs_of)),
                                prefix_caching=caching) as serve:
                timings = sorted(serve(reqs) for reqs in runs_of)
            m[f"prefix_{'on' if caching else 'off'}"] = timings[len(timings) // 2]
        log(f"  shared prefix: caching on {m['prefix_on'][1] / m['prefix_on'][0]:,.0f} tok/s, "
            f"off {m['prefix_off'][1] / m['prefix_off'][0]:,.0f} tok/s")
    return m


def measure_hf(side: Transformers, vocab: int, work: list[str], plan: Plan,
               elapsed: Callable[[], float], budget: float) -> tuple[dict, dict]:
    """({workload: raw timings}, {workload: why skipped}) of transformers, in HF_ORDER."""
    m: dict = {}
    skipped: dict = {}
    log(f"\ntransformers ({side.name}):")
    for name in [w for w in HF_ORDER if w in work]:
        if elapsed() > budget:
            skipped[name] = (f"not run: the run had taken {elapsed():.0f} s, past --budget "
                             f"{budget:.0f}; run it alone with --only {name}")
            log(f"  {name}: {skipped[name]}")
            continue
        t0 = time.perf_counter()
        if name == "offline":
            reqs = W.offline(plan.requests, vocab)
            timing = side.serving(W.padded_len(reqs), HF_DYNAMIC_OFFLINE_NEW)(reqs)
            m["offline"] = (timing, len(reqs), side.cache)   # the cache that served it
        elif name == "batch1":
            request = W.fixed(1, W.BATCH1_PROMPT, plan.batch1_new, vocab, seed=2)[0]
            reps = plan.reps if side.cache == "static" else 1
            m["batch1"] = runs.decode_ms_per_token(
                side.serving(W.BATCH1_PROMPT + plan.batch1_new), request, reps)
        elif name == "sweep":
            serve = side.serving(W.SWEEP_PROMPT + plan.sweep_new)
            m["sweep"] = {b: runs.first_token_and_all(
                serve, W.fixed(b, W.SWEEP_PROMPT, plan.sweep_new, vocab, seed=b))
                for b in W.SWEEP_BATCHES}
        elif name == "ttft":
            prompts = [p for p, _ in W.fixed(plan.reps, W.TTFT_PROMPT, 1, vocab, seed=3)]
            m["ttft"] = runs.first_token_ms(side.serving(W.TTFT_PROMPT + 1), prompts)
        elif name == "prefix":
            reqs = W.shared_prefix(plan.requests, vocab)
            m["prefix"] = side.serving(W.padded_len(reqs))(reqs)
        log(f"  {name}: done in {time.perf_counter() - t0:.0f} s ({side.name})")
    return m, skipped


def sections(work: list[str], plan: Plan, ours: dict, theirs: dict,
             skipped_all: str | None) -> dict:
    """The document's workloads from both sides' raw timings."""
    hf_skips = ours.get("skipped_hf", {})

    def why(name: str) -> dict | None:
        reason = skipped_all or hf_skips.get(name)
        return {"transformers": reason} if reason else None

    out = {}
    if "offline" in work:
        hf = theirs.get("offline")
        note = ""
        if hf and hf[2] == "dynamic":
            note = (f"dynamic cache, so each request's first {HF_DYNAMIC_OFFLINE_NEW} new "
                    "tokens only (shorter contexts: in its favour)")
        out["offline"] = results.offline_section(
            plan.requests, ours["offline"], hf and hf[0], hf and hf[1], note, why("offline"))
    if "batch1" in work:
        out["batch1"] = results.batch1_section(W.BATCH1_PROMPT, plan.batch1_new,
                                               ours["floor_ms"], ours["batch1"],
                                               theirs.get("batch1"), why("batch1"))
    if "sweep" in work:
        hf = theirs.get("sweep", {})
        out["sweep"] = results.sweep_section(
            W.SWEEP_PROMPT, plan.sweep_new,
            [results.sweep_row(b, plan.sweep_new, t, hf.get(b)) for b, t in ours["sweep"].items()],
            why("sweep"))
    if "ttft" in work:
        out["ttft"] = results.ttft_section(W.TTFT_PROMPT, ours["ttft"], theirs.get("ttft"),
                                           why("ttft"))
    if "prefix" in work:
        out["prefix"] = results.prefix_section(plan.requests, W.PREFIX_TOKENS, ours["prefix_on"],
                                               ours["prefix_off"], theirs.get("prefix"),
                                               why("prefix"))
    return out


if __name__ == "__main__":
    sys.exit(main())
