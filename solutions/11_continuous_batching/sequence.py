"""Stage 11: one request as the scheduler sees it -- its tokens, and how many are cached.

    token_ids    prompt + generated tokens so far
    num_cached   how many of them have their K/V in the cache
    num_scheduled  how many this step runs through the model (set by the scheduler)

Everything the scheduler decides follows from `num_cached < num_tokens`: a new request has
nothing cached (a prefill of its whole prompt), a long prompt can be fed in chunks (chunked
prefill: several steps with num_scheduled < the uncached rest), and a running request has
exactly its newest token uncached (a decode step). A step's sampled token is kept only when
the step made the whole sequence cached; a chunk that ends inside the prompt samples nothing.
A preempted sequence (stage 13) simply goes back to num_cached = 0 with all its tokens, and
is prefilled again -- prompt and output alike -- when it is readmitted.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from course import parts

SamplingParams = parts.load("11", "sampling_params").SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"     # in the queue, owns no cache
    RUNNING = "running"     # owns cache, scheduled every step until it finishes
    FINISHED = "finished"   # done (finish_reason says why); its cache is free again


@dataclass(eq=False)
class Sequence:
    """seq_id: unique per engine; prompt_ids: the prompt's tokens; params: sampling."""
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    token_ids: list[int] = field(init=False)
    status: SequenceStatus = SequenceStatus.WAITING
    num_cached: int = 0
    num_scheduled: int = 0
    block_table: list[int] = field(default_factory=list)   # the cache blocks it owns (its slot)
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.prompt_ids = list(self.prompt_ids)
        self.token_ids = list(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncached(self) -> int:
        """Tokens whose K/V are not in the cache yet: what the next steps must run."""
        # BEGIN SOLUTION: tokens minus cached ones
        return len(self.token_ids) - self.num_cached
        # END SOLUTION

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def complete_step(self, token: int) -> bool:
        """After a step ran num_scheduled tokens and sampled `token`: count them as cached,
        and keep the token if the whole sequence is now cached (else the step was a chunk
        inside the prompt and its sample means nothing). Returns whether it was kept."""
        # BEGIN SOLUTION: num_cached += num_scheduled, reset num_scheduled; append token only if nothing is left uncached
        self.num_cached += self.num_scheduled
        self.num_scheduled = 0
        if self.num_cached < len(self.token_ids):
            return False
        self.token_ids.append(int(token))
        return True
        # END SOLUTION
