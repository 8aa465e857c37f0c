"""Snapshots: the plain attributes of student objects, sent along with the reply that names
them, so that reading them costs the judge no round trip.

Every attribute a test reads of a student object is a request to the worker. A test that
walks the student's queues reads a few attributes of each entry every step (stage 11's
invariants: two of each of some 70 waiting sequences, 700 steps): 100,000 round trips, most
of the cost of grading a stage through the judge. Most such attributes are plain: an entry of
the object's `__dict__` that its class does not intercept (no property or other data
descriptor of that name, no `__getattribute__`), so reading one runs no student code and
changes nothing. The worker sends those of every object a reply names (`collect`); the judge
answers later reads from them (`Snapshots`) for as long as no student code can have run:

    - a reply to a request that ran student code (a call, a property, `setattr`, an operator
      other than reading a builtin container) drops every snapshot, and so does a call back
      into the judge (the student's code is half-way through a call);
    - a frame that updates the worker's copies of objects kept in step drops them too (a
      student object may hold a list of such a copy);
    - a restarted worker starts with none.

So a read answered from a snapshot gives what the request would have answered. Values are
decoded afresh on each read, as a reply would be: a test that changes the list it got does
not change what the next read gives. Only plain data, containers of it and handles to other
student objects are sent (no tensors: a model's weights would cross on every reply), within
budgets per reply; anything else is simply read by a request, as before.
"""
from __future__ import annotations

import collections
import pickle
from collections.abc import Callable

from grader.classroom import protocol

MAX_OBJECTS = 1024           # objects with a snapshot per reply
MAX_BYTES = 1 << 20          # the snapshots' pickled size per reply
MAX_ITEMS = 4096             # a container attribute longer than this is read by a request
MAX_HELD = 64 << 20          # what the judge holds at most (replies that say no code ran add up)
SNAPSHOT_PIDS = ("obj", "lent", "dtype", "size", "device", "enum")   # what a snapshot may name

# containers whose reading (len, bool, iteration) runs no student code
BUILTIN_CONTAINERS = (list, tuple, dict, set, frozenset, collections.deque)
PURE_OPERATORS = ("__len__", "__bool__", "__iter__")


class NotPlain(Exception):
    """A value that a snapshot does not carry (the judge asks for it instead)."""


# --- the worker's side ------------------------------------------------------------------------
def plain_attribute(obj: object, name: str) -> bool:
    """Whether `obj.name` is an entry of obj's __dict__ that its class does not intercept:
    reading it runs no code. Checked on the class's own dicts, without any attribute access
    the student's class could take over."""
    cls = type(obj)
    if cls.__getattribute__ is not object.__getattribute__:
        return False
    try:
        if name not in object.__getattribute__(obj, "__dict__"):
            return False
    except AttributeError:       # __slots__ only
        return False
    for klass in cls.__mro__:
        if name in klass.__dict__:
            found = type(klass.__dict__[name])
            return not (hasattr(found, "__set__") or hasattr(found, "__delete__"))
    return True


def pure_operator(obj: object, name: str) -> bool:
    """Whether the operator reads a builtin container (no student code)."""
    return type(obj) in BUILTIN_CONTAINERS and name in PURE_OPERATORS


def collect(queue: list[tuple[int, object]], encode: Callable[[object], object],
            dumps: Callable[[object], bytes]) -> dict[int, dict[str, bytes]]:
    """{handle: {attribute: pickled value}} for the objects a reply names (`queue`: handle and
    object) and, breadth first, for those their snapshots name, within the budgets. `encode`
    raises NotPlain for what a snapshot does not carry, and appends each object it gives a
    handle to `queue`."""
    out: dict[int, dict[str, bytes]] = {}
    size, i = 0, 0
    while i < len(queue) and len(out) < MAX_OBJECTS and size < MAX_BYTES:
        hid, obj = queue[i]
        i += 1
        if hid in out:
            continue
        try:
            attributes = dict(object.__getattribute__(obj, "__dict__"))
        except (AttributeError, TypeError):
            continue
        snap = out[hid] = {}
        for name, value in attributes.items():
            if type(name) is not str or not plain_attribute(obj, name):
                continue
            try:
                snap[name] = dumps(encode(value))
            except (NotPlain, RecursionError, ValueError, pickle.PicklingError):
                continue
            size += len(snap[name])
    return out


# --- the judge's side -------------------------------------------------------------------------
class Snapshots:
    """The snapshots the judge may answer attribute reads from (see the module's doc)."""

    MISSING = object()

    def __init__(self) -> None:
        self.by_handle: dict[int, dict[str, bytes]] = {}
        self.held = 0          # bytes, so that a worker cannot fill the judge's memory

    def clear(self) -> None:
        self.by_handle.clear()
        self.held = 0

    def take(self, envelope: dict) -> None:
        """A reply's snapshots, after dropping the held ones unless the reply says no student
        code ran (and they stay under MAX_HELD). ProtocolError for a snapshot of the wrong
        shape."""
        snaps, pure = envelope["snapshots"], envelope["pure"]
        if not isinstance(snaps, dict):
            raise protocol.ProtocolError("snapshots that are not a dict")
        size = 0
        for hid, snap in snaps.items():
            if type(hid) is not int or not isinstance(snap, dict) or not all(
                    type(k) is str and type(v) is bytes for k, v in snap.items()):
                raise protocol.ProtocolError("a snapshot of the wrong shape")
            size += sum(len(v) for v in snap.values())
        if envelope["callback"] is not None or pure is not True or self.held + size > MAX_HELD:
            self.clear()
        self.by_handle.update(snaps)
        self.held += size

    def read(self, hid: int, name: str, decode: Callable[[bytes], object]) -> object:
        """The attribute's value from a snapshot (decoded afresh), or MISSING."""
        data = self.by_handle.get(hid, {}).get(name)
        return self.MISSING if data is None else decode(data)
