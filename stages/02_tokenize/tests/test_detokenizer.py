"""Stage 02: detokenizer.py, streaming text out of token ids with the real tokenizers.

The invariant: the pieces from push() and flush() concatenate to
tokenizer.decode(all generated ids), and no piece from push() ends in a broken character
(U+FFFD). Inputs: real text in many scripts, text fed one BYTE-token at a time (so every
multi-byte character arrives split), random token streams (special tokens included), and
Llama 3's 256 special tokens.
"""
from __future__ import annotations

import random

import pytest

from course import parts

FFFD = "\ufffd"

TEXTS = [
    "Plain ASCII: the quick brown fox jumps over the lazy dog, 1234567890 times.",
    "Accents: naïve café, Zürich, Ångström, façade, São Paulo, Dvořák.",
    "CJK: 日本語のテキストを処理します。中文分词。한국어 문장입니다.",
    "Emoji: 🦙🚀 family 👩‍👩‍👧 flags 🇫🇷🇯🇵 skin 👍🏽 done.",
    "Mixed: Ελληνικά, русский, עברית, हिन्दी, ไทย — “quotes” … ∑∫√ ≠ ≤.",
]


def detok_cls():
    return parts.load("02", "detokenizer").IncrementalDetokenizer


def stream(tokenizer, ids, prompt_ids=None, skip_special=True) -> list[str]:
    d = detok_cls()(tokenizer, prompt_ids=prompt_ids, skip_special=skip_special)
    pieces = [d.push(i) for i in ids] + [d.flush()]
    wrong = next((x for x in pieces if not isinstance(x, str)), "")
    assert not wrong, (f"push() and flush() return text, got {wrong!r}: while a character is "
                       "incomplete (or nothing is new) the piece is '' (an empty string), never None")
    return pieces


def check_stream(tokenizer, ids, pieces, skip_special=True, what="") -> None:
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special)
    got = "".join(pieces)
    if got != expected:
        i = next((k for k, (a, b) in enumerate(zip(expected, got)) if a != b),
                 min(len(expected), len(got)))
        raise AssertionError(
            f"{what}: the streamed pieces do not add up to decode(ids); first difference at "
            f"character {i}: expected {expected[i:i + 20]!r}, got {got[i:i + 20]!r}\n"
            f"pieces: {pieces[:40]}\nlikely cause: emit new_text[len(prefix_text):] and move "
            "prefix_offset/read_offset only when you emit")
    broken = [(k, p) for k, p in enumerate(pieces[:-1]) if p.endswith(FFFD)]
    assert not broken, (f"{what}: push() returned text ending in U+FFFD (a character whose "
                        f"bytes have not all arrived) at tokens {broken[:5]}: hold it back")


