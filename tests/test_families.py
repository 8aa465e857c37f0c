"""Each model family the engine runs against transformers, on the CPU in float32.

Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm), each as tiny random
checkpoints whose heads are not hidden / heads wide (course.testing.fixtures.HEAD_DIM_APART:
GQA 2:1 with tied embeddings, GQA 3:1 with an lm_head of its own), saved in HF layout and
loaded the way a user's model is: `LLM(DIR)` (the serving engine: paged KV cache, RoPE in the
cache write, batches) and the CLI's `--model DIR`. Greedy tokens must equal transformers'
generate(do_sample=False) and the last-token logits agree to float32 rounding. The Qwen
biases and norm weights are random (not transformers' zeros and ones), so a bias or a norm
weight that is left out or put in the wrong place changes the tokens.
"""
from __future__ import annotations

import json

import pytest
import torch

from course import parts
from course.testing import checks, equivalence, fixtures
from solutions.engine.llm import LLM
from tests.test_engine_cli import copy_model, run_main, write_word_tokenizer

FAMILIES = list(fixtures.FAMILIES)
SHAPES = list(fixtures.HEAD_DIM_APART)
FP32_TOL = 1e-4   # relative to the largest |logit|
STEPS = 12


@pytest.fixture(scope="module", params=[(f, s) for f in FAMILIES for s in SHAPES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def saved(request, tmp_path_factory):
    """(directory, transformers model, engine) of one family and shape, with no eos id so
    that greedy runs last all STEPS."""
    family, shape = request.param
    directory = tmp_path_factory.mktemp(f"{family}-{shape}")
    hf = fixtures.save_tiny_llama(directory, shape, family=family, eos_token_id=None)
    return directory, hf, LLM(directory, device="cpu", load_tokenizer=False)


def prompts(vocab: int, seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    g = checks.generator("cpu", seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def test_config_reads_the_family(saved):
    directory, hf, llm = saved
    c, family = llm.config, hf.config.model_type
    assert (c.model_type, c.qkv_bias, c.qk_norm) == (family, family == "qwen2",
                                                     family == "qwen3")
    assert c.head_dim == hf.config.head_dim != c.hidden_size // c.num_attention_heads


def test_greedy_batch_equals_transformers(saved, seed):
    """Three prompts in one generate() call (one engine, batched and paged), each equal to
    transformers' greedy tokens for it alone."""
    _, hf, llm = saved
    batch = prompts(llm.config.vocab_size, seed, (9, 1, 23))
    results = llm.generate(batch, max_tokens=STEPS)
    for prompt, result in zip(batch, results):
        theirs, their_logits = equivalence.hf_greedy(hf, prompt, STEPS)
        print(equivalence.assert_greedy_agrees(result.output_ids, theirs, their_logits,
                                               FP32_TOL, what=f"{hf.config.model_type}"))
        assert len(result.output_ids) == STEPS


def test_packed_logits_equal_transformers(saved, seed):
    """Stage 08's forward over two packed prompts: each one's last-token logits."""
    _, hf, llm = saved
    batch = prompts(llm.config.vocab_size, seed, (17, 5))
    logits = equivalence.our_logits(llm.model, batch)
    for row, prompt in zip(logits, batch):
        expected = equivalence.hf_forward(hf, prompt)[0][-1]
        checks.assert_close(row, expected, what=f"{hf.config.model_type} last-token logits",
                            dtype=torch.float32,
                            atol=FP32_TOL * max(float(expected.abs().max()), 1.0), rtol=0.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_cli_runs_each_family(capsys, tmp_path, family):
    """`python3 -m solutions.engine --model DIR`: transformers' greedy tokens, as JSON."""
    src = tmp_path / "src"
    hf = fixtures.save_tiny_llama(src, "wide_heads_tied", family=family, eos_token_id=None)
    d = copy_model(src, tmp_path / "model")
    code, out, err = run_main(capsys, "--model", str(d), "--device", "cpu", "--json", "--raw",
                              "--max-tokens", "6", "What is the capital of France ?")
    assert code == 0, err
    result = json.loads(out)
    theirs, their_logits = equivalence.hf_greedy(hf, result["prompt_ids"], 6)
    print(equivalence.assert_greedy_agrees(result["output_ids"], theirs, their_logits,
                                           FP32_TOL, what=f"{family} through the CLI"))


# The no-tool branch of two ChatML templates, shortened: Qwen2.5-Instruct's writes a default
# system turn, Qwen3's none (transformers renders them: the oracle).
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + "
    "messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are "
    "Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role != 'system' %}{{- '<|im_start|>' + "
    "message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
QWEN3_TEMPLATE = (
    "{%- for message in messages %}{%- if message.role == 'user' or (message.role == 'system' "
    "and not loop.first) or loop.first %}{{- '<|im_start|>' + message.role + '\\n' + "
    "message.content + '<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
SYSTEM_WORDS = "You are Qwen , created by Alibaba Cloud . a helpful assistant".split()


@pytest.mark.parametrize("family,template", [("qwen2", QWEN25_TEMPLATE),
                                             ("qwen3", QWEN3_TEMPLATE)])
def test_chat_prompt_follows_the_models_template(tmp_path, family, template):
    """A text prompt is wrapped as the model's own template wraps it: Qwen2.5 with its
    default system turn, Qwen3 with none (not SmolLM2's, which a ChatML vocabulary alone would
    suggest)."""
    from transformers import PreTrainedTokenizerFast
    src = tmp_path / "src"
    fixtures.save_tiny_llama(src, "wide_heads_tied", family=family)
    d = copy_model(src, tmp_path / "model")
    write_word_tokenizer(d, {w: 100 + i for i, w in enumerate(dict.fromkeys(SYSTEM_WORDS))})
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    ours = LLM(d, device="cpu").encode_prompt("What is the capital of France ?")
    hf = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"),
                                 chat_template=template)
    theirs = hf.apply_chat_template([{"role": "user", "content": "What is the capital of "
                                                                "France ?"}],
                                    add_generation_prompt=True, tokenize=True)
    if hasattr(theirs, "keys"):   # transformers >= 5 returns a BatchEncoding
        theirs = theirs["input_ids"]
    assert ours == list(theirs), (ours, list(theirs))
    assert 0 not in ours, "a word of the prompt is unknown to the test tokenizer"


def test_a_family_tensor_the_config_does_not_declare(tmp_path):
    """A Qwen2 checkpoint under a config that says llama would run without its biases: the
    loader names the first bias instead."""
    fixtures.save_tiny_llama(tmp_path, "wide_heads_tied", family="qwen2")
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(
        {**raw, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    config = parts.load("01", "config").load_config(tmp_path)
    with pytest.raises(ValueError, match=r"self_attn\.k_proj\.bias.*'llama'"):
        parts.load("01", "checkpoint").load_checked(tmp_path, config)


def test_cuda_refuses_a_head_dim_its_kernels_lack():
    """LLM(DIR) checks it before the weights load, and it needs no GPU: one line naming
    head_dim (a head of 24 runs on the CPU, as the fixtures do; the CUDA kernels take 16,
    32, ..., 128)."""
    from solutions.engine.model_runner import check_head_dim
    check_head_dim(24, torch.device("cpu"))
    check_head_dim(128, torch.device("cuda"))
    with pytest.raises(ValueError, match="head_dim 24 is not supported on CUDA"):
        check_head_dim(24, torch.device("cuda"))
    with pytest.raises(ValueError, match="head_dim 256 is not supported on CUDA"):
        check_head_dim(256, torch.device("cuda"))


@pytest.mark.parametrize("name", ["Qwen3-0.6B", "Qwen2.5-0.5B", "Mistral-7B"])
def test_bench_shapes_build_each_family(monkeypatch, name):
    """`python3 -m bench --shape ...`'s models on the CPU (a dry run of the plumbing; the GPU
    measures): the shape's family on both sides, its sizes in our config, and our forward of
    a one-layer cut equal to transformers' to bf16 rounding."""
    from bench import engine
    monkeypatch.setattr(engine, "DEVICE", "cpu")
    shape = engine.SHAPES[engine.shape_named(name.lower())]
    config = parts.load("01", "config").load_config(engine.hf_model_config(shape).to_dict())
    assert config.model_type == shape["model_type"]
    assert all(getattr(config, k) == v for k, v in shape.items() if k in ("hidden_size",
               "head_dim", "num_attention_heads", "num_key_value_heads", "vocab_size"))
    small = dict(shape, num_hidden_layers=1, vocab_size=300, hidden_size=128,
                 intermediate_size=96)
    hf, ours, model_mod = engine.build_models(small, seed=0, max_positions=64)
    assert type(hf).__name__ == fixtures.FAMILIES[shape["model_type"]][1]
    prompt = list(range(3, 19))
    logits = equivalence.our_logits(ours, [prompt])
    equivalence.assert_rel_close(logits, equivalence.hf_forward(hf, prompt)[0][-1:], 2e-2,
                                 f"{name} cut to one layer, bf16 on the CPU")
