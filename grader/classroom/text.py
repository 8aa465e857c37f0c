"""Text that came from a student, made safe to print and to write into CSV, JSON and XML.

Anything a submission says (an exception message, a test name, a compiler log) is capped in
bytes and stripped of the control characters XML 1.0 cannot hold, so one message can neither
make grades.xml invalid nor blow a report up to megabytes.
"""
from __future__ import annotations

import re

MESSAGE_BYTES = 4000
# XML 1.0 allows tab, newline, carriage return and everything from U+0020 except surrogates
# and U+FFFE/U+FFFF; everything else (NUL, ESC, form feed...) is dropped.
_NOT_XML = re.compile("[^\t\n\r\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def clean(text: object, limit: int = MESSAGE_BYTES) -> str:
    """`text` as a string without XML-invalid characters, at most `limit` bytes of UTF-8."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    text = _NOT_XML.sub("", str(text))
    raw = text.encode("utf-8", errors="replace")
    if len(raw) <= limit:
        return text
    note = f"\n... [{len(raw) - limit} more bytes cut]"
    return raw[: max(0, limit - len(note))].decode("utf-8", errors="ignore") + note
