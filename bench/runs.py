"""One workload on one side: the same measurement for this engine and for transformers.

Each function takes a side's serve(requests) -> (seconds, output tokens) (bench.ours, bench.hf)
and returns raw seconds; bench.results turns them into the JSON's rates and ratios. A side
warms itself up before its first measurement of a shape, so nothing here is a warm-up.
"""
from __future__ import annotations

from bench.ours import Serve
from bench.workloads import Request


def first_token_and_all(serve: Serve, requests: list[Request]) -> tuple[float, float]:
    """(seconds for the first token of every request, seconds for all their tokens).

    The difference is the decode time of the tokens after the first. The two runs serve the
    same prompts, so a side must not cache prompts between them (ours runs with prefix
    caching off here)."""
    first, _ = serve([(p, 1) for p, _ in requests])
    total, _ = serve(requests)
    return first, total


def decode_ms_per_token(serve: Serve, request: Request, reps: int) -> list[float]:
    """ms per output token after the first, alone in the batch; one value per repetition."""
    out = []
    for _ in range(reps):
        first, total = first_token_and_all(serve, [request])
        out.append((total - first) / (request[1] - 1) * 1e3)
    return out


def first_token_ms(serve: Serve, prompts: list[list[int]]) -> list[float]:
    """Time to first token (ms) of each prompt, served alone, one after the other."""
    return [serve([(p, 1)])[0] * 1e3 for p in prompts]
