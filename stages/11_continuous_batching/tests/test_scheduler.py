"""Stage 11: sequences and the scheduler, alone (sequence.py, scheduler.py). Pure Python.

Every plan the scheduler returns here is also checked against the scheduler's requirements
(course/testing/engine_audit.py, check_plan): the token budget, no empty chunk, all prefill
or all decode, first come first served, the newest preempted and queued first, nothing lost.
"""
from __future__ import annotations

import random

import pytest

from course import parts
from course.testing.engine_audit import watch_plans


def seq_mod():
    return parts.load("11", "sequence")


def sched_mod():
    return parts.load("11", "scheduler")


def scheduler(allocator=None, slots=4, max_len=64, max_seqs=8, budget=32, chunked=True):
    """A scheduler whose every plan is checked (watch_plans)."""
    S = sched_mod()
    sched = S.Scheduler(S.SchedulerConfig(max_model_len=max_len, max_num_seqs=max_seqs,
                                          max_num_batched_tokens=budget,
                                          chunked_prefill=chunked),
                        allocator, None if allocator else slots)
    watch_plans(sched)
    return sched


def new_seq(i: int, n: int):
    return seq_mod().Sequence(i, list(range(1, n + 1)))


def run_step(batch, token=7):
    """What the engine does after the model ran: complete each scheduled sequence's step."""
    return [s for s in batch if s.complete_step(token)]


def plan(batch):
    return [(s.seq_id, s.num_scheduled) for s in batch]


@pytest.mark.points(3)
def test_sequence_counts_and_keeps_only_the_token_of_a_complete_step():
    s = new_seq(0, 10)
    assert s.num_uncached == 10, "a new sequence has its whole prompt uncached"
    s.num_scheduled = 6
    assert s.complete_step(99) is False, (
        "after a chunk of 6 of 10 prompt tokens the sampled token means nothing: drop it")
    assert s.num_cached == 6 and s.num_scheduled == 0 and s.num_uncached == 4, (
        f"complete_step adds num_scheduled to num_cached and resets num_scheduled: cached "
        f"{s.num_cached} (want 6), scheduled {s.num_scheduled} (want 0)")
    assert s.token_ids == list(range(1, 11))
    s.num_scheduled = 4
    assert s.complete_step(42) is True, "the step that caches the whole prompt keeps its token"
    assert s.output_ids == [42] and s.num_uncached == 1 and s.num_cached == 10


@pytest.mark.points(6)
def test_prefill_packs_prompts_in_arrival_order_within_budget():
    sched = scheduler(budget=32, max_len=32, chunked=False)
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
    run_step(batch)
    assert plan(sched.schedule()) == [(2, 11), (3, 3)], (
        "the next step admits the two prompts that waited, in order (no decode: prompt work "
        "goes first)")
    exact = scheduler(budget=32, max_len=32, chunked=False)
    exact.add(new_seq(0, 32))
    assert plan(exact.schedule()) == [(0, 32)], "a prompt of exactly the budget fits it"


@pytest.mark.points(6)
def test_chunked_prefill_takes_what_is_left_of_the_budget():
    sched = scheduler(budget=16, chunked=True)
    sched.add(new_seq(0, 10))
    sched.add(new_seq(1, 20))
    batch = sched.schedule()
    assert plan(batch) == [(0, 10), (1, 6)], (
        f"with chunked prefill the second prompt takes the 6 tokens left of the budget 16; "
        f"got (seq_id, num_scheduled) {plan(batch)}")
    run_step(batch)
    batch = sched.schedule()
    assert plan(batch) == [(1, 14)], (
        f"next step: the unfinished prompt continues (its 14 tokens), before any decode; got "
        f"{plan(batch)}")
    run_step(batch)
    batch = sched.schedule()
    assert plan(batch) == [(0, 1), (1, 1)], (
        "no prompt work left: a decode step of every running sequence, one token each")


@pytest.mark.points(3)
def test_long_prompt_is_chunked_over_several_steps():
    sched = scheduler(budget=8, max_len=64)
    sched.add(new_seq(0, 30))
    sizes = []
    while True:
        batch = sched.schedule()
        sizes.append(batch[0].num_scheduled)
        if run_step(batch):
            break
    assert sizes == [8, 8, 8, 6], f"30 prompt tokens through a budget of 8: {sizes}"


