"""Stage 01: config.json -> ModelConfig (config.py).

Configs come from two places: written by `transformers` itself (save_pretrained of tiny
random Llamas: the newer `rope_parameters` form), and written here by hand in the older
`rope_theta` + `rope_scaling` form, copied from real checkpoints (Llama-3.2-1B, SmolLM2-135M,
TinyLlama, Qwen3-0.6B, Qwen2.5-0.5B-Instruct, Mistral-7B-Instruct-v0.3). transformers' config
class of the family reading the same dict is the oracle where it applies.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from course import parts
from course.testing import fixtures


def cfg_mod():
    return parts.load("01", "config")


# Real config.json files of the older form (trimmed of keys the engine does not read).
LLAMA_32_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 8192, "max_position_embeddings": 131072,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
    "hidden_size": 576, "intermediate_size": 1536, "max_position_embeddings": 8192,
    "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30,
    "num_key_value_heads": 3, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 100000, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "vocab_size": 49152,
}
TINYLLAMA = {  # no rope_theta (transformers' default 10000.0), no model_type, untied
    "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 2048, "intermediate_size": 5632,
    "max_position_embeddings": 2048, "num_attention_heads": 32, "num_hidden_layers": 22,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
    "vocab_size": 32000,
}

QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
    "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
}
QWEN25_05B = {  # no head_dim (896 / 14 = 64); sliding_window set, but use_sliding_window off
    "architectures": ["Qwen2ForCausalLM"], "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 896, "intermediate_size": 4864,
    "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2",
    "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_sliding_window": False,
    "vocab_size": 151936,
}
MISTRAL_7B_V03 = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 32768,
}
FAMILY_CONFIGS = {"qwen3": (QWEN3_06B, "Qwen3Config"), "qwen2": (QWEN25_05B, "Qwen2Config"),
                  "mistral": (MISTRAL_7B_V03, "MistralConfig")}


def write_config(directory: Path, raw: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.json"
    path.write_text(json.dumps(raw, indent=2))
    return path


def hf_rope(raw: dict) -> dict:
    """transformers' normalized rope settings for a config dict (the oracle)."""
    from transformers import LlamaConfig
    return dict(LlamaConfig(**raw).rope_parameters)


def assert_rope_matches_hf(cfg, raw: dict) -> None:
    hf = hf_rope(raw)
    assert cfg.rope_theta == pytest.approx(float(hf["rope_theta"])), (
        f"rope_theta {cfg.rope_theta}, transformers reads {hf['rope_theta']}")
    assert isinstance(cfg.rope_theta, float), (
        "rope_theta must be a float (config.json may say 100000)")
    if hf["rope_type"] == "default":
        assert cfg.rope_scaling is None, (
            f"rope_type 'default' means no scaling: rope_scaling must be None, got "
            f"{cfg.rope_scaling}")
        return
    s = cfg.rope_scaling
    assert s is not None, f"this config has {hf['rope_type']} rope scaling, got rope_scaling=None"
    assert s.rope_type == hf["rope_type"]
    for key in ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"):
        assert getattr(s, key) == pytest.approx(hf[key]), (
            f"rope_scaling.{key} = {getattr(s, key)}, transformers reads {hf[key]}")


# --- configs written by transformers (rope_parameters form) ------------------------------

@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for variant in fixtures.VARIANTS:
        d = tmp_path_factory.mktemp(variant)
        fixtures.save_tiny_llama(d, variant)
        out[variant] = d
    return out


@pytest.mark.parametrize("variant", list(fixtures.VARIANTS))
def test_transformers_written_config(hf_dirs, variant):
    directory = hf_dirs[variant]
    raw = json.loads((directory / "config.json").read_text())
    hf = fixtures.hf_config(variant)
    cfg = cfg_mod().load_config(directory)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim",
                  "max_position_embeddings", "tie_word_embeddings", "bos_token_id"):
        assert getattr(cfg, field) == getattr(hf, field), (
            f"{variant}: {field} = {getattr(cfg, field)!r}, "
            f"config.json says {getattr(hf, field)!r}")
    assert cfg.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert cfg.eos_token_ids == (hf.eos_token_id,), (
        f"eos_token_id {hf.eos_token_id} (an int) must become the tuple ({hf.eos_token_id},)")
    assert cfg.dtype == "float32", f"dtype {cfg.dtype!r}: config.json says {raw.get('dtype')!r}"
    assert_rope_matches_hf(cfg, raw)


def test_directory_file_and_dict_agree(hf_dirs):
    directory = hf_dirs["llama3_untied"]
    m = cfg_mod()
    by_dir = m.load_config(directory)
    by_file = m.load_config(directory / "config.json")
    by_str = m.load_config(str(directory))
    by_dict = m.load_config(json.loads((directory / "config.json").read_text()))
    assert by_dir == by_file == by_str == by_dict, (
        "load_config must accept a model directory, a config.json path, and a dict alike")


