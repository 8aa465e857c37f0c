"""Stage 13: the block manager alone (block_manager.py). Pure Python, no model.

The sequences are stage 11's; a "step" is what the engine does: run the uncached tokens
(num_scheduled = num_uncached), keep the sampled token (complete_step), and before the next
decode step ask for room for it (can_append / append).
"""
from __future__ import annotations

import pytest

from course import parts
from course.testing.engine_audit import watch_plans


def bm_mod():
    return parts.load("13", "block_manager")


def manager(num_blocks=9, block_size=4, prefix_caching=True):
    return bm_mod().BlockManager(num_blocks, block_size, prefix_caching)


def new_seq(i: int, tokens):
    return parts.load("11", "sequence").Sequence(i, list(tokens))


def admit(bm, seq):
    assert bm.can_allocate(seq), f"sequence {seq.seq_id} should fit ({bm.num_free_blocks} free)"
    bm.allocate(seq)
    return seq


def prefill(bm, seq, token=100):
    """Run everything uncached, keep the sampled token, make room for it (a decode step's
    append: this registers the blocks the prompt filled)."""
    seq.num_scheduled = seq.num_uncached
    assert seq.complete_step(token)
    assert bm.can_append(seq)
    bm.append(seq)
    return seq


def decode(bm, seq, token=101):
    seq.num_scheduled = 1
    seq.complete_step(token)
    assert bm.can_append(seq)
    bm.append(seq)


def check_pool(bm, seqs):
    """Ref counts equal owners; free + used = total; the pad block is nobody's."""
    owners: dict[int, int] = {}
    for s in seqs:
        assert len(set(s.block_table)) == len(s.block_table), (
            f"sequence {s.seq_id} holds a block twice: {s.block_table}")
        for b in s.block_table:
            owners[b] = owners.get(b, 0) + 1
    assert bm.pad_block not in owners, "the pad block (0) must never be handed out"
    for block in bm.blocks:
        assert block.ref_count == owners.get(block.block_id, 0), (
            f"block {block.block_id}: ref_count {block.ref_count}, but "
            f"{owners.get(block.block_id, 0)} sequences hold it")
    assert set(bm.free_blocks) == {b.block_id for b in bm.blocks[1:] if b.ref_count == 0}, (
        "the free list must hold exactly the blocks nobody holds (and never the pad block)")
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_total_blocks == bm.num_blocks - 1


@pytest.mark.points(3)
def test_allocate_gives_each_token_a_position_and_never_the_pad_block():
    bm = manager(num_blocks=9, block_size=4)
    assert bm.pad_block == 0 and bm.num_total_blocks == 8 and bm.num_free_blocks == 8, (
        f"9 blocks, block 0 the pad block: 8 to hand out, all free; got {bm.num_free_blocks} "
        f"free ({sorted(bm.free_blocks)}): the pad block is never in the free list")
    a = admit(bm, new_seq(0, range(1, 11)))            # 10 tokens: 3 blocks
    assert len(a.block_table) == 3, f"10 tokens in blocks of 4 need 3 blocks, got {a.block_table}"
    assert a.num_cached == 0, "nothing is cached in a fresh pool"
    assert all(bm.blocks[blk].hash is None for blk in a.block_table), (
        "a's blocks got hashes at admission: a block is registered (gets its hash) once its "
        "K/V are computed (computed/append), never at admission, or a request hits blocks "
        "whose K/V do not exist yet")
    b = admit(bm, new_seq(1, range(50, 58)))           # 8 tokens: exactly 2 blocks
    assert len(b.block_table) == 2, f"8 tokens need 2 blocks of 4, got {b.block_table}"
    assert not set(a.block_table) & set(b.block_table)
    assert bm.num_free_blocks == 3
    check_pool(bm, [a, b])
    c = new_seq(2, range(200, 216))                    # 16 tokens: 4 blocks > 3 free
    assert not bm.can_allocate(c), "4 blocks are needed, 3 are free"
    assert bm.num_free_blocks == 3 and not c.block_table, "can_allocate must change nothing"
    assert bm.can_allocate(new_seq(3, range(300, 312))), "12 tokens need 3 blocks: they fit"


