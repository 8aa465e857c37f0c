"""Invariants of a serving engine between two steps, for the tests that drive one (stage 13's
serving test, tests/test_engine_fuzz.py): the scheduler's queues against the live requests,
and the KV cache -- a contiguous one's slots, or a paged one's blocks (no block held twice,
reference counts equal to the holders, shared blocks registered prefix blocks holding those
tokens at the same table position, the prefix index consistent, the free list exactly the
blocks nobody holds, free + used = total); and the requirements on every step the scheduler
plans (check_plan, watch_plans), stated so that any correct scheduler meets them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from course import parts

if TYPE_CHECKING:
    from solutions.engine.llm_engine import LLMEngine


def audit(engine: LLMEngine, where: str) -> None:
    """The scheduler and the cache between two steps."""
    s = engine.scheduler
    running, waiting = s.running, list(s.waiting)
    Status = parts.load("11", "sequence").SequenceStatus
    assert len(running) <= s.config.max_num_seqs, (
        f"{where}: {len(running)} running > max_num_seqs {s.config.max_num_seqs}")
    ids = [q.seq_id for q in running + waiting]
    assert len(ids) == len(set(ids)), f"{where}: a sequence is queued or running twice: {ids}"
    assert set(ids) == set(engine.requests), (
        f"{where}: running + waiting {sorted(ids)} are not the live requests "
        f"{sorted(engine.requests)}")
    for q in running:
        # by value, not identity: graded through the judge, a student's enum member is a proxy
        assert q.status.value == Status.RUNNING.value, (
            f"{where}: running sequence {q.seq_id} is {q.status.value}")
        assert 0 <= q.num_cached <= q.num_tokens, (
            f"{where}: sequence {q.seq_id} has {q.num_cached} of {q.num_tokens} tokens cached")
        assert q.block_table, f"{where}: running sequence {q.seq_id} holds no cache"
    for q in waiting:
        assert q.status.value == Status.WAITING.value and not q.block_table \
            and q.num_cached == 0, (
            f"{where}: waiting sequence {q.seq_id} ({q.status.value}) holds blocks {q.block_table} "
            f"or {q.num_cached} cached tokens")
    alloc = s.allocator
    if not engine.runner.paged:
        slots = [b for q in running for b in q.block_table]
        free = alloc.free_slots
        assert len(slots) == len(running) and len(set(slots)) == len(slots), (
            f"{where}: every running sequence owns its own slot, got {slots}")
        assert not set(slots) & set(free) and len(set(free)) == len(free), (
            f"{where}: a slot is both used and free, or free twice: used {slots}, free {free}")
        assert len(slots) + len(free) == alloc.num_slots, (
            f"{where}: free ({len(free)}) + used ({len(slots)}) != {alloc.num_slots} slots")
        return
    bs = alloc.block_size
    holders: dict[int, list] = {}
    for q in running:
        assert len(set(q.block_table)) == len(q.block_table), (
            f"{where}: sequence {q.seq_id} holds a block twice: {q.block_table}")
        assert len(q.block_table) * bs >= q.num_tokens - 1 and \
            len(q.block_table) <= -(-engine.max_model_len // bs), (
            f"{where}: sequence {q.seq_id} ({q.num_tokens} tokens) has blocks {q.block_table}")
        for i, b in enumerate(q.block_table):
            holders.setdefault(b, []).append((q, i))
    assert alloc.pad_block not in holders, f"{where}: the pad block was handed out"
    for block in alloc.blocks:
        owners = holders.get(block.block_id, [])
        assert block.ref_count == len(owners), (
            f"{where}: block {block.block_id} has ref_count {block.ref_count} but "
            f"{len(owners)} holders")
        if len(owners) > 1:
            i = owners[0][1]
            assert block.hash is not None and block.token_ids is not None, (
                f"{where}: block {block.block_id} is held by {len(owners)} sequences but is "
                "not a registered prefix block")
            for q, j in owners:
                assert j == i and tuple(q.token_ids[i * bs: (i + 1) * bs]) == block.token_ids \
                        and q.num_cached >= (i + 1) * bs, (
                    f"{where}: block {block.block_id} (tokens {block.token_ids}) is shared by "
                    f"sequences {[o.seq_id for o, _ in owners]} at table positions "
                    f"{[k for _, k in owners]}, not all holding those tokens cached there")
    for h, b in alloc.hash_to_block.items():
        block = alloc.blocks[b]
        assert block.hash == h and block.token_ids is not None and len(block.token_ids) == bs, (
            f"{where}: hash_to_block names block {b}, whose hash is {block.hash}")
    free = set(alloc.free_blocks)
    assert len(free) == len(alloc.free_blocks)
    assert free == {b for b in range(1, alloc.num_blocks) if b not in holders}, (
        f"{where}: the free list is not exactly the blocks nobody holds")
    assert alloc.num_free_blocks + len(holders) == alloc.num_total_blocks, (
        f"{where}: free + used != total: a block leaked or was freed twice")


# -- the scheduler's plans: what every step it returns must satisfy -------------------------

@dataclass(frozen=True)
class _Before:
    """The queues and each sequence's counts just before schedule() ran."""
    running: list
    waiting: list
    uncached: dict[int, int]
    tokens: dict[int, list[int]]

    @classmethod
    def of(cls, sched) -> _Before:
        seqs = list(sched.running) + list(sched.waiting)
        return cls(list(sched.running), list(sched.waiting),
                   {q.seq_id: q.num_tokens - q.num_cached for q in seqs},
                   {q.seq_id: list(q.token_ids) for q in seqs})


