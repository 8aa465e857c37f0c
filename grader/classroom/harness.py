"""The worker: the sandboxed process where a student's Python parts run, and nothing else.

The judge (grader/classroom/judge.py) runs the course's tests; whenever a test touches a
student part, the judge sends a request here: load a module, get an attribute, call, or one of
a few operators (`in`, len, [], iteration, `with`, bool, == between two student objects).
The answer goes back as plain data (protocol.py); objects that are not plain data stay here
and the judge gets a numbered handle to them. Tensors go back as their bytes, or, when they
view a memory-mapped file the judge can see, as (file, offset), so that zero-copy loading
stays observable on the judge's side.

Everything in this process is the student's to tamper with, including this code: nothing it
says is trusted beyond being the student's answer to the question asked.

    python3 -m grader.classroom.harness      (started by the judge; speaks on stdin/stdout)
"""
from __future__ import annotations

import enum
import io
import os
import pickle
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grader.classroom import protocol, snapshot
from grader.classroom.protocol import PLAIN, REFERENCE_MODULES

if TYPE_CHECKING:   # torch is used here only once student code has loaded it
    import torch

SHARED_ENV = "TINYVLLM_CLASSROOM_SHARED"
MAX_ITEMS = 1_000_000
MAX_DEPTH = 200
OPERATORS = ("__enter__", "__exit__", "__contains__", "__len__", "__getitem__", "__iter__",
             "__bool__", "__eq__")


class _Pid:
    __slots__ = ("pid",)

    def __init__(self, pid: tuple):
        self.pid = pid


class JudgeObject:
    """An object a test passed in that cannot be copied here (a local class wrapping a
    tokenizer, say): its public methods are called back in the judge."""

    def __init__(self, worker: Worker, jid: int):
        self._worker, self._jid = worker, jid

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self._worker.callback(self._jid, name, args, kwargs)

    def __call__(self, *args: object, **kwargs: object) -> object:
        # a function of the tests (a lambda patched in)
        return self._worker.callback(self._jid, None, args, kwargs)