@pytest.mark.points(2)
def test_free_gives_every_block_back():
    bm = manager(num_blocks=9, block_size=4)
    seqs = [admit(bm, new_seq(i, range(10 * i + 1, 10 * i + 6))) for i in range(4)]
    check_pool(bm, seqs)
    for s in seqs:
        bm.free(s)
        assert s.block_table == [], "free empties the sequence's block table"
    check_pool(bm, [])
    assert bm.num_free_blocks == 8, "after freeing everything, every block is free again"


@pytest.mark.points(4)
def test_append_takes_a_block_exactly_when_the_newest_token_starts_one():
    bm = manager(num_blocks=5, block_size=4)
    s = admit(bm, new_seq(0, [1, 2, 3, 4]))            # one full block
    prefill(bm, s)                                      # token 5 (position 4) starts block 2
    assert len(s.block_table) == 2, (
        f"the 5th token (position 4) needs a second block of 4, got {s.block_table}: a new "
        "block is needed when the table covers fewer positions than num_tokens, not when "
        "num_tokens % block_size == 0")
    for n in (6, 7, 8):
        decode(bm, s)
        assert len(s.block_table) == 2, f"{n} tokens fit 2 blocks of 4, got {s.block_table}"
    decode(bm, s)                                       # 9 tokens: a third block
    assert len(s.block_table) == 3, f"the 9th token starts block 3, got {s.block_table}"
    check_pool(bm, [s])
    other = admit(bm, new_seq(1, range(20, 24)))       # takes the last free block
    assert bm.num_free_blocks == 0
    for _ in range(3):                                  # tokens 10..12 fit the third block
        s.num_scheduled = 1
        s.complete_step(7)
        assert bm.can_append(s), "no new block is needed: room must not depend on free blocks"
        bm.append(s)
    s.num_scheduled = 1
    s.complete_step(7)                                  # 13 tokens: a fourth block, none free
    assert not bm.can_append(s), "the 13th token needs a block and none is free"
    bm.free(other)
    assert bm.can_append(s)
    bm.append(s)
    assert len(s.block_table) == 4
    check_pool(bm, [s])


@pytest.mark.points(4)
def test_a_shared_prefix_is_cached_once_and_reference_counted():
    bm = manager(num_blocks=12, block_size=4)
    system = list(range(1, 9))                         # 8 tokens: 2 full blocks
    a = prefill(bm, admit(bm, new_seq(0, system + [20, 21])))
    b = admit(bm, new_seq(1, system + [30, 31, 32]))
    assert b.block_table[:2] == a.block_table[:2], (
        f"b starts with a's 8 system tokens: it must reuse a's first 2 blocks "
        f"{a.block_table[:2]}, got {b.block_table}; the lookup must compute the chained "
        "hashes the registration stored (hash_i = chain_hash(hash_(i-1), tokens of block i))")
    assert b.block_table[2] not in a.block_table, "b's own tokens go to a fresh block"
    assert b.num_cached == 8, f"b finds 8 tokens cached, got num_cached {b.num_cached}"
    for blk in a.block_table[:2]:
        assert bm.blocks[blk].ref_count == 2, f"block {blk} is held by a and b: ref_count 2"
    check_pool(bm, [a, b])
    bm.free(a)
    check_pool(bm, [b])
    assert all(blk not in bm.free_blocks for blk in b.block_table), (
        "freeing a must not free the blocks b still holds")
    stats = bm.stats
    assert stats.hit_tokens == 8 and stats.queried_tokens == 10 + 11, (
        f"stats: 8 hit tokens of {10 + 11} looked up, got {stats}")


@pytest.mark.points(4)
def test_blocks_are_named_by_a_chained_hash():
    """hash of block i = chain_hash(hash of block i - 1, its tokens); the first starts at -1."""
    mod = bm_mod()
    bm = manager(num_blocks=12, block_size=4)
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    a = prefill(bm, admit(bm, new_seq(0, x + y + [9])))
    h0 = mod.chain_hash(-1, x)
    h1 = mod.chain_hash(h0, y)
    got = [bm.blocks[blk].hash for blk in a.block_table]
    assert got[:2] == [h0, h1] and got[2] is None, (
        f"after the prefill a's 2 full blocks are registered with chained hashes {[h0, h1]} "
        f"and its partly filled last block is not: got {got}")
    assert bm.hash_to_block == {h0: a.block_table[0], h1: a.block_table[1]}
    # the same second block after another first block is another prefix: no hit at all
    b = admit(bm, new_seq(1, [9, 9, 9, 9] + y + [9]))
    assert b.num_cached == 0 and not set(b.block_table) & set(a.block_table), (
        "b's tokens 4-7 equal a's, but after other tokens: its K/V differ, nothing is shared")
    c = admit(bm, new_seq(2, x + [7, 7, 7, 7, 7]))
    assert c.block_table[0] == a.block_table[0] and c.num_cached == 4, (
        "c shares a's first block only")


