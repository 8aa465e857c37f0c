"""config.json -> ModelConfig: every size the engine allocates comes from here, never from a
constant, so any checkpoint of the supported families in Hugging Face layout loads: Llama
(Llama 3.x, SmolLM2, TinyLlama), Mistral, Qwen2 / Qwen2.5 and Qwen3.

The four families are one decoder with a few switches, read from config.json:

    model_type  architectures         what differs from Llama
    llama       LlamaForCausalLM      -
    mistral     MistralForCausalLM    nothing (a sliding window, if set, must cover the context)
    qwen2       Qwen2ForCausalLM      q_proj, k_proj and v_proj have a bias (qkv_bias)
    qwen3       Qwen3ForCausalLM      each q and k head is RMS-normalized over head_dim before
                                      RoPE (qk_norm); head_dim is set apart from hidden / heads

What a family needs that the engine lacks (a sliding window, an o_proj or MLP bias, another
activation, experts) is refused in one line naming the field (`refuse_unsupported`).

Two spellings of rotary-embedding settings exist in the wild:

    older (transformers < 5):  "rope_theta": 500000.0,
                               "rope_scaling": {"rope_type": "llama3", "factor": 32.0, ...}
                               (or "type": "llama3"; or "rope_scaling": null)
    newer (transformers >= 5): "rope_parameters": {"rope_theta": 500000.0,
                                                   "rope_type": "llama3", "factor": 32.0, ...}
                               ("rope_type": "default" means no scaling)

Both become ModelConfig.rope_theta + ModelConfig.rope_scaling (None or a RopeScaling).
Graded by stages/01_load/tests/test_config.py (`nox -s grade -- 01`).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path


class ConfigError(ValueError):
    """A config.json this engine cannot run: a missing key, another architecture, ..."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency scaling of the rotary embedding (stage 05 uses it)."""
    rope_type: str                           # "llama3", the only kind supported
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """The model config.json describes; the last three fields are the family's switches."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"                   # "bfloat16", "float16", "float32"
    model_type: str = "llama"                # a key of FAMILIES
    qkv_bias: bool = False                   # q_proj, k_proj, v_proj have a bias (Qwen2)
    qk_norm: bool = False                    # RMSNorm of every q and k head before RoPE (Qwen3)


# model_type -> the one architecture (transformers' class) of that family this engine runs
FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "rms_norm_eps", "max_position_embeddings")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings")


def parse_rope(raw: dict, where: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, rope_scaling) from either spelling (see the module docstring).

    - "rope_parameters" present: theta is its "rope_theta"; the scaling kind is its
      "rope_type" ("default" -> None); the llama3 numbers are in the same dict.
    - otherwise: theta is the top-level "rope_theta" (10000.0 when absent, as in
      transformers); "rope_scaling" is null/absent (-> None) or a dict whose kind is under
      "rope_type" or, in older files, "type".
    - kind "llama3" needs the four LLAMA3_KEYS; any other kind -> ConfigError.
    Raise ConfigError(f"{where}: ...") so the message names the file.
    """
    # TODO stage 01: find the rope dict, read theta and the kind, build RopeScaling (about 24 lines)
    raise NotImplementedError("TODO stage 01: find the rope dict, read theta and the kind, build RopeScaling (about 24 lines)")


def parse_config(raw: dict, where: str = "<dict>") -> ModelConfig:
    """Validate a config.json dict and build a ModelConfig; `where` names it in errors.

    - model_type must be a key of FAMILIES ("llama" when absent); else ConfigError.
    - qkv_bias is true for "qwen2" (its q/k/v projections always have a bias), qk_norm for
      "qwen3" (its q_norm / k_norm weights); both false for the other families.
    - every key in REQUIRED must be present; else ConfigError naming the key.
    - num_key_value_heads defaults to num_attention_heads (pre-GQA configs lack it), and
      num_attention_heads must be a multiple of it: each KV head serves a group of heads.
    - head_dim defaults to hidden_size // num_attention_heads (absent or null).
    - eos_token_id may be an int, a list (Llama 3 stops on several) or absent/null.
    - the dtype is under "torch_dtype" (older) or "dtype" (newer); default "float32".
    """
    # TODO stage 01: check, apply the defaults, call parse_rope, return ModelConfig(...) with the family's switches (about 34 lines)
    raise NotImplementedError("TODO stage 01: check, apply the defaults, call parse_rope, return ModelConfig(...) with the family's switches (about 34 lines)")


EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")


