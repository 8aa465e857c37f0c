"""transformers' side of the benchmark: generate() on the same weights, its fastest way that works.

    side = Transformers(hf_model, cache="static", compile_limit_s=240, log=print)
    serve = side.serving(max_len=2048)           # one static-cache length per workload
    seconds, tokens = serve(requests)            # one left-padded batch, greedy, EOS ignored

"static": `generate(cache_implementation="static", max_cache_len=L)`, which transformers
compiles by itself (its "automatic compilation" of the decoding forward, torch.compile with
mode="reduce-overhead", i.e. CUDA graphs) because the cache is compileable; we pass a
CompileConfig with dynamic=True so that one compiled graph serves every batch size and cache
length of the run (batch 1 gets its own: torch specialises sizes 0 and 1). The prefill runs
eagerly either way. "dynamic": plain generate() with the default DynamicCache, eager.

Compiling and CUDA-graph recording never fall inside a measurement: the first time a batch
shape (batch, prompt length, cache length) is served, a short generate of the same shape runs
first (warm-up), and its time is reported apart (the first one includes the compile). A
compile that raises, or runs past compile_limit_s, switches the side to the dynamic cache for
the rest of the run, and `name` says so and why.

transformers serves a batch as one padded tensor: every row decodes until the longest request
is done, and only each request's own new tokens count (the padding work does not).
"""
from __future__ import annotations

import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from bench.engine import sync
from bench.ours import Serve
from bench.workloads import Request, capped, output_tokens

if TYPE_CHECKING:   # transformers loads when a model is made
    from transformers import PreTrainedModel

CACHES = ("static", "dynamic")
# A static shape's warm-up: enough decode steps for torch's CUDA-graph trees to run eagerly
# once, record, and replay.
WARM_STEPS = 8


class CompileTimeout(Exception):
    """transformers' compile ran past the limit we give it."""


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise CompileTimeout in this (main) thread after `seconds` of wall time.

    A compile cannot be cancelled from outside; the timer's exception surfaces at the next
    Python bytecode the main thread runs, which in a compile is soon. Elsewhere than the main
    thread of a POSIX process, no limit is set."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread() \
            or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum, frame):
        raise CompileTimeout(f"the compile ran past {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def padded_batch(requests: list[Request], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask), both [B, longest prompt] int64, prompts padded on the left."""
    longest = max(len(p) for p, _ in requests)
    ids = torch.zeros((len(requests), longest), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, (p, _) in enumerate(requests):
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    return ids.to(device), mask.to(device)


class Transformers:
    """generate() on one transformers model; cache "static" (compiled) or "dynamic"."""

    def __init__(self, model: PreTrainedModel, cache: str = "static",
                 compile_limit_s: float = 240.0, log: Callable[[str], None] = print):
        if cache not in CACHES:
            raise ValueError(f"cache must be one of {CACHES}, got {cache!r}")
        self.model, self.cache, self.log = model, cache, log
        self.compile_limit_s = compile_limit_s
        self.fallback_reason: str | None = None
        self.first_warmup_s: float | None = None   # includes the compile, when static
        self.warmup_s = 0.0                          # every warm-up, the first included
        self._warm: set[tuple[str, int, int, int]] = set()

    @property
    def name(self) -> str:
        if self.cache == "static":
            return "static cache + torch.compile (reduce-overhead, dynamic shapes)"
        if self.fallback_reason:
            return f"dynamic cache, eager (static + compile failed: {self.fallback_reason})"
        return "dynamic cache, eager"

    def describe(self) -> dict:
        return {"name": self.name, "cache": self.cache, "fallback_reason": self.fallback_reason,
                "first_warmup_s": self.first_warmup_s, "warmup_s": self.warmup_s}

    def serving(self, max_len: int, dynamic_cap: int | None = None) -> Serve:
        """serve(requests) -> (seconds, output tokens), a static cache of max_len positions.
        dynamic_cap: with the dynamic cache, each request generates at most that many tokens
        (a workload that would otherwise take minutes)."""
        return lambda requests: self.serve(requests, max_len, dynamic_cap)

    def serve(self, requests: list[Request], max_len: int,
              dynamic_cap: int | None = None) -> tuple[float, int]:
        if self.cache == "static":
            try:
                return self._timed(requests, max_len)
            except Exception:  # the compiled path failed: say why, then go on without it
                self._fall_back()
        if dynamic_cap is not None:
            requests = capped(requests, dynamic_cap)
        return self._timed(requests, max_len)

    def _fall_back(self) -> None:
        """Called in an except block: log its traceback, and serve dynamically from now on."""
        error = sys.exc_info()[1]
        text = str(error).strip()
        reason = f"{type(error).__name__}: {text.splitlines()[0][:200]}" if text \
            else type(error).__name__
        self.log("transformers: static cache + compile failed; falling back to the dynamic "
                 f"cache for the rest of the run.\n{traceback.format_exc(limit=-3)}")
        self.cache, self.fallback_reason = "dynamic", reason
        self._warm.clear()
        sync_quietly()

    def _timed(self, requests: list[Request], max_len: int) -> tuple[float, int]:
        ids, mask = padded_batch(requests, str(self.model.device))
        new = max(n for _, n in requests)
        key = (self.cache, ids.shape[0], ids.shape[1], max_len)
        if key not in self._warm:
            # WARM_STEPS tokens whatever the request's count: compiling the decode step and
            # recording its CUDA graphs happen at the first decode of a shape, so a warm-up of
            # one token (a first-token run) would leave them to the timed run after it. The
            # static cache keeps the timed runs' length (max_len), so its shape stays theirs.
            room = max_len - ids.shape[1] if self.cache == "static" else WARM_STEPS
            t0 = time.perf_counter()
            with deadline(self.compile_limit_s if self.cache == "static" else 0):
                self._generate(ids, mask, max(1, min(WARM_STEPS, room)), max_len)
            spent = time.perf_counter() - t0
            if self.first_warmup_s is None:
                self.first_warmup_s = spent
                self.log(f"transformers ({self.name}): first warm-up {spent:.1f} s")
            self.warmup_s += spent
            self._warm.add(key)
        sync()
        t0 = time.perf_counter()
        self._generate(ids, mask, new, max_len)
        sync()
        return time.perf_counter() - t0, output_tokens(requests)

    @torch.no_grad()
    def _generate(self, ids: torch.Tensor, mask: torch.Tensor, new: int, max_len: int):
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                      min_new_tokens=new, do_sample=False, num_beams=1, pad_token_id=0,
                      eos_token_id=None, temperature=None, top_p=None, top_k=None)
        if self.cache == "static":
            from transformers import CompileConfig
            kwargs.update(cache_implementation="static",
                          max_cache_len=max(max_len, ids.shape[1] + new),
                          compile_config=CompileConfig(dynamic=True))
        return self.model.generate(**kwargs)


def sync_quietly() -> None:
    """Synchronise after a failure, which may itself have left an error to report: ignore it."""
    try:
        sync()
        torch.cuda.empty_cache()
    except RuntimeError:
        pass