@pytest.mark.points(4)
def test_a_hit_is_checked_against_tokens_and_parent(monkeypatch):
    """With a hash that collides for every block, nothing may be shared wrongly: a hit must
    hold the same tokens after the same (already matched) block."""
    mod = bm_mod()
    monkeypatch.setattr(mod, "chain_hash", lambda prefix, tokens: 7)
    bm = manager(num_blocks=16, block_size=4)
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    a = prefill(bm, admit(bm, new_seq(0, x + y + [9])))
    b = admit(bm, new_seq(1, [11, 12, 13, 14] + y + [9]))
    assert b.num_cached == 0 and not set(b.block_table) & set(a.block_table), (
        "every block hashes alike here: b's first block holds other tokens, so it is no hit "
        "(compare the block's token_ids), and the lookup stops at the first miss")
    c = admit(bm, new_seq(2, y + [1, 1, 1, 1, 1]))
    assert c.num_cached == 0 and not set(c.block_table) & set(a.block_table), (
        "c's first block has the tokens of a's SECOND block: same tokens, other prefix (a's "
        "block was registered after another block, its parent): no hit")
    d = admit(bm, new_seq(3, x + y + [9]))
    shared = set(d.block_table) & set(a.block_table)
    assert shared <= {a.block_table[0]} and d.num_cached == 4 * len(shared), (
        "d is a's prompt: when every hash collides the one table entry may miss it, but "
        f"only a's first block may be shared with it; got {d.block_table}, a has {a.block_table}")
    check_pool(bm, [a, b, c, d])


@pytest.mark.points(3)
def test_a_fully_cached_prompt_still_runs_its_last_token():
    bm = manager(num_blocks=12, block_size=4)
    prompt = list(range(1, 9))                         # exactly 2 blocks
    a = prefill(bm, admit(bm, new_seq(0, prompt)))
    b = admit(bm, new_seq(1, prompt))
    assert b.num_cached < b.num_tokens, (
        f"b's whole prompt is cached, but the step needs its last token's logits: num_cached "
        f"must stay below {b.num_tokens}, got {b.num_cached}")
    assert b.num_cached == 4 and b.block_table[0] == a.block_table[0], (
        "only the blocks before the last token are hits (a cached block is never rewritten): "
        f"4 tokens cached, got {b.num_cached}")
    assert b.block_table[1] != a.block_table[1]
    c = admit(bm, new_seq(2, prompt + [100]))          # a's prompt and its first output
    assert c.num_cached == 8 and c.block_table[:2] == a.block_table[:2], (
        f"c's first 8 tokens are cached in a's 2 blocks: num_cached 8, got {c.num_cached}")
    check_pool(bm, [a, b, c])


