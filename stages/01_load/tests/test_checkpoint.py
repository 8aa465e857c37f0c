"""Stage 01: load and check a whole checkpoint (checkpoint.py).

Tiny random Llamas, and a Qwen2 (q/k/v biases) and a Qwen3 (q/k norms) with heads apart from
hidden / heads, are saved by `transformers` (one file, and sharded with an index); the
loaded tensors must equal the transformers model's state_dict() bit for bit. Broken
checkpoints (a tensor missing, a wrong shape, a shard missing) must be refused with an error
that names the tensor and the file.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file as library_load_file
from safetensors.torch import save_file

from course import parts
from course.testing import checks, fixtures


def ckpt():
    return parts.load("01", "checkpoint")


def load_config(directory: Path):
    return parts.load("01", "config").load_config(directory)


CASES = {
    # name: (variant, shard_size, dtype, family)
    "gqa_tied": ("gqa_tied", None, torch.float32, "llama"),
    "llama3_untied": ("llama3_untied", None, torch.float32, "llama"),
    "odd_mha_bf16": ("odd_mha", None, torch.bfloat16, "llama"),
    "llama3_untied_sharded": ("llama3_untied", "50KB", torch.float32, "llama"),
    "gqa_tied_sharded_bf16": ("gqa_tied", "50KB", torch.bfloat16, "llama"),
    "qwen2_wide_heads": ("wide_heads_tied", None, torch.float32, "qwen2"),
    "qwen3_narrow_heads_bf16": ("narrow_heads_untied", None, torch.bfloat16, "qwen3"),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """Each case saved once: (directory, the transformers model's state_dict)."""
    out = {}
    for name, (variant, shard_size, dtype, family) in CASES.items():
        d = tmp_path_factory.mktemp(name)
        model = fixtures.save_tiny_llama(d, variant, shard_size=shard_size, dtype=dtype,
                                         family=family)
        out[name] = (d, {k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("case", list(CASES))
def test_loads_what_transformers_saved(saved, case):
    directory, state = saved[case]
    if CASES[case][1]:
        assert (directory / "model.safetensors.index.json").exists()
        assert len(list(directory.glob("model-*.safetensors"))) > 1, "fixture: expected shards"
    weights = ckpt().load_weights(directory, load_config(directory))
    missing, extra = sorted(set(state) - set(weights)), sorted(set(weights) - set(state))
    assert not missing and not extra, (
        f"tensor names differ from transformers' state_dict: missing {missing[:5]}, "
        f"unexpected {extra[:5]}")
    for name, expected in state.items():
        got = weights[name]
        assert got.dtype == expected.dtype, (
            f"{name}: dtype {got.dtype}, the checkpoint stores {expected.dtype} (load tensors "
            "as stored; converting is the engine's choice, later)")
        assert tuple(got.shape) == tuple(expected.shape), f"{name}: shape {tuple(got.shape)}"
        checks.assert_equal(bits(got), bits(expected), what=f"{name} bytes",
                            hint="a tensor read from the wrong file or at the wrong offset")


@pytest.mark.parametrize("case", ["gqa_tied", "gqa_tied_sharded_bf16"])
def test_tied_lm_head_is_the_embedding(saved, case):
    directory, _ = saved[case]
    weights = ckpt().load_weights(directory, load_config(directory))
    assert "lm_head.weight" in weights, "tied embeddings: lm_head.weight is embed_tokens.weight"
    lm_head, embed = weights["lm_head.weight"], weights["model.embed_tokens.weight"]
    assert lm_head.data_ptr() == embed.data_ptr(), (
        "tied embeddings: lm_head.weight must be the embed_tokens tensor itself, not a copy")


@pytest.mark.parametrize("case", ["gqa_tied", "llama3_untied", "odd_mha_bf16",
                                  "qwen2_wide_heads", "qwen3_narrow_heads_bf16"])
def test_expected_shapes(saved, case):
    directory, state = saved[case]
    config = load_config(directory)
    got = {k: tuple(v) for k, v in ckpt().expected_shapes(config).items()}
    expected = {k: tuple(v.shape) for k, v in state.items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    assert not missing and not extra, (
        f"expected_shapes: missing {missing[:5]}, unexpected {extra[:5]} "
        "(lm_head.weight belongs in the table only when embeddings are not tied)")
    wrong = {k: (got[k], v) for k, v in expected.items() if got[k] != v}
    assert not wrong, "expected_shapes: wrong shapes (got, transformers): " + ", ".join(
        f"{k}: {g} vs {e}" for k, (g, e) in list(wrong.items())[:5]) + (
        ". Linear weights are [out_features, in_features]; k/v_proj have "
        "num_key_value_heads * head_dim rows; with qkv_bias (Qwen2) q/k/v_proj have a .bias "
        "[rows], with qk_norm (Qwen3) self_attn has q_norm.weight and k_norm.weight [head_dim]")


# --- broken checkpoints ------------------------------------------------------------------

def expect_checkpoint_error(directory: Path, config, *words: str, hint: str) -> str:
    m = ckpt()
    try:
        m.load_weights(directory, config)
    except NotImplementedError:
        raise
    except parts.load("01", "safetensors").CheckpointError as e:
        msg = str(e)
        for w in words:
            assert w in msg, f"the error must mention {w!r}; it says: {msg!r}"
        return msg
    except Exception as e:
        raise AssertionError(f"expected a CheckpointError mentioning {', '.join(words)}, got "
                             f"{type(e).__name__}: {e}. Likely cause: {hint}") from e
    raise AssertionError(f"this checkpoint is broken but was accepted. Likely cause: {hint}")


def copy_case(saved, case: str, dst: Path) -> Path:
    shutil.copytree(saved[case][0], dst)
    return dst


def rewrite_single(directory: Path, edit) -> None:
    path = directory / "model.safetensors"
    tensors = {k: v.clone() for k, v in library_load_file(str(path)).items()}
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_missing_tensor(saved, tmp_path):
    d = copy_case(saved, "llama3_untied", tmp_path / "ckpt")
    name = "model.layers.1.mlp.up_proj.weight"
    rewrite_single(d, lambda t: t.pop(name))
    expect_checkpoint_error(d, load_config(d), name, "model.safetensors",
                            hint="check every name of expected_shapes(config) is in the files")


@pytest.mark.parametrize("case,name", [
    ("qwen2_wide_heads", "model.layers.0.self_attn.v_proj.bias"),
    ("qwen3_narrow_heads_bf16", "model.layers.1.self_attn.k_norm.weight")])
def test_missing_family_tensor(saved, tmp_path, case, name):
    d = copy_case(saved, case, tmp_path / "ckpt")
    rewrite_single(d, lambda t: t.pop(name))
    expect_checkpoint_error(d, load_config(d), name, "model.safetensors",
                            hint="config.qkv_bias (Qwen2) adds q/k/v_proj.bias to each layer, "
                                 "config.qk_norm (Qwen3) self_attn.q_norm.weight and "
                                 "k_norm.weight")


def test_untied_without_lm_head(saved, tmp_path):
    d = copy_case(saved, "llama3_untied", tmp_path / "ckpt")
    rewrite_single(d, lambda t: t.pop("lm_head.weight"))
    expect_checkpoint_error(d, load_config(d), "lm_head.weight", "model.safetensors",
                            hint="tie_word_embeddings is false: lm_head.weight must be present")


def test_config_with_more_layers_than_the_checkpoint(saved, tmp_path):
    d = saved["gqa_tied"][0]
    raw = json.loads((d / "config.json").read_text())
    config = parts.load("01", "config").load_config(dict(raw, num_hidden_layers=3))
    expect_checkpoint_error(d, config, "model.layers.2.", "model.safetensors",
                            hint="the layers come from config.num_hidden_layers")


def test_wrong_shape(saved, tmp_path):
    d = copy_case(saved, "llama3_untied", tmp_path / "ckpt")
    name = "model.layers.0.self_attn.k_proj.weight"

    def transpose(t):
        t[name] = t[name].t().contiguous()
    rewrite_single(d, transpose)
    config = load_config(d)
    kv, h = config.num_key_value_heads * config.head_dim, config.hidden_size
    msg = expect_checkpoint_error(d, config, name, "model.safetensors",
                                  hint="compare each tensor's shape with expected_shapes")
    assert str((h, kv)) in msg and str((kv, h)) in msg, (
        f"say which shape was found and which was expected, {(h, kv)} vs {(kv, h)}: {msg!r}")


def test_missing_shard(saved, tmp_path):
    d = copy_case(saved, "llama3_untied_sharded", tmp_path / "ckpt")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.layers.1.self_attn.o_proj.weight"]
    (d / shard).unlink()
    expect_checkpoint_error(d, load_config(d), shard, "model.safetensors.index.json",
                            hint="check that every shard the index names exists, and say which "
                                 "one is missing")


def test_index_points_to_the_wrong_shard(saved, tmp_path):
    d = copy_case(saved, "llama3_untied_sharded", tmp_path / "ckpt")
    path = d / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    name = "model.layers.0.mlp.down_proj.weight"
    wrong = index["weight_map"]["model.embed_tokens.weight"]
    assert wrong != index["weight_map"][name]
    index["weight_map"][name] = wrong
    path.write_text(json.dumps(index))
    expect_checkpoint_error(d, load_config(d), name, wrong,
                            hint="the tensor is not in the shard the index names")


@pytest.mark.parametrize("weight_map,words", [
    ([1, 2], ["weight_map", "list"]),
    ({"model.embed_tokens.weight": 5}, ["model.embed_tokens.weight", "5"]),
], ids=["a-list", "a-number"])
def test_index_with_a_malformed_weight_map(saved, tmp_path, weight_map, words):
    d = copy_case(saved, "llama3_untied_sharded", tmp_path / "ckpt")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    expect_checkpoint_error(d, load_config(d), "model.safetensors.index.json", *words,
                            hint="read the index with read_weight_map(index)")


@pytest.mark.parametrize("escape", ["../outside.safetensors", "absolute"])
def test_index_naming_a_file_outside_the_directory(saved, tmp_path, escape):
    """The shard exists, outside the model directory: it must be refused, not read."""
    d = copy_case(saved, "llama3_untied_sharded", tmp_path / "ckpt")
    path = d / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    name = "model.embed_tokens.weight"
    outside = tmp_path / "outside.safetensors"
    shutil.copy(d / index["weight_map"][name], outside)
    entry = str(outside) if escape == "absolute" else escape
    index["weight_map"][name] = entry
    path.write_text(json.dumps(index))
    expect_checkpoint_error(d, load_config(d), "model.safetensors.index.json", entry,
                            hint="a shard is a file name inside the model directory: read the "
                                 "index with read_weight_map(index)")


def test_not_a_checkpoint_directory(saved, tmp_path):
    d = tmp_path / "nothing_here"
    d.mkdir()
    shutil.copy(saved["gqa_tied"][0] / "config.json", d / "config.json")
    expect_checkpoint_error(d, load_config(d), "nothing_here",
                            hint="neither model.safetensors nor model.safetensors.index.json: "
                                 "say so, naming the directory")