def test_config_is_frozen(hf_dirs):
    cfg = cfg_mod().load_config(hf_dirs["gqa_tied"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 1  # type: ignore[misc]


# --- hand-written configs of the older form ----------------------------------------------

def test_llama_32_1b(tmp_path):
    cfg = cfg_mod().load_config(write_config(tmp_path / "llama", LLAMA_32_1B))
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (128256, 2048, 8192)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (16, 32, 8)
    assert cfg.head_dim == 64 and cfg.max_position_embeddings == 131072
    assert cfg.tie_word_embeddings is True
    assert cfg.bos_token_id == 128000
    assert cfg.eos_token_ids == (128001, 128008, 128009), (
        f"Llama 3 lists three eos ids; got {cfg.eos_token_ids}")
    assert cfg.dtype == "bfloat16", f"torch_dtype 'bfloat16' (older key), got {cfg.dtype!r}"
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 32.0
    assert cfg.rope_scaling.original_max_position_embeddings == 8192
    assert isinstance(cfg.rope_scaling.original_max_position_embeddings, int)
    assert_rope_matches_hf(cfg, LLAMA_32_1B)


def test_smollm2_head_dim_default(tmp_path):
    cfg = cfg_mod().load_config(write_config(tmp_path / "smollm2", SMOLLM2_135M))
    assert cfg.head_dim == 576 // 9, (
        f"no head_dim in config.json: it is hidden_size // num_attention_heads = 64, "
        f"got {cfg.head_dim}")
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (9, 3)
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    assert cfg.tie_word_embeddings is True
    assert cfg.rope_scaling is None and cfg.rope_theta == 100000.0
    assert_rope_matches_hf(cfg, SMOLLM2_135M)


def test_tinyllama_defaults(tmp_path):
    cfg = cfg_mod().load_config(write_config(tmp_path / "tinyllama", TINYLLAMA))
    assert cfg.tie_word_embeddings is False
    assert cfg.rope_theta == 10000.0, (
        f"no rope_theta in config.json: transformers uses 10000.0, got {cfg.rope_theta}")
    assert cfg.rope_scaling is None
    assert cfg.head_dim == 64 and cfg.num_key_value_heads == 4
    assert cfg.dtype == "float32", f"no dtype key: the default is 'float32', got {cfg.dtype!r}"
    assert_rope_matches_hf(cfg, TINYLLAMA)


def test_old_type_key_for_rope_scaling(tmp_path):
    raw = dict(LLAMA_32_1B, rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192})
    cfg = cfg_mod().load_config(write_config(tmp_path / "type", raw))
    assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "llama3", (
        "older files name the scaling kind under 'type' instead of 'rope_type'")
    assert cfg.rope_scaling.factor == 8.0
    assert_rope_matches_hf(cfg, raw)


def test_new_form_written_by_hand(tmp_path):
    raw = {k: v for k, v in LLAMA_32_1B.items() if k not in ("rope_theta", "rope_scaling")}
    raw["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 250000.0, "factor": 16.0,
                              "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                              "original_max_position_embeddings": 4096}
    raw["dtype"] = raw.pop("torch_dtype")
    cfg = cfg_mod().load_config(write_config(tmp_path / "new", raw))
    assert cfg.rope_theta == 250000.0, "in the new form rope_theta lives in rope_parameters"
    s = cfg.rope_scaling
    assert s is not None and (s.factor, s.low_freq_factor, s.high_freq_factor) == (16.0, 2.0, 8.0)
    assert s.original_max_position_embeddings == 4096
    assert cfg.dtype == "bfloat16", f"the newer key is 'dtype', got {cfg.dtype!r}"


@pytest.mark.parametrize("eos, expected", [(7, (7,)), ([5, 6], (5, 6)), (None, ())],
                         ids=["int", "list", "null"])
def test_eos_forms(tmp_path, eos, expected):
    raw = dict(SMOLLM2_135M, eos_token_id=eos)
    cfg = cfg_mod().load_config(raw)
    assert cfg.eos_token_ids == expected, (
        f"eos_token_id {eos!r} -> {expected}, got {cfg.eos_token_ids}")
    assert isinstance(cfg.eos_token_ids, tuple)


# --- errors ------------------------------------------------------------------------------

def expect_config_error(raw: dict, tmp_path: Path, *words: str, hint: str) -> str:
    path = write_config(tmp_path / "bad", raw)
    try:
        cfg_mod().load_config(path)
    except NotImplementedError:
        raise
    except cfg_mod().ConfigError as e:
        msg = str(e)
        assert str(path) in msg, f"the error must name the file {path}; it says: {msg!r}"
        for w in words:
            assert w in msg, f"the error must mention {w!r}; it says: {msg!r}"
        return msg
    except Exception as e:
        raise AssertionError(f"expected ConfigError, got {type(e).__name__}: {e}. Likely "
                             f"cause: {hint}") from e
    raise AssertionError(f"this config must be refused, but it was accepted. Likely cause: {hint}")


@pytest.mark.parametrize("key", ["vocab_size", "hidden_size", "intermediate_size",
                                 "num_hidden_layers", "num_attention_heads", "rms_norm_eps",
                                 "max_position_embeddings"])
def test_missing_required_key(tmp_path, key):
    raw = {k: v for k, v in SMOLLM2_135M.items() if k != key}
    expect_config_error(raw, tmp_path, key,
                        hint="check every REQUIRED key before reading it (a bare KeyError "
                             "does not say which file)")


@pytest.mark.parametrize("model_type", ["gpt2", "qwen3_moe", "mixtral"])
def test_other_architecture(tmp_path, model_type):
    expect_config_error(dict(SMOLLM2_135M, model_type=model_type), tmp_path, model_type,
                        hint="accept the model_types of FAMILIES (or no model_type), nothing "
                             "else")


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_family_configs(tmp_path, family):
    """Real config.json files of the other families, read as transformers reads them, and the
    family's switches: qkv_bias for Qwen2, qk_norm for Qwen3, neither for Mistral."""
    import transformers
    raw, hf_class = FAMILY_CONFIGS[family]
    cfg = cfg_mod().load_config(write_config(tmp_path / family, raw))
    hf = getattr(transformers, hf_class)(**raw)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                  "tie_word_embeddings", "bos_token_id"):
        assert getattr(cfg, field) == getattr(hf, field), (
            f"{family}: {field} = {getattr(cfg, field)!r}, transformers reads "
            f"{getattr(hf, field)!r}")
    # as transformers' attention takes it (Qwen2Config has no head_dim of its own)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert cfg.head_dim == head_dim, f"{family}: head_dim {cfg.head_dim}, expected {head_dim}"
    assert cfg.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert cfg.rope_theta == pytest.approx(hf.rope_parameters["rope_theta"])
    assert cfg.rope_scaling is None
    assert (cfg.model_type, cfg.qkv_bias, cfg.qk_norm) == (
        family, family == "qwen2", family == "qwen3"), (
        f"{family}: model_type, qkv_bias, qk_norm = {cfg.model_type!r}, {cfg.qkv_bias}, "
        f"{cfg.qk_norm}. Likely cause: qkv_bias is model_type == 'qwen2', qk_norm is "
        "model_type == 'qwen3'")