@pytest.mark.points(5)
def test_freed_blocks_stay_cached_until_evicted_least_recently_used_first():
    bm = manager(num_blocks=7, block_size=4)           # 6 blocks, free in order 1..6
    prompt = list(range(1, 10))                        # 9 tokens: blocks 1, 2, 3
    a = prefill(bm, admit(bm, new_seq(0, prompt)))
    assert a.block_table == [1, 2, 3], (
        f"fresh blocks in free-list order, got {a.block_table}: LRU, a fresh block is the least "
        "recently freed, the front of free_blocks (popitem(last=False))")
    bm.free(a)
    assert list(bm.free_blocks) == [4, 5, 6, 3, 2, 1], (
        f"a frees its blocks last one first, at the end of the free list: "
        f"[4, 5, 6, 3, 2, 1], got {list(bm.free_blocks)}")
    assert bm.blocks[1].hash is not None and bm.blocks[2].hash is not None, (
        "a freed block keeps its hash: a later request may still hit it")
    again = admit(bm, new_seq(1, prompt))
    assert again.block_table[:2] == [1, 2] and again.num_cached == 8, (
        f"the same prompt finds its 2 full blocks in the free pool, got {again.block_table}")
    bm.free(again)
    assert bm.stats.evictions == 0
    assert list(bm.free_blocks) == [5, 6, 3, 4, 2, 1], (
        "the second run took 1, 2 (hits) and 4 (fresh), and gave them back 4, 2, 1: "
        f"free list [5, 6, 3, 4, 2, 1], got {list(bm.free_blocks)}; a hit on a free block takes "
        "it out of the free list, or it is handed out again as fresh while a sequence reads it")
    c = admit(bm, new_seq(2, range(50, 62)))           # 3 blocks: the least recently used
    assert c.block_table == [5, 6, 3], f"LRU: blocks 5, 6, 3 first, got {c.block_table}"
    d = admit(bm, new_seq(3, range(70, 78)))           # 2 more: 4 (no hash), then 2 (evicted)
    assert d.block_table == [4, 2], f"then 4 and 2, got {d.block_table}"
    assert bm.stats.evictions == 1, f"block 2 lost its cached contents: 1 eviction, got {bm.stats}"
    assert bm.blocks[2].hash is None and len(bm.hash_to_block) == 1, (
        "evicting block 2 forgets what it held: its hash becomes None and its entry leaves "
        f"hash_to_block (a's first block's stays), got hash {bm.blocks[2].hash} and "
        f"hash_to_block {bm.hash_to_block}")
    bm.free(c)                                          # free list: 1, 3, 6, 5
    e = admit(bm, new_seq(4, prompt))
    assert e.block_table == [1, 3, 6] and e.num_cached == 4, (
        "block 1 is still cached (a's first block), block 2 was evicted: 4 tokens cached, "
        f"then 2 fresh blocks from the front of the free list; got {e.block_table}")
    check_pool(bm, [d, e])


@pytest.mark.points(2)
def test_without_prefix_caching_nothing_is_shared():
    bm = manager(num_blocks=12, block_size=4, prefix_caching=False)
    a = prefill(bm, admit(bm, new_seq(0, range(1, 10))))
    b = admit(bm, new_seq(1, range(1, 10)))
    assert b.num_cached == 0 and not set(a.block_table) & set(b.block_table)
    assert not bm.hash_to_block
    check_pool(bm, [a, b])


@pytest.mark.points(4)
def test_scheduler_preempts_when_blocks_run_out_and_nothing_leaks():
    """Stage 11's scheduler on this block manager: decode steps outgrow the pool, the newest
    sequence is preempted, freed and recomputed later; at the end every block is free."""
    S = parts.load("11", "scheduler")
    bm = manager(num_blocks=9, block_size=4)           # 8 blocks = 32 positions
    sched = S.Scheduler(S.SchedulerConfig(max_model_len=24, max_num_seqs=4,
                                          max_num_batched_tokens=64), bm)
    watch_plans(sched)     # every step's plan checked, an exhausted pool explained
    seqs = [new_seq(i, range(10 * i + 1, 10 * i + 7)) for i in range(4)]   # 6 tokens each
    for s in seqs:
        sched.add(s)
    for _ in range(400):
        if not sched.has_unfinished():
            break
        batch = sched.schedule()
        for s in batch:
            s.complete_step(5)
        for s in list(sched.running):
            if s.num_tokens >= 20:
                sched.finish(s, "max_tokens")
        check_pool(bm, sched.running)
        for s in sched.waiting:
            assert not s.block_table, f"waiting sequence {s.seq_id} still holds blocks"
    assert not sched.has_unfinished(), "the requests never finished"
    assert sched.num_preemptions > 0, "4 sequences of 20 tokens do not fit 32 positions"
    assert all(s.token_ids[6:] == [5] * (s.num_tokens - 6) for s in seqs)
    check_pool(bm, [])
    assert bm.num_free_blocks == 8


