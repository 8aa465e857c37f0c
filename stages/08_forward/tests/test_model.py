"""Stage 08: the whole forward pass (model.py) against transformers on tiny random models.

The oracle is transformers' model of the same family holding the same weights
(course.testing.fixtures): Llamas with GQA and tied embeddings, Llama-3 rope scaling with
untied embeddings, and odd sizes with plain multi-head attention; a Qwen2 (q/k/v bias) and a
Qwen3 (per-head q/k norm) whose heads are not hidden / heads wide. On the CPU everything runs
in float32 and must agree to float32 rounding; on a GPU (bf16) within bf16 tolerance, measured
by the relative error of each layer's output (course.testing.equivalence).
"""
from __future__ import annotations


import pytest
import torch

from course import parts
from course.testing import checks, equivalence, fixtures

# (shape, family): every Llama variant, and one model of each family that changes the layer
CASES = [(v, "llama") for v in fixtures.VARIANTS] + [("narrow_heads_untied", "qwen2"),
                                                      ("wide_heads_tied", "qwen3")]
FP32_TOL = 1e-4    # relative to the largest |value|: float32 rounding through a few layers
BF16_TOL = 2e-2    # relative Frobenius error of each layer's output and of the logits
STEPS = 20


def model_mod():
    return parts.load("08", "model")


@pytest.fixture(scope="module", params=CASES,
                ids=lambda c: c[0] if c[1] == "llama" else f"{c[1]}_{c[0]}")
def tiny(request, tmp_path_factory):
    """A tiny random model saved in HF layout, loaded back by stage 01's loader."""
    variant, family = request.param
    tiny = fixtures.load_tiny(tmp_path_factory.mktemp(variant), variant, family=family)
    if family != "llama":
        tiny.variant = f"{family} {variant}"
    return tiny


def random_prompt(length: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=checks.generator("cpu")).tolist()


def assert_fp32_close(got: torch.Tensor, expected: torch.Tensor, what: str, hint: str) -> None:
    scale = float(expected.abs().max())
    checks.assert_close(got, expected, what=what, hint=hint, dtype=torch.float32,
                        atol=FP32_TOL * max(scale, 1.0), rtol=0.0)


LAYER_HINT = {
    0: "the first layer is already wrong: check the attention block (qkv split into q, k, v; "
       "RoPE on q and k only; the o projection) and the MLP block (gate first, up second); "
       "Qwen: self.family_qkv_(layer, qkv) right after the qkv projection, before the split",
    "later": "the first layers agree and this one does not: is each layer using its own "
             "weights, and does the residual stream carry over between layers?",
}


@pytest.mark.points(3)
def test_logits_match_transformers(tiny, seed):
    m = model_mod().LlamaModel(tiny.config, tiny.weights, "cpu", torch.float32)
    ids = random_prompt(13, tiny.config.vocab_size)
    logits = equivalence.our_logits(m, [ids])
    hf_logits, _ = equivalence.hf_forward(tiny.hf, ids)
    assert logits.dtype == torch.float32, f"logits must be float32, got {logits.dtype}"
    assert_fp32_close(logits, hf_logits[-1:], f"{tiny.variant}: logits of the last token",
                      hint="compare the hidden states layer by layer (the next test); if those "
                           "agree, the final norm or lm_head (tied: the embedding matrix) is "
                           "wrong, or the logits are not the LAST token's")


@pytest.mark.points(2)
def test_hidden_states_match_transformers(tiny, seed):
    m = model_mod().LlamaModel(tiny.config, tiny.weights, "cpu", torch.float32)
    ids = random_prompt(11, tiny.config.vocab_size)
    _, hidden = equivalence.our_logits(m, [ids], return_hidden=True)
    _, hf_hidden = equivalence.hf_forward(tiny.hf, ids)
    assert len(hidden) == len(hf_hidden), (f"return_hidden gave {len(hidden)} tensors, "
                                           f"expected one per layer ({len(hf_hidden)})")
    for i, (ours, theirs) in enumerate(zip(hidden, hf_hidden)):
        assert_fp32_close(ours, theirs, f"{tiny.variant}: residual stream after layer {i}",
                          hint=LAYER_HINT[0 if i == 0 else "later"])


@pytest.mark.points(3)
def test_packed_sequences(tiny, seed):
    """Three prompts in one forward: each must get the logits it gets alone."""
    m = model_mod().LlamaModel(tiny.config, tiny.weights, "cpu", torch.float32)
    prompts = [random_prompt(n, tiny.config.vocab_size) for n in (5, 1, 12)]
    logits = equivalence.our_logits(m, prompts)
    expected = torch.stack([equivalence.hf_forward(tiny.hf, p)[0][-1] for p in prompts])
    assert_fp32_close(logits, expected, f"{tiny.variant}: logits of 3 packed sequences",
                      hint="positions restart at 0 in each sequence; attention gets "
                           "the metadata; the logits are the rows meta.last_rows (each "
                           "sequence's last token)")


