"""The reference engine's side of the benchmark: an engine per workload, serving requests.

    with engine_session(model, max_model_len=2048, prefix_caching=True) as serve:
        seconds, tokens = serve(requests)      # every request added at once, run to the end

Each session is a fresh LLMEngine (its KV pool sized from the memory free at that moment, its
decode CUDA graphs captured at start-up), warmed up on other prompts so nothing measured is
cached beforehand, and dropped afterwards with its memory given back, so the next engine (or
transformers) finds the GPU as it was.
"""
from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from bench import workloads
from bench.engine import sync
from bench.workloads import Request

if TYPE_CHECKING:   # the engine loads when used; parts.load names a stage folder's types
    from course import parts
    from solutions.engine.llm_engine import LLMEngine, SamplingParams
    LlamaModel = parts.load("08", "model").LlamaModel

Serve = Callable[[list[Request]], tuple[float, int]]   # requests -> (seconds, output tokens)


def new_engine(model: LlamaModel, max_model_len: int, prefix_caching: bool = True
               ) -> tuple[LLMEngine, type[SamplingParams]]:
    """(LLMEngine over model with these sizes, stage 11's SamplingParams class)."""
    from course import parts
    from solutions.engine.llm_engine import LLMEngine
    from solutions.engine.model_runner import EngineConfig
    engine = LLMEngine(model, None, (), EngineConfig(max_model_len=max_model_len,
                                                     enable_prefix_caching=prefix_caching))
    return engine, parts.load("11", "sampling_params").SamplingParams


def release() -> None:
    """Give a dropped engine's KV pool and graphs back before the next one sizes its own.
    The collection is needed, not a precaution: an engine is a reference cycle (its model
    runner's decode graphs call back into the runner), so dropping the last reference to it
    frees nothing until the cycle collector runs."""
    gc.collect()
    torch.cuda.empty_cache()


def run_ours(engine: LLMEngine, params_type: type[SamplingParams],
             requests: list[Request]) -> tuple[float, int]:
    """(seconds, output tokens) to serve every request, all added at once, EOS ignored."""
    sync()
    t0 = time.perf_counter()
    for prompt, n in requests:
        engine.add_request(prompt, params_type(max_tokens=n, ignore_eos=True))
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    sync()
    return time.perf_counter() - t0, tokens


def warmed_engine(model: LlamaModel, max_model_len: int, prefix_caching: bool,
                  describe: Callable[[str], None] | None = None
                  ) -> tuple[LLMEngine, type[SamplingParams]]:
    """new_engine, warmed up on prompts nothing measured shares (seed 99): prefill and decode
    at a few sizes."""
    t0 = time.perf_counter()
    engine, params_type = new_engine(model, max_model_len, prefix_caching)
    if describe is not None:
        describe(f"engine ready in {time.perf_counter() - t0:.1f} s: {engine.runner.describe()}")
    warm = [(p[: max_model_len // 2], min(n, max_model_len // 2))
            for p, n in workloads.offline(8, model.config.vocab_size, seed=99)]
    run_ours(engine, params_type, warm)
    return engine, params_type


@contextmanager
def engine_session(model: LlamaModel, max_model_len: int, prefix_caching: bool = False,
                   describe: Callable[[str], None] | None = None) -> Iterator[Serve]:
    """A warmed-up engine for one workload; yields serve(requests) -> (seconds, tokens).

    prefix_caching is off unless asked for: the timing workloads repeat prompts (a first-token
    run, then the full run), and a cache hit would make the second run skip its prefill."""
    held = {"engine": warmed_engine(model, max_model_len, prefix_caching, describe)}

    # The caller's name for serve outlives its with-block: serve must not keep the engine
    # alive after the session, or release() would find its KV pool still in use.
    def serve(requests: list[Request]) -> tuple[float, int]:
        if not held:
            raise RuntimeError("this engine session has ended: open a new engine_session")
        return run_ours(*held["engine"], requests)
    try:
        yield serve
    finally:
        held.clear()
        release()