@pytest.mark.points(3)
def test_a_prefix_computed_twice_stays_one_chain():
    """Two requests with the same 3-block prefix arrive in one step: both compute it, and
    only the first copy of each block is registered. A third request must still find all 3
    blocks: the second copy's later blocks chain to the FIRST copy (what a lookup walks),
    not to their own duplicate parent."""
    bm = manager(num_blocks=20, block_size=4)
    prefix = list(range(1, 13))                       # 3 full blocks
    a = admit(bm, new_seq(0, prefix + [50, 51]))
    b = admit(bm, new_seq(1, prefix + [60]))
    assert a.num_cached == b.num_cached == 0, (
        f"nothing is cached before either has run, yet b found {b.num_cached} tokens: a block "
        "is registered (gets its hash) once its K/V are computed (computed/append), never at "
        "admission, or a request hits blocks whose K/V do not exist yet")
    prefill(bm, a)
    prefill(bm, b)
    c = admit(bm, new_seq(2, prefix + [70, 71]))
    assert c.num_cached == 12 and c.block_table[:3] == a.block_table[:3], (
        f"the third request should find the 3 prefix blocks {a.block_table[:3]} (12 tokens); "
        f"got num_cached {c.num_cached}, blocks {c.block_table[:3]}: a duplicate's parent must "
        "be the registered block before it, or the chain breaks after the first block")
    d = admit(bm, new_seq(3, prefix + [60, 61, 62, 63, 64]))
    assert d.num_cached >= 12, "b's prefix is the same chain: a fourth request finds it too"
    check_pool(bm, [a, b, c, d])


@pytest.mark.points(4)
def test_the_same_block_after_different_prefixes_is_two_cache_entries():
    """A block's hash covers every token before it: [x, y] and [w, y] hold the same tokens y
    in their second block, but with other K/V (attention saw other tokens before). Both
    prefixes stay cached, each found by its own requests."""
    bm = manager(num_blocks=20, block_size=4)
    x, w, y = [1, 2, 3, 4], [9, 9, 9, 9], [5, 6, 7, 8]
    a = prefill(bm, admit(bm, new_seq(0, x + y + [1])))
    b = prefill(bm, admit(bm, new_seq(1, w + y + [1])))
    assert not set(a.block_table) & set(b.block_table), "a and b share no block"
    c = admit(bm, new_seq(2, x + y + [2]))
    d = admit(bm, new_seq(3, w + y + [2]))
    assert c.block_table[:2] == a.block_table[:2] and d.block_table[:2] == b.block_table[:2], (
        f"c repeats a's 8 tokens and d b's: each finds its own 2 blocks; got c "
        f"{c.block_table[:2]} (a {a.block_table[:2]}), d {d.block_table[:2]} (b "
        f"{b.block_table[:2]}). A hash of the block's tokens alone names y's block the same "
        "after x and after w: chain it, hash_i = chain_hash(hash_(i-1), tokens of block i)")
    check_pool(bm, [a, b, c, d])


@pytest.mark.points(4)
def test_a_preempted_sequence_finds_its_own_blocks_again():
    """Preemption frees a sequence's blocks, but they keep their contents: readmitted (its
    prompt and output so far), it finds its computed full blocks cached and recomputes only
    the rest."""
    bm = manager(num_blocks=12, block_size=4)
    a = prefill(bm, admit(bm, new_seq(0, range(1, 7))))   # 7 tokens: 6 computed
    for _ in range(3):
        decode(bm, a)                                       # 10 tokens: 9 computed
    table = list(a.block_table)
    bm.free(a)                                              # preempted
    a.num_cached = 0
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert a.num_cached == 8 and a.block_table[:2] == table[:2], (
        f"a's first 2 blocks (8 tokens) were computed before it was preempted and nobody "
        f"took them: readmitted, it must find them (num_cached 8, blocks {table[:2]}); got "
        f"num_cached {a.num_cached}, blocks {a.block_table}")
    check_pool(bm, [a])


@pytest.mark.points(3)
def test_freeing_a_sequence_twice_changes_nothing():
    """finish after preempt, or abort after finish: the second free must not drop the
    reference counts again (a shared block would go free while another sequence reads it)."""
    bm = manager(num_blocks=12, block_size=4)
    system = list(range(1, 9))
    a = prefill(bm, admit(bm, new_seq(0, system + [20])))
    b = admit(bm, new_seq(1, system + [30]))
    bm.free(a)
    bm.free(a)
    assert all(bm.blocks[blk].ref_count == 1 for blk in b.block_table[:2]), (
        f"freeing a twice dropped the shared blocks' counts below b's hold: ref counts "
        f"{[bm.blocks[blk].ref_count for blk in b.block_table[:2]]}, want [1, 1]; free empties "
        "the sequence's block table, so a second free finds nothing to give back")
    check_pool(bm, [b])


