"""The given (not graded) code of stages 09-11 refuses what cannot run, with a clear message:
step plans, decode-graph batch sizes and inputs, batch prompts, scheduler limits."""
from __future__ import annotations

import pytest
import torch

from course import parts
from grader import fixtures


def kv():
    return parts.reference("09", "kv_cache")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gqa_tied")
    fixtures.save_tiny_llama(directory, "gqa_tied", eos_token_id=None)
    config = parts.load("01", "config").load_config(directory)
    weights = parts.load("01", "checkpoint").load_weights(directory, config)
    return parts.load("08", "model").LlamaModel(config, weights, "cpu", torch.float32)


def test_step_plan_rejects_what_does_not_fit():
    with pytest.raises(ValueError, match="do not fit"):
        kv().StepPlan.build([kv().SeqStep(0, 8, 3)], max_len=10, num_slots=1)
    with pytest.raises(ValueError, match="at least one"):
        kv().StepPlan.build([], max_len=10, num_slots=1)


def test_graph_batch_sizes():
    sizes = parts.reference("10", "decode_graphs").graph_batch_sizes
    assert sizes(1) == [1]
    assert sizes(5) == [1, 2, 4, 5]
    assert sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def test_decode_graphs_run_decode_steps_only(model):
    cache = kv().KVCache.for_model(model, num_slots=2, max_len=32)
    model.attention = kv().KVCacheAttention()
    decoder = parts.reference("10", "decode_graphs").DecodeGraphs(model, cache, max_batch=8,
                                                                  use_graphs=False)
    prefill = kv().StepPlan.build([kv().SeqStep(0, 3, 2)], cache.max_len, cache.num_slots)
    with pytest.raises(ValueError, match="decode"):
        decoder.run([1, 2], prefill)
    too_many = kv().StepPlan.build([kv().SeqStep(0, 20, 1)] * 9, cache.max_len, cache.num_slots)
    with pytest.raises(ValueError, match="larger than max_batch"):
        decoder.run([1] * 9, too_many)
    with pytest.raises(ValueError, match="CUDA device"):
        parts.reference("10", "decode_graphs").DecodeGraphs(model, cache, 4, use_graphs=True)


def test_bad_batches_are_refused(model):
    gen = parts.reference("10", "static_batch").generate_batch
    with pytest.raises(ValueError, match="at least one token"):
        gen(model, [[1, 2], []], 4)
    with pytest.raises(ValueError, match="positions"):
        gen(model, [[1] * 10], model.max_positions)
    with pytest.raises(IndexError, match="out of range"):
        gen(model, [[1, model.config.vocab_size]], 4)


def test_scheduler_refuses_what_can_never_run():
    S = parts.reference("11", "scheduler")
    Sequence = parts.reference("11", "sequence").Sequence
    sched = S.Scheduler(S.SchedulerConfig(num_slots=2, max_model_len=16))
    with pytest.raises(ValueError, match="context"):
        sched.add(Sequence(0, list(range(17))))
    with pytest.raises(ValueError, match="prompt"):
        Sequence(1, [])
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        S.SchedulerConfig(num_slots=1, max_model_len=64, max_num_batched_tokens=32,
                          chunked_prefill=False)
    with pytest.raises(ValueError, match="num_slots"):
        S.SchedulerConfig(num_slots=0, max_model_len=64)
