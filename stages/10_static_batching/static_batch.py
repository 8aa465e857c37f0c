"""Stage 10: generate for a batch of prompts together -- one packed prefill, batched decodes.

    prompts    a: 5 tokens, b: 3 tokens, c: 4 tokens
    prefill    one forward over 12 packed tokens (cu_seqlens [0, 5, 8, 12]) -> 3 first tokens
    decode     one forward over 3 tokens (one per sequence), each at its own position and
               its own cache slot; repeat. A sequence that finishes (eos or max tokens)
               leaves the batch: the next step runs the others only.

A decode step reads every weight once whatever the batch, so B sequences cost about what one
costs until the GEMMs become compute-bound: batching is the largest throughput lever an
engine has. The batch is static in one sense only: no sequence joins after the start (stage
11 lets them).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from course import ops, parts

_kv = parts.load("09", "kv_cache")
KVCache, KVCacheAttention, SeqStep, StepPlan = (_kv.KVCache, _kv.KVCacheAttention, _kv.SeqStep,
                                                _kv.StepPlan)
DecodeGraphs = parts.load("10", "decode_graphs").DecodeGraphs
check_prompt = parts.load("08", "model").check_prompt
if TYPE_CHECKING:   # a stage folder is no package: parts.load names its types
    LlamaModel = parts.load("08", "model").LlamaModel


def generate_batch(model: LlamaModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   eos_ids: Iterable[int] = (), use_graphs: bool | None = None) -> list[list[int]]:
    """Greedy generation for every prompt at once; returns each prompt's new tokens, in order.

    model: a stage-08 LlamaModel (its attention becomes stage 09's KVCacheAttention).
    use_graphs: replay decode steps from CUDA graphs (default: on CUDA).
    Each output is what generate_greedy gives for that prompt alone (on the CPU exactly; on
    a GPU up to near-ties, as cuBLAS may pick other algorithms for other batch shapes).
    """
    if not prompts:
        raise ValueError("there must be at least one prompt")
    for p in prompts:
        check_prompt(model, p, max_new_tokens)
    if max_new_tokens < 1:
        return [[] for _ in prompts]
    longest = max(len(p) for p in prompts) + max_new_tokens - 1
    cache = KVCache.for_model(model, num_slots=len(prompts), max_len=longest)
    model.attention = KVCacheAttention()
    decoder = DecodeGraphs(model, cache, max_batch=len(prompts), use_graphs=use_graphs)
    argmax, eos = ops.get("argmax"), set(eos_ids)
    seqs = [list(p) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    # TODO stage 10: one packed prefill of every prompt (slot i = prompt i); then, while some sequence is running, a decode step of the running ones through decoder.run; drop a sequence after eos or max_new_tokens (about 18 lines)
    raise NotImplementedError("TODO stage 10: one packed prefill of every prompt (slot i = prompt i); then, while some sequence is running, a decode step of the running ones through decoder.run; drop a sequence after eos or max_new_tokens (about 18 lines)")