@pytest.mark.points(2)
def test_free_forgets_the_sequence():
    """A server runs for days: what the block manager keeps per sequence (seq_hashes) goes
    when the sequence's blocks do."""
    bm = manager(num_blocks=12, block_size=4)
    seqs = [prefill(bm, admit(bm, new_seq(i, range(10 * i + 1, 10 * i + 10)))) for i in range(3)]
    for s in seqs:
        bm.free(s)
    assert not bm.seq_hashes, (
        f"every sequence was freed, yet seq_hashes still holds {sorted(bm.seq_hashes)}: free "
        "forgets the sequence (a leak that grows with every request)")


@pytest.mark.points(3)
def test_a_hit_on_a_free_block_counts_against_the_free_pool():
    """A cached block nobody holds sits in the free list: reusing it takes it from there, as a
    fresh block would."""
    bm = manager(num_blocks=5, block_size=4)            # 4 blocks
    prompt = list(range(1, 9))
    a = prefill(bm, admit(bm, new_seq(0, prompt)))     # 9 tokens: 2 full blocks + 1
    bm.free(a)                                          # 4 free, 2 of them cached
    b = admit(bm, new_seq(1, range(50, 58)))           # takes the 2 uncached ones
    c = new_seq(2, prompt + [100])
    assert not bm.can_allocate(c), (
        "c hits a's 2 cached blocks, both free, and needs 1 fresh block: 3 blocks out of the "
        "2 free ones. can_allocate counts fresh blocks plus the hits that are free")
    bm.free(b)
    assert bm.can_allocate(c), (
        "b gave its 2 blocks back: c's 2 free hits and 1 fresh block fit the 4 free blocks "
        "(each free hit counts once)")


@pytest.mark.points(2)
def test_a_hit_must_follow_the_block_matched_before_it(monkeypatch):
    """With a hash that ignores the prefix, block y after x and block y after w collide: only
    the parent check (the serial of the block matched before) keeps them apart."""
    mod = bm_mod()
    monkeypatch.setattr(mod, "chain_hash", lambda prefix, tokens: hash(tuple(tokens)))
    bm = manager(num_blocks=16, block_size=4)
    x, w, y = [1, 2, 3, 4], [9, 9, 9, 9], [5, 6, 7, 8]
    a = prefill(bm, admit(bm, new_seq(0, x + y + [1])))
    b = prefill(bm, admit(bm, new_seq(1, w + y + [1])))
    d = admit(bm, new_seq(2, w + y + [2]))
    assert d.block_table[:2] == b.block_table[:2], (
        f"d repeats b's 8 tokens: it must share b's blocks {b.block_table[:2]}, got "
        f"{d.block_table[:2]} (a's are {a.block_table[:2]}): a block's parent is the serial of "
        "the block before it, and each block handed out fresh gets a new serial")
    check_pool(bm, [a, b, d])



@pytest.mark.points(2)
def test_a_duplicate_prefix_computed_in_chunks_chains_to_the_registered_copy():
    """a and b arrive together with the same 2-block prefix; a is prefilled at once, b in
    chunks of one block. b's copies are duplicates: its second chunk must chain to a's
    registered first block, so a third request still finds both blocks."""
    bm = manager(num_blocks=20, block_size=4)
    prefix = list(range(1, 9))
    a = admit(bm, new_seq(0, prefix + [50]))
    b = admit(bm, new_seq(1, prefix + [60]))
    prefill(bm, a)
    for _ in range(2):                                  # b: a block a step, then computed()
        b.num_scheduled = 4
        b.complete_step(0)
        bm.computed(b)
    c = admit(bm, new_seq(2, prefix + [70]))
    assert c.num_cached == 8 and c.block_table[:2] == a.block_table[:2], (
        f"c should find a's 2 prefix blocks {a.block_table[:2]}; got num_cached {c.num_cached}, "
        f"blocks {c.block_table[:2]}: when registration resumes after a duplicate block, the "
        "parent is the block registered under the last hash (hash_to_block), not the duplicate")
    check_pool(bm, [a, b, c])
