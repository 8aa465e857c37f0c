"""Stage 02: when does generation stop, and what text does the user get?

Three reasons, checked after every generated token, in this order:

    "eos"          the token is one of the model's end tokens (<|eot_id|>, <|im_end|>, ...)
    "stop_string"  the text so far contains a user-given stop string ("\\n\\n", "User:", ...)
    "max_tokens"   max_tokens tokens have been generated

A stop string is TEXT, not a token: it can arrive split over several tokens ("Us" + "er:"),
or inside one token together with text before it. The output ends right before the first
occurrence, and the stop string itself is never shown -- not even while streaming: text that
might be the start of a stop string ("Us") is held back until the next tokens decide.

Usage, per request:

    stop = StopChecker(tokenizer.eos_ids, ["User:"], max_tokens=256)
    text = ""
    for token in generate(...):
        text += detokenizer.push(token)
        reason = stop.check(token, text)
        send(stop.safe_text(text, finished=reason is not None)[len(sent):])   # streaming
        if reason: break
    final = stop.truncate(text)

Run: nox -s grade -- 02   (or python3 -m grader 02)
"""
from __future__ import annotations


class StopChecker:
    """Stop conditions of one request. Call check() once per generated token."""

    def __init__(self, eos_ids: set[int], stop_strings: list[str] | tuple[str, ...] = (),
                 max_tokens: int | None = None):
        if isinstance(stop_strings, str):
            raise TypeError(f"stop_strings must be a list of strings, got the string "
                            f"{stop_strings!r} (wrap it in a list)")
        for s in stop_strings:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer or None, got {max_tokens!r}")
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.stop_strings = list(stop_strings)
        self.max_tokens = max_tokens
        self.num_tokens = 0          # tokens checked so far
        self.reason: str | None = None
        self.stop_at: int | None = None   # where the output text ends (a stop string starts)
        self._searched = 0           # text before this index has no stop string

    def check(self, token_id: int, text_so_far: str) -> str | None:
        """Count `token_id` (just generated; `text_so_far` includes its text) and return the
        reason to stop ("eos", "stop_string", "max_tokens") or None to go on."""
        if self.reason is not None:
            return self.reason
        # TODO stage 02: count it; then eos, stop string (find_stop), max_tokens (about 8 lines)
        raise NotImplementedError("TODO stage 02: count it; then eos, stop string (find_stop), max_tokens (about 8 lines)")

    def find_stop(self, text: str) -> int | None:
        """Index of the earliest stop string in `text`, or None. Searches only what can hold
        a new occurrence: the text added since the last call, plus the len(stop) - 1
        characters before it, where a stop string split over tokens starts."""
        if not self.stop_strings:
            return None
        # TODO stage 02: search from _searched - (longest - 1), then update _searched (about 5 lines)
        raise NotImplementedError("TODO stage 02: search from _searched - (longest - 1), then update _searched (about 5 lines)")

    def truncate(self, text: str) -> str:
        """The final output: `text` cut before the stop string that stopped generation."""
        # TODO stage 02: cut at stop_at when a stop string stopped generation (about 1 line)
        raise NotImplementedError("TODO stage 02: cut at stop_at when a stop string stopped generation (about 1 line)")

    def safe_text(self, text: str, finished: bool) -> str:
        """The part of `text` that may be streamed to the user now.

        Finished: the truncated output. Otherwise all of `text` except its longest ending
        that is the beginning of a stop string ("...Us" while "User:" is a stop string),
        which the next tokens may complete.
        """
        if finished or self.reason is not None:
            return self.truncate(text)
        # TODO stage 02: hold back the longest ending of text that begins a stop string (about 5 lines)
        raise NotImplementedError("TODO stage 02: hold back the longest ending of text that begins a stop string (about 5 lines)")