def check_plan(sched, before: _Before, batch: list, where: str) -> None:
    """The requirements on one step the scheduler planned (batch: what schedule() returned),
    whatever way it was written: every sequence in the step runs at least one of its uncached
    tokens and no more; a prefill step holds at most max_num_batched_tokens tokens; at most
    max_num_seqs sequences run; a step is all prefill (unfinished prompts first, then
    admissions in arrival order) or all decode (every running sequence, one token); a
    preempted sequence is the newest running one, goes back ahead of the waiting requests
    with its tokens kept and its cache freed; no request is lost."""
    c = sched.config
    ids = [q.seq_id for q in batch]
    assert len(set(ids)) == len(ids), f"{where}: a sequence is scheduled twice: {ids}"
    was_running = {q.seq_id for q in before.running}
    admitted = [q for q in batch if q.seq_id not in was_running]
    gone = [q.seq_id for q in batch if q not in sched.running]
    assert not gone, (
        f"{where}: sequences {gone} are in the step but no longer running: preempted after "
        "they were scheduled? The victim is the newest running request, which the step has "
        "not reached yet")
    _check_preemption(sched, before, where)
    for q in batch:
        n = q.num_scheduled
        assert n >= 1, (
            f"{where}: sequence {q.seq_id} is in the step with num_scheduled {n} (an empty "
            "chunk): stop admitting and continuing prompts once the budget is spent "
            "(budget > 0), and leave a sequence with nothing to run out of the step")
        if q in admitted and q.num_cached and q.num_cached + n > q.num_tokens:
            raise AssertionError(
                f"{where}: sequence {q.seq_id} has {q.num_cached} of its {q.num_tokens} tokens "
                f"cached but num_scheduled {n}: num_scheduled was set before the allocator "
                "granted the blocks; with a prefix-cache hit allocate() raises the sequence's "
                "num_cached, so compute the chunk after allocate")
        assert q.num_cached + n <= q.num_tokens, (
            f"{where}: sequence {q.seq_id} schedules {n} tokens but only "
            f"{q.num_tokens - q.num_cached} are uncached: a step runs uncached tokens only")
    sizes = {q.seq_id: q.num_scheduled for q in batch}
    # a decode step runs every running sequence, one token each, budget or not (as nano-vllm)
    prefill = any(before.uncached[i] > 1 or q in admitted for i, q in zip(ids, batch))
    assert not prefill or sum(sizes.values()) <= c.max_num_batched_tokens, (
        f"{where}: the step schedules {sum(sizes.values())} tokens ({sizes}), more than "
        f"max_num_batched_tokens {c.max_num_batched_tokens}: every scheduled token counts "
        "against the step's budget, and a chunk takes at most what is left of it")
    running_ids = {q.seq_id for q in sched.running}
    for q in sched.running + list(sched.waiting):
        want = "running" if q.seq_id in running_ids else "waiting"
        assert q.status.value == want, (
            f"{where}: sequence {q.seq_id} is {want} but its status is {q.status.value}: "
            "admitting sets RUNNING, preempting WAITING")
    assert len(sched.running) <= c.max_num_seqs, (
        f"{where}: {len(sched.running)} sequences run, more than max_num_seqs {c.max_num_seqs}")
    assert batch or not sched.running, (
        f"{where}: schedule() returned an empty step while sequences "
        f"{sorted(running_ids)} are running: they would never run again")
    _check_kind(sched, before, batch, admitted, where)
    _check_admission_order(before, admitted, where)