class Worker:
    def __init__(self) -> None:
        self.proto: tuple[int, int] = (0, 1)
        self.objects: dict[int, object] = {}
        self.ids: dict[int, int] = {}              # id(obj) -> handle, so a class keeps its handle
        self.kept: dict[str, object] = {}          # reference objects the judge sent once
        self.shared = Path(os.environ.get(SHARED_ENV, "/nonexistent"))
        # Reference objects kept in step with the judge's (judge.py): by the judge's number,
        # the number by id() here, states received but not applied yet, and those the
        # request in progress was given (their attributes go back with the reply).
        self.replicas: dict[int, object] = {}
        self.replica_ids: dict[int, int] = {}
        self.pending: dict[int, bytes] = {}
        self.loading: set[int] = set()
        self.touched: set[int] = set()
        self.pure = False      # whether the request being answered ran no student code

    # --- frames from the judge ----------------------------------------------------------
    def receive(self) -> tuple:
        """The next request (or answer to a callback): its objects kept in step are updated
        first, in place, from the states the frame carries."""
        tag, states, body = pickle.loads(protocol.read_frame(self.proto[0]))
        if tag != "sync":
            raise ValueError(f"unknown frame {tag!r}")
        self.pending.update(states)
        message = _Requests(body, self).load()
        for rid in list(self.pending):
            self.replica(rid)
        return message

    def replica(self, rid: int) -> object:
        data = self.pending.pop(rid, None)
        if data is not None:
            if rid in self.loading:
                raise ValueError("an object that contains itself cannot be kept in step")
            self.loading.add(rid)
            try:
                new = _Requests(data, self).load()
            finally:
                self.loading.discard(rid)
            if rid in self.replicas:
                protocol.update_in_place(self.replicas[rid], vars(new))
            else:
                self.replicas[rid] = new
                self.replica_ids[id(new)] = rid
        self.touched.add(rid)
        return self.replicas[rid]

    def answer(self, request: tuple) -> None:
        self.pure = False
        try:
            payload = self.reply(self.handle(request))
        except BaseException as e:   # SystemExit, KeyboardInterrupt, pytest.exit: all answers
            payload = self.reply(error=e)
        protocol.write_frame(self.proto[1], payload)

    # --- requests -----------------------------------------------------------------------
    def handle(self, request: tuple) -> object:
        op, *args = request
        if op == "load":
            from course import parts
            return parts.load(*args)
        if op == "getattr":
            obj, name = self.objects[args[0]], args[1]
            if snapshot.plain_attribute(obj, name):
                self.pure = True
                return vars(obj)[name]
            return getattr(obj, name)
        if op == "setattr":
            setattr(self.objects[args[0]], args[1], args[2])
            return None
        if op == "call":
            return self.objects[args[0]](*args[1], **args[2])
        if op == "op" and args[1] in OPERATORS:
            self.pure = snapshot.pure_operator(self.objects[args[0]], args[1])
            return self.operator(self.objects[args[0]], args[1], args[2])
        raise ValueError(f"unknown request {op!r}")

    @staticmethod
    def operator(obj: Any, name: str, args: tuple) -> object:
        if name == "__contains__":
            return bool(args[0] in obj)
        if name == "__len__":
            return len(obj)
        if name == "__getitem__":
            return obj[args[0]]
        if name == "__iter__":
            out = []
            for item in obj:
                out.append(item)
                if len(out) > MAX_ITEMS:
                    raise ValueError(f"iteration gave more than {MAX_ITEMS} items")
            return out
        if name == "__bool__":
            return bool(obj)
        if name == "__eq__":
            return bool(obj == args[0])
        return getattr(obj, name)(*args)       # __enter__ / __exit__

    def callback(self, jid: int, name: str | None, args: tuple, kwargs: dict) -> object:
        """Call a test's object in the judge; while it runs, the judge may ask things of
        student objects (the test's allocator sets seq.block_table): those are answered here."""
        ctx = _context()
        value = _dumps(self.encode((args, kwargs), ctx))
        protocol.write_frame(self.proto[1], pickle.dumps(self.envelope(
            ctx, value=value, callback=(jid, name), snapshots=self.snapshots(ctx)), protocol=5))
        while True:
            message = self.receive()
            if message[0] == "answer":
                break
            self.answer(message)
        self.pure = False          # a request answered meanwhile said nothing of this one
        _, status, result = message
        if status != "ok":
            what = f"{name}() of the test's object" if name else "the test's function"
            raise RuntimeError(f"calling {what} failed: {result}")
        return result

    def envelope(self, ctx: dict, value: bytes = b"", error: tuple[int, str, str] | None = None,
                 callback: tuple[int, str | None] | None = None,
                 snapshots: dict[int, dict[str, bytes]] | None = None) -> dict:
        """A reply, with the attributes of the objects kept in step that the request was
        given (or that the reply names), whether the request ran student code, and the
        snapshots of the student objects the reply names (snapshot.py)."""
        synced: dict[int, bytes] = {}
        todo, done = self.touched | ctx["synced"], set()
        while todo:
            rid = todo.pop()
            done.add(rid)
            ctx["synced"] = set()
            try:
                synced[rid] = _dumps(self.encode(dict(vars(self.replicas[rid])), ctx))
            except Exception:   # nested past MAX_DEPTH, say: the test keeps its own version
                continue
            todo |= ctx["synced"] - done
        return {"value": value, "error": error, "callback": callback,
                "storages": {ctx["order"][k]: v for k, v in ctx["storages"].items()},
                "classes": ctx["classes"], "synced": synced,
                "pure": self.pure and error is None and callback is None,
                "snapshots": snapshots or {}}

    # --- replies ------------------------------------------------------------------------
    def handle_of(self, obj: object) -> int:
        key = id(obj)
        if key not in self.ids:
            self.ids[key] = len(self.objects) + 1
            self.objects[self.ids[key]] = obj
        return self.ids[key]

    def encode(self, value: object, ctx: dict, depth: int = 0) -> object:
        """The value as the judge may decode it. For a snapshot (ctx["plain"]) only plain
        data, containers of it and handles: anything else raises snapshot.NotPlain."""
        if depth > MAX_DEPTH:
            raise ValueError(f"the return value is nested more than {MAX_DEPTH} levels deep")
        t = type(value)
        if t in PLAIN:
            return value
        if t is JudgeObject:   # an object a test lent: it goes back as the test's own object
            return _Pid(("lent", value._jid))
        if ctx["plain"] and t in snapshot.BUILTIN_CONTAINERS and len(value) > snapshot.MAX_ITEMS:
            raise snapshot.NotPlain
        if t in (list, tuple, set, frozenset):
            if all(type(v) in PLAIN for v in value):   # token ids: the common case, fast
                return value
            return t(self.encode(v, ctx, depth + 1) for v in value)
        if t is dict:
            return {self.encode(k, ctx, depth + 1): self.encode(v, ctx, depth + 1)
                    for k, v in value.items()}
        torch = sys.modules.get("torch")
        if ctx["plain"] and (id(value) in self.replica_ids
                             or (torch is not None and isinstance(value, torch.Tensor))
                             or (isinstance(value, type) and issubclass(value, BaseException))):
            raise snapshot.NotPlain
        if torch is not None:
            if isinstance(value, torch.Tensor):
                return self.encode_tensor(value, ctx)
            if t is torch.dtype:
                return _Pid(("dtype", str(value).removeprefix("torch.")))
            if t is torch.Size:
                return _Pid(("size", tuple(int(n) for n in value)))
            if t is torch.device:   # model.device: the test moves its inputs there
                return _Pid(("device", str(value)))
        if isinstance(value, type) and issubclass(value, BaseException):
            return _Pid(("exc_class", self.register_class(value, ctx)))
        if id(value) in self.replica_ids:
            ctx["synced"].add(self.replica_ids[id(value)])
            return _Pid(("synced", self.replica_ids[id(value)]))
        if isinstance(value, enum.Enum) and t.__module__.startswith(REFERENCE_MODULES):
            return _Pid(("enum", t.__module__, t.__qualname__, value.name))
        kind = ("module" if t.__name__ == "module" else "class" if isinstance(value, type)
                else "callable" if callable(value) else "object")
        label = getattr(value, "__qualname__", None) or t.__qualname__
        hid = self.handle_of(value)
        ctx["named"].append((hid, value))
        return _Pid(("obj", hid, kind, str(label)[:200]))

    def register_class(self, cls: type, ctx: dict) -> int:
        hid = self.handle_of(cls)
        if hid not in ctx["classes"]:
            ctx["classes"][hid] = None             # placeholder: bases may refer back
            bases = tuple(self.register_class(b, ctx) for b in cls.__bases__
                          if issubclass(b, BaseException))
            ctx["classes"][hid] = (cls.__module__, cls.__qualname__, bases)
        return hid

    def encode_tensor(self, t: torch.Tensor, ctx: dict) -> _Pid:
        t = t.detach().cpu()
        storage = t.untyped_storage()
        key = storage.data_ptr(), storage.nbytes()
        if key not in ctx["storages"]:
            ctx["storages"][key] = self.mapped_file(*key, ctx) or ("bytes", _storage_bytes(t))
        index = ctx["order"].setdefault(key, len(ctx["order"]))
        return _Pid(("tensor", str(t.dtype).removeprefix("torch."), tuple(t.shape),
                     tuple(t.stride()), t.storage_offset(), index))

    def mapped_file(self, ptr: int, nbytes: int, ctx: dict) -> tuple | None:
        """('file', path, offset, nbytes) when the storage lies in a mapping of a file that the
        judge can see too (the shared folder), else None."""
        if nbytes == 0:
            return None
        if "maps" not in ctx:
            try:
                ctx["maps"] = Path("/proc/self/maps").read_text().splitlines()
            except OSError:
                ctx["maps"] = []
        for line in ctx["maps"]:
            fields = line.split(maxsplit=5)
            if len(fields) < 6:
                continue
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            path = Path(fields[5].strip())
            if lo <= ptr and ptr + nbytes <= hi and path.is_relative_to(self.shared):
                return ("file", str(path), ptr - lo + int(fields[2], 16), nbytes)
        return None

    def reply(self, value: object = None, error: BaseException | None = None) -> bytes:
        ctx = _context()
        try:
            if error is not None:
                cls = self.register_class(type(error), ctx)
                return pickle.dumps(self.envelope(ctx, error=(cls, _safe_str(error), "".join(
                    traceback.format_exception(error)[-12:])[-6000:])), protocol=5)
            encoded = _dumps(self.encode(value, ctx))
        except BaseException as e:   # an unsendable value is the student's error, not ours
            return self.reply(error=ValueError(f"could not send the return value back "
                                               f"({type(e).__name__}: {_safe_str(e)})"))
        return pickle.dumps(self.envelope(ctx, value=encoded, snapshots=self.snapshots(ctx)),
                            protocol=5)

    def snapshots(self, ctx: dict) -> dict[int, dict[str, bytes]]:
        """The plain attributes of the student objects the message names (snapshot.py)."""
        plain = {**_context(), "plain": True, "named": ctx["named"]}
        try:
            return snapshot.collect(ctx["named"], lambda v: self.encode(v, plain), _dumps)
        except Exception:   # a class that defeats the checks: the judge asks instead
            return {}


