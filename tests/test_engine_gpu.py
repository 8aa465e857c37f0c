"""The serving engine on a GPU: what only a GPU can show (its CPU tests are stages 11 and 13's)."""
from __future__ import annotations

import pytest
import torch

from course import parts
from course.testing import fixtures


@pytest.mark.gpu
def test_steady_decode_never_waits_for_the_whole_stream(tmp_path):
    """Once it decodes, each engine.step() queues the next step and only then reads the tokens
    of the step before, through that step's own CUDA event. A stream-wide synchronisation
    instead (.tolist(), .item() or .cpu() of a device tensor, a blocking copy) would also wait
    for the step just queued, and the GPU would idle while the host prepares the one after:
    on the H200 that was ~1 ms per step at batch 256. torch's sync debug mode "error" turns
    every such call into an exception."""
    from solutions.engine.llm_engine import LLMEngine
    from solutions.engine.model_runner import EngineConfig
    SamplingParams = parts.load("11", "sampling_params").SamplingParams
    tiny = fixtures.load_tiny(tmp_path, "gqa_tied")
    model = parts.load("08", "model").LlamaModel(tiny.config, tiny.weights, "cuda",
                                                 torch.bfloat16)
    engine = LLMEngine(model, None, (), EngineConfig(max_model_len=96, max_num_seqs=4,
                                                     gpu_memory_utilization=0.05))
    for n in (5, 9, 13, 17):
        engine.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=60, ignore_eos=True))
    while not (engine._inflight and engine._inflight[2]):   # the prefills, to a decode step
        engine.step()
    engine.step()
    torch.cuda.synchronize()
    produced = 0
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):
            produced += sum(len(out.new_token_ids) for out in engine.step())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert produced == 20 * 4, f"20 decode steps of 4 sequences gave {produced} tokens, not 80"
