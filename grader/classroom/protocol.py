"""The wire between the judge (trusted) and the worker (the student's code, sandboxed).

Frames are a 4-byte length and a pickle. Judge -> worker is ordinary pickle: the worker trusts
the judge. Worker -> judge is the dangerous direction, so replies are decoded by an unpickler
that resolves NO global at all: only None, bool, int, float, str, bytes, tuple, list, dict,
set and frozenset can come back, plus persistent ids that this module checks field by field
(tensors as dtype/shape/strides over bytes or over a mapped file, and handles to objects that
stay in the worker). A reply can therefore carry wrong answers, never code.
"""
from __future__ import annotations

import io
import os
import pickle
import struct
from collections.abc import Callable
from typing import NoReturn

MAX_FRAME = 256 << 20          # a bigger reply is refused: "return value too large"
HEADER = struct.Struct("<I")
PLAIN = (type(None), bool, int, float, str, bytes)   # what crosses as itself
REFERENCE_MODULES = "tinyvllm_solution_"   # course/parts.py's names for the reference modules


class ProtocolError(Exception):
    """The worker sent something that is not a valid reply (or nothing at all)."""


def write_frame(fd: int, payload: bytes) -> None:
    data = HEADER.pack(len(payload)) + payload
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def read_exact(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("the worker closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int, limit: int = MAX_FRAME) -> bytes:
    (n,) = HEADER.unpack(read_exact(fd, HEADER.size))
    if n > limit:
        raise ProtocolError(f"a reply of {n} bytes (over the {limit >> 20} MiB limit): "
                            "is a return value unreasonably large?")
    return read_exact(fd, n)


class SafeUnpickler(pickle.Unpickler):
    """Plain data only; persistent ids are handed to `persistent` for checking."""

    def __init__(self, data: bytes, persistent: Callable[[object], object]):
        super().__init__(io.BytesIO(data))
        self._persistent = persistent

    def find_class(self, module: str, name: str) -> NoReturn:
        raise ProtocolError(f"the reply refers to {module}.{name}: only plain data may come back")

    def persistent_load(self, pid: object) -> object:
        return self._persistent(pid)


def update_in_place(obj: object, state: dict) -> None:
    """Make obj's attributes those of `state`, keeping its lists, dicts and sets themselves
    (a test or a student's structure may hold on to `seq.block_table`). Written to __dict__
    directly: a frozen dataclass is kept in step too."""
    current = vars(obj)
    for name in [n for n in current if n not in state]:
        del current[name]
    for name, new in state.items():
        old = current.get(name)
        if old is not new and type(old) is type(new) and type(new) in (list, dict, set):
            if type(new) is list:
                old[:] = new
            else:
                old.clear()
                old.update(new)
        else:
            current[name] = new


def safe_loads(data: bytes, persistent: Callable[[object], object]) -> object:
    try:
        return SafeUnpickler(data, persistent).load()
    except ProtocolError:
        raise
    except Exception as e:  # truncated or garbage bytes: the worker's problem, not ours
        raise ProtocolError(f"unreadable reply ({type(e).__name__}: {str(e)[:200]})") from None