@pytest.mark.points(1)
def test_logits_of_every_row(tiny, seed):
    """compute_logits(hidden, None): the logits of every row, what a decode step asks for
    (each of its rows is a sequence's last token)."""
    M = model_mod()
    m = M.LlamaModel(tiny.config, tiny.weights, "cpu", torch.float32)
    ids = random_prompt(6, tiny.config.vocab_size)
    tokens, positions, meta = M.packed_inputs([ids], m.device)
    logits = m.compute_logits(m.forward(tokens, positions, meta), None)
    hf_logits, _ = equivalence.hf_forward(tiny.hf, ids)
    assert tuple(logits.shape) == tuple(hf_logits.shape), (
        f"rows=None must give one row of logits per token: {tuple(hf_logits.shape)}, got "
        f"{tuple(logits.shape)}")
    assert_fp32_close(logits, hf_logits, f"{tiny.variant}: logits of every row (rows=None)",
                      hint="with rows=None take every row of hidden as it is (no index_select)")


@pytest.mark.points(3)
def test_greedy_matches_generate(tiny, seed):
    M = model_mod()
    m = M.LlamaModel(tiny.config, tiny.weights, "cpu", torch.float32)
    prompt = random_prompt(7, tiny.config.vocab_size)
    ours = M.generate_greedy(m, prompt, STEPS)
    theirs, their_logits = equivalence.hf_greedy(tiny.hf, prompt, STEPS)
    assert len(theirs) == STEPS
    report = equivalence.assert_greedy_agrees(ours, theirs, their_logits, FP32_TOL,
                                              what=f"{tiny.variant}: greedy tokens")
    print(report)


def test_greedy_stops_at_eos(tiny, seed):
    """generate_greedy returns the end-of-sequence token it emits and stops there."""
    M = model_mod()
    m = M.LlamaModel(tiny.config, tiny.weights, "cpu", torch.float32)
    prompt = random_prompt(5, tiny.config.vocab_size)
    free, _ = equivalence.hf_greedy(tiny.hf, prompt, STEPS)
    eos = free[6]
    first = free.index(eos)
    theirs, their_logits = equivalence.hf_greedy(tiny.hf, prompt, STEPS, eos_ids=[eos])
    assert theirs == free[:first + 1]  # what transformers does with this eos
    ours = M.generate_greedy(m, prompt, STEPS, eos_ids=[eos])
    assert ours == theirs, (f"{tiny.variant}: with eos_ids=[{eos}] expected {theirs}, got "
                            f"{ours}: stop right after appending an eos id (and return it)")


@pytest.mark.gpu
@pytest.mark.points(6)
def test_bf16_on_gpu_matches_transformers(tiny, seed):
    """The same model in bf16 on the GPU (our kernels) vs transformers in bf16 on the GPU."""
    M = model_mod()
    # Loaded in bf16 as users load it. (hf.to(torch.bfloat16) would also round the rotary
    # inv_freq buffer to bf16, and transformers' own angles would drift with the position.)
    hf = type(tiny.hf).from_pretrained(tiny.directory, dtype=torch.bfloat16).to("cuda").eval()
    m = M.LlamaModel(tiny.config, tiny.weights, "cuda", torch.bfloat16)
    ids = random_prompt(29, tiny.config.vocab_size)
    logits, hidden = equivalence.our_logits(m, [ids], return_hidden=True)
    hf_logits, hf_hidden = equivalence.hf_forward(hf, ids)
    for i, (ours, theirs) in enumerate(zip(hidden, hf_hidden)):
        equivalence.assert_rel_close(ours, theirs, BF16_TOL,
                                     f"{tiny.variant} bf16: residual stream after layer {i}",
                                     hint=LAYER_HINT[0 if i == 0 else "later"])
    equivalence.assert_rel_close(logits, hf_logits[-1:], BF16_TOL, f"{tiny.variant} bf16: logits")

    prompts = [random_prompt(n, tiny.config.vocab_size) for n in (9, 1, 30)]
    logits = equivalence.our_logits(m, prompts)
    expected = torch.stack([equivalence.hf_forward(hf, p)[0][-1] for p in prompts])
    equivalence.assert_rel_close(logits, expected, BF16_TOL,
                                 f"{tiny.variant} bf16: logits of 3 packed sequences")

    prompt = random_prompt(7, tiny.config.vocab_size)
    ours = M.generate_greedy(m, prompt, 16)
    theirs, their_logits = equivalence.hf_greedy(hf, prompt, 16)
    print(equivalence.assert_greedy_agrees(ours, theirs, their_logits, BF16_TOL,
                                           what=f"{tiny.variant} bf16: greedy tokens"))