def _check_kind(sched, before: _Before, batch: list, admitted: list, where: str) -> None:
    """A step is all prefill or all decode; prefill work (an unfinished prompt) comes first."""
    decodes = [q.seq_id for q in batch if q not in admitted and before.uncached[q.seq_id] == 1]
    prefills = [q.seq_id for q in batch if q.seq_id not in decodes]
    unfinished = [q.seq_id for q in before.running if before.uncached[q.seq_id] > 1]
    one_by_one = [q.seq_id for q in batch if q.seq_id in unfinished and q.num_scheduled == 1]
    assert not (decodes and one_by_one), (
        f"{where}: a decode step while sequences {one_by_one} are in the middle of their "
        "prompts: an unfinished prompt continues in a prefill step (as much of it as the "
        "budget allows) before any decode, not one token at a time")
    assert not (decodes and prefills), (
        f"{where}: the step mixes decodes (sequences {decodes}, one token each) with prefill "
        f"work (sequences {prefills}): a step is all prefill or all decode; decodes wait for "
        "a step without prompt work")
    if decodes:
        assert not unfinished, (
            f"{where}: a decode step while sequences {unfinished} are in the middle of their "
            "prompts: an unfinished prompt continues (a prefill step) before any decode")
        left_out = [q.seq_id for q in sched.running if q.seq_id not in decodes]
        assert not left_out, (
            f"{where}: a decode step leaves running sequences {left_out} out: every running "
            "sequence decodes one token each step (likely: removing from running while "
            "iterating over it, which skips the sequence after the removed one, or counting a "
            "sequence's prompt against the budget in a decode step, which runs one token)")
    elif admitted:
        skipped = [i for i in unfinished if i not in prefills]
        assert not skipped, (
            f"{where}: admitted {[q.seq_id for q in admitted]} while the prompts of running "
            f"sequences {skipped} were unfinished and left out: unfinished prompts continue "
            "first, then waiting requests are admitted")


def _check_admission_order(before: _Before, admitted: list, where: str) -> None:
    """Admissions are the front of the queue, in order (first come, first served)."""
    got = [q.seq_id for q in admitted]
    front = [q.seq_id for q in before.waiting[: len(got)]]
    assert got == front, (
        f"{where}: admitted {got}, but the queue's front was {front}: requests are admitted "
        "first come, first served; one that does not fit waits, and nothing behind it jumps "
        "the queue")


def _check_preemption(sched, before: _Before, where: str) -> None:
    """Victims: the newest running sequences, back at the front of the queue, nothing lost."""
    now_waiting = [q.seq_id for q in sched.waiting]
    alive = {q.seq_id for q in sched.running} | set(now_waiting)
    lost = [q.seq_id for q in before.running + before.waiting if q.seq_id not in alive]
    assert not lost, f"{where}: sequences {lost} left both the queue and the running set"
    order = [q.seq_id for q in before.running]
    victims = [q for q in before.running if q.seq_id in set(now_waiting)]
    if not victims:
        return
    newest = order[len(order) - len(victims):]
    got = [q.seq_id for q in victims]
    assert got == newest, (
        f"{where}: preempted {got} of the running {order} (oldest first): the victim is the "
        f"newest running request ({newest}): it has the least work done, and the oldest "
        "requests finish first")
    assert set(now_waiting[: len(victims)]) == set(got), (
        f"{where}: preempted {got}, but the queue is now {now_waiting}: a preempted sequence "
        "goes back to the FRONT of the queue (appendleft), ahead of the requests that were "
        "waiting: it was admitted before them")
    for q in victims:
        assert q.num_cached == 0 and not q.block_table, (
            f"{where}: preempted sequence {q.seq_id} still has {q.num_cached} cached tokens or "
            f"blocks {q.block_table}: preemption frees its cache (allocator.free) and sets "
            "num_cached to 0, so it is prefilled again")
        assert q.token_ids == before.tokens[q.seq_id], (
            f"{where}: preempted sequence {q.seq_id} lost tokens: it keeps its prompt and "
            "every token generated so far (recompute, not restart)")


def watch_plans(sched) -> None:
    """Check every step `sched` plans from now on (check_plan), as schedule() returns it
    (once per scheduler: a second call changes nothing), and explain an allocation that runs
    out of blocks (watch_allocations)."""
    if getattr(sched.schedule, "watched", False):
        return
    if hasattr(sched.allocator, "blocks"):     # stage 13's BlockManager
        watch_allocations(sched.allocator)
    schedule = sched.schedule
    steps = iter(range(1 << 62))

    def checked_schedule() -> list:
        before = _Before.of(sched)
        batch = schedule()
        check_plan(sched, before, batch, f"step {next(steps)}")
        return batch
    checked_schedule.watched = True
    sched.schedule = checked_schedule


def watch_allocations(block_manager) -> None:
    """An allocate that runs out of free blocks fails deep in the learner's code, on the free
    list (KeyError: 'dictionary is empty'); say instead what let it happen."""
    allocate = block_manager.allocate

    def explained_allocate(seq) -> None:
        free = block_manager.num_free_blocks
        try:
            allocate(seq)
        except (KeyError, IndexError) as e:
            raise AssertionError(
                f"allocate(sequence {seq.seq_id} of {seq.num_tokens} tokens) ran out of free "
                f"blocks ({free} free when it began; {type(e).__name__}: {e}): can_allocate "
                "let in a sequence the pool cannot hold. A prefix-cache hit on a free block "
                "(ref_count 0) leaves the free pool as well, so can_allocate counts the fresh "
                "blocks plus the hits that are free") from e
    block_manager.allocate = explained_allocate

