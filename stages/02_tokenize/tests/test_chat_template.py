"""Stage 02: chat_template.py against Jinja chat templates rendered by transformers.

The oracle is transformers' apply_chat_template rendering a Jinja template:
  llama3  the course's own template (tests/data/llama3-plain.jinja), written from Meta's
          documented Llama 3 / 3.1 / 3.2 prompt format for plain text conversations. Meta's
          template is not redistributed here; ours is pinned by hand-written expected strings
          (LLAMA3_BY_HAND), so the oracle itself is checked against the documented format.
  chatml  SmolLM2-135M-Instruct's own template, from its GGUF file.
Strings must match character for character, and the token ids too.

About the date: the Llama 3 format writes "Today Date: <today>" into the system block.
The tests pass a fixed date_string to both sides, and check once that the default is today.
"""
from __future__ import annotations

import pytest

from course import parts

DATE = "26 Jul 2024"

CONVERSATIONS = {
    "one_user_message": [
        {"role": "user", "content": "What is the capital of France?"}],
    "system_and_user": [
        {"role": "system", "content": "You are a pirate. Answer in one sentence."},
        {"role": "user", "content": "Where is the treasure?"}],
    "multi_turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And times 3?"}],
    "no_system_multi_turn": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."}],
    "whitespace_around_contents": [
        {"role": "system", "content": "\n  Be kind.  \n"},
        {"role": "user", "content": "   spaced out\n\n"}],
    "unicode": [
        {"role": "user", "content": "Qu'est-ce que c'est ? 日本語 🦙 naïve"}],
    "system_later": [
        {"role": "user", "content": "first"},
        {"role": "system", "content": "a late system message"},
        {"role": "user", "content": "second"}],
}


# Written out by hand from the documented Llama 3 prompt format, not produced by any code:
# (conversation, add_generation_prompt) -> the prompt, with date_string=DATE.
_LLAMA3_SYSTEM_HEAD = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                       "Cutting Knowledge Date: December 2023\n"
                       "Today Date: 26 Jul 2024\n\n")
LLAMA3_BY_HAND = {
    ("one_user_message", True):
        _LLAMA3_SYSTEM_HEAD + "<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is the capital of France?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ("system_and_user", False):
        _LLAMA3_SYSTEM_HEAD + "You are a pirate. Answer in one sentence.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhere is the treasure?<|eot_id|>",
    ("multi_turn", True):
        _LLAMA3_SYSTEM_HEAD + "Be brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n4.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAnd times 3?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ("whitespace_around_contents", True):
        _LLAMA3_SYSTEM_HEAD + "Be kind.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nspaced out<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
}


def chat():
    return parts.load("02", "chat_template")


def first_difference(expected: str, got: str) -> str:
    i = next((k for k, (a, b) in enumerate(zip(expected, got)) if a != b),
             min(len(expected), len(got)))
    return (f"first difference at character {i}:\n"
            f"  expected ...{expected[max(0, i - 30):i + 30]!r}\n"
            f"  got      ...{got[max(0, i - 30):i + 30]!r}\n"
            f"full expected:\n{expected!r}\nfull got:\n{got!r}")


def assert_same_text(got: str, expected: str, hint: str) -> None:
    if got != expected:
        raise AssertionError(f"{first_difference(expected, got)}\nlikely cause: {hint}")


def hf_ids(hf_tok, messages, **kw) -> list[int]:
    out = hf_tok.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.points(0.5)  # 28 cases: the part weighs about as much as the others
@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen_prompt", "no_gen"])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_llama3_matches_template(name, add_generation_prompt, hf_llama3):
    messages = CONVERSATIONS[name]
    expected = hf_llama3.apply_chat_template(messages, tokenize=False, date_string=DATE,
                                             add_generation_prompt=add_generation_prompt)
    got = chat().apply_chat_template(messages, "llama3", add_generation_prompt,
                                     date_string=DATE)
    assert_same_text(got, expected, "Llama 3 always writes the system block (with the "
                     "'Cutting Knowledge Date' and 'Today Date' lines, even with no system "
                     "message), strips whitespace around every content (Jinja |trim), and "
                     "starts with <|begin_of_text|>")


@pytest.mark.points(0.5)
@pytest.mark.parametrize("name,add_generation_prompt", list(LLAMA3_BY_HAND),
                         ids=[f"{n}-{'gen_prompt' if g else 'no_gen'}" for n, g in LLAMA3_BY_HAND])
