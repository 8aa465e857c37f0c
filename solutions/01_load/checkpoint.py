"""Load a checkpoint (Llama, Mistral, Qwen2, Qwen3) in Hugging Face layout and check that it
is the model config.json describes, tensor by tensor, before any kernel touches it.

A checkpoint is either one file, model.safetensors, or shards with an index:

    model.safetensors.index.json   {"metadata": {...},
                                    "weight_map": {"model.embed_tokens.weight":
                                                       "model-00001-of-00002.safetensors",
                                                   ...}}
    model-00001-of-00002.safetensors, model-00002-of-00002.safetensors

The tensors come from the safetensors reader of this stage (the student's, when graded), as
zero-copy views of the mapped files, in the dtype they are stored in.
Graded by stages/01_load/tests/test_checkpoint.py (`nox -s grade -- 01`).
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from course import parts

_st = parts.load("01", "safetensors")
CheckpointError = _st.CheckpointError
if TYPE_CHECKING:   # a stage folder is no package: parts.load names its types
    ModelConfig = parts.load("01", "config").ModelConfig

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model with this ModelConfig needs, by Hugging Face name, with its shape.

    Linear weights are stored [out_features, in_features] (y = x @ W.T):
        model.embed_tokens.weight                        [vocab, hidden]
        model.layers.{i}.input_layernorm.weight          [hidden]
        model.layers.{i}.self_attn.q_proj.weight         [heads * head_dim, hidden]
        model.layers.{i}.self_attn.k_proj.weight         [kv_heads * head_dim, hidden]
        model.layers.{i}.self_attn.v_proj.weight         [kv_heads * head_dim, hidden]
        model.layers.{i}.self_attn.o_proj.weight         [hidden, heads * head_dim]
        model.layers.{i}.post_attention_layernorm.weight [hidden]
        model.layers.{i}.mlp.gate_proj.weight            [intermediate, hidden]
        model.layers.{i}.mlp.up_proj.weight              [intermediate, hidden]
        model.layers.{i}.mlp.down_proj.weight            [hidden, intermediate]
        model.norm.weight                                [hidden]
        lm_head.weight                                   [vocab, hidden]  (not when tied)

    and in each layer, with config.qkv_bias (Qwen2) and config.qk_norm (Qwen3):
        model.layers.{i}.self_attn.q_proj.bias           [heads * head_dim]
        model.layers.{i}.self_attn.k_proj.bias           [kv_heads * head_dim]
        model.layers.{i}.self_attn.v_proj.bias           [kv_heads * head_dim]
        model.layers.{i}.self_attn.q_norm.weight         [head_dim]
        model.layers.{i}.self_attn.k_norm.weight         [head_dim]
    """
    # BEGIN SOLUTION: build the dict above from config's sizes, one group per layer (with the family's biases and q/k norms)
    h, hd = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    inter = config.intermediate_size
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
        if config.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if config.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,),
                           p + "self_attn.k_norm.weight": (hd,)})
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes
    # END SOLUTION


def read_weight_map(index: Path) -> dict[str, str]:
    """The "weight_map" of a model.safetensors.index.json: {tensor name: shard file name}.

    CheckpointError naming the index when it is not JSON, has no weight_map, maps to anything
    but strings, or names a shard that is not a plain file name: a path such as
    "../../etc/passwd" or "/etc/passwd" would read a file outside the model directory.
    """
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not an index with a weight_map ({e!r})") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: weight_map is a {type(weight_map).__name__}, expected "
                              "an object of tensor name -> shard file name")
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CheckpointError(f"{index}: weight_map[{name!r}] is "
                                  f"{type(shard).__name__} {shard!r}, expected a shard file name")
        # "/" and "\\" on every platform: an index written on one must not escape on another
        if shard in ("", ".", "..") or any(c in shard for c in "/\\\0"):
            raise CheckpointError(f"{index}: weight_map[{name!r}] is {shard!r}, expected the "
                                  "file name of a shard in the model directory")
    return weight_map