@pytest.mark.points(4)
def test_the_last_token_of_the_budget_is_used():
    """Chunked prefill wastes no budget: one token left still starts the next prompt."""
    sched = scheduler(budget=11, chunked=True)
    sched.add(new_seq(0, 10))
    sched.add(new_seq(1, 5))
    batch = sched.schedule()
    assert plan(batch) == [(0, 10), (1, 1)], (
        f"a's 10 tokens leave 1 of the budget 11: b takes it (a chunk of 1); got {plan(batch)}")


@pytest.mark.points(4)
def test_a_spent_budget_admits_nobody():
    """A prompt that uses the whole budget leaves nothing: the next request is not admitted
    with an empty chunk (it would hold a slot and run nothing)."""
    sched = scheduler(budget=10, chunked=True)
    a, b = new_seq(0, 10), new_seq(1, 5)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch == [a] and list(sched.waiting) == [b] and not b.block_table, (
        f"a's 10 tokens spend the budget of 10: b must keep waiting, without a slot (an empty "
        f"chunk: check budget > 0 before admitting); got the step {plan(batch)}, waiting "
        f"{[s.seq_id for s in sched.waiting]}")


class PrefixHits:
    """A test allocator of unlimited slots that finds the first `hits` tokens of every
    sequence whose id is in `cached` already in the cache, as stage 13's prefix cache does."""

    def __init__(self, hits: int, cached: set[int]):
        self.hits, self.cached, self.next = hits, cached, 0

    def can_allocate(self, seq):
        return True

    def allocate(self, seq):
        self.next += 1
        seq.block_table = [self.next]
        if seq.seq_id in self.cached:
            seq.num_cached = min(self.hits, seq.num_tokens - 1)

    def can_append(self, seq):
        return True

    def append(self, seq):
        pass

    def free(self, seq):
        seq.block_table = []

    def computed(self, seq):
        pass


@pytest.mark.points(6)
def test_the_chunk_is_computed_after_allocate():
    """allocate() may find a prefix cached (stage 13) and raise num_cached: the step then runs
    only the rest, and the budget it saves goes to the next prompt."""
    sched = scheduler(PrefixHits(hits=8, cached={0}), budget=16)
    a, b = new_seq(0, 12), new_seq(1, 20)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()                  # the plan check names the mistake, if made
    assert a.num_scheduled == 4, (
        "allocate() found a's first 8 tokens cached (num_cached 8 of 12): its step must run "
        "the 4 others; num_scheduled was set before the allocator granted the blocks? With a "
        "prefix-cache hit allocate() raises num_cached, so compute the chunk after allocate "
        f"(got num_scheduled {a.num_scheduled})")
    assert plan(batch) == [(0, 4), (1, 12)], (
        f"b takes the 12 tokens left of the budget 16 after a's 4; got {plan(batch)}")


@pytest.mark.points(3)
def test_limits_on_slots_and_sequences():
    sched = scheduler(slots=2, max_seqs=8, budget=100)
    for i in range(5):
        sched.add(new_seq(i, 3))
    batch = sched.schedule()
    assert len(batch) == 2, f"only 2 cache slots: admit 2 sequences, got {len(batch)}"
    sched2 = scheduler(slots=8, max_seqs=3, budget=100)
    for i in range(5):
        sched2.add(new_seq(i, 3))
    assert len(sched2.schedule()) == 3, "max_num_seqs 3: at most 3 running sequences"


@pytest.mark.points(6)
def test_a_step_is_all_prefill_or_all_decode():
    """A request arriving while others decode gets a prefill step of its own; the decodes
    wait one step, then all run together."""
    sched = scheduler(budget=32)
    a = new_seq(0, 5)
    sched.add(a)
    run_step(sched.schedule())
    assert plan(sched.schedule()) == [(0, 1)]          # a decodes (run_step below)
    run_step([a])
    b = new_seq(1, 6)
    sched.add(b)
    batch = sched.schedule()
    assert plan(batch) == [(1, 6)], (
        f"b's prompt is prefill work: the step is b's prefill alone, a's decode waits a step "
        f"(mixing decodes into a prefill step is wrong); got {plan(batch)}")
    run_step(batch)
    assert plan(sched.schedule()) == [(0, 1), (1, 1)], "then both decode together"


