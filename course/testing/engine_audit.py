"""Invariants of a serving engine between two steps, for the tests that drive one (stage 13's
serving test, tests/test_engine_fuzz.py): the scheduler's queues against the live requests,
and the KV cache -- a contiguous one's slots, or a paged one's blocks (no block held twice,
reference counts equal to the holders, shared blocks registered prefix blocks holding those
tokens at the same table position, the prefix index consistent, the free list exactly the
blocks nobody holds, free + used = total)."""
from __future__ import annotations

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
        assert q.status is Status.RUNNING, f"{where}: running sequence {q.seq_id} is {q.status}"
        assert 0 <= q.num_cached <= q.num_tokens, (
            f"{where}: sequence {q.seq_id} has {q.num_cached} of {q.num_tokens} tokens cached")
        assert q.block_table, f"{where}: running sequence {q.seq_id} holds no cache"
    for q in waiting:
        assert q.status is Status.WAITING and not q.block_table and q.num_cached == 0, (
            f"{where}: waiting sequence {q.seq_id} ({q.status}) holds blocks {q.block_table} "
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
