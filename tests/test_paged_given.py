"""The given (not graded) code of stage 13: the paged cache and its attention backend, the
cache-write twin, the pool size, and the engine's choice between paged and contiguous."""
from __future__ import annotations

import re

import pytest
import torch

from course import parts
from course.testing import checks, fixtures


def paged():
    return parts.reference("13", "paged_cache")


def kv():
    return parts.reference("09", "kv_cache")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return fixtures.load_tiny(tmp_path_factory.mktemp("gqa_tied"), "gqa_tied")


def new_model(tiny):
    return parts.load("08", "model").LlamaModel(tiny.config, tiny.weights, "cpu", torch.float32)


def test_cache_write_native_skips_minus_one_and_takes_views(seed):
    cw = parts.reference("13", "cache_write")
    g = checks.generator("cpu", seed)
    qkv = torch.randn(5, 6 * 8, generator=g)
    k, v = qkv[:, 16:32].view(5, 2, 8), qkv[:, 32:].view(5, 2, 8)
    kc, vc = torch.randn(3, 4, 2, 8, generator=g), torch.randn(3, 4, 2, 8, generator=g)
    want_k, want_v = kc.clone(), vc.clone()
    slots = torch.tensor([-1, 5, -1, 0, 11])
    for t, row in ((1, 5), (3, 0), (4, 11)):
        want_k.view(-1, 2, 8)[row] = k[t]
        want_v.view(-1, 2, 8)[row] = v[t]
    cw.cache_write_native(k, v, kc, vc, slots)
    checks.assert_equal(kc, want_k, what="k_cache")
    checks.assert_equal(vc, want_v, what="v_cache")
    cw.cache_write_native(k, v, kc, vc, torch.full((5,), -1))
    checks.assert_equal(kc, want_k, what="k_cache after -1 slots only")
    with pytest.raises(ValueError, match="slot_mapping"):
        cw.cache_write_native(k, v, kc, vc, torch.tensor([0, 1]))


def test_paged_attention_equals_contiguous_attention(tiny):
    """The same steps (a chunked prompt, a second sequence, decode steps) through stage 09's
    contiguous cache and through the paged cache with scattered blocks: same logits."""
    model = new_model(tiny)
    vocab = tiny.config.vocab_size
    prompts = [[(7 * i + 3) % vocab for i in range(11)], [(5 * i + 1) % vocab for i in range(6)]]
    contiguous = kv().KVCache.for_model(model, num_slots=2, max_len=32)
    pcache = paged().PagedKVCache.for_model(model, num_blocks=20, block_size=4, max_len=32)
    tables = [[9, 2, 14, 5, 7, 11, 3, 8], [1, 17, 6, 12, 4, 19, 10, 13]]
    results = []
    for cache, backend, blocks in ((contiguous, kv().KVCacheAttention(), [[0], [1]]),
                                   (pcache, paged().PagedAttention(), tables)):
        model.attention = backend
        out = []
        cached = [0, 0]
        ids = [list(p) for p in prompts]
        schedule = [[(0, 7), (1, 6)], [(0, 4)], [(0, 1), (1, 1)], [(0, 1), (1, 1)]]
        for step in schedule:
            steps = [kv().SeqStep(blocks[s], cached[s], n) for s, n in step]
            plan = kv().StepPlan.build(steps, cache)
            positions, meta = plan.metadata(cache, "cpu")
            tokens = [t for s, n in step for t in ids[s][cached[s]: cached[s] + n]]
            logits = model.compute_logits(
                model.forward(torch.tensor(tokens), positions, meta), meta.last_rows)
            out.append(logits)
            for (s, n), row in zip(step, logits):
                cached[s] += n
                if cached[s] == len(ids[s]):
                    ids[s].append(int(row.argmax()))
        results.append(out)
    for step, (a, b) in enumerate(zip(*results)):
        checks.assert_close(b, a, what=f"logits of step {step}", dtype=torch.float32,
                            atol=1e-5, rtol=1e-5)


