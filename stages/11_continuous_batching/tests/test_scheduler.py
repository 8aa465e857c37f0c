"""Stage 11: sequences and the scheduler, alone (sequence.py, scheduler.py). Pure Python."""
from __future__ import annotations

from course import parts


def seq_mod():
    return parts.load("11", "sequence")


def sched_mod():
    return parts.load("11", "scheduler")


def make_scheduler(slots=4, max_len=64, max_seqs=8, budget=32, chunked=True):
    S = sched_mod()
    return S.Scheduler(S.SchedulerConfig(max_model_len=max_len, max_num_seqs=max_seqs,
                                         max_num_batched_tokens=budget,
                                         chunked_prefill=chunked), num_slots=slots)


def new_seq(i: int, n: int):
    return seq_mod().Sequence(i, list(range(1, n + 1)))


def run_step(sched, batch, token=7):
    """What the engine does after the model ran: complete each scheduled sequence's step."""
    return [s for s in batch if s.complete_step(token)]


def test_sequence_counts_and_keeps_only_the_token_of_a_complete_step():
    s = new_seq(0, 10)
    assert s.num_uncached == 10, "a new sequence has its whole prompt uncached"
    s.num_scheduled = 6
    assert s.complete_step(99) is False, (
        "after a chunk of 6 of 10 prompt tokens the sampled token means nothing: drop it")
    assert s.num_cached == 6 and s.num_scheduled == 0 and s.num_uncached == 4
    assert s.token_ids == list(range(1, 11))
    s.num_scheduled = 4
    assert s.complete_step(42) is True, "the step that caches the whole prompt keeps its token"
    assert s.output_ids == [42] and s.num_uncached == 1 and s.num_cached == 10


def test_prefill_packs_prompts_in_arrival_order_within_budget():
    sched = make_scheduler(budget=32, max_len=32, chunked=False)
    for i, n in enumerate([10, 12, 11, 3]):
        sched.add(new_seq(i, n))
    batch = sched.schedule()
    assert [s.seq_id for s in batch] == [0, 1], (
        "10 + 12 tokens fit a budget of 32, the third prompt (11) does not: without chunked "
        f"prefill it waits, and nothing behind it jumps the queue; got {[s.seq_id for s in batch]}")
    assert [s.num_scheduled for s in batch] == [10, 12]
    tables = [s.block_table for s in batch]
    assert all(len(t) == 1 for t in tables) and tables[0] != tables[1], (
        f"each admitted sequence gets its own slot (block_table [slot]), got {tables}")


def test_chunked_prefill_takes_what_is_left_of_the_budget():
    sched = make_scheduler(budget=16, chunked=True)
    sched.add(new_seq(0, 10))
    sched.add(new_seq(1, 20))
    batch = sched.schedule()
    assert [(s.seq_id, s.num_scheduled) for s in batch] == [(0, 10), (1, 6)], (
        "with chunked prefill the second prompt takes the 6 tokens left of the budget 16")
    run_step(sched, batch)
    batch = sched.schedule()
    assert [(s.seq_id, s.num_scheduled) for s in batch] == [(1, 14)], (
        "next step: the unfinished prompt continues (its 14 tokens), before any decode; got "
        f"{[(s.seq_id, s.num_scheduled) for s in batch]}")
    run_step(sched, batch)
    batch = sched.schedule()
    assert [(s.seq_id, s.num_scheduled) for s in batch] == [(0, 1), (1, 1)], (
        "no prompt work left: a decode step of every running sequence, one token each")


def test_long_prompt_is_chunked_over_several_steps():
    sched = make_scheduler(budget=8, max_len=64)
    sched.add(new_seq(0, 30))
    sizes = []
    while True:
        batch = sched.schedule()
        sizes.append(batch[0].num_scheduled)
        if run_step(sched, batch):
            break
    assert sizes == [8, 8, 8, 6], f"30 prompt tokens through a budget of 8: {sizes}"


def test_limits_on_slots_and_sequences():
    sched = make_scheduler(slots=2, max_seqs=8, budget=100)
    for i in range(5):
        sched.add(new_seq(i, 3))
    batch = sched.schedule()
    assert len(batch) == 2, f"only 2 cache slots: admit 2 sequences, got {len(batch)}"
    sched2 = make_scheduler(slots=8, max_seqs=3, budget=100)
    for i in range(5):
        sched2.add(new_seq(i, 3))
    assert len(sched2.schedule()) == 3, "max_num_seqs 3: at most 3 running sequences"


def test_finish_frees_the_slot_for_the_next_request():
    sched = make_scheduler(slots=1)
    a, b = new_seq(0, 4), new_seq(1, 4)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch == [a]
    run_step(sched, batch)
    slot = a.block_table
    sched.finish(a, "max_tokens")
    assert a.is_finished and a.finish_reason == "max_tokens" and a.block_table == [], (
        "finish gives the sequence's cache back to the allocator")
    batch = sched.schedule()
    assert batch == [b] and b.block_table == slot, "b takes the slot a freed"