def test_llama3_matches_hand_written_prompts(name, add_generation_prompt, hf_llama3):
    messages = CONVERSATIONS[name]
    got = chat().apply_chat_template(messages, "llama3", add_generation_prompt,
                                     date_string=DATE)
    expected = LLAMA3_BY_HAND[name, add_generation_prompt]
    oracle = hf_llama3.apply_chat_template(messages, tokenize=False, date_string=DATE,
                                           add_generation_prompt=add_generation_prompt)
    assert_same_text(oracle, expected, "the test oracle tests/data/llama3-plain.jinja no longer "
                     "renders the documented Llama 3 format: fix the template, not your code")
    assert_same_text(got, expected, "the documented Llama 3 format: <|begin_of_text|>, the "
                     "system block with both date lines, then <|start_header_id|>role"
                     "<|end_header_id|>\\n\\n + trimmed content + <|eot_id|> per message")


@pytest.mark.points(0.5)  # 28 cases: the part weighs about as much as the others
@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen_prompt", "no_gen"])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_chatml_matches_smollm2_template(name, add_generation_prompt, hf_smollm2):
    messages = CONVERSATIONS[name]
    expected = hf_smollm2.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=add_generation_prompt)
    got = chat().apply_chat_template(messages, "chatml", add_generation_prompt)
    assert_same_text(got, expected, "ChatML is <|im_start|>role\\ncontent<|im_end|>\\n per "
                     "message, contents untouched; SmolLM2 adds its default system prompt only "
                     "when the FIRST message is not a system message")


def test_llama3_default_date_is_today(hf_llama3):
    messages = CONVERSATIONS["one_user_message"]
    got = chat().apply_chat_template(messages, "llama3")
    expected = hf_llama3.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert_same_text(got, expected, "without date_string, write today's date as "
                     "strftime('%d %b %Y') does (see today())")


@pytest.mark.parametrize("name", ["system_and_user", "multi_turn", "unicode"])
def test_llama3_token_ids_and_single_bos(name, llama3, hf_llama3):
    messages = CONVERSATIONS[name]
    prompt = chat().apply_chat_template(messages, "llama3", date_string=DATE)
    ids = llama3.encode(prompt, add_special_tokens=False)
    expected = hf_ids(hf_llama3, messages, date_string=DATE, add_generation_prompt=True)
    assert ids == expected, f"token ids differ:\n  expected {expected}\n  got      {ids}"
    bos = llama3.bos_id
    assert bos == 128000 and ids[0] == bos and ids.count(bos) == 1
    # The pitfall: Llama 3's post-processor prepends <|begin_of_text|> on its own, so a prompt
    # that already holds it must be encoded with add_special_tokens=False.
    doubled = llama3.encode(prompt, add_special_tokens=True)
    assert doubled[:2] == [bos, bos], "expected the post-processor to add a second BOS"


@pytest.mark.parametrize("name", ["one_user_message", "multi_turn", "unicode"])
def test_chatml_token_ids(name, smollm2, hf_smollm2):
    messages = CONVERSATIONS[name]
    prompt = chat().apply_chat_template(messages, "chatml")
    ids = smollm2.encode(prompt, add_special_tokens=False)
    expected = hf_ids(hf_smollm2, messages, add_generation_prompt=True)
    assert ids == expected, f"token ids differ:\n  expected {expected}\n  got      {ids}"
    # one <|im_start|> per turn: the default system prompt, each message, the generation prompt
    turns = len(messages) + (messages[0]["role"] != "system") + 1
    assert ids.count(smollm2.token_to_id("<|im_start|>")) == turns


def test_chatml_default_system_prompt_choices():
    ct = chat()
    messages = [{"role": "user", "content": "Hi"}]
    plain = ct.apply_chat_template(messages, "chatml", default_system=None)
    assert plain == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    qwen = ct.apply_chat_template(messages, "chatml", default_system="You are a helpful "
                                  "assistant.")
    assert qwen.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                           "<|im_start|>user\nHi<|im_end|>\n")


def test_bad_input_is_a_clear_error():
    ct = chat()
    ok = [{"role": "user", "content": "Hi"}]
    assert ct.apply_chat_template(ok, "chatml", False, default_system=None) == \
        "<|im_start|>user\nHi<|im_end|>\n"
    with pytest.raises(ValueError, match="llama3, chatml"):
        ct.apply_chat_template(ok, "alpaca")
    with pytest.raises(ValueError, match="non-empty"):
        ct.apply_chat_template([], "llama3")
    with pytest.raises(ValueError, match="role"):
        ct.apply_chat_template([{"role": "robot", "content": "beep"}], "chatml")
    with pytest.raises(ValueError, match="content"):
        ct.apply_chat_template([{"role": "user"}], "llama3")