def _context() -> dict:
    """What encoding one message collects: tensor storages, exception classes, the objects
    kept in step and the student objects (handles) that it names."""
    return {"storages": {}, "order": {}, "classes": {}, "synced": set(), "named": [],
            "plain": False}


def _dumps(tree: object) -> bytes:
    class P(pickle.Pickler):
        def persistent_id(self, obj):
            return obj.pid if type(obj) is _Pid else None
    buf = io.BytesIO()
    P(buf, protocol=5).dump(tree)
    return buf.getvalue()


def _storage_bytes(t) -> bytes:
    import torch
    raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return raw.numpy().tobytes()


def _safe_str(e: BaseException) -> str:
    try:
        return str(e)[:4000]
    except BaseException:
        return f"<{type(e).__name__} whose message cannot be printed>"


class _Requests(pickle.Unpickler):
    """Requests come from the judge (trusted); handles name objects that live here, and the
    reference modules the tests pass objects of (a Tokenizer) are imported through the
    resolver, under the names the judge gave them."""

    def __init__(self, data: bytes, worker: Worker):
        super().__init__(io.BytesIO(data))
        self.worker = worker

    def persistent_load(self, pid):
        if pid[0] == "j":
            return JudgeObject(self.worker, pid[1])
        if pid[0] == "S":   # kept in step with the judge's object (judge.py's _dumps)
            return self.worker.replica(pid[1])
        if pid[0] == "K":   # a reference object, sent once (judge.py's _dumps)
            self.worker.kept[pid[1]] = _Requests(pid[2], self.worker).load()
        if pid[0] in ("K", "k"):
            return self.worker.kept[pid[1]]
        return self.worker.objects[pid[1]]

    def find_class(self, module: str, name: str):
        if module.startswith(REFERENCE_MODULES) and module not in sys.modules:
            from course import parts
            stage, _, part = module.removeprefix(REFERENCE_MODULES).partition("_")
            parts.reference(stage, part)
        return super().find_class(module, name)


def main() -> int:
    # The protocol keeps private copies of stdin/stdout; whatever student code prints goes to
    # stderr, so a print() cannot corrupt a reply.
    proto_in, proto_out = os.dup(0), os.dup(1)
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    sys.stdout = sys.stderr
    worker = Worker()
    worker.proto = (proto_in, proto_out)
    while True:
        try:
            request = worker.receive()
        except EOFError:
            return 0
        except Exception as e:   # the grader's fault, not the student's: say so, keep going
            worker.pending.clear()
            protocol.write_frame(proto_out, worker.reply(error=RuntimeError(
                f"the grader could not pass the test's values to the student's code "
                f"({type(e).__name__}: {_safe_str(e)})")))
            continue
        worker.answer(request)
        worker.touched = set()


if __name__ == "__main__":
    sys.exit(main())
