"""A differential fuzz test of the serving engine (solutions/engine/) on the CPU, float32.

Each case is one seed. From it a random workload and engine config are drawn: 5-30
requests (prompts of 1-80 tokens, many sharing long common prefixes or repeating an earlier
prompt whole, so the prefix cache hits and some prompts are cached but for their last
block), max_tokens 1-20, greedy and seeded sampled requests mixed, in some cases eos ids
(some requests ignoring them) or a context too short for some requests; a paged (block
size 1, 2, 4 or 16, prefix caching on or off) or contiguous cache, often so small that
sequences are preempted; chunked prefill on or off; token budgets down to 1 (one-token
chunks of prompts, steps shaped like decode steps); requests arriving between steps and a
few aborted at random steps.

The oracle: every request run ALONE. A greedy one by stage 09's generate_greedy, a seeded
sampled one in a fresh engine of its own (the engine promises a seeded request the same
tokens alone and in any batch). Batched, every request must give exactly those tokens (an
aborted one: a prefix of them), finish exactly once with the right finish_reason, and after
every step the scheduler and the cache must be consistent (no block held twice or lost,
reference counts equal to the holders, the free list exactly the blocks nobody holds, no
slot leaked); at the end everything is free.

On the CPU in float32 batching is invisible bit for bit (the stage 11 and 13 serving tests
rely on it too), so any difference is a bug, never rounding.

    PYTHONPATH=. .nox/tiny-vllm/bin/python -m pytest -q tests/test_engine_fuzz.py

Environment:
    TINYVLLM_FUZZ_CASES=N     run seeds 0..N-1 instead of the fixed list (a local hunt)
    TINYVLLM_FUZZ_SEEDS=3,17  run exactly these seeds (what a failure message tells you)
"""
from __future__ import annotations

import dataclasses
import os
import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from course import parts
from course.testing import fixtures
from course.testing.engine_audit import audit, watch_plans

GiB = 1 << 30
MAX_NEW = 20          # the most tokens a request asks for
MAX_PROMPT = 80       # the longest prompt
FIXED_SEEDS = list(range(40))


def _seeds() -> list[int]:
    if os.environ.get("TINYVLLM_FUZZ_SEEDS"):
        return [int(s) for s in os.environ["TINYVLLM_FUZZ_SEEDS"].split(",") if s.strip()]
    if os.environ.get("TINYVLLM_FUZZ_CASES"):
        return list(range(int(os.environ["TINYVLLM_FUZZ_CASES"])))
    return FIXED_SEEDS


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The model is tiny: one thread is as fast, and far faster on a shared CPU (two torch
    threads on two busy cores wait on each other); restored for the tests that follow."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gqa_tied")
    fixtures.save_tiny_llama(directory, "gqa_tied", eos_token_id=None)
    config = parts.load("01", "config").load_config(directory)
    weights = parts.load("01", "checkpoint").load_weights(directory, config)
    return SimpleNamespace(config=config, weights=weights, greedy={})


def new_model(tiny):
    # one per engine and one for the oracle: each sets its own attention backend on it
    return parts.load("08", "model").LlamaModel(tiny.config, tiny.weights, "cpu", torch.float32)


def SamplingParams(**kw):
    return parts.load("11", "sampling_params").SamplingParams(**kw)


# -- the workload --------------------------------------------------------------------------

@dataclass
class Request:
    prompt: list[int]
    params: object
    arrival: int                  # added before this step() call
    abort_at: int | None = None   # aborted before this step() call (if still running)
    rid: int | None = None
    tokens: list[int] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    aborted: bool = False         # abort() found it running and stopped it

    def describe(self) -> str:
        p = self.params
        how = ("greedy" if p.greedy else
               f"T={p.temperature:.3f} top_k={p.top_k} top_p={p.top_p:.3f} seed={p.seed}")
        abort = "" if self.abort_at is None else f", abort before step {self.abort_at}"
        how += ", ignore_eos" if p.ignore_eos else ""
        return (f"prompt ({len(self.prompt)} tokens) {self.prompt}, max_tokens "
                f"{p.max_tokens}, {how}, arrives before step {self.arrival}{abort}")


