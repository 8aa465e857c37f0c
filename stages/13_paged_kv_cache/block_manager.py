"""Stage 13: the block manager -- KV memory handed out a block at a time, and shared.

The cache is a pool of `num_blocks` blocks of `block_size` positions (paged_cache.py). A
sequence owns a list of blocks, its block table: position p lives in block
`block_table[p // block_size]`, row `p % block_size`. A sequence of n tokens needs
ceil(n / block_size) blocks, so at most block_size - 1 positions of its last block are
unused -- instead of the max_model_len - n of a contiguous slot (stages 09-11).

    blocks: 0 (pad) | 1 2 3 4 5 6 7 ...
    seq a  [3, 1, 6]     tokens 0-15 in block 3, 16-31 in block 1, 32-40 in block 6
    seq b  [3, 1, 4]     the same first 32 tokens (a shared system prompt): blocks 3 and 1
                         are SHARED (reference count 2); b's own tokens start in block 4

Prefix caching: a FULL block is named by a chained hash of its tokens,

    hash_i = hash((hash_{i-1}, tokens of block i))      (hash_{-1} = -1)

so equal hashes mean "the same tokens after the same prefix" (up to a hash collision). A new
sequence looks its full blocks up in `hash_to_block` and reuses the ones already computed;
it only has to run the rest (`seq.num_cached` says how much is cached). A hit is verified:
the block's stored tokens must equal the looked-up tokens and the block before it must be
the block the lookup matched just before (its `parent`), so a collision can cost a hit,
never share a wrong block. A freed block keeps its hash and contents: until its memory is
needed for a fresh block, a later request with the same prefix can still hit it. Free blocks
are reused least-recently-freed first (LRU); a sequence frees its blocks last one first, so
a prefix's later blocks are evicted before its earlier ones (which more requests share).

Blocks are registered (get their hash) only once their K/V are in the cache: after every
step (prefill steps too) the engine calls `computed(seq)`, which registers the full blocks
that seq's cached tokens have filled, so the next step's prefill can already hit them. (A
block whose prompt is still being prefilled in chunks must not be hit before its chunk has
run: its K/V do not exist yet.) A hit never covers a prompt's last token: a fully cached
prompt still runs its last token (the step needs that token's logits), so hits stop at the
last full block before it, and cached blocks are never written again.

Block 0 is the pad block: never handed out; padding rows of stage 10's CUDA-graph batches
write their K/V there.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # a stage folder is no package: parts.load names its types
    from course import parts
    Sequence = parts.load("11", "sequence").Sequence


def chain_hash(prefix_hash: int, token_ids: Iterable[int]) -> int:
    """The hash of a full block: its tokens after the prefix whose hash is prefix_hash (-1
    for the first block). Python's hash of a tuple of ints is the same in every process."""
    return hash((prefix_hash, tuple(token_ids)))


@dataclass
class Block:
    """One block of the pool. ref_count: sequences whose table holds it (0: free). hash,
    token_ids, parent: set while it is registered in the prefix cache (parent: the serial of
    the block before it in the table that registered it, -1 for a first block). serial: new
    each time the block is handed out fresh (names its current contents)."""
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    parent: int = -1
    serial: int = 0


@dataclass
class CacheStats:
    """For the lesson: prompt tokens looked up and found in the prefix cache, and blocks
    whose cached contents were dropped to make room (evictions)."""
    queried_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass
class _Lookup:
    """What the prefix cache holds for a sequence: the blocks it can reuse, in order."""
    blocks: list[Block] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)


