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

Each running sequence owns one cache slot of max_model_len positions (stage 09's contiguous
cache), reserved when it is admitted, so a running sequence can never run out of cache and
nothing is ever preempted -- at the price of reserving memory it may never use. Stage 13's
paged cache gives memory out a block at a time instead, and then must preempt.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from course import parts

_seq = parts.load("11", "sequence")
Sequence, SequenceStatus = _seq.Sequence, _seq.SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """num_slots: cache slots (sequences that can hold a cache at once); max_model_len:
    positions per slot; max_num_seqs: sequences per step; max_num_batched_tokens: tokens per
    step; chunked_prefill: split prompts longer than the budget left."""
    num_slots: int
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("num_slots", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"without chunked prefill a step must hold a whole prompt: "
                             f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                             f">= max_model_len ({self.max_model_len})")


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots: list[int] = list(range(config.num_slots - 1, -1, -1))

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
        # TODO stage 11: prefill: continue running sequences with more than one uncached token, then admit waiting ones in order (slot, budget, max_num_seqs; chunk if allowed); if any, return them. Else decode every running sequence, one token each (about 22 lines)
        raise NotImplementedError("TODO stage 11: prefill: continue running sequences with more than one uncached token, then admit waiting ones in order (slot, budget, max_num_seqs; chunk if allowed); if any, return them. Else decode every running sequence, one token each (about 22 lines)")

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (finished or aborted): it leaves the running set or the queue and
        its slot is free for the next request."""
        # TODO stage 11: remove it from running (free its slot) or from waiting; status FINISHED, finish_reason (about 9 lines)
        raise NotImplementedError("TODO stage 11: remove it from running (free its slot) or from waiting; status FINISHED, finish_reason (about 9 lines)")