@dataclass
class Case:
    seed: int
    config: dict
    pool: int                     # blocks (paged, pad block included) or slots
    requests: list[Request]
    eos: tuple[int, ...] = ()     # the engine's end-of-sequence ids

    def describe(self) -> str:
        kind = "blocks (pad included)" if self.config["paged"] else "slots"
        config = ", ".join(f"{k}={v!r}" for k, v in self.config.items())
        return (f"fuzz seed {self.seed}: EngineConfig({config}), kv_cache_gib sized for "
                f"{self.pool} {kind}, eos ids {self.eos}\n"
                f"reproduce: TINYVLLM_FUZZ_SEEDS={self.seed} PYTHONPATH=. "
                ".nox/tiny-vllm/bin/python -m pytest -q tests/test_engine_fuzz.py")


def draw_case(seed: int, vocab: int) -> Case:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    paged = rng.random() < 0.75
    block_size = rng.choice([1, 2, 4, 16])
    # prefixes of lengths that often end on a block boundary (a prompt cached but for its
    # last block), and often do not
    prefixes = []
    for _ in range(rng.randint(1, 3)):
        n = rng.randint(1, 60)
        if rng.random() < 0.5:
            n = max(block_size, n // block_size * block_size)
        prefixes.append(tokens(min(n, MAX_PROMPT)))
    prompts: list[list[int]] = []
    for _ in range(rng.randint(5, 30)):
        kind = rng.random()
        if kind < 0.25 or not prompts and kind < 0.45:
            p = tokens(rng.randint(1, MAX_PROMPT) if rng.random() < 0.5 else rng.randint(1, 8))
        elif kind < 0.6:
            base = rng.choice(prefixes)
            p = base + tokens(rng.choice([0, rng.randint(1, 4), rng.randint(1, 20)]))
        elif kind < 0.8 and prompts:
            p = list(rng.choice(prompts))        # the same prompt again: fully cached
        elif prompts:
            base = rng.choice(prompts)           # an earlier prompt, cut or extended
            p = base[: rng.randint(1, len(base))] + tokens(rng.choice([0, 1, rng.randint(1, 16)]))
        else:
            p = tokens(rng.randint(1, 20))
        prompts.append(p[:MAX_PROMPT])
    greedy_share = rng.choice([0.0, 0.5, 0.8, 1.0])
    params = []
    for _ in prompts:
        max_tokens = rng.randint(1, MAX_NEW) if rng.random() < 0.7 else rng.randint(1, 4)
        if rng.random() < greedy_share:
            params.append(SamplingParams(max_tokens=max_tokens))
        else:
            params.append(SamplingParams(
                max_tokens=max_tokens, temperature=rng.choice([0.5, 0.8, 1.0, 1.5]),
                top_k=rng.choice([0, 0, 1, 5, 40]), top_p=rng.choice([1.0, 1.0, 0.9, 0.5]),
                seed=rng.getrandbits(40)))
    longest = max(len(p) + sp.max_tokens for p, sp in zip(prompts, params))
    if rng.random() < 0.2:
        # some requests end on "context": the context is shorter than prompt + max_tokens
        max_model_len = max(len(p) for p in prompts) + rng.randint(0, 6)
    else:
        max_model_len = longest + rng.randint(0, 3)
    max_num_seqs = rng.randint(1, 8)
    budget = rng.choice([1, 1, 2, 2, 3, 4, rng.randint(5, 16), rng.randint(17, 128)])
    chunked = rng.random() < 0.8
    config = dict(paged=paged, block_size=block_size,
                  enable_prefix_caching=rng.random() < 0.8, chunked_prefill=chunked,
                  max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                  max_model_len=max_model_len)
    # the pool: from one sequence of max_model_len (the least the engine accepts) to every
    # sequence at max_model_len (no preemption); mostly small, so sequences are preempted
    if paged:
        per_seq = -(-max_model_len // block_size)
        most = max_num_seqs * per_seq + 1
        extra = (most - per_seq - 1) // rng.choice([1, 3, 8])
        pool = rng.randint(per_seq + 1, per_seq + 1 + extra)
    else:
        pool = rng.randint(1, max_num_seqs)
    # arrivals: all at once, or spread over the first steps; a few aborts
    spread = rng.choice([0, 0, 5, 20, 60])
    requests = [Request(p, sp, rng.randint(0, spread)) for p, sp in zip(prompts, params)]
    requests.sort(key=lambda r: r.arrival)
    if rng.random() < 0.35:
        for r in rng.sample(requests, rng.randint(1, min(3, len(requests)))):
            r.abort_at = r.arrival + rng.randint(0, 25)
    # end-of-sequence ids for some cases, from a generator of their own (the rest of the
    # case stays what it was before eos ids were drawn)
    eos_rng = random.Random(f"eos {seed}")
    eos = ()
    if eos_rng.random() < 0.3:
        eos = tuple(eos_rng.sample(range(vocab), eos_rng.randint(2, 8)))
        for r in requests:
            if eos_rng.random() < 0.3:
                r.params = dataclasses.replace(r.params, ignore_eos=True)
    return Case(seed, config, pool, requests, eos)


def make_engine(tiny, config: dict, pool: int | None = None, eos: tuple[int, ...] = ()):
    """An engine of EngineConfig(**config), its kv_cache_gib sized to give exactly `pool`
    blocks (paged, the pad block included) or slots (contiguous)."""
    from solutions.engine.llm_engine import LLMEngine
    from solutions.engine.model_runner import EngineConfig
    per_token = parts.load("09", "kv_cache").KVCache.bytes_per_token(tiny.config, torch.float32)
    config = dict(config)
    if pool is not None:
        unit = (config["block_size"] if config["paged"] else config["max_model_len"]) * per_token
        config["kv_cache_gib"] = (pool + 0.5) * unit / GiB
    engine = LLMEngine(new_model(tiny), None, eos, EngineConfig(**config))
    if pool is not None:
        runner = engine.runner
        got = runner.num_blocks if config["paged"] else runner.num_slots
        assert got == pool, f"the test sized a pool of {pool}, the engine made {got}"
    return engine


# -- the oracle ----------------------------------------------------------------------------

def unstopped_length(req: Request, max_model_len: int) -> int:
    """Tokens it generates with no eos: max_tokens, or until the context is full (the engine
    emits tokens until the sequence holds max_model_len + 1: the last needs no position)."""
    return min(req.params.max_tokens, max_model_len + 1 - len(req.prompt))


def alone(tiny, req: Request, max_model_len: int, eos: tuple[int, ...]) -> tuple[list[int], str]:
    """The request's tokens and finish reason when it runs alone."""
    n = unstopped_length(req, max_model_len)
    stops = () if req.params.ignore_eos else eos
    if req.params.greedy:
        key = tuple(req.prompt)
        if key not in tiny.greedy:
            gen = parts.load("09", "kv_cache").generate_greedy
            tiny.greedy[key] = gen(new_model(tiny), list(req.prompt), MAX_NEW + 1)
        out = tiny.greedy[key][:n]
    else:
        engine = make_engine(tiny, dict(paged=True, block_size=16, max_model_len=max_model_len,
                                        max_num_seqs=1), eos=eos)
        rid = engine.add_request(req.prompt, req.params)
        out = []
        while engine.has_unfinished():
            for o in engine.step():
                assert o.request_id == rid
                out += o.new_token_ids
    stop = next((i for i, t in enumerate(out) if t in stops), None)
    if stop is not None:
        return out[: stop + 1], "eos"
    assert len(out) == n, f"alone, {req.describe()} gave {len(out)} tokens, not {n}"
    return out, "max_tokens" if n == req.params.max_tokens else "context"


# -- the run -------------------------------------------------------------------------------

def serve(engine, case: Case) -> int:
    """Run the case's requests through the engine, checking after every step; the steps."""
    by_rid: dict[int, Request] = {}
    pending = list(case.requests)
    watch_plans(engine.scheduler)   # every plan meets what any correct scheduler guarantees
    step = 0
    while engine.has_unfinished() or pending:
        where = f"before step {step}"
        while pending and pending[0].arrival <= step:
            req = pending.pop(0)
            req.rid = engine.add_request(req.prompt, req.params)
            by_rid[req.rid] = req
        for req in by_rid.values():
            if req.abort_at == step and not req.reasons:
                out = engine.abort(req.rid)
                assert out is not None and out.finished and out.finish_reason == "abort", (
                    f"{where}: abort of running request {req.rid} returned {out}")
                req.aborted = True
                req.reasons.append("abort")
                audit(engine, f"{where}, after aborting request {req.rid}")
        where = f"after step {step}"
        for out in engine.step():
            req = by_rid.get(out.request_id)
            assert req is not None, f"{where}: output for unknown request {out.request_id}"
            assert not req.reasons, (
                f"{where}: request {out.request_id} produced {out} after it finished "
                f"({req.reasons})")
            assert len(out.new_token_ids) == 1, f"{where}: {out} is not one token"
            req.tokens += out.new_token_ids
            if out.finished:
                assert out.finish_reason, f"{where}: {out} finished with no reason"
                req.reasons.append(out.finish_reason)
            else:
                assert out.finish_reason is None, f"{where}: {out} has a reason, unfinished"
        audit(engine, where)
        step += 1
        assert step < 20_000, "the engine does not finish: a request is never scheduled?"
    for req in by_rid.values():
        if req.abort_at is not None and not req.reasons:   # it had finished before: a no-op
            assert engine.abort(req.rid) is None
    return step


def check_case(tiny, case: Case) -> None:
    __tracebackhide__ = True   # the message says it all: seed, config, requests, tokens
    header = case.describe()
    engine = make_engine(tiny, case.config, case.pool, case.eos)
    try:
        steps = serve(engine, case)
    except AssertionError as e:
        raise AssertionError(f"{header}\n{e}\n" + "\n".join(
            f"  request {r.rid}: {r.describe()}" for r in case.requests)) from None
    except Exception as e:
        raise AssertionError(f"{header}\nthe engine raised {e!r}") from e
    s, alloc = engine.scheduler, engine.scheduler.allocator
    leaks = []
    if s.running or s.waiting or engine.requests:
        leaks.append(f"still running {len(s.running)}, waiting {len(s.waiting)}")
    if engine.runner.paged:
        if alloc.num_free_blocks != alloc.num_total_blocks or \
                any(b.ref_count for b in alloc.blocks):
            leaks.append(f"{alloc.num_free_blocks} of {alloc.num_total_blocks} blocks free")
    elif len(alloc.free_slots) != alloc.num_slots:
        leaks.append(f"{len(alloc.free_slots)} of {alloc.num_slots} slots free")
    assert not leaks, f"{header}\nafter {steps} steps, at the end: {'; '.join(leaks)}"
    L = engine.max_model_len
    wrong = []
    for req in case.requests:
        solo, reason = alone(tiny, req, L, case.eos)
        if req.aborted:
            ok = req.tokens == solo[: len(req.tokens)] and len(req.tokens) < len(solo)
            what = "aborted: a prefix of the alone tokens"
        else:
            ok = req.tokens == solo and req.reasons == [reason]
            what = f"finish {reason!r}"
        if not ok:
            first = next((i for i, (a, b) in enumerate(zip(req.tokens, solo)) if a != b), None)
            wrong.append(
                f"  request {req.rid}: {req.describe()}\n"
                f"    expected ({what}): {solo}\n"
                f"    batched (finish {req.reasons}): {req.tokens}\n"
                f"    first difference at output token {first}")
    assert not wrong, (
        f"{header}\n{len(wrong)} of {len(case.requests)} requests differ from running alone "
        f"({steps} steps, {s.num_preemptions} preemptions"
        + (f", {alloc.stats.hit_tokens} prefix-cache hit tokens" if engine.runner.paged else "")
        + "):\n" + "\n".join(wrong[:6]))


@pytest.mark.parametrize("seed", _seeds(), ids=lambda s: f"seed{s}")
def test_engine_matches_each_request_run_alone(tiny, seed):
    check_case(tiny, draw_case(seed, tiny.config.vocab_size))