def test_abort_a_waiting_request():
    sched = make_scheduler(slots=1)
    a, b = new_seq(0, 4), new_seq(1, 4)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.finish(b, "abort")
    assert list(sched.waiting) == [] and b.finish_reason == "abort"
    assert sched.has_unfinished(), "a is still running"


class Blocks:
    """A test allocator of `total` blocks of `size` tokens: decode steps can run out."""

    def __init__(self, total: int, size: int):
        self.free_blocks, self.size = list(range(total)), size

    def need(self, seq, tokens: int) -> int:
        return -(-tokens // self.size) - len(seq.block_table)

    def can_allocate(self, seq):
        return self.need(seq, seq.num_tokens) <= len(self.free_blocks)

    def allocate(self, seq):
        seq.block_table = [self.free_blocks.pop() for _ in range(self.need(seq, seq.num_tokens))]

    def can_append(self, seq):
        return self.need(seq, seq.num_tokens) <= len(self.free_blocks)

    def append(self, seq):
        seq.block_table += [self.free_blocks.pop() for _ in range(self.need(seq, seq.num_tokens))]

    def free(self, seq):
        self.free_blocks += seq.block_table
        seq.block_table = []


def test_preemption_when_the_cache_runs_out():
    """3 blocks of 4 tokens, two sequences of 4: when both need a second block, the newest
    one is preempted (back to the front of the queue, its tokens kept, nothing cached)."""
    S = sched_mod()
    sched = S.Scheduler(S.SchedulerConfig(max_model_len=64, max_num_batched_tokens=64),
                        Blocks(total=3, size=4))
    a, b = new_seq(0, 3), new_seq(1, 3)
    sched.add(a)
    sched.add(b)
    assert sched.schedule() == [a, b]
    run_step(sched, [a, b])                   # both now hold 4 tokens, one block each
    batch = sched.schedule()                  # decode: the 4th token fits, no new block
    assert batch == [a, b]
    run_step(sched, batch)                    # 5 tokens each: both need a second block
    batch = sched.schedule()
    assert batch == [a], (f"one free block for two sequences: the older one decodes, the newest "
                          f"is preempted; got {[s.seq_id for s in batch]}")
    assert list(sched.waiting) == [b] and b.num_cached == 0 and b.block_table == [], (
        "a preempted sequence goes back to the front of the queue with its cache freed")
    assert b.token_ids == [1, 2, 3, 7, 7], "and keeps every token it had: nothing is lost"
    assert sched.num_preemptions == 1
    run_step(sched, batch)
    sched.finish(a, "max_tokens")
    batch = sched.schedule()
    assert batch == [b] and b.num_scheduled == 5, (
        "when there is room again it is prefilled again, prompt and output: 5 tokens")


def test_preemption_takes_the_newest_others_first_and_queues_it_ahead_of_the_waiting():
    """4 blocks of 4 tokens, three running sequences and one waiting (max_num_seqs 3). When all
    three need a second block and one is free: the oldest takes it, the second preempts the
    newest (not itself, not the oldest) and takes its block, and the newest goes back AHEAD of
    the request that was already waiting."""
    S = sched_mod()
    sched = S.Scheduler(S.SchedulerConfig(max_model_len=64, max_num_seqs=3,
                                          max_num_batched_tokens=64), Blocks(total=4, size=4))
    a, b, c, d = new_seq(0, 3), new_seq(1, 3), new_seq(2, 3), new_seq(3, 2)
    for s in (a, b, c, d):
        sched.add(s)
    batch = sched.schedule()
    assert batch == [a, b, c] and list(sched.waiting) == [d], "max_num_seqs 3: d waits"
    run_step(sched, batch)
    batch = sched.schedule()                  # 4 tokens each: the 4th fits the first block
    assert batch == [a, b, c]
    run_step(sched, batch)                    # 5 tokens each, one free block for three
    batch = sched.schedule()
    got = [s.seq_id for s in batch]
    assert got == [0, 1], (
        "a (oldest) takes the free block; b finds none, so the NEWEST running sequence, c, is "
        "preempted and b takes its block: running a and b. Preempting b itself while a newer "
        f"one runs, or the oldest, is wrong; got the sequences {got}")
    queue = [s.seq_id for s in sched.waiting]
    assert queue == [2, 3], (
        "the preempted c goes to the FRONT of the queue (appendleft), ahead of d, which was "
        f"waiting already: it was admitted first and keeps its place; got the queue {queue}")
    assert c.num_cached == 0 and c.block_table == [] and c.token_ids == [1, 2, 3, 7, 7]
    assert sched.num_preemptions == 1, (
        f"one preemption made room; num_preemptions is {sched.num_preemptions}")
    run_step(sched, batch)
    sched.finish(a, "max_tokens")             # a's two blocks come back
    batch = sched.schedule()
    assert batch == [c] and c.num_scheduled == 5, (
        "c is first in line: prefilled again, prompt and output (5 tokens); d (one block) "
        "finds none left and keeps waiting")