def test_the_pool_size_on_a_cpu(tiny):
    model = new_model(tiny)
    per_block = paged().PagedKVCache.block_bytes(tiny.config, torch.float32, 16)
    gib = 50.5 * per_block / 2**30
    assert paged().kv_cache_blocks(model, 16, 64, 256, 512, cpu_gib=gib) == 50
    assert paged().kv_cache_blocks(model, 16, 64, 3, 512, cpu_gib=gib) == 3 * 4 + 1, (
        "never more blocks than max_num_seqs full block tables and the pad block")
    with pytest.raises(ValueError, match="does not hold one sequence") as e:
        paged().kv_cache_blocks(model, 16, 64 * 16, 4, 512, cpu_gib=gib)
    have, need = map(float, re.findall(r"([0-9.e-]+) GiB", str(e.value)))
    assert need > have, f"the message must show more memory needed than there is: {e.value}"
    assert "kv_cache_gib" in str(e.value), (
        f"on a CPU the setting to raise is EngineConfig.kv_cache_gib: {e.value}")
    assert paged().warmup_lengths(10, 4, 2) == [4, 3, 3]
    assert paged().warmup_lengths(8192, 4096, 256) == [32] * 256


def test_the_engine_pages_its_cache_when_stage_13_is_ready(tiny):
    from solutions.engine.llm_engine import LLMEngine
    from solutions.engine.model_runner import EngineConfig
    engine = LLMEngine(new_model(tiny), None, (), EngineConfig(max_model_len=64))
    runner = engine.runner
    assert paged().paging_ready() and runner.paged, "stage 13 is ready: the engine pages"
    assert runner.cache.pad_slot == 0 == runner.allocator.pad_block
    assert runner.decoder.tables.shape[1] == 4, "max_blocks = ceil(64 / 16)"
    assert "blocks x 16 positions" in runner.describe()
    contiguous = LLMEngine(new_model(tiny), None, (), EngineConfig(max_model_len=64, paged=False))
    assert not contiguous.runner.paged and "sequences x 64 positions" in contiguous.runner.describe()
    for e in (engine, contiguous):
        rid = e.add_request([5, 6, 7], parts.load("11", "sampling_params").SamplingParams(
            max_tokens=5))
        got = [t for _ in range(10) for out in e.step() for t in out.new_token_ids]
        assert got == kv().generate_greedy(new_model(tiny), [5, 6, 7], 5), rid


def test_requests_admitted_in_consecutive_prefill_steps_share_a_prefix(tiny):
    """Three requests with a 32-token common prefix arrive together; a budget of 64 tokens a
    step (no chunking) admits the first alone. The blocks it computed must be registered when
    its step ends (no decode step comes between to do it), so the next two, admitted in the
    next prefill step, find them."""
    from solutions.engine.llm_engine import LLMEngine
    from solutions.engine.model_runner import EngineConfig
    SamplingParams = parts.load("11", "sampling_params").SamplingParams
    engine = LLMEngine(new_model(tiny), None, (), EngineConfig(
        paged=True, block_size=8, max_model_len=64, max_num_batched_tokens=64,
        chunked_prefill=False, kv_cache_gib=1e-3))
    prefix = [5 + i % 50 for i in range(32)]
    for tail in ([1, 2], [3, 4, 6], [7]):
        engine.add_request(prefix + tail, SamplingParams(max_tokens=3))
    while engine.has_unfinished():
        engine.step()
    stats = engine.runner.allocator.stats
    assert stats.hit_tokens == 2 * 32, (
        f"the 2nd and 3rd requests should each find the 32 prefix tokens (4 blocks of 8) "
        f"cached; {stats.hit_tokens} prompt tokens were hits")


