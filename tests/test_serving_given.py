"""The given (not graded) code of stages 09-11 refuses what cannot run, with a clear message:
step plans, decode-graph batch sizes and inputs, batch prompts, scheduler limits."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from course import parts
from course.testing import fixtures


def kv():
    return parts.reference("09", "kv_cache")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tiny = fixtures.load_tiny(tmp_path_factory.mktemp("gqa_tied"), "gqa_tied")
    return parts.load("08", "model").LlamaModel(tiny.config, tiny.weights, "cpu", torch.float32)


def test_step_plan_rejects_what_does_not_fit():
    cache = SimpleNamespace(block_size=10, num_blocks=3)
    with pytest.raises(ValueError, match="must fit its 1 block"):
        kv().StepPlan.build([kv().SeqStep([0], 8, 3)], cache)
    with pytest.raises(ValueError, match="numbered 0..2"):
        kv().StepPlan.build([kv().SeqStep([0, 3], 8, 3)], cache)
    with pytest.raises(ValueError, match="at least one new token"):
        kv().StepPlan.build([kv().SeqStep([0], 8, 0)], cache)
    with pytest.raises(ValueError, match="at least one"):
        kv().StepPlan.build([], cache)


def test_step_plan_maps_positions_through_block_tables():
    """Position p of a sequence is row blocks[p // block_size] * block_size + p % block_size."""
    plan = kv().StepPlan.build([kv().SeqStep([5, 2], 3, 3), kv().SeqStep([1], 0, 2)],
                               SimpleNamespace(block_size=4, num_blocks=6))
    assert plan.positions == [3, 4, 5, 0, 1]
    assert plan.slot_mapping == [5 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 1 * 4 + 0, 1 * 4 + 1]
    assert plan.key_rows == [20, 21, 22, 23, 8, 9, 4, 5]
    assert plan.cu_seqlens_q == [0, 3, 5] and plan.cu_seqlens_k == [0, 6, 8]
    assert plan.context_lens == [6, 2] and not plan.decode
    assert plan.padded_block_tables() == [[5, 2], [1, 0]] and plan.seq_slots == [5, 1]


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
    prefill = kv().StepPlan.build([kv().SeqStep([0], 3, 2)], cache)
    with pytest.raises(ValueError, match="decode"):
        decoder.run([1, 2], prefill)
    too_many = kv().StepPlan.build([kv().SeqStep([0], 20, 1)] * 9, cache)
    with pytest.raises(ValueError, match="larger than max_batch"):
        decoder.run([1] * 9, too_many)
    with pytest.raises(ValueError, match="CUDA device"):
        parts.reference("10", "decode_graphs").DecodeGraphs(model, cache, 4, use_graphs=True)


def test_decode_graphs_inputs_and_head(model):
    """The step's inputs land in the kernels' dtypes (context lengths and block tables int32,
    no cast in the step), padding rows attend over nothing, and a head runs after the forward:
    its rows are what run returns: given the final norm's inputs, the logits it makes equal the
    lm_head's of the hidden states that a run without a head returns."""
    cache = kv().KVCache.for_model(model, num_slots=3, max_len=32)
    model.attention = kv().KVCacheAttention()
    graphs = parts.reference("10", "decode_graphs").DecodeGraphs
    plan = kv().StepPlan.build([kv().SeqStep([1], 5, 1), kv().SeqStep([0], 2, 1),
                                kv().SeqStep([2], 0, 1)], cache)      # padded to 4 rows
    slots = []

    def head(stream, ids, token_slot):
        slots.append(token_slot.tolist())
        return model.stream_logits(*stream)

    logits = graphs(model, cache, max_batch=4, use_graphs=False, head=head).run(
        [7, 9, 4], plan, token_slot=1)
    assert slots == [[1]], f"the head must find run's token_slot on the device, got {slots}"
    assert logits.shape == (3, model.config.vocab_size)
    plain = graphs(model, cache, max_batch=4, use_graphs=False)
    hidden = plain.run([7, 9, 4], plan)
    torch.testing.assert_close(logits, model.compute_logits(hidden, None))
    assert plain.context_lens.dtype == plain.tables.dtype == torch.int32
    assert plain.context_lens.tolist() == [6, 3, 1, 0], "a padding row attends over nothing"
    assert plain.tables[:, 0].tolist() == [1, 0, 2, cache.pad_slot], (
        "a padding row's table holds the pad slot")
    assert plain.inputs[0, :3].tolist() == [7, 9, 4] and plain.inputs[1].tolist() == [5, 2, 0, 0]


def test_decode_graphs_head_writes_the_next_ids_in_place(model):
    """A head may write the next step's ids into the graph's ids row (the engine's greedy
    argmax does); a run given that very row as ids_device copies nothing over it and computes
    what a run given the same ids from the host computes."""
    cache = kv().KVCache.for_model(model, num_slots=2, max_len=32)
    model.attention = kv().KVCacheAttention()
    graphs = parts.reference("10", "decode_graphs").DecodeGraphs

    def greedy(stream, next_ids, token_slot):
        logits = model.stream_logits(*stream)
        next_ids.copy_(logits.argmax(dim=-1))
        return logits

    first = kv().StepPlan.build([kv().SeqStep([0], 3, 1), kv().SeqStep([1], 5, 1)], cache)
    second = kv().StepPlan.build([kv().SeqStep([0], 4, 1), kv().SeqStep([1], 6, 1)], cache)
    decoder = graphs(model, cache, max_batch=2, use_graphs=False, head=greedy)
    chosen = decoder.run([7, 9], first).argmax(dim=-1).tolist()
    assert decoder.inputs[0, :2].tolist() == chosen, "the head's ids are in the ids row"
    in_place = decoder.run([0, 0], second, ids_device=decoder.inputs[0, :2]).clone()
    from_host = graphs(model, cache, max_batch=2, use_graphs=False, head=greedy)
    from_host.run([7, 9], first)
    torch.testing.assert_close(in_place, from_host.run(chosen, second), rtol=0, atol=0)


def test_bad_batches_are_refused(model):
    gen = parts.reference("10", "static_batch").generate_batch
    with pytest.raises(ValueError, match="empty"):
        gen(model, [[1, 2], []], 4)
    with pytest.raises(ValueError, match="at least one prompt"):
        gen(model, [], 4)
    with pytest.raises(ValueError, match="positions"):
        gen(model, [[1] * 10], model.max_positions)
    with pytest.raises(IndexError, match="out of range"):
        gen(model, [[1, model.config.vocab_size]], 4)


def test_scheduler_refuses_what_can_never_run():
    S = parts.reference("11", "scheduler")
    Sequence = parts.reference("11", "sequence").Sequence
    sched = S.Scheduler(S.SchedulerConfig(max_model_len=16), num_slots=2)
    with pytest.raises(ValueError, match="context"):
        sched.add(Sequence(0, list(range(17))))
    with pytest.raises(ValueError, match="prompt"):
        Sequence(1, [])
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        S.SchedulerConfig(max_model_len=64, max_num_batched_tokens=32, chunked_prefill=False)
    with pytest.raises(ValueError, match="max_num_seqs"):
        S.SchedulerConfig(max_model_len=64, max_num_seqs=0)
    with pytest.raises(ValueError, match="allocator"):
        S.Scheduler(S.SchedulerConfig(max_model_len=64))


def test_token_mailbox_keeps_unread_tokens_apart():
    """The runner's two token slots, taken in turn: a step's tokens stay readable when a third
    step is queued before they are read (they are kept apart from the slot reused), and
    each step reads its own tokens."""
    from solutions.engine.model_runner import TokenMailbox
    mailbox = TokenMailbox(4, pinned=False)
    source = torch.tensor([1, 2, 3])
    first = mailbox.take(source)
    source.copy_(torch.tensor([4, 5, 6]))     # the device buffer is written again
    second = mailbox.take(source[:2])
    assert first.tolist() == [1, 2, 3] and second.tolist() == [4, 5]
    third = mailbox.take(torch.tensor([7, 8, 9]))
    unread = mailbox.take(torch.tensor([10]))           # reuses second's slot (read)
    late = mailbox.take(torch.tensor([11, 12]))         # reuses third's slot, unread
    assert third.tolist() == [7, 8, 9], "unread tokens must be kept apart before their slot is reused"
    assert unread.tolist() == [10] and late.tolist() == [11, 12]


def test_token_mailbox_hands_out_tokens_a_kernel_stored():
    """A greedy decode graph's argmax stores its tokens in the slot reserved for the step: the
    mailbox hands them out from there without copying, keeps the slot's unread tokens apart
    before the kernel may write it, and the next take uses the other slot."""
    from solutions.engine.model_runner import TokenMailbox
    mailbox = TokenMailbox(4, pinned=False)
    first = mailbox.take(torch.tensor([1, 2]))
    second = mailbox.take(torch.tensor([3]))
    slot = mailbox.reserve()                    # first's slot again: first is unread
    mailbox.slots[slot, :3] = torch.tensor([7, 8, 9])   # what the argmax stores there
    stored = mailbox.take(torch.tensor([0, 0, 0]), stored_in=slot)
    assert first.tolist() == [1, 2], "unread tokens must be kept apart before a kernel stores"
    assert stored.tolist() == [7, 8, 9], "stored tokens are read from the slot, not copied"
    after = mailbox.take(torch.tensor([5]))
    assert after.tolist() == [5] and second.tolist() == [3] and stored.tolist() == [7, 8, 9]


def test_forward_without_the_final_norm(model):
    """forward(..., final_norm=False) returns the final norm's inputs; stream_logits of them
    equals compute_logits of the normed output, and return_hidden with it is refused."""
    metadata = parts.load("08", "attention_metadata")
    ids, positions, meta = metadata.packed_inputs([[3, 1, 4]], model.device)
    model.attention = metadata.PrefillAttention()
    h, residual = model.forward(ids, positions, meta, final_norm=False)
    expected = model.compute_logits(model.forward(ids, positions, meta), None)
    torch.testing.assert_close(model.stream_logits(h, residual), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="final norm"):
        model.forward(ids, positions, meta, return_hidden=True, final_norm=False)


def test_stream_logits_picks_the_greedy_tokens(model):
    """stream_logits(..., pick=, host=, host_slot=): the logits as without a pick, each row's
    argmax in pick, and in the host row at the slot (a slot outside the buffer: nowhere)."""
    metadata = parts.load("08", "attention_metadata")
    ids, positions, meta = metadata.packed_inputs([[3, 1, 4], [2, 7]], model.device)
    model.attention = metadata.PrefillAttention()
    h, residual = model.forward(ids, positions, meta, final_norm=False)
    plain = model.stream_logits(h.clone(), residual.clone())
    host = torch.full((2, 5), -1, dtype=torch.int64)
    for slot in (1, 4):
        pick = torch.full((5,), -1, dtype=torch.int64)
        logits = model.stream_logits(h.clone(), residual.clone(), pick=pick, host=host,
                                     host_slot=torch.tensor([slot]))
        torch.testing.assert_close(logits, plain, rtol=0, atol=0)
        assert pick.tolist() == plain.argmax(dim=-1).tolist()
    assert host.tolist() == [[-1] * 5, plain.argmax(dim=-1).tolist()], (
        "the tokens go to the slot's row only; a slot outside the buffer stores nothing")
    with pytest.raises(ValueError, match="silu_mul"):
        parts.load("08", "norm_linear").add_rmsnorm_linear(
            h, residual, model.final_norm, 1e-5, torch.cat([model.lm_head] * 2), silu_mul=True,
            pick=pick)


def test_argmax_host_rows_on_the_cpu():
    """The CPU path keeps the same contract as the kernel: row host_slot[0] of `host` gets the
    answers, a slot outside the buffer gets nothing, and host comes with host_slot."""
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 2.0, -1.0]])
    host = torch.full((2, 3), -1, dtype=torch.int64)
    got = parts.reference("08", "argmax").argmax(logits, None, host, torch.tensor([1]))
    assert got.tolist() == [1, 0] and host[1, :2].tolist() == [1, 0] and host[1, 2] == -1
    parts.reference("08", "argmax").argmax(logits, None, host, torch.tensor([2]))
    assert (host[0] == -1).all(), "a slot outside the host buffer stores nothing"
    with pytest.raises(ValueError, match="together"):
        parts.reference("08", "argmax").argmax(logits, None, None, torch.tensor([0]))
