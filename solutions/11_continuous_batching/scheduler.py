"""Stage 11: continuous batching -- which sequences run in the next step, and how many tokens.

A static batch (stage 10) runs until its longest member is done, its finished slots idle.
Here requests join and leave between any two steps:

    waiting  (FIFO)  --admit-->  running  --finish-->  gone (its cache slot freed)

Every step is either a PREFILL step or a DECODE step (as nano-vllm does):

1. Prefill, if there is prompt work: first the running sequences still in the middle of a
   chunked prompt, then waiting requests in arrival order, while the step's token budget
   (`max_num_batched_tokens`), the sequence limit (`max_num_seqs`) and the free cache slots
   allow. Several prompts are packed into one step. With chunked prefill a prompt that does
   not fit the budget left takes what is left, and continues next step; without it, it
   waits for a step with room.
2. Otherwise decode: every running sequence, one token each.

Keeping the two apart keeps decode steps uniform (one token per sequence: stage 10's CUDA
graphs, stage 09's decode kernel). While a long prompt is prefilled the running sequences
wait a step; chunking bounds how long.

Cache memory comes from an allocator (`CacheAllocator`). This stage's `SlotAllocator` gives
each admitted sequence one slot of max_model_len positions (stage 09's contiguous cache), so
a running sequence can never run out of cache -- at the price of reserving memory it may never
use. Stage 13's block manager gives memory out a block at a time instead; then a decode step
can find no block for a sequence's next token, and the scheduler PREEMPTS: it frees the
newest running sequence's cache and puts it back at the front of the queue, to be prefilled
again later (recompute), never lost. The policy is written here, against the interface; with
slots it never fires (the tests drive it with an allocator that runs out).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from course import parts

_seq = parts.load("11", "sequence")
Sequence, SequenceStatus = _seq.Sequence, _seq.SequenceStatus


class CacheAllocator(Protocol):
    """Where the scheduler gets cache for its sequences (stage 13's BlockManager is one)."""

    def can_allocate(self, seq: Sequence) -> bool:
        """Is there cache for all of seq's tokens now?"""

    def allocate(self, seq: Sequence) -> None:
        """Give seq cache for all its tokens (seq.block_table). May find some of them cached
        already (stage 13's prefix cache) and raise seq.num_cached to match."""

    def can_append(self, seq: Sequence) -> bool:
        """Can seq's newest token get a cache position?"""

    def append(self, seq: Sequence) -> None:
        """Make room for seq's newest token (a new block when the last one is full)."""

    def free(self, seq: Sequence) -> None:
        """Take back all of seq's cache (seq.block_table becomes empty)."""

    def computed(self, seq: Sequence) -> None:
        """A step has run: seq's first num_cached tokens now have their K/V in the cache
        (stage 13's prefix cache may now offer those blocks to other requests). The engine
        calls it after each step; the scheduler never does."""


class SlotAllocator:
    """One slot of max_model_len positions per sequence: block_table = [slot]."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))

    def can_allocate(self, seq: Sequence) -> bool:
        return bool(self.free_slots)

    def allocate(self, seq: Sequence) -> None:
        if not self.free_slots:
            raise RuntimeError(f"allocate(sequence {seq.seq_id}) with no free slot: admit a "
                               "sequence only when allocator.can_allocate(seq) says yes")
        seq.block_table = [self.free_slots.pop()]

    def can_append(self, seq: Sequence) -> bool:
        return True   # the slot holds the whole context

    def append(self, seq: Sequence) -> None:
        pass

    def free(self, seq: Sequence) -> None:
        self.free_slots.extend(seq.block_table)
        seq.block_table = []

    def computed(self, seq: Sequence) -> None:
        pass   # a slot is nobody else's: nothing to share


@dataclass(frozen=True)
class SchedulerConfig:
    """max_model_len: positions per sequence; max_num_seqs: sequences per step;
    max_num_batched_tokens: tokens per step; chunked_prefill: split prompts longer than the
    budget left."""
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"without chunked prefill a step must hold a whole prompt: "
                             f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                             f">= max_model_len ({self.max_model_len})")


class Scheduler:
    """config: the limits; allocator: where cache comes from (default: SlotAllocator of
    num_slots slots)."""

    def __init__(self, config: SchedulerConfig, allocator: CacheAllocator | None = None,
                 num_slots: int | None = None):
        if allocator is None:
            if num_slots is None:
                raise ValueError("give the scheduler an allocator or a number of cache slots")
            allocator = SlotAllocator(num_slots)
        self.config, self.allocator = config, allocator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new request. A prompt that can never run is refused here, not later."""
        if seq.num_tokens > self.config.max_model_len:
            raise ValueError(f"the prompt has {seq.num_tokens} tokens, more than the context of "
                             f"{self.config.max_model_len} positions")
        if seq.status is not SequenceStatus.WAITING or seq.num_cached:
            raise ValueError(f"sequence {seq.seq_id} is not a new request")
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Sequence]:
        """The sequences of the next step, each with num_scheduled set (empty: nothing to do)."""
        c = self.config
        budget = c.max_num_batched_tokens
        batch: list[Sequence] = []
        # BEGIN SOLUTION: the next step: a prefill step if there is prompt work, else a decode step, meeting every requirement of the lesson's exercise 3 (one kind per step, unfinished prompts first, first come first served, the limits, counted after allocate, decode with preemption)
        for seq in self.running:
            if seq.num_uncached > 1 and budget > 0:
                seq.num_scheduled = min(seq.num_uncached, budget)
                budget -= seq.num_scheduled
                batch.append(seq)
        while self.waiting and budget > 0 and len(self.running) < c.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_uncached > budget and not c.chunked_prefill:
                break
            if not self.allocator.can_allocate(seq):
                break
            self.waiting.popleft()
            self.allocator.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            seq.num_scheduled = min(seq.num_uncached, budget)
            budget -= seq.num_scheduled
            self.running.append(seq)
            batch.append(seq)
        if batch:
            return batch
        i = 0
        while i < len(self.running):           # oldest first; victims are taken from the end
            seq = self.running[i]
            room = self.allocator.can_append(seq)
            while not room and self.running[-1] is not seq:
                self.preempt(self.running[-1])
                room = self.allocator.can_append(seq)
            if not room:
                self.preempt(seq)                  # the newest itself: nothing left to free
                break
            self.allocator.append(seq)
            seq.num_scheduled = 1
            batch.append(seq)
            i += 1
        return batch
        # END SOLUTION

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's cache and queue it first: it is prefilled again (prompt
        and output so far) when there is room. Its tokens are kept; nothing is lost."""
        # BEGIN SOLUTION: what a preempted sequence becomes (the lesson's exercise 4: its cache, its counts, its status, its place in the queue, the count)
        self.running.remove(seq)
        self.allocator.free(seq)
        seq.num_cached = seq.num_scheduled = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        # END SOLUTION

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (finished or aborted): it leaves the running set or the queue and
        its cache goes back to the allocator."""
        # BEGIN SOLUTION: end a running or a waiting sequence (the lesson's exercise 5)
        if seq in self.running:
            self.running.remove(seq)
            self.allocator.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.num_scheduled = 0
        # END SOLUTION