def byte_tokens(tokenizer, data: bytes) -> list[int]:
    """Ids of the single-byte tokens that spell `data` (GPT-2's byte-to-unicode map: printable
    bytes stand for themselves, the others for chr(256 + k))."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    char = {b: chr(b) if b in printable else chr(256 + others.index(b)) for b in range(256)}
    ids = [tokenizer.token_to_id(char[b]) for b in data]
    assert None not in ids, f"the vocabulary lacks a token for some byte of {data!r}"
    return ids


@pytest.mark.parametrize("model", ["llama3", "smollm2"])
@pytest.mark.parametrize("text", TEXTS, ids=lambda t: t.split(":")[0])
def test_real_text_streams_exactly(model, text, request):
    tok = request.getfixturevalue(model)
    ids = tok.encode(text, add_special_tokens=False)
    pieces = stream(tok, ids)
    check_stream(tok, ids, pieces, what=f"{model} {text[:20]!r}")
    assert "".join(pieces) == text


@pytest.mark.parametrize("model", ["llama3", "smollm2"])
def test_with_prompt_context(model, request):
    tok = request.getfixturevalue(model)
    prompt = tok.encode("<|im_start|>user\nSay something in French and Japanese: ",
                        add_special_tokens=False)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        pieces = stream(tok, ids, prompt_ids=prompt)
        check_stream(tok, ids, pieces, what=f"{model} after a prompt")
        assert "".join(pieces) == text, "the prompt is context only: never emit its text"


@pytest.mark.parametrize("model", ["llama3", "smollm2"])
def test_one_byte_per_token_holds_back_partial_characters(model, request):
    tok = request.getfixturevalue(model)
    text = "é中🦙a"
    pieces = stream(tok, byte_tokens(tok, text.encode("utf-8")))
    # each character comes out exactly when its last byte arrives, never before
    expected = []
    for ch in text:
        expected += [""] * (len(ch.encode("utf-8")) - 1) + [ch]
    assert pieces[:-1] == expected, (
        f"pushing the bytes of {text!r} one token at a time:\n  expected {expected}\n"
        f"  got      {pieces[:-1]}\nlikely cause: text ending in U+FFFD is an incomplete "
        "character: return '' and keep the offsets until it completes")
    assert pieces[-1] == ""


@pytest.mark.parametrize("model", ["llama3", "smollm2"])
def test_flush_releases_an_incomplete_character(model, request):
    tok = request.getfixturevalue(model)
    ids = [tok.token_to_id("Hi"), *byte_tokens(tok, "🦙".encode("utf-8")[:2])]  # half an emoji
    d = detok_cls()(tok)
    pieces = [d.push(i) for i in ids]
    assert pieces == ["Hi", "", ""], (
        f"pushed 'Hi' and half an emoji's bytes, got {pieces}: each push returns the new text "
        "that is complete, and '' (never None) while the character is unfinished")
    assert d.flush() == tok.decode(ids)[2:] and FFFD in tok.decode(ids)


@pytest.mark.parametrize("skip_special", [True, False], ids=["skip_special", "keep_special"])
@pytest.mark.parametrize("model", ["llama3", "smollm2"])
def test_random_token_streams(model, skip_special, request, seed):
    tok = request.getfixturevalue(model)
    rng = random.Random(seed)
    specials = sorted(tok.special_ids)
    for trial in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 60))]
        ids += rng.sample(specials, 3)           # random tokens rarely hit the specials
        rng.shuffle(ids)
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 8))]
        pieces = stream(tok, ids, prompt_ids=prompt, skip_special=skip_special)
        check_stream(tok, ids, pieces, skip_special,
                     what=f"{model} random stream #{trial} (seed {seed})")


def test_llama3_special_tokens(llama3):
    special = list(range(128000, 128256))
    assert set(special) <= llama3.special_ids, "Llama 3's ids 128000-128255 are special"
    text_ids = llama3.encode("Hello there", add_special_tokens=False)
    ids = [special[9], *text_ids, *special[::7], 128009]   # <|eot_id|> is 128009
    skipped = stream(llama3, ids)
    check_stream(llama3, ids, skipped, what="Llama 3 with special tokens skipped")
    assert "".join(skipped) == "Hello there"
    kept = stream(llama3, ids, skip_special=False)
    check_stream(llama3, ids, kept, skip_special=False, what="Llama 3 keeping special tokens")
    assert "".join(kept).endswith("<|eot_id|>")


def test_decodes_a_short_window_not_the_whole_history(smollm2):
    calls = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return smollm2.decode(ids, skip_special_tokens=skip_special_tokens)

    text = " ".join(["streaming"] * 150)
    ids = smollm2.encode(text, add_special_tokens=False)
    pieces = stream(Counting(), ids, prompt_ids=list(range(100, 160)))
    assert "".join(pieces) == text
    assert max(calls) <= 8, (
        f"decode() was given up to {max(calls)} ids at once for {len(ids)} generated tokens: "
        "decode only ids[prefix_offset:], and start prefix_offset a few tokens before the end "
        "of the prompt, so every step costs the same however long the text gets")
