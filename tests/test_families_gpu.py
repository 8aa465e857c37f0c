"""Each model family on the GPU (bf16, our kernels) against transformers (bf16, on the GPU).

Random weights with the exact shapes of Qwen3-0.6B (q/k norms, heads of 128 over a hidden
size of 1024), Qwen2.5-0.5B (q/k/v biases) and Mistral-7B cut to 4 layers (bench.engine.SHAPES),
and a Llama whose heads of 128 are not hidden / heads wide. transformers builds each on the
GPU; the biases and q/k norm weights are drawn (not its zeros and ones), so that they count.

- the residual stream after every layer and the logits, within max(2e-2, 2 * noise), where
  noise is transformers' own bf16 error against its float32 forward of the same weights (see
  tests/test_equivalence_gpu.py for why);
- the serving engine (paged KV cache, RoPE in the cache write, decode steps replayed from CUDA
  graphs) on three prompts at once: each one's greedy tokens equal transformers' for it alone,
  up to a proven near-tie (course.testing.equivalence.assert_greedy_agrees).

    python3 -m pytest tests/test_families_gpu.py -v
"""
from __future__ import annotations

import pytest
import torch

from bench.engine import SHAPES, hf_model_config
from course import parts
from course.testing import checks, equivalence, fixtures

STEPS = 24
CASES = {
    "qwen3": SHAPES["Qwen3-0.6B"],
    "qwen2": SHAPES["Qwen2.5-0.5B"],
    "mistral": dict(SHAPES["Mistral-7B"], num_hidden_layers=4),
    "llama": dict(vocab_size=32000, hidden_size=1536, intermediate_size=4096,
                  num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                  head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                  max_position_embeddings=8192, tie_word_embeddings=False),
}


@pytest.fixture(scope="module", params=list(CASES))
def models(request):
    """(family, transformers bf16, transformers float32 with the same bf16 weights, config)."""
    import transformers
    hf_config = hf_model_config(CASES[request.param])
    hf_config.eos_token_id = None
    model_class = getattr(transformers, fixtures.FAMILIES[hf_config.model_type][1])
    torch.manual_seed(0)
    with torch.device("cuda"):
        # bf16 as from_pretrained(dtype=bf16) builds it: the rotary inv_freq stays float32
        hf = model_class._from_config(hf_config, dtype=torch.bfloat16).eval()
        hf32 = model_class._from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():
        hf.model.embed_tokens.weight.normal_(0.0, 0.1)   # decisive logits (as in the Llama test)
        for name, p in hf.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0.0, 0.1)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1.0, 0.2)
    hf32.load_state_dict({k: v.float() for k, v in hf.state_dict().items()})
    config = parts.load("01", "config").load_config(hf_config.to_dict())
    assert config.model_type == request.param
    yield request.param, hf, hf32, config
    del hf, hf32
    torch.cuda.empty_cache()


def random_prompt(length: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=checks.generator("cpu")).tolist()


@pytest.mark.gpu
def test_hidden_states_and_logits(models, seed):
    family, hf, hf32, config = models
    ours = parts.load("08", "model").LlamaModel(config, hf.state_dict(), "cuda", torch.bfloat16)
    ids = random_prompt(200, config.vocab_size)
    print(equivalence.assert_bf16_forward_close(
        family, ours, hf, hf32, ids, hint="; layer 0 wrong: the family's bias or q/k norm "
                                          "(family_qkv_ of stage 08's model)"))


@pytest.mark.gpu
def test_engine_with_paging_and_cuda_graphs(models, seed):
    """Three prompts through the serving engine at once: prefill, then decode steps replayed
    from CUDA graphs over the paged cache; each prompt's tokens against transformers alone."""
    from solutions.engine.llm_engine import LLMEngine
    from solutions.engine.model_runner import EngineConfig
    SamplingParams = parts.load("11", "sampling_params").SamplingParams
    family, hf, hf32, config = models
    model = parts.load("08", "model").LlamaModel(config, hf.state_dict(), "cuda",
                                                 torch.bfloat16)
    engine = LLMEngine(model, None, (), EngineConfig(max_model_len=256, max_num_seqs=4,
                                                     gpu_memory_utilization=0.5))
    assert engine.runner.paged and engine.runner.decoder.use_graphs, (
        "the engine should run paged with CUDA graphs here")
    prompts = [random_prompt(n, config.vocab_size) for n in (16, 41, 7)]
    sp = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    got, requests = fixtures.drive(engine, {0: [(p, sp) for p in prompts]})
    for rid, (prompt, *_) in requests.items():
        theirs, their_logits = equivalence.hf_greedy(hf, prompt, STEPS)
        ids = prompt + theirs[:-1]
        noise = equivalence.rel_error(equivalence.hf_forward(hf, ids)[0][len(prompt) - 1:],
                                      equivalence.hf_forward(hf32, ids)[0][len(prompt) - 1:])
        print(equivalence.assert_greedy_agrees(got[rid], theirs, their_logits,
                                               equivalence.bf16_tolerance(noise),
                                               what=f"{family}: engine, prompt of "
                                                    f"{len(prompt)}"))
    del engine, model