def weight_files(model_dir: str | os.PathLike) -> tuple[Path, dict[str, Path]]:
    """(where, {tensor name: file}) for a checkpoint directory; `where` names it in errors.

    - model.safetensors.index.json present: its "weight_map" (name -> shard file name in
      model_dir; read it with read_weight_map(index), which refuses a malformed index); every
      shard it names must exist, else CheckpointError naming the index and the shard.
      `where` is the index.
    - else model.safetensors: every tensor in it (open it with the reader to list the names:
      _st.SafetensorsFile(path).names()). `where` is that file.
    - neither: CheckpointError naming the directory.
    """
    # BEGIN SOLUTION: the index's weight_map (shards must exist), else the single file
    model_dir = Path(model_dir)
    index = model_dir / INDEX
    if index.is_file():
        files = {name: model_dir / shard for name, shard in read_weight_map(index).items()}
        for name, file in files.items():
            if not file.is_file():
                raise CheckpointError(f"{index}: shard {file.name} (holding {name!r}) is missing "
                                      f"from {model_dir}")
        return index, files
    single = model_dir / SINGLE
    if single.is_file():
        return single, dict.fromkeys(_st.SafetensorsFile(single).names(), single)
    raise CheckpointError(f"{model_dir}: no {SINGLE} or {INDEX}: not a Hugging Face checkpoint "
                          "directory")
    # END SOLUTION


def load_weights(model_dir: str | os.PathLike, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor of expected_shapes(config), checked, plus lm_head.weight.

    - each name missing from weight_files -> CheckpointError "NAME missing from WHERE";
    - each shape that differs -> CheckpointError "NAME in FILE has shape (a, b), expected
      (c, d)"; tensors come from _st.SafetensorsFile(file).tensor(name), one open per file;
    - tied embeddings (config.tie_word_embeddings): lm_head.weight is the embed_tokens
      tensor itself (a checkpoint's own lm_head.weight is ignored, as transformers does).
    Extra tensors in the files (e.g. rotary inv_freq buffers) are ignored.
    """
    # BEGIN SOLUTION: for each expected name: present? take it, check its shape; tie lm_head
    where, files = weight_files(model_dir)
    opened: dict[Path, object] = {}
    weights: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(config).items():
        if name not in files:
            raise CheckpointError(f"{name} missing from {where}")
        file = files[name]
        if file not in opened:
            opened[file] = _st.SafetensorsFile(file)
        t = opened[file].tensor(name)
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{name} in {file} has shape {tuple(t.shape)}, expected "
                                  f"{shape}")
        weights[name] = t
    if config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return weights
    # END SOLUTION


FLOATS = (torch.float32, torch.bfloat16, torch.float16)
LAYER = re.compile(r"model\.layers\.(\d+)\.")
# a family's attention tensors (Qwen's biases and q/k norms): left out, the model is another
FAMILY_TENSOR = re.compile(r"model\.layers\.\d+\.self_attn\.(\w_proj\.bias|[qk]_norm\.weight)$")


def load_checked(model_dir: str | os.PathLike, config: ModelConfig) -> dict[str, torch.Tensor]:
    """load_weights, with what it takes on trust checked around it (the engine loads through
    this): every tensor floating point (an int32 embedding would load and answer noise) and
    finite (one NaN spreads to every logit: the reply is token 0 over and over), and no layer
    in the files beyond config.num_hidden_layers (a config that counts fewer layers than the
    checkpoint has would run a truncated model without a word), and no q/k/v bias or q/k norm
    the config's family lacks (a Qwen2 checkpoint under a Llama config would drop its biases)."""
    weights = load_weights(model_dir, config)
    where, files = weight_files(model_dir)
    for name, t in weights.items():
        if t.dtype not in FLOATS:
            raise CheckpointError(f"{name} in {files.get(name, where)} is "
                                  f"{str(t.dtype).removeprefix('torch.')}: expected float32, "
                                  "bfloat16 or float16")
        # one pass, no copy: NaN and inf reach a float64 sum, which no finite weights overflow
        if not math.isfinite(t.sum(dtype=torch.float64).item()):
            raise CheckpointError(f"{name} in {files.get(name, where)} holds NaN or infinite "
                                  "values: the checkpoint is damaged or was converted wrongly")
    layers = {int(m.group(1)) for name in files if (m := LAYER.match(name))}
    if layers and max(layers) >= config.num_hidden_layers:
        raise CheckpointError(f"{where} holds layers up to model.layers.{max(layers)}, but the "
                              f"config says num_hidden_layers={config.num_hidden_layers}")
    stray = sorted(n for n in files if FAMILY_TENSOR.match(n) and n not in weights)
    if stray:
        raise CheckpointError(f"{where} holds {stray[0]}, which a {config.model_type!r} model "
                              "with this config.json does not have: the config does not "
                              "describe this checkpoint")
    return weights
