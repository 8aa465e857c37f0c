"""Stage 02: streaming detokenization -- text out as each token arrives, never broken UTF-8.

A byte-level BPE token is a run of BYTES, not of characters: "é" is two bytes (C3 A9), an
emoji four, and the tokenizer may put them in different tokens. Decoding a token on its own
then yields U+FFFD (the replacement character, "\ufffd") for the incomplete bytes. And decoding
each token alone loses context that decoding the whole sequence has (SentencePiece tokenizers
drop the leading space of the first token they decode).

The vLLM technique keeps two offsets into the token ids:

    ids:  ... p r o m p t | already emitted | new tokens
                  ^prefix_offset  ^read_offset         ^len(ids)

    prefix_text = decode(ids[prefix_offset:read_offset])   the context, already emitted
    new_text    = decode(ids[prefix_offset:])              the context plus the new tokens

If new_text is longer than prefix_text and does not end with U+FFFD, the difference
new_text[len(prefix_text):] is complete text: emit it and move both offsets forward
(prefix_offset = read_offset, read_offset = len(ids)). Otherwise emit nothing and wait: the
next token may complete the character. flush() emits whatever is still held back at the end.
The window stays a few tokens long, so each step costs O(1), not O(length).

Run: nox -s grade -- 02   (or python3 -m grader 02)
"""
from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# How many prompt tokens to decode as context before the first generated token (vLLM uses 5).
PROMPT_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    """What the detokenizer needs of a tokenizer."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text pieces.

    tokenizer   anything with decode(ids, skip_special_tokens=...) -> str (the course's
                Tokenizer or a `tokenizers.Tokenizer`)
    prompt_ids  the prompt's ids, used only as decoding context (never emitted)
    skip_special  leave special tokens (<|eot_id|>, <|im_end|>, ...) out of the text

    The pieces returned by push() and flush() concatenate to
    tokenizer.decode(generated_ids, skip_special_tokens=skip_special).
    """

    def __init__(self, tokenizer: Decoder, prompt_ids: list[int] | None = None,
                 skip_special: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = list(prompt_ids or [])
        self.prefix_offset = max(len(self.ids) - PROMPT_CONTEXT_TOKENS, 0)
        self.read_offset = len(self.ids)

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=self.skip_special)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ("" if none yet)."""
        self.ids.append(int(token_id))
        # BEGIN SOLUTION: emit the new text unless it ends in U+FFFD; move the offsets
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset, len(self.ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text):]
        # END SOLUTION

    def flush(self) -> str:
        """The text still held back (an incomplete character at the very end), at the end."""
        # BEGIN SOLUTION: emit everything after read_offset, even if it ends in U+FFFD
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset, len(self.ids))
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text):]
        # END SOLUTION