@pytest.mark.points(3)
def test_finish_frees_the_slot_for_the_next_request():
    sched = scheduler(slots=1)
    a, b = new_seq(0, 4), new_seq(1, 4)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch == [a]
    run_step(batch)
    slot = a.block_table
    sched.finish(a, "max_tokens")
    assert a.is_finished and a.finish_reason == "max_tokens" and a.block_table == [], (
        "finish gives the sequence's cache back to the allocator")
    assert a not in sched.running, "a finished sequence leaves the running set"
    batch = sched.schedule()
    assert batch == [b] and b.block_table == slot, "b takes the slot a freed"


@pytest.mark.points(3)
def test_abort_a_waiting_request():
    sched = scheduler(slots=1)
    a, b = new_seq(0, 4), new_seq(1, 4)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.finish(b, "abort")
    assert list(sched.waiting) == [], (
        "finish (an abort) of a waiting request takes it out of the queue: it would be "
        f"admitted later; the queue holds {[s.seq_id for s in sched.waiting]}")
    assert b.finish_reason == "abort" and b.is_finished, (
        f"an aborted request is FINISHED with reason 'abort', got {b.status} {b.finish_reason}")
    assert sched.has_unfinished(), "a is still running"


class Blocks:
    """A test allocator of `total` blocks of `size` tokens: decode steps can run out. It
    records the sequences it frees, in order (`freed`)."""

    def __init__(self, total: int, size: int):
        self.free_blocks, self.size, self.freed = list(range(total)), size, []

    def need(self, seq, tokens: int) -> int:
        return -(-tokens // self.size) - len(seq.block_table)

    def can_allocate(self, seq):
        return self.need(seq, seq.num_tokens) <= len(self.free_blocks)

    def allocate(self, seq):
        assert not seq.block_table, f"sequence {seq.seq_id} is allocated twice"
        seq.block_table = [self.free_blocks.pop() for _ in range(self.need(seq, seq.num_tokens))]

    def can_append(self, seq):
        return self.need(seq, seq.num_tokens) <= len(self.free_blocks)

    def append(self, seq):
        seq.block_table += [self.free_blocks.pop() for _ in range(self.need(seq, seq.num_tokens))]

    def free(self, seq):
        self.freed.append(seq.seq_id)
        self.free_blocks += seq.block_table
        seq.block_table = []

    def computed(self, seq):
        pass


def blocks_scheduler(total: int, size: int = 4, max_seqs: int = 8):
    return scheduler(Blocks(total, size), max_seqs=max_seqs, budget=64)


@pytest.mark.points(7)
def test_preemption_when_the_cache_runs_out():
    """3 blocks of 4 tokens, two sequences of 4: when both need a second block, the newest
    one is preempted (back to the front of the queue, its tokens kept, nothing cached)."""
    sched = blocks_scheduler(total=3)
    a, b = new_seq(0, 3), new_seq(1, 3)
    sched.add(a)
    sched.add(b)
    assert sched.schedule() == [a, b]
    run_step([a, b])                          # both now hold 4 tokens, one block each
    batch = sched.schedule()                  # decode: the 4th token fits, no new block
    assert batch == [a, b]
    run_step(batch)                           # 5 tokens each: both need a second block
    batch = sched.schedule()
    assert sched.allocator.freed == [1] and batch == [a], (
        f"one free block for two sequences: the older one (0) decodes, the newest (1) is "
        f"preempted; preempted {sched.allocator.freed}, the step ran "
        f"{[s.seq_id for s in batch]}")
    assert list(sched.waiting) == [b] and b.num_cached == 0 and b.block_table == [], (
        "a preempted sequence goes back to the queue with its cache freed and nothing cached")
    assert b.token_ids == [1, 2, 3, 7, 7], "and keeps every token it had: nothing is lost"
    assert sched.num_preemptions == 1, f"num_preemptions {sched.num_preemptions}, want 1"
    run_step(batch)
    sched.finish(a, "max_tokens")
    batch = sched.schedule()
    assert batch == [b] and b.num_scheduled == 5, (
        "when there is room again it is prefilled again, prompt and output: 5 tokens")


@pytest.mark.points(8)
def test_preemption_takes_the_newest_others_first_and_queues_it_ahead_of_the_waiting():
    """4 blocks of 4 tokens, three running sequences and one waiting (max_num_seqs 3). When all
    three need a second block and one is free: the oldest takes it, the second preempts the
    newest (not itself, not the oldest) and takes its block, and the newest goes back AHEAD of
    the request that was already waiting."""
    sched = blocks_scheduler(total=4, max_seqs=3)
    a, b, c, d = new_seq(0, 3), new_seq(1, 3), new_seq(2, 3), new_seq(3, 2)
    for s in (a, b, c, d):
        sched.add(s)
    batch = sched.schedule()
    assert batch == [a, b, c] and list(sched.waiting) == [d], "max_num_seqs 3: d waits"
    run_step(batch)
    batch = sched.schedule()                  # 4 tokens each: the 4th fits the first block
    assert batch == [a, b, c]
    run_step(batch)                           # 5 tokens each, one free block for three
    batch = sched.schedule()
    victims = sched.allocator.freed
    assert victims == [2], (
        f"a (oldest) takes the free block; b finds none, so the NEWEST running sequence, c "
        f"(2), is preempted and b takes its block. Preempting the oldest, or b itself while a "
        f"newer one runs, is wrong; preempted {victims}")
    assert [s.seq_id for s in batch] == [0, 1], (
        f"then a and b decode; the step ran {[s.seq_id for s in batch]}")
    queue = [s.seq_id for s in sched.waiting]
    assert queue == [2, 3], (
        "the preempted c goes to the FRONT of the queue (appendleft), ahead of d, which was "
        f"waiting already: it was admitted first and keeps its place; got the queue {queue}")
    assert c.num_cached == 0 and c.block_table == [] and c.token_ids == [1, 2, 3, 7, 7]
    assert sched.num_preemptions == 1, (
        f"one preemption made room; num_preemptions is {sched.num_preemptions}")
    run_step(batch)
    sched.finish(a, "max_tokens")             # a's two blocks come back
    batch = sched.schedule()
    assert batch == [c] and c.num_scheduled == 5, (
        "c is first in line: prefilled again, prompt and output (5 tokens); d (one block) "
        "finds none left and keeps waiting")


@pytest.mark.points(5)
def test_the_newest_preempts_itself_when_nothing_newer_runs():
    """2 blocks of 4: after their prefill a holds 3 tokens and b 5. a's next token fits its
    block; b, the newest, needs a second block and none is free, and no sequence is newer: b
    preempts itself, a decodes."""
    sched = blocks_scheduler(total=2)
    a, b = new_seq(0, 2), new_seq(1, 4)
    sched.add(a)
    sched.add(b)
    run_step(sched.schedule())                 # a: 3 tokens, b: 5 tokens (one block each)
    batch = sched.schedule()
    assert sched.allocator.freed == [1] and batch == [a], (
        f"b (the newest) needs a second block and nothing newer can be preempted: b preempts "
        f"itself and a decodes alone (preempting the older a to feed b is wrong); preempted "
        f"{sched.allocator.freed}, the step ran {[s.seq_id for s in batch]}")
    assert list(sched.waiting) == [b] and sched.running == [a]


@pytest.mark.points(6)
def test_random_traffic_through_a_small_pool_loses_nothing():
    """200 requests of 1-20 tokens arrive at random steps into 10 blocks of 4 positions and a
    budget of 12 tokens: prompts are chunked, the pool runs out, sequences are preempted and
    come back. Every plan is checked (watch_plans); every request finishes with all its
    tokens."""
    rng = random.Random(11)
    sched = scheduler(Blocks(total=10, size=4), max_len=28, max_seqs=5, budget=12)
    arrivals: dict[int, list] = {}
    for i in range(200):
        arrivals.setdefault(rng.randrange(0, 600), []).append(
            (new_seq(i, rng.randint(1, 20)), rng.randint(1, 8)))
    wanted, done = {}, []
    for step in range(20_000):
        for seq, max_new in arrivals.get(step, []):
            sched.add(seq)
            wanted[seq.seq_id] = (seq, max_new)
        if not sched.has_unfinished() and step > max(arrivals):
            break
        for seq in run_step(sched.schedule(), token=step):
            if len(seq.output_ids) == wanted[seq.seq_id][1]:
                sched.finish(seq, "max_tokens")
                done.append(seq.seq_id)
    assert not sched.has_unfinished(), (
        f"after 20000 steps {len(sched.running)} sequences still run and {len(sched.waiting)} "
        "wait: a request is never scheduled again")
    assert sorted(done) == sorted(wanted) and len(done) == len(set(done)), (
        "every request finishes exactly once")
    assert sched.num_preemptions > 0, "the pool is small enough that sequences are preempted"
    assert len(sched.allocator.free_blocks) == 10, "every block is free again at the end"
