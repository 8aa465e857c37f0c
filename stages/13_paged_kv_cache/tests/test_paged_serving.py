"""Stage 13: the engine on the paged cache with your block manager (solutions/engine/, on
the CPU in float32 with the native twins).

The oracle, as in stage 11: each request run alone (stage 09's generate_greedy) gives the same
tokens. Paging, prefix sharing and preemption must all be invisible in the output. After
every step the pool is audited: every block is either free or held, a block held by several
sequences is a shared, registered prefix block at the same place in each of their tables with
the same tokens, and its reference count is the number of its holders.
"""
from __future__ import annotations

import random

import pytest
import torch

from course import parts
from course.testing import fixtures
from course.testing.engine_audit import audit, watch_plans

BLOCK = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return fixtures.load_tiny(tmp_path_factory.mktemp("gqa_tied"), "gqa_tied")


def new_model(tiny):
    return parts.load("08", "model").LlamaModel(tiny.config, tiny.weights, "cpu", torch.float32)


def new_engine(tiny, num_blocks: int, eos=(), **config):
    from solutions.engine.llm_engine import LLMEngine
    from solutions.engine.model_runner import EngineConfig
    per_block = BLOCK * parts.load("09", "kv_cache").KVCache.bytes_per_token(tiny.config,
                                                                            torch.float32)
    engine = LLMEngine(new_model(tiny), None, eos, EngineConfig(
        paged=True, block_size=BLOCK, kv_cache_gib=(num_blocks + 0.5) * per_block / 2**30,
        **config))
    assert engine.runner.num_blocks == num_blocks
    return engine


def params(**kw):
    return parts.load("11", "sampling_params").SamplingParams(**kw)


MAX_NEW = 16   # tokens the solo oracle computes per prompt


def solo_oracle(tiny):
    return fixtures.Solo(new_model(tiny), MAX_NEW)


def drive(engine, arrivals):
    """Run the engine, checking every plan of the scheduler as it is made (watch_plans) and
    the queues and the pool after every step (audit)."""
    watch_plans(engine.scheduler)
    return fixtures.drive(engine, arrivals, lambda e, step: audit(e, f"after step {step}"))


@pytest.mark.points(8)
def test_soak_shared_prefixes_through_a_small_pool(tiny):
    """200 requests: one of 3 system prompts (9, 14, 21 tokens) + a short question from a
    pool, arriving at random steps, greedy, through 24 blocks of 4 positions while up to 6
    sequences of up to 48 tokens run: prefixes are shared, blocks run out, sequences are
    preempted and recomputed. Every output equals the request run alone; nothing leaks."""
    rng = random.Random(1313)
    vocab = tiny.config.vocab_size
    systems = [[rng.randrange(4, vocab) for _ in range(n)] for n in (9, 14, 21)]
    prompts = [sp + [rng.randrange(4, vocab) for _ in range(rng.randint(1, 7))]
               for sp in systems for _ in range(8)]
    eos = (3,)
    engine = new_engine(tiny, num_blocks=25, eos=eos, max_model_len=48, max_num_seqs=6,
                        max_num_batched_tokens=32)
    arrivals: dict[int, list] = {}
    for _ in range(200):
        sp = params(max_tokens=rng.randint(1, MAX_NEW), ignore_eos=rng.random() < 0.3)
        arrivals.setdefault(rng.randrange(0, 300), []).append((rng.choice(prompts), sp))
    got, ids = drive(engine, arrivals)
    solo = solo_oracle(tiny)
    for rid, (prompt, sp, reason) in ids.items():
        expected = solo(prompt, sp.max_tokens, () if sp.ignore_eos else eos)
        assert got[rid] == expected, (
            f"request {rid} (prompt of {len(prompt)}, max_tokens {sp.max_tokens}) gave "
            f"{got[rid]}, alone {expected}: shared blocks must hold exactly its prefix, and a "
            "block must not be written while another sequence reads it")
    bm, s = engine.scheduler.allocator, engine.scheduler
    assert not s.running and not s.waiting
    assert bm.num_free_blocks == bm.num_total_blocks and all(b.ref_count == 0 for b in bm.blocks), (
        "at the end every block is free again")
    assert s.num_preemptions > 0, "the pool is small enough that sequences must be preempted"
    assert bm.stats.hit_tokens > 0, "requests with a common system prompt must share blocks"


@pytest.mark.points(3)
def test_a_shared_system_prompt_is_computed_once(tiny):
    """Two requests with a 13-token system prompt, one after the other: the second finds 12
    tokens (3 full blocks) cached and runs only the rest, with the same output as alone."""
    rng = random.Random(7)
    vocab = tiny.config.vocab_size
    system = [rng.randrange(4, vocab) for _ in range(13)]
    a, b = system + [5, 6], system + [7, 8, 9]
    engine = new_engine(tiny, num_blocks=30, max_model_len=48)
    steps = []
    launch = engine.runner.launch

    def recording_launch(seqs, previous=None):
        steps.append([(q.seq_id, q.num_cached, q.num_scheduled) for q in seqs])
        return launch(seqs, previous)
    engine.runner.launch = recording_launch
    got, _ = drive(engine, {0: [(a, params(max_tokens=4))]})
    steps.clear()
    more, _ = drive(engine, {0: [(b, params(max_tokens=4))]})
    assert steps[0] == [(1, 12, len(b) - 12)], (
        f"b's first 12 tokens are a's 3 full blocks: cached, so its first step runs the "
        f"{len(b) - 12} others (seq_id, num_cached, num_scheduled) = (1, 12, {len(b) - 12}); "
        f"got {steps[0]}")
    solo = solo_oracle(tiny)
    assert got[0] == solo(a, 4) and more[1] == solo(b, 4)
