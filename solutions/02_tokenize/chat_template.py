"""Stage 02: a conversation -> the prompt text an instruct model was trained on.

A chat model never sees "messages": it sees one string in which special tokens mark who
speaks. Each model family has its own format, written as a Jinja template in its
tokenizer_config.json ("chat_template"). This file reimplements the two formats the course
uses, character for character, in plain Python:

  llama3 (Llama 3.1 / 3.2 Instruct)

    <|begin_of_text|><|start_header_id|>system<|end_header_id|>\\n\\n
    Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n
    {system prompt}<|eot_id|>
    <|start_header_id|>user<|end_header_id|>\\n\\n{content}<|eot_id|>
    <|start_header_id|>assistant<|end_header_id|>\\n\\n          <- the generation prompt

    (no line breaks except the \\n shown). The system block is always there, even without a
    system message; message contents are stripped of surrounding whitespace (Jinja `|trim`).

  chatml (SmolLM2, Qwen, ...)

    <|im_start|>system\\n{system prompt}<|im_end|>\\n
    <|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n                                      <- the generation prompt

    Contents are used as they are. SmolLM2's template inserts a default system prompt when
    the conversation does not start with one.

Dates: Llama 3.2's template writes today's date ("Today Date: 29 Nov 2026") when rendered by
transformers. `date_string=None` does the same; pass a fixed date for reproducible prompts.

Run: nox -s grade -- 02   (or python3 -m grader 02)
"""
from __future__ import annotations

import datetime

FORMATS = ("llama3", "chatml")
ROLES = ("system", "user", "assistant")

LLAMA3_BOS = "<|begin_of_text|>"
LLAMA3_KNOWLEDGE_CUTOFF = "December 2023"
SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def today() -> str:
    """The date as Llama 3's template writes it: strftime("%d %b %Y"), e.g. "26 Jul 2024"."""
    return datetime.datetime.now().strftime("%d %b %Y")


def apply_chat_template(messages: list[dict], fmt: str, add_generation_prompt: bool = True,
                        bos_token: str | None = None, *, date_string: str | None = None,
                        default_system: str | None = SMOLLM2_DEFAULT_SYSTEM) -> str:
    """The prompt string for `messages` ([{"role": "user", "content": "..."}, ...]) in `fmt`.

    add_generation_prompt  end with the assistant header, so the model writes the reply
    bos_token              text the prompt starts with: "<|begin_of_text|>" for llama3 by
                           default, nothing for chatml. The prompt then already holds the BOS
                           token: encode it with add_special_tokens=False.
    date_string            llama3 only: the "Today Date" line (default: today)
    default_system         chatml only: the system prompt inserted when the first message is
                           not a system message (SmolLM2's; None inserts none)
    """
    _check_messages(messages)
    if fmt == "llama3":
        return _llama3(messages, add_generation_prompt, LLAMA3_BOS if bos_token is None
                       else bos_token, today() if date_string is None else date_string)
    if fmt == "chatml":
        return _chatml(messages, add_generation_prompt, bos_token or "", default_system)
    raise ValueError(f"unknown chat format {fmt!r}; known formats: {', '.join(FORMATS)}")


def _check_messages(messages: list[dict]) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be a dict with a string 'content', got {m!r}")
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}] has role {m.get('role')!r}; supported roles: "
                             f"{', '.join(ROLES)}")


def _llama3(messages: list[dict], add_generation_prompt: bool, bos_token: str,
            date_string: str) -> str:
    def header(role: str) -> str:
        return f"<|start_header_id|>{role}<|end_header_id|>\n\n"

    # BEGIN SOLUTION: system block (always), trimmed messages, generation prompt
    if messages[0]["role"] == "system":
        system, messages = messages[0]["content"].strip(), messages[1:]
    else:
        system = ""
    parts = [bos_token, header("system"),
             f"Cutting Knowledge Date: {LLAMA3_KNOWLEDGE_CUTOFF}\nToday Date: {date_string}\n\n",
             system, "<|eot_id|>"]
    for m in messages:
        parts += [header(m["role"]), m["content"].strip(), "<|eot_id|>"]
    if add_generation_prompt:
        parts.append(header("assistant"))
    return "".join(parts)
    # END SOLUTION


def _chatml(messages: list[dict], add_generation_prompt: bool, bos_token: str,
            default_system: str | None) -> str:
    def turn(role: str, content: str) -> str:
        return f"<|im_start|>{role}\n{content}<|im_end|>\n"

    # BEGIN SOLUTION: default system turn if needed, the turns, generation prompt
    parts = [bos_token]
    if messages[0]["role"] != "system" and default_system is not None:
        parts.append(turn("system", default_system))
    parts += [turn(m["role"], m["content"]) for m in messages]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)
    # END SOLUTION