def refuse_unsupported(raw: dict, config: ModelConfig, where: str) -> None:
    """ConfigError, naming the field, for what config.json asks of the family that the one
    model does not do: it would load and compute something else than the checkpoint's model."""
    arch = raw.get("architectures")
    expected = FAMILIES[config.model_type]
    if arch is not None and (not isinstance(arch, list) or any(a != expected for a in arch)):
        raise ConfigError(f"{where}: architectures {arch!r} is not supported (model_type "
                          f"{config.model_type!r} runs {expected!r})")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act {act!r} is not supported (the MLP is "
                          "silu(gate) * up)")
    # Qwen2 biases q, k and v whatever attention_bias says; elsewhere it also biases o_proj
    if raw.get("attention_bias") and config.model_type != "qwen2":
        raise ConfigError(f"{where}: attention_bias true (a bias on q, k, v and o_proj) is not "
                          "supported")
    if raw.get("mlp_bias"):
        raise ConfigError(f"{where}: mlp_bias true is not supported (the MLP has no bias)")
    experts = [k for k in EXPERTS if raw.get(k)]
    if experts:
        raise ConfigError(f"{where}: {experts[0]}={raw[experts[0]]!r}: mixture-of-experts "
                          "layers are not supported")
    rotary = raw.get("partial_rotary_factor", 1.0)
    if rotary != 1.0:
        raise ConfigError(f"{where}: partial_rotary_factor {rotary!r} is not supported (RoPE "
                          "rotates the whole head)")
    # A window that covers every position the model has never masks a key: harmless (some
    # Mistral configs set it to max_position_embeddings); a shorter one would.
    window = raw.get("sliding_window")
    if (config.model_type == "mistral" and window is not None
            and window < config.max_position_embeddings):
        raise ConfigError(f"{where}: sliding_window {window!r} is shorter than "
                          f"max_position_embeddings {config.max_position_embeddings}: "
                          "sliding-window attention is not supported")
    if raw.get("use_sliding_window"):   # Qwen's switch; its sliding_window alone is unused
        raise ConfigError(f"{where}: use_sliding_window true: sliding-window attention is not "
                          "supported")
    layer_types = raw.get("layer_types") or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise ConfigError(f"{where}: layer_types holds {other}: only full_attention layers "
                          "are supported")


SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")


def checked_parse(raw: dict, where: str) -> ModelConfig:
    """parse_config, with the numbers it takes on trust checked around it: a size of 0 would
    divide by zero in it (or allocate nothing and fail far away), and a NaN rms_norm_eps or a
    negative rope_theta would load fine and make every reply noise."""
    # bool is an int to Python, and int(576.5) would quietly be 576
    bad = [f"{k}={raw[k]!r}" for k in SIZES if raw.get(k) is not None
           and (type(raw[k]) is not int or raw[k] <= 0)]
    if bad:
        raise ConfigError(f"{where}: {', '.join(bad)}: sizes must be positive integers")
    tied = raw.get("tie_word_embeddings")
    if tied is not None and type(tied) is not bool:   # bool("no") is True
        raise ConfigError(f"{where}: tie_word_embeddings={tied!r} must be true or false")
    params, scaling = raw.get("rope_parameters"), raw.get("rope_scaling")
    if isinstance(params, dict) and isinstance(scaling, dict):
        # parse_rope reads rope_parameters; transformers may take rope_scaling: two rotations
        same = {("rope_type" if k == "type" else k): v for k, v in scaling.items()}
        if any(params.get(k, "default" if k == "rope_type" else None) != v
               for k, v in same.items()):
            raise ConfigError(f"{where}: rope_parameters {params} and rope_scaling {scaling} "
                              "disagree: keep one of them")
    config = parse_config(raw, where)
    refuse_unsupported(raw, config, where)
    if not 0 <= config.rms_norm_eps < math.inf:    # False for NaN
        raise ConfigError(f"{where}: rms_norm_eps={config.rms_norm_eps} must be a finite "
                          "number >= 0")
    if not 0 < config.rope_theta < math.inf:
        raise ConfigError(f"{where}: rope_theta={config.rope_theta} must be a finite number > 0")
    r = config.rope_scaling
    # stage 05 divides by factor, low_freq_factor and their difference: 0 or NaN there gives
    # a table of NaN, and every reply is token 0
    if r is not None and not (0 < r.factor < math.inf and 0 < r.low_freq_factor
                              < r.high_freq_factor < math.inf
                              and r.original_max_position_embeddings > 0):
        raise ConfigError(
            f"{where}: llama3 rope scaling factor={r.factor}, low_freq_factor="
            f"{r.low_freq_factor}, high_freq_factor={r.high_freq_factor}, "
            f"original_max_position_embeddings={r.original_max_position_embeddings}: it needs "
            "finite factors with factor > 0 and 0 < low_freq_factor < high_freq_factor, and a "
            "positive original_max_position_embeddings")
    return config


def load_config(source: str | os.PathLike | dict) -> ModelConfig:
    """A ModelConfig from a model directory, a config.json path, or an already-parsed dict."""
    if isinstance(source, dict):
        return checked_parse(source, "<dict>")
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no such file (expected a model directory or config.json)")
    try:
        raw = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    try:
        return checked_parse(raw, str(path))
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        # a value of the wrong type ("hidden_size": "abc"): int() alone would not name the file
        raise ConfigError(f"{path}: a value has the wrong type ({e})") from None