@pytest.mark.parametrize("paged_cache", [True, False], ids=["paged", "contiguous"])
def test_one_token_chunks_of_prompts_are_not_decodes(tiny, paged_cache):
    """A token budget of 2 splits a 4-token prompt, beside a 1-token one, into steps of one new
    token per sequence: the shape of a decode step. Each step must feed the sequence's first
    uncached token, not its newest (the engine once fed the prompt's last token at every
    position); greedy outputs then equal running each request alone."""
    from solutions.engine.llm_engine import LLMEngine
    from solutions.engine.model_runner import EngineConfig
    SamplingParams = parts.load("11", "sampling_params").SamplingParams
    prompts = [[5], [10, 20, 30, 40], [7, 8, 9]]
    for budget in (2, 3):
        engine = LLMEngine(new_model(tiny), None, (), EngineConfig(
            paged=paged_cache, max_model_len=64, max_num_batched_tokens=budget))
        rids = [engine.add_request(p, SamplingParams(max_tokens=6)) for p in prompts]
        got = {rid: [] for rid in rids}
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] += out.new_token_ids
        for p, rid in zip(prompts, rids):
            alone = kv().generate_greedy(new_model(tiny), p, 6)
            assert got[rid] == alone, (
                f"budget {budget}: prompt {p} gave {got[rid]}, alone {alone}: a step of one "
                f"new token per sequence must read each one's first uncached token")


def test_no_step_is_queued_after_every_request_has_its_last_token(tiny):
    """The engine queues the next decode step while the current one runs; when the step in
    flight gives every running request its last token (max_tokens), a step queued then would
    be thrown away (at batch 1 it cost a whole step per request, ~0.4% of a 256-token reply).
    A reply of n tokens takes n steps: one prefill, n - 1 decodes."""
    from solutions.engine.llm_engine import LLMEngine
    from solutions.engine.model_runner import EngineConfig
    SamplingParams = parts.load("11", "sampling_params").SamplingParams
    engine = LLMEngine(new_model(tiny), None, (), EngineConfig(max_model_len=64))
    launch, launched = engine.runner.launch, []
    engine.runner.launch = lambda seqs, *rest: launched.append(len(seqs)) or launch(seqs, *rest)
    for max_tokens in (1, 2, 7):
        launched.clear()
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=max_tokens))
        while engine.has_unfinished():
            engine.step()
        assert len(launched) == max_tokens, (
            f"{len(launched)} steps for a reply of {max_tokens} tokens: one step too many is a "
            f"decode queued after the last token")
    launched.clear()
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=3))
    engine.add_request([8, 9], SamplingParams(max_tokens=6))
    while engine.has_unfinished():
        engine.step()
    assert len(launched) == 6, f"{launched}: the longer request sets the count (6 steps)"


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole-prompts"])
def test_the_pool_is_sized_for_the_largest_step_the_scheduler_may_take(tiny, monkeypatch,
                                                                      chunked):
    """Without chunked prefill a whole prompt of up to max_model_len tokens goes in one step,
    past max_num_batched_tokens. The warm-up that measures a step's activations (and so sizes
    the KV pool on a GPU) must run a step that large, or a long prompt's step would run out of
    memory at run time instead of failing at start-up."""
    from solutions.engine.llm_engine import LLMEngine
    from solutions.engine.model_runner import EngineConfig
    paged_cache = parts.load("13", "paged_cache")
    sized_for = []
    real = paged_cache.kv_cache_blocks

    def spy(model, block_size, max_len, max_num_seqs, max_num_batched_tokens, *args):
        sized_for.append(max_num_batched_tokens)
        return real(model, block_size, max_len, max_num_seqs, max_num_batched_tokens, *args)
    monkeypatch.setattr(paged_cache, "kv_cache_blocks", spy)
    engine = LLMEngine(new_model(tiny), None, (), EngineConfig(
        paged=True, max_model_len=64, max_num_batched_tokens=16, chunked_prefill=chunked))
    step = engine.scheduler.config.max_num_batched_tokens
    assert step == (16 if chunked else 64), "the scheduler's budget per step"
    assert sized_for == [step], (
        f"the pool was sized for steps of {sized_for} tokens; the scheduler takes up to {step}")
