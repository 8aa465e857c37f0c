"""The benchmark's workloads: lists of requests, each (prompt token ids, new tokens).

Pure Python and seeded, so every run, on any machine, measures the same requests (tests check
it). Token ids start at 3: ids 0-2 are the pad, BOS and EOS ids given to the random model's
config. Random weights never stop early and every side ignores EOS, so a request always
produces exactly its number of new tokens.

    offline          nano-vllm's bench.py: 256 requests, prompt and output lengths uniform in
                     [100, 1024]
    batch1           one request: a 32-token prompt, 256 new tokens
    sweep            B requests of a 128-token prompt, 128 new tokens each, B in SWEEP_BATCHES
    ttft             one 4,096-token prompt, 1 new token
    shared_prefix    256 requests: one 1,000-token system prompt, then a question of 16-64
                     tokens; 64 new tokens each
"""
from __future__ import annotations

import random

Request = tuple[list[int], int]     # (prompt token ids, new tokens)

FIRST_ID = 3
OFFLINE_REQUESTS = 256
OFFLINE_LENGTHS = (100, 1024)
BATCH1_PROMPT, BATCH1_NEW = 32, 256
SWEEP_BATCHES = (1, 8, 32, 64, 128, 256)
SWEEP_PROMPT, SWEEP_NEW = 128, 128
TTFT_PROMPT = 4096
PREFIX_TOKENS, PREFIX_QUESTION, PREFIX_NEW = 1000, (16, 64), 64


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def offline(n: int, vocab: int, seed: int = 0) -> list[Request]:
    """nano-vllm's bench.py: n requests, prompt and output lengths uniform in OFFLINE_LENGTHS."""
    rng = random.Random(seed)
    return [(_ids(rng, rng.randint(*OFFLINE_LENGTHS), vocab), rng.randint(*OFFLINE_LENGTHS))
            for _ in range(n)]


def shared_prefix(n: int, vocab: int, seed: int = 1) -> list[Request]:
    """n requests: one PREFIX_TOKENS-token system prompt, then a question of 16-64 tokens."""
    rng = random.Random(seed)
    system = _ids(rng, PREFIX_TOKENS, vocab)
    return [(system + _ids(rng, rng.randint(*PREFIX_QUESTION), vocab), PREFIX_NEW)
            for _ in range(n)]


def fixed(batch: int, prompt_len: int, new: int, vocab: int, seed: int) -> list[Request]:
    """batch requests of prompt_len random tokens each, new tokens each (no shared prefix)."""
    rng = random.Random(seed)
    return [(_ids(rng, prompt_len, vocab), new) for _ in range(batch)]


def output_tokens(requests: list[Request]) -> int:
    """The output tokens a workload produces (every request runs to its new tokens)."""
    return sum(n for _, n in requests)


def capped(requests: list[Request], most: int) -> list[Request]:
    """The same requests, each generating at most `most` tokens (a slow side's shorter run)."""
    return [(p, min(n, most)) for p, n in requests]


def context_len(requests: list[Request]) -> int:
    """Positions the longest request needs: its prompt plus its new tokens."""
    return max(len(p) + n for p, n in requests)


def padded_len(requests: list[Request]) -> int:
    """Positions of one padded batch of them: the longest prompt plus the most new tokens."""
    return max(len(p) for p, _ in requests) + max(n for _, n in requests)