class BlockManager:
    """Stage 11's CacheAllocator over a pool of num_blocks blocks of block_size positions
    (block 0 reserved as the pad block, so num_blocks - 1 are handed out)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2 or block_size < 1:
            raise ValueError(f"a block manager needs at least 2 blocks (one is the pad block) "
                             f"of at least 1 position, got {num_blocks} of {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pad_block = 0
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in the order they were freed: the first is the least recently used, the
        # one a fresh allocation takes. An OrderedDict, not a dict: both keep insertion order
        # and delete any key in O(1), but a dict's first key is found by walking over the
        # slots of the keys deleted before it (until the dict is next resized), so taking
        # blocks from the front of a pool of many thousands costs microseconds per block;
        # OrderedDict.popitem(last=False) takes it in O(1).
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.hash_to_block: dict[int, int] = {}
        # Per sequence (by seq_id): the chain hashes of its registered full blocks, in order.
        self.seq_hashes: dict[int, list[int]] = {}
        self.stats = CacheStats()
        self._serial = 0

    # -- the pool ---------------------------------------------------------------------------

    @property
    def num_total_blocks(self) -> int:
        """Blocks that can be handed out (all but the pad block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take_fresh(self) -> Block:
        """The least recently used free block, emptied for new contents (if it was in the
        prefix cache, that entry is evicted)."""
        # TODO stage 13: the least recently freed block, evicted from the prefix cache if it names cached contents (count it), emptied, a new serial, held once (about 10 lines)
        raise NotImplementedError("TODO stage 13: the least recently freed block, evicted from the prefix cache if it names cached contents (count it), emptied, a new serial, held once (about 10 lines)")

    def _share(self, block: Block) -> None:
        """One more sequence holds `block` (a prefix-cache hit); a free one leaves the free list."""
        # TODO stage 13: a free block (ref_count 0) leaves free_blocks; ref_count += 1 (about 3 lines)
        raise NotImplementedError("TODO stage 13: a free block (ref_count 0) leaves free_blocks; ref_count += 1 (about 3 lines)")

    # -- the prefix cache -------------------------------------------------------------------

    def _lookup(self, seq: Sequence) -> _Lookup:
        """The cached blocks at the start of seq: full blocks before its last token whose
        chained hash is registered and whose tokens and parent match. Changes nothing."""
        found = _Lookup()
        if not self.enable_prefix_caching:
            return found
        bs = self.block_size
        # TODO stage 13: the cached blocks at the start of seq, in order, and their hashes: the rules of the lesson's "Keeping shared memory correct" (changes nothing) (about 13 lines)
        raise NotImplementedError("TODO stage 13: the cached blocks at the start of seq, in order, and their hashes: the rules of the lesson's \"Keeping shared memory correct\" (changes nothing) (about 13 lines)")
        return found

    def _register(self, seq: Sequence) -> None:
        """Give every full block of seq whose K/V are cached (within its first num_cached
        tokens) a hash, in order, unless it has one. A block whose prefix is registered in
        another block already (computed twice) stays out of the prefix cache, and the chain
        goes on through that other block: a block's parent is the block a lookup of the same
        prefix finds before it, so later blocks of either copy stay reachable."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes = self.seq_hashes.setdefault(seq.seq_id, [])
        start = len(hashes)
        if seq.num_cached // bs <= start:
            return   # no block filled since the last call: most decode steps end here
        # TODO stage 13: name seq's computed full blocks that have no name yet, in order, extending its chain; a prefix already registered in another block keeps that block in the chain (about 22 lines)
        raise NotImplementedError("TODO stage 13: name seq's computed full blocks that have no name yet, in order, extending its chain; a prefix already registered in another block keeps that block in the chain (about 22 lines)")

    # -- the CacheAllocator interface (stage 11's scheduler calls these) ---------------------

    def can_allocate(self, seq: Sequence) -> bool:
        """Are there free blocks for all of seq's tokens, counting the prefix-cache hits?"""
        # TODO stage 13: fresh blocks needed (blocks_needed minus hits) plus the hits that are free now must fit num_free_blocks (about 4 lines)
        raise NotImplementedError("TODO stage 13: fresh blocks needed (blocks_needed minus hits) plus the hits that are free now must fit num_free_blocks (about 4 lines)")

    def allocate(self, seq: Sequence) -> None:
        """Blocks for all of seq's tokens: the cached prefix shared, the rest fresh. Sets
        seq.block_table, and seq.num_cached to the cached prefix length (always below
        seq.num_tokens). The caller checked can_allocate."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks {seq.block_table}")
        # TODO stage 13: lookup; share each hit; fresh blocks for the rest; block_table; num_cached = hits * block_size; remember the hits' hashes in seq_hashes; stats (queried and hit tokens) (about 10 lines)
        raise NotImplementedError("TODO stage 13: lookup; share each hit; fresh blocks for the rest; block_table; num_cached = hits * block_size; remember the hits' hashes in seq_hashes; stats (queried and hit tokens) (about 10 lines)")

    def can_append(self, seq: Sequence) -> bool:
        """Can seq's newest token get a position (a free block, if it starts a new one)?"""
        # TODO stage 13: a new block is needed when the table covers fewer than num_tokens positions (about 2 lines)
        raise NotImplementedError("TODO stage 13: a new block is needed when the table covers fewer than num_tokens positions (about 2 lines)")

    def append(self, seq: Sequence) -> None:
        """Before a decode step: a fresh block if the newest token starts one; blocks that
        the tokens cached so far filled get their hashes."""
        # TODO stage 13: take a fresh block when the table is short; then _register (about 3 lines)
        raise NotImplementedError("TODO stage 13: take a fresh block when the table is short; then _register (about 3 lines)")

    def computed(self, seq: Sequence) -> None:
        """After a step: the blocks that seq's cached tokens filled join the prefix cache, so
        a request admitted in the next step (a prefill step, with no decode step between to
        call append) already finds them."""
        self._register(seq)

    def free(self, seq: Sequence) -> None:
        """seq gives its blocks back (finished, aborted or preempted): ref counts drop, and
        a block nobody holds joins the end of the free list, last block first, keeping its
        hash for later hits."""
        # TODO stage 13: for the table's blocks in reverse: ref_count -= 1, at 0 append to free_blocks; empty the table; forget seq_hashes (about 7 lines)
        raise NotImplementedError("TODO stage 13: for the table's blocks in reverse: ref_count -= 1, at 0 append to free_blocks; empty the table; forget seq_hashes (about 7 lines)")
