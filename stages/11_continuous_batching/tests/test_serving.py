"""Stage 11: the engine serving many requests at once (your scheduler inside the reference
engine, solutions/engine/llm_engine.py), on the CPU in float32 with the native twins.

The oracle: each request run alone (stage 09's generate_greedy). Continuous batching must be
invisible in the output: on the CPU in float32 every request's tokens equal its solo tokens
exactly, whatever joined or left around it.
"""
from __future__ import annotations

import random

import pytest
import torch

from course import parts
from course.testing import fixtures
from course.testing.engine_audit import audit, watch_plans


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return fixtures.load_tiny(tmp_path_factory.mktemp("gqa_tied"), "gqa_tied")


def new_model(tiny):
    return parts.load("08", "model").LlamaModel(tiny.config, tiny.weights, "cpu", torch.float32)


def new_engine(tiny, eos=(), **config):
    from solutions.engine.llm_engine import LLMEngine
    from solutions.engine.model_runner import EngineConfig
    # stage 11's cache: one slot per sequence (stage 13's paged cache is tested in stage 13)
    return LLMEngine(new_model(tiny), None, eos, EngineConfig(paged=False, **config))


def params(**kw):
    return parts.load("11", "sampling_params").SamplingParams(**kw)


MAX_NEW = 20   # tokens the solo oracle computes per prompt


def solo_oracle(tiny):
    return fixtures.Solo(new_model(tiny), MAX_NEW)


def drive(engine, arrivals):
    """Run the engine (fixtures.drive), checking every plan of the scheduler as it is made
    (watch_plans: budget, limits, prefill or decode, FCFS) and the queues and slots after
    every step (audit)."""
    watch_plans(engine.scheduler)
    return fixtures.drive(engine, arrivals, lambda e, step: audit(e, f"after step {step}"))


@pytest.mark.points(10)
def test_soak_many_requests_through_few_slots(tiny):
    """300 requests arrive at random steps with random prompts (of 1-30 tokens, from a pool of
    50), stop points and eos handling, through a cache of 5 slots, at most 4 sequences and 24
    tokens a step (so prompts get chunked)."""
    rng = random.Random(1234)
    vocab = tiny.config.vocab_size
    pool = [[rng.randrange(4, vocab) for _ in range(rng.randint(1, 30))] for _ in range(50)]
    eos = (3,)
    per_token = parts.load("09", "kv_cache").KVCache.bytes_per_token(tiny.config, torch.float32)
    engine = new_engine(tiny, eos=eos, max_model_len=48, max_num_seqs=4,
                        max_num_batched_tokens=24, kv_cache_gib=5.5 * 48 * per_token / 2**30)
    assert engine.runner.num_slots == 4, "the cache holds 5 sequences, capped at max_num_seqs 4"
    arrivals: dict[int, list] = {}
    for _ in range(300):
        prompt = rng.choice(pool)
        sp = params(max_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.2)
        arrivals.setdefault(rng.randrange(0, 400), []).append((prompt, sp))
    got, ids = drive(engine, arrivals)
    solo = solo_oracle(tiny)
    for rid, (prompt, sp, reason) in ids.items():
        expected = solo(prompt, sp.max_tokens, () if sp.ignore_eos else eos)
        assert got[rid] == expected, (
            f"request {rid} (prompt of {len(prompt)}, max_tokens {sp.max_tokens}) gave "
            f"{got[rid]}, alone {expected}: a sequence's tokens must not depend on its "
            "batch-mates (its own slot, positions, chunks)")
        want = "eos" if expected and expected[-1] in eos and not sp.ignore_eos else "max_tokens"
        assert reason in (want, "context"), f"request {rid}: finish reason {reason}, want {want}"
    s = engine.scheduler
    assert not s.running and not s.waiting and len(s.allocator.free_slots) == 4, (
        "at the end every slot is free again")


@pytest.mark.points(4)
def test_requests_join_while_others_decode(tiny):
    """b arrives while a is decoding; each gives the tokens it gives alone."""
    engine = new_engine(tiny, max_model_len=64, max_num_seqs=8)
    a = engine.add_request([5, 6, 7, 8], params(max_tokens=10))
    early = []
    for _ in range(3):
        early += [t for out in engine.step() if out.request_id == a for t in out.new_token_ids]
    assert 0 < len(early) < 10 and engine.has_unfinished(), (
        f"after 3 steps a should be decoding, with some of its 10 tokens: got {early}")
    b = engine.add_request([9, 10], params(max_tokens=4))
    got, _ = drive(engine, {})
    solo = solo_oracle(tiny)
    assert early + got[a] == solo([5, 6, 7, 8], 10), (
        "a's tokens changed when b joined its batch: b must get its own slot and positions")
    assert got[b] == solo([9, 10], 4), "b, joining a running batch, must decode as it would alone"


@pytest.mark.points(4)
def test_abort_frees_the_slot_and_spares_the_others(tiny):
    engine = new_engine(tiny, max_model_len=64, max_num_seqs=2, kv_cache_gib=1e-3)
    a = engine.add_request([5, 6, 7], params(max_tokens=20))
    b = engine.add_request([8, 9], params(max_tokens=20))
    got = {a: [], b: []}
    for _ in range(4):
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    out = engine.abort(a)
    assert out.finished and out.finish_reason == "abort"
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    assert got[b] == solo_oracle(tiny)([8, 9], 20)
    allocator = engine.scheduler.allocator
    assert len(allocator.free_slots) == allocator.num_slots


@pytest.mark.parametrize("bad,needle", [
    (dict(prompt=[]), "empty"),
    (dict(prompt=[1] * 65), "context"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(prompt=[1, 10**6]), "out of range"),
])
def test_bad_requests_are_refused_and_disturb_nobody(tiny, bad, needle):
    engine = new_engine(tiny, max_model_len=64)
    good = engine.add_request([5, 6, 7], params(max_tokens=6))
    first = [t for out in engine.step() for t in out.new_token_ids]
    prompt = bad.pop("prompt", [4, 5])
    with pytest.raises((ValueError, IndexError), match=needle):
        engine.add_request(prompt, params(**bad) if bad else params())
    got, _ = drive(engine, {})
    assert first + got.get(good, []) == solo_oracle(tiny)([5, 6, 7], 6), (
        "a refused request must not change what the running ones produce")


@pytest.mark.points(2)
def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny):
    """A seeded random request draws the same numbers whatever else is in the batch."""
    sp = params(max_tokens=12, temperature=0.9, top_k=20, top_p=0.9, seed=77)
    alone = new_engine(tiny, max_model_len=64)
    rid = alone.add_request([5, 6, 7, 8], sp)
    got_alone, _ = drive(alone, {})
    crowd = new_engine(tiny, max_model_len=64)
    rng = random.Random(5)
    arrivals = {0: [([rng.randrange(4, 200) for _ in range(9)], params(max_tokens=8,
                                                                      temperature=1.0, seed=i))
                    for i in range(3)],
                2: [([5, 6, 7, 8], sp)]}
    got, ids = drive(crowd, arrivals)
    mine = next(r for r, v in ids.items() if v[1] is sp)
    assert got[mine] == got_alone[rid], (
        f"seeded request alone {got_alone[rid]}, in a batch {got[mine]}: its random numbers "
        "must depend only on its seed and its own token count")