@pytest.mark.parametrize("raw,words", [
    (dict(MISTRAL_7B_V03, sliding_window=4096), ("sliding_window", "4096")),
    (dict(QWEN25_05B, use_sliding_window=True), ("use_sliding_window",)),
    (dict(QWEN3_06B, layer_types=["full_attention", "sliding_attention"]), ("layer_types",)),
    (dict(QWEN3_06B, attention_bias=True), ("attention_bias",)),
    (dict(LLAMA_32_1B, mlp_bias=True), ("mlp_bias",)),
    (dict(QWEN3_06B, num_experts=128), ("num_experts",)),
    (dict(MISTRAL_7B_V03, hidden_act="gelu"), ("hidden_act", "gelu")),
    (dict(QWEN3_06B, architectures=["Qwen3ForSequenceClassification"]), ("architectures",)),
    (dict(LLAMA_32_1B, partial_rotary_factor=0.5), ("partial_rotary_factor",)),
], ids=["mistral-window", "qwen-window", "sliding-layers", "o-bias", "mlp-bias", "experts",
        "gelu", "classifier", "partial-rope"])
def test_what_a_family_needs_is_refused(tmp_path, raw, words):
    """Each would load and compute another model than the checkpoint's: one line naming the
    field (refuse_unsupported, given)."""
    expect_config_error(raw, tmp_path, *words, hint="see refuse_unsupported in config.py")


def test_a_window_that_covers_the_context_is_harmless(tmp_path):
    """Some Mistral configs set sliding_window to max_position_embeddings: no key is ever
    outside it, so the model is the one without a window."""
    raw = dict(MISTRAL_7B_V03, sliding_window=MISTRAL_7B_V03["max_position_embeddings"])
    assert cfg_mod().load_config(write_config(tmp_path / "w", raw)).model_type == "mistral"


@pytest.mark.parametrize("form", ["rope_scaling", "rope_parameters"])
def test_unsupported_rope_type(tmp_path, form):
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    raw = dict(SMOLLM2_135M)
    if form == "rope_parameters":
        del raw["rope_theta"], raw["rope_scaling"]
        raw["rope_parameters"] = dict(yarn, rope_theta=10000.0)
    else:
        raw["rope_scaling"] = yarn
    expect_config_error(raw, tmp_path, "yarn",
                        hint="only 'default' and 'llama3' are implemented; refuse the rest "
                             "instead of silently computing wrong positions")


def test_llama3_scaling_missing_a_field(tmp_path):
    scaling = {k: v for k, v in LLAMA_32_1B["rope_scaling"].items() if k != "low_freq_factor"}
    expect_config_error(dict(LLAMA_32_1B, rope_scaling=scaling), tmp_path, "low_freq_factor",
                        hint="llama3 scaling needs factor, low_freq_factor, high_freq_factor "
                             "and original_max_position_embeddings")


def test_heads_not_divisible_by_kv_heads(tmp_path):
    raw = dict(SMOLLM2_135M, num_attention_heads=9, num_key_value_heads=4)
    expect_config_error(raw, tmp_path, "9", "4",
                        hint="grouped-query attention shares each KV head among "
                             "num_attention_heads // num_key_value_heads query heads: it must "
                             "divide evenly")
