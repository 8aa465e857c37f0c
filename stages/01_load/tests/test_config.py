"""Stage 01: config.json -> ModelConfig (config.py).

Configs come from two places: written by `transformers` itself (save_pretrained of tiny
random Llamas: the newer `rope_parameters` form), and written here by hand in the older
`rope_theta` + `rope_scaling` form, copied from real checkpoints (Llama-3.2-1B, SmolLM2-135M,
TinyLlama). transformers' LlamaConfig reading the same dict is the oracle where it applies.
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


def test_other_architecture(tmp_path):
    expect_config_error(dict(SMOLLM2_135M, model_type="mistral"), tmp_path, "mistral",
                        hint="accept model_type 'llama' or no model_type, nothing else")


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
