"""Tiny random checkpoints in Hugging Face layout, built with `transformers` (tests only).

They cover what trips engines up: grouped-query attention, Llama-3 rope scaling, tied and
untied embeddings, sizes that are not powers of two, head_dim apart from hidden / heads, and
sharded checkpoints; in each family the engine runs (FAMILIES: Llama, Mistral, Qwen2, Qwen3).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:   # transformers loads with a test's model; parts.load names a stage's types
    from transformers import PretrainedConfig, PreTrainedModel

    from course import parts
    from solutions.engine.llm_engine import LLMEngine, SamplingParams
    LlamaModel = parts.load("08", "model").LlamaModel

VARIANTS: dict[str, dict] = {
    # GQA 3:1 like SmolLM2, tied embeddings, unscaled rope
    "gqa_tied": dict(hidden_size=96, intermediate_size=160, num_attention_heads=6,
                     num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    # Llama-3 rope scaling, untied embeddings, GQA 4:1
    "llama3_untied": dict(hidden_size=128, intermediate_size=200, num_attention_heads=8,
                          num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                          rope_theta=500000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64}),
    # odd sizes, plain multi-head attention (GQA ratio 1)
    "odd_mha": dict(hidden_size=72, intermediate_size=100, num_attention_heads=3,
                    num_key_value_heads=3, head_dim=24, tie_word_embeddings=False),
}

# Shapes whose heads are not hidden / heads wide (as Qwen3's): wider heads with GQA 2:1 and
# tied embeddings, narrower ones with GQA 3:1 and an lm_head of its own.
HEAD_DIM_APART: dict[str, dict] = {
    "wide_heads_tied": dict(hidden_size=64, intermediate_size=136, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    "narrow_heads_untied": dict(hidden_size=120, intermediate_size=176, num_attention_heads=6,
                                num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
}

# model_type -> transformers' (config class, model class) of that family
FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def hf_config(variant: str, vocab_size: int = 211, num_layers: int = 2, family: str = "llama",
              **overrides: Any) -> PretrainedConfig:
    """A transformers config of `family` (a key of FAMILIES) for one of VARIANTS or
    HEAD_DIM_APART."""
    import transformers
    kw = dict(vocab_size=vocab_size, num_hidden_layers=num_layers, rms_norm_eps=1e-5,
              max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
              attention_bias=False, mlp_bias=False)
    kw.update({**VARIANTS, **HEAD_DIM_APART}[variant])
    kw.update(overrides)
    return getattr(transformers, FAMILIES[family][0])(**kw)


def tiny_llama(variant: str, seed: int = 0, family: str = "llama",
               **overrides: Any) -> PreTrainedModel:
    """A random transformers model of `family`, e.g. LlamaForCausalLM (float32, eval mode)."""
    import transformers
    torch.manual_seed(seed)
    config = hf_config(variant, family=family, **overrides)
    model = getattr(transformers, FAMILIES[family][1])(config).eval()
    # Default init gives near-uniform logits; widen the weights so greedy picks are decisive.
    # Qwen's biases and q/k norm weights start at 0 and 1: drawn too, so that a bias or a norm
    # weight used in the wrong place shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif name.endswith("_proj.bias"):
                p.normal_(0.0, 0.1)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1.0, 0.2)
    return model


def save_tiny_llama(directory: Path, variant: str, seed: int = 0, shard_size: str | None = None,
                    dtype: torch.dtype = torch.float32, family: str = "llama",
                    **overrides: Any) -> PreTrainedModel:
    """Save a tiny random model of `family` in HF layout (config.json + safetensors); return
    the model.

    shard_size="20KB" writes a sharded checkpoint with model.safetensors.index.json.
    """
    model = tiny_llama(variant, seed, family, **overrides).to(dtype)
    kwargs = {"safe_serialization": True}
    if shard_size:
        kwargs["max_shard_size"] = shard_size
    model.save_pretrained(directory, **kwargs)
    cfg = json.loads((Path(directory) / "config.json").read_text())
    assert cfg["model_type"] == family
    return model


def load_tiny(directory: Path, variant: str, family: str = "llama",
              **overrides: Any) -> SimpleNamespace:
    """A tiny random model saved in HF layout without an end-of-sequence id (so greedy runs
    last as long as asked), loaded back by stage 01's loader: variant, directory, hf (the
    transformers model), config and weights (by their Hugging Face names)."""
    from course import parts
    hf = save_tiny_llama(directory, variant, eos_token_id=None, family=family, **overrides)
    config = parts.load("01", "config").load_config(directory)
    weights = parts.load("01", "checkpoint").load_checked(directory, config)
    return SimpleNamespace(variant=variant, directory=directory, hf=hf, config=config,
                           weights=weights)


class Solo:
    """The serving tests' oracle (stages 11 and 13): each prompt's greedy tokens run alone by
    stage 09's generate_greedy, computed once for `max_new` tokens; a shorter max_tokens or
    an eos id cuts that list (greedy decoding does not look ahead)."""

    def __init__(self, model: LlamaModel, max_new: int):
        self.model, self.max_new, self.done = model, max_new, {}

    def __call__(self, prompt: Sequence[int], max_tokens: int,
                 eos: Collection[int] = ()) -> list[int]:
        assert max_tokens <= self.max_new
        key = tuple(prompt)
        if key not in self.done:
            from course import parts
            gen = parts.load("09", "kv_cache").generate_greedy
            self.done[key] = gen(self.model, list(prompt), self.max_new)
        out = self.done[key][:max_tokens]
        stop = next((i for i, t in enumerate(out) if t in eos), None)
        return out if stop is None else out[: stop + 1]


def drive(engine: LLMEngine,
          arrivals: dict[int, list[tuple[list[int], SamplingParams]]],
          after_step: Callable[[LLMEngine, int], object] | None = None
          ) -> tuple[dict[int, list[int]], dict[int, tuple]]:
    """Run a serving engine until nothing is left; arrivals: {step: [(prompt, SamplingParams)]}
    added before that step; after_step(engine, step) runs after every step (a test's
    invariants). Returns (new tokens by request id, (prompt, params, finish reason) by id)."""
    got, ids, step = {}, {}, 0
    while engine.has_unfinished() or any(k >= step for k in arrivals):
        for prompt, sp in arrivals.get(step, []):
            rid = engine.add_request(prompt, sp)
            ids[rid] = (prompt, sp)
            got[rid] = []
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished and out.request_id in ids:
                ids[out.request_id] = ids[out.request_id] + (out.finish_reason,)
        if after_step is not None:
            after_step(engine, step)
        step += 1
        assert step < 20_000, "the engine does not finish: a request is never scheduled?"
    return got, ids
