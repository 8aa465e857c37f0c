"""The judge: a pytest plugin that runs the course's tests with student parts kept at arm's length.

Loaded into the pytest child that runs a stage's tests during class grading (never together
with student code). `parts.load()` of a student part returns a proxy: every attribute,
call and operator on it is a request to the worker (harness.py), a sandboxed process that
holds the student's modules. The tests, their expected values, the comparisons and the
results stay in this process, which the student's code cannot reach: it can only answer.

What comes back is checked (protocol.py): plain data, tensors rebuilt here, handles to
objects that stay in the worker, and exception classes mirrored here (only ordinary Exception
subclasses: a student's SystemExit, KeyboardInterrupt or pytest.exit() becomes a plain
failure). Objects of the course's reference modules that a test passes to student code go by
value. Those whose attributes are plain data (stage 11's Sequence, given to stage 13's
BlockManager) are kept in step: the worker keeps one copy of each, updated in place when the
test changed it, and every reply brings back the attributes of those the call was given, which
are written into the test's own objects (lists and dicts in place), so the test sees what the
student's code did to them, as in a local run. The others (a Tokenizer) are copied once.
Objects of the tests themselves (a test's allocator, a lambda it patches in) are lent: the
worker, which has no tests, calls them back here. A `with` block on a student object never
swallows the judge's exception, == between two student objects is the student's answer
coerced to a bool, and a worker that dies or hangs fails the test in progress (one that
hangs past --timeout reads `timeout`) and is restarted (a few times) for the next.

Configured by a JSON file named in TINYVLLM_CLASSROOM_JUDGE (written by grade.py).
"""
from __future__ import annotations

import builtins
import dataclasses
import enum
import hashlib
import io
import json
import mmap
import os
import pickle
import re
import select
import subprocess
import sys
import types
from pathlib import Path

from course import manifest, parts
from grader.classroom import protocol, sandbox, snapshot
from grader.classroom.protocol import PLAIN, REFERENCE_MODULES
from grader.classroom.harness import SHARED_ENV
from grader.pytest_plugin import TimedOut

CONFIG_ENV = "TINYVLLM_CLASSROOM_JUDGE"
MAX_RESTARTS = 3


class RemoteError(Exception):
    """An exception raised by student code that is not an ordinary Exception (or whose class
    cannot be mirrored): a plain failure here."""


class WorkerFailed(RemoteError):
    """The worker died, hung or sent something that is not a reply."""


class WorkerTimeout(WorkerFailed, TimedOut):
    """The worker did not answer within --timeout: the test reads `timeout` (TimedOut), as
    one that the grader kills for running too long does."""


KNOWN: dict[tuple[str, str], type] = {
    ("builtins", name): cls for name, cls in vars(builtins).items()
    if isinstance(cls, type) and issubclass(cls, Exception)}
KNOWN[("dataclasses", "FrozenInstanceError")] = dataclasses.FrozenInstanceError
KNOWN[("json.decoder", "JSONDecodeError")] = json.JSONDecodeError


class Remote:
    """A student object that lives in the worker."""

    __slots__ = ("_r_conn", "_r_gen", "_r_hid", "_r_kind", "_r_label")

    def __init__(self, conn: Connection, gen: int, hid: int, kind: str, label: str):
        for k, v in (("conn", conn), ("gen", gen), ("hid", hid), ("kind", kind),
                     ("label", label)):
            object.__setattr__(self, "_r_" + k, v)

    def _r(self, op: str, *args):
        return self._r_conn.request(self._r_gen, op, self._r_hid, *args)

    def __getattr__(self, name: str):
        if name.startswith("__"):   # copy/pickle/inspect probes stay local
            raise AttributeError(name)
        conn = self._r_conn
        if self._r_gen == conn.gen:   # a plain attribute the last replies brought along
            value = conn.snapshots.read(self._r_hid, name, conn.snapshot_value)
            if value is not snapshot.Snapshots.MISSING:
                return value
        return self._r("getattr", name)

    def __setattr__(self, name: str, value) -> None:
        self._r("setattr", name, value)

    def __call__(self, *args: object, **kwargs: object) -> object:
        return self._r("call", args, kwargs)

    def __enter__(self):
        return self._r("op", "__enter__", ())

    def __exit__(self, *exc) -> bool:
        self._r("op", "__exit__", (None, None, None))
        return False               # the student's __exit__ may not swallow a failed assert

    def __contains__(self, item) -> bool:
        return _expect(self._r("op", "__contains__", (item,)), bool, "`in`")

    def __len__(self) -> int:
        n = _expect(self._r("op", "__len__", ()), int, "len()")
        if n < 0:
            raise WorkerFailed(f"len() of a student object gave {n}")
        return n

    def __getitem__(self, key):
        return self._r("op", "__getitem__", (key,))

    def __iter__(self):
        return iter(_expect(self._r("op", "__iter__", ()), list, "iteration"))

    def __bool__(self) -> bool:
        return _expect(self._r("op", "__bool__", ()), bool, "bool()")

    def __eq__(self, other):
        if isinstance(other, Remote) and other._r_conn is self._r_conn:
            return _expect(self._r("op", "__eq__", (other,)), bool, "==")
        return NotImplemented

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"<student {self._r_kind} {self._r_label}>"

    __str__ = __repr__


def _expect(value, kind: type, what: str):
    if type(value) is not kind:
        raise WorkerFailed(f"{what} on a student object gave {type(value).__name__}, "
                           f"expected {kind.__name__}")
    return value


class Connection:
    """The judge's end of the worker: started on first use, restarted after a death."""

    def __init__(self, config: dict):
        self.config = config
        self.proc: subprocess.Popen | None = None
        self.gen = 0
        self.deaths = 0
        self.last_death: type[WorkerFailed] = WorkerFailed   # a hang: WorkerTimeout
        self.mirrors: dict[tuple[int, int], type] = {}
        self.maps: dict[tuple, object] = {}
        self.shared = Path(config["shared"]).resolve()
        self.lent: dict[int, object] = {}      # objects of the tests the worker may call back
        self.kept: set[str] = set()            # digests of the reference objects it holds
        self.synced: dict[int, object] = {}    # reference objects kept in step, by id here
        self.synced_digest: dict[int, str] = {}   # ... and the version the worker holds
        self.extra_tests = [Path(h).resolve() for h in config.get("extra_tests", ())]
        self.test_modules: dict[str, bool] = {}   # module name -> defined by the tests?
        self.snapshots = snapshot.Snapshots()     # plain attributes read without a request

    # --- the process ----------------------------------------------------------------------
    def start(self) -> None:
        if self.deaths > MAX_RESTARTS:   # not run, for the reason its process last ended
            raise self.last_death(f"the student's code killed or hung its process "
                                  f"{self.deaths} times; not restarting it again")
        c = self.config
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
               "HOME": c["shared"], "PYTHONPATH": c["worker_root"],
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0",
               "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
               SHARED_ENV: c["shared"], "TINYVLLM_CACHE": str(Path(c["shared"]) / ".cache"),
               **parts.selection_env(c["student_stages"], Path(c["student_root"]))}
        mounts = sandbox.Mounts([Path(c["worker_root"]), Path(c["student_root"])],
                                [Path(c["shared"])], [Path(p) for p in c["hidden"]])
        self.proc = sandbox.popen([sys.executable, "-m", "grader.classroom.harness"], mounts,
                                  Path(c["shared"]), env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.gen += 1
        self.mirrors.clear()
        self.kept.clear()
        self.synced.clear()
        self.synced_digest.clear()
        self.snapshots.clear()

    def stop(self) -> None:
        if self.proc is not None:
            sandbox.kill(self.proc)
            self.proc = None

    def _died(self, why: str, kind: type[WorkerFailed] = WorkerFailed) -> WorkerFailed:
        self.stop()
        self.deaths += 1
        self.last_death = kind
        return kind(f"the student's code {why}")

    # --- requests -------------------------------------------------------------------------
    def module(self, stage_id: str, name: str) -> Remote:
        if self.proc is None or self.proc.poll() is not None:
            if self.proc is not None:
                self._died("ended its process")
            self.start()
        return self.request(self.gen, "load", stage_id, name)

    def request(self, gen: int, op: str, *args: object) -> object:
        if gen != self.gen or self.proc is None:
            raise WorkerFailed("this student object belonged to a worker process that has "
                               "died since")
        try:
            protocol.write_frame(self.proc.stdin.fileno(), self._dumps((op, *args)))
        except (BrokenPipeError, OSError):
            raise self._died("ended its process (os._exit? a crash?)") from None
        fd = self.proc.stdout.fileno()
        while True:
            ready, _, _ = select.select([fd], [], [], self.config["call_timeout"])
            if not ready:
                raise self._died(f"did not answer within {self.config['call_timeout']:.0f} s "
                                 "(an infinite loop?)", WorkerTimeout)
            try:
                envelope = protocol.safe_loads(protocol.read_frame(fd), _no_pid)
            except EOFError:
                raise self._died("ended its process while answering (os._exit? a crash?)") \
                    from None
            except protocol.ProtocolError as e:
                raise self._died(f"sent an invalid reply: {e}") from None
            value = self._decode(envelope)
            if envelope["callback"] is None:
                return value
            self._call_back(envelope["callback"], value)

    def _call_back(self, target, value) -> None:
        """The student's code calls a public method of an object a test gave it (name None:
        the object itself, a function)."""
        try:
            jid, name = target
            args, kwargs = value
            if (name is not None and (type(name) is not str or name.startswith("_"))) \
                    or type(args) is not tuple or type(kwargs) is not dict:
                raise ValueError(f"cannot call {name!r} of the test's object")
            fn = self.lent[jid] if name is None else getattr(self.lent[jid], name)
            answer = ("answer", "ok", fn(*args, **kwargs))
        except Exception as e:
            answer = ("answer", "error", f"{type(e).__name__}: {e}")
        protocol.write_frame(self.proc.stdin.fileno(), self._dumps(answer))

    def _dumps(self, payload: object) -> bytes:
        """A frame for the worker: ("sync", states, payload pickled). states holds, for each
        object kept in step that the payload reaches and that changed since the worker last
        had it, its pickled self; the worker updates its copy in place before it reads the
        payload. An object of a reference module that is not kept in step (a Tokenizer: 7 MB
        pickled, 2 s to unpickle) goes once per worker, named by the digest of its bytes, so a
        changed one is sent again."""
        frame = _Frame()
        body = self._pickle(payload, frame)
        while frame.pending:
            obj = frame.pending.pop()
            data = self._pickle(obj, frame, top=obj)
            digest = hashlib.sha256(data).hexdigest()
            if self.synced_digest.get(id(obj)) != digest:
                frame.states[id(obj)] = data
                self.synced_digest[id(obj)] = digest
        if frame.states:    # a student object may hold a list of an object updated now
            self.snapshots.clear()
        return pickle.dumps(("sync", frame.states, body), protocol=5)

    def _pickle(self, value: object, frame: _Frame, top: object = None) -> bytes:
        conn = self

        class P(pickle.Pickler):
            def persistent_id(self, obj):
                if isinstance(obj, Remote):
                    if obj._r_conn is not conn or obj._r_gen != conn.gen:
                        raise WorkerFailed("a student object from a dead worker was passed on")
                    return ("h", obj._r_hid)
                if type(obj) in _DATA or obj is top or isinstance(obj, (type, enum.Enum)):
                    return None
                if conn._lent(obj):   # the worker cannot rebuild it: lend it
                    conn.lent[id(obj)] = obj
                    return ("j", id(obj))
                if not type(obj).__module__.startswith(REFERENCE_MODULES):
                    return None
                if _in_step(obj, []):
                    conn.synced[id(obj)] = obj
                    if id(obj) not in frame.seen:
                        frame.seen.add(id(obj))
                        frame.pending.append(obj)
                    return ("S", id(obj))
                data = conn._pickle(obj, frame, top=obj)
                digest = hashlib.sha256(data).hexdigest()
                if digest in conn.kept:
                    return ("k", digest)
                conn.kept.add(digest)
                return ("K", digest, data)
        buf = io.BytesIO()
        P(buf, protocol=5).dump(value)
        return buf.getvalue()

    def _lent(self, obj) -> bool:
        """Whether obj belongs to the tests (a local class or function, or one defined in a
        test module or the hidden tests): the worker has no tests to rebuild it from."""
        if isinstance(obj, types.FunctionType):
            name, module = obj.__qualname__, obj.__module__
        else:
            name, module = type(obj).__qualname__, type(obj).__module__
        if "<locals>" in name or "<lambda>" in name:
            return True
        if module not in self.test_modules:
            file = getattr(sys.modules.get(module), "__file__", None)
            self.test_modules[module] = file is not None and self._is_test_file(Path(file))
        return self.test_modules[module]

    def _is_test_file(self, path: Path) -> bool:
        """A course test (a `tests` folder inside the course), a conftest.py, or a hidden test.
        Only the course's own part of the path counts, and a hidden-tests folder never makes
        the course's modules tests: `--extra-tests /tmp` with the course in /tmp/tiny-vllm, or
        the course under a folder named tests, must not lend the course's own classes."""
        path, root = path.resolve(), manifest.ROOT
        if path.name == "conftest.py" or any(path.is_relative_to(d) and not
                                             root.is_relative_to(d) for d in self.extra_tests):
            return True    # a hidden-tests folder beside the course, or inside it
        if path.is_relative_to(root):
            return "tests" in path.relative_to(root).parts
        return any(path.is_relative_to(d) for d in self.extra_tests)

    def _apply(self, synced: dict, classes: dict, storages: dict, built: dict) -> None:
        """Write what the student's code did to objects kept in step into the test's own."""
        for rid, data in synced.items():
            obj = self.synced.get(rid) if type(rid) is int else None
            if obj is None or not isinstance(data, bytes):
                raise protocol.ProtocolError("the state of an object the test never passed")
            state = protocol.safe_loads(
                data, lambda pid: self._object(pid, classes, storages, built))
            if type(state) is not dict or any(type(k) is not str for k in state):
                raise protocol.ProtocolError("an object's state that is not a dict of names")
            for name in state:
                # what the class defines (a method, a property) is not the student's to replace:
                # the test would call student code thinking it the reference's
                defined = getattr(type(obj), name, None)
                if isinstance(defined, property) or (callable(defined) and name not in vars(obj)):
                    raise protocol.ProtocolError(f"the student's code set {name!r}, which "
                                                 f"{type(obj).__name__} defines itself")
            protocol.update_in_place(obj, state)
            data = self._pickle(obj, _Frame(), top=obj)
            self.synced_digest[rid] = hashlib.sha256(data).hexdigest()

    # --- replies --------------------------------------------------------------------------
    def _decode(self, envelope):
        if not (isinstance(envelope, dict) and set(envelope) == {
                "value", "error", "callback", "storages", "classes", "synced", "pure",
                "snapshots"}):
            raise self._died("sent a reply of the wrong shape")
        classes, storages = envelope["classes"], envelope["storages"]
        if not (isinstance(classes, dict) and isinstance(storages, dict)
                and isinstance(envelope["synced"], dict)):
            raise self._died("sent a reply of the wrong shape")
        built: dict[int, object] = {}
        try:
            self.snapshots.take(envelope)
            self._apply(envelope["synced"], classes, storages, built)
        except protocol.ProtocolError as e:
            raise self._died(f"sent an invalid reply: {e}") from None
        if envelope["error"] is not None:
            err = envelope["error"]
            if not (isinstance(err, tuple) and len(err) == 3 and isinstance(err[1], str)
                    and isinstance(err[2], str)):
                raise self._died("sent an error of the wrong shape")
            cls = self._mirror(err[0], classes, set())
            exc = cls.__new__(cls)
            Exception.__init__(exc, err[1])
            exc._remote_message = err[1]
            if isinstance(exc, SyntaxError):   # its str() is its msg: "invalid syntax (x.py, ...)"
                exc.msg = err[1]
            exc.add_note("raised in the student's code:\n" + err[2])
            raise exc

        def persistent(pid):
            return self._object(pid, classes, storages, built)
        if not isinstance(envelope["value"], bytes):
            raise self._died("sent a reply of the wrong shape")
        try:
            return protocol.safe_loads(envelope["value"], persistent)
        except protocol.ProtocolError as e:
            raise self._died(f"sent an invalid reply: {e}") from None

    def snapshot_value(self, data: bytes) -> object:
        """An attribute's value from a snapshot: plain data and handles only."""
        def persistent(pid):
            if not (isinstance(pid, tuple) and pid and pid[0] in snapshot.SNAPSHOT_PIDS):
                raise protocol.ProtocolError(f"a snapshot naming {str(pid)[:80]}")
            return self._object(pid, {}, {}, {})
        try:
            return protocol.safe_loads(data, persistent)
        except protocol.ProtocolError as e:
            raise self._died(f"sent an invalid reply: {e}") from None

    def _object(self, pid, classes: dict, storages: dict, built: dict):
        if not isinstance(pid, tuple) or not pid:
            raise protocol.ProtocolError("bad persistent id")
        if pid[0] == "obj" and len(pid) == 4 and type(pid[1]) is int \
                and pid[2] in ("module", "class", "callable", "object") \
                and isinstance(pid[3], str):
            return Remote(self, self.gen, pid[1], pid[2], pid[3][:200])
        if pid[0] == "exc_class" and len(pid) == 2:
            return self._mirror(pid[1], classes, set())
        if pid[0] == "lent" and len(pid) == 2 and type(pid[1]) is int and pid[1] in self.lent:
            return self.lent[pid[1]]         # the test's own object, which it lent the worker
        if pid[0] == "synced" and len(pid) == 2 and type(pid[1]) is int and pid[1] in self.synced:
            return self.synced[pid[1]]       # the test's own object, kept in step
        if pid[0] == "enum" and len(pid) == 4 and all(type(f) is str for f in pid[1:]):
            return _reference_enum(*pid[1:])
        if pid[0] in ("dtype", "size", "device") and len(pid) == 2:
            import torch
            if pid[0] == "size" and _ints(pid[1]):
                return torch.Size(pid[1])
            if pid[0] == "device" and isinstance(pid[1], str) \
                    and re.fullmatch(r"(cpu|cuda|meta)(:\d{1,3})?", pid[1]):
                return torch.device(pid[1])
            dtype = getattr(torch, pid[1], None) if isinstance(pid[1], str) else None
            if isinstance(dtype, torch.dtype):
                return dtype
        if pid[0] == "tensor" and len(pid) == 6:
            return self._tensor(pid[1:], storages, built)
        raise protocol.ProtocolError(f"unknown persistent id {str(pid)[:80]}")

    def _mirror(self, hid, classes: dict, seen: set) -> type:
        """The local stand-in for a student exception class (the real class when it is a
        builtin or a known library exception)."""
        info = classes.get(hid) if type(hid) is int else None
        if not (isinstance(info, tuple) and len(info) == 3 and isinstance(info[0], str)
                and isinstance(info[1], str) and isinstance(info[2], tuple)) or hid in seen:
            return RemoteError
        if (info[0], info[1]) in KNOWN:
            return KNOWN[info[0], info[1]]
        key = (self.gen, hid)
        if key not in self.mirrors:
            bases = tuple(dict.fromkeys(self._mirror(b, classes, seen | {hid})
                                        for b in info[2][:8])) or (RemoteError,)
            namespace = {"__module__": "student." + info[0][:100],
                         "__str__": lambda e: getattr(e, "_remote_message", "")}
            try:
                self.mirrors[key] = type(info[1][:100], bases, namespace)
            except TypeError:   # an impossible MRO: keep the name, lose the ancestry
                self.mirrors[key] = type(info[1][:100], (RemoteError,), namespace)
        return self.mirrors[key]

    def _tensor(self, fields: tuple, storages: dict, built: dict):
        import torch
        dtype_name, shape, stride, offset, index = fields
        dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
        if not isinstance(dtype, torch.dtype) or not _ints(shape) or not _ints(stride) \
                or len(shape) != len(stride) or type(offset) is not int or offset < 0 \
                or any(n < 0 for n in shape):
            raise protocol.ProtocolError("a tensor with a bad description")
        if index not in built:
            built[index] = self._storage(storages.get(index))
        raw, byte_offset = built[index]
        item = torch.empty(0, dtype=dtype).element_size()
        if 0 in shape:
            return torch.empty(shape, dtype=dtype)
        end = (offset + sum((n - 1) * s for n, s in zip(shape, stride)) + 1) * item
        if any(s < 0 for s in stride) or end > raw.numel() - byte_offset \
                or byte_offset % item:
            if byte_offset % item == 0:
                raise protocol.ProtocolError("a tensor that reaches past its storage")
            raw, byte_offset = raw[byte_offset:].clone(), 0    # misaligned in the file: copy
        return torch.empty(0, dtype=dtype).set_(raw.untyped_storage(),
                                                 (raw.storage_offset() + byte_offset) // item
                                                 + offset, shape, stride)

    def _storage(self, spec) -> tuple:
        """(uint8 tensor, byte offset of the storage in it)."""
        import torch
        if isinstance(spec, tuple) and len(spec) == 2 and spec[0] == "bytes" \
                and isinstance(spec[1], bytes):
            data = bytearray(spec[1])
            return (torch.frombuffer(data, dtype=torch.uint8) if data
                    else torch.empty(0, dtype=torch.uint8)), 0
        if isinstance(spec, tuple) and len(spec) == 4 and spec[0] == "file" \
                and isinstance(spec[1], str) and _ints(spec[2:]):
            return self._mapped(Path(spec[1]), spec[2], spec[3])
        raise protocol.ProtocolError("a tensor storage with a bad description")

    def _mapped(self, path: Path, offset: int, nbytes: int) -> tuple:
        """A view of the judge's own mapping of a file in the shared folder (one mapping per
        file version, so two tensors of one file relate here as they did in the worker)."""
        import torch
        if path.is_symlink() or not path.resolve().is_relative_to(self.shared) \
                or not path.is_file():
            raise protocol.ProtocolError(f"a tensor mapped from {path}, outside the shared folder")
        st = path.stat()
        key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
        if key not in self.maps:
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            self.maps[key] = torch.frombuffer(mm, dtype=torch.uint8)
        raw = self.maps[key]
        if offset < 0 or nbytes < 0 or offset + nbytes > raw.numel():
            raise protocol.ProtocolError(f"a tensor past the end of {path.name}")
        return raw, offset


def _ints(values) -> bool:
    return isinstance(values, tuple) and all(type(v) is int for v in values)


@dataclasses.dataclass
class _Frame:
    """What one frame to the worker collects: the objects kept in step that it reaches."""
    states: dict = dataclasses.field(default_factory=dict)   # id -> pickled self, if changed
    pending: list = dataclasses.field(default_factory=list)
    seen: set = dataclasses.field(default_factory=set)


_DATA = frozenset((*PLAIN, list, tuple, dict, set, frozenset))   # pickled as they are


def _in_step(value, path: list) -> bool:
    """Whether `value` can be kept in step with a copy in the worker: plain data, containers
    of it, enum members, and objects of the reference modules whose attributes are such
    (no cycles: `path` holds the objects being checked)."""
    t = type(value)
    if t in PLAIN or isinstance(value, enum.Enum):
        return True
    if t in (list, tuple, set, frozenset):
        return all(_in_step(v, path) for v in value)
    if t is dict:
        return all(_in_step(k, path) and _in_step(v, path) for k, v in value.items())
    if not t.__module__.startswith(REFERENCE_MODULES) or not hasattr(value, "__dict__") \
            or isinstance(value, (type, types.ModuleType)) or any(value is p for p in path):
        return False
    return all(_in_step(v, path + [value]) for v in vars(value).values())


def _reference_enum(module: str, qualname: str, name: str):
    """A member of an enum of a reference module, as loaded here (never imports anything)."""
    cls = sys.modules.get(module) if module.startswith(REFERENCE_MODULES) else None
    for part in qualname.split("."):
        cls = getattr(cls, part, None)
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum)) or name not in cls.__members__:
        raise protocol.ProtocolError(f"no enum member {module}.{qualname}.{name}")
    return cls[name]


def _no_pid(pid):
    raise protocol.ProtocolError("unexpected persistent id in a reply envelope")


_connection: Connection | None = None


def pytest_configure(config) -> None:
    global _connection
    path = os.environ.get(CONFIG_ENV)
    if not path:
        return
    settings = json.loads(Path(path).read_text())
    _connection = Connection(settings)
    original = parts.load
    student = set(settings["student_stages"])

    def load(stage_id: str, module: str):
        stage = manifest.find(stage_id)
        if stage.id in student and module + ".py" in stage.parts:
            return _connection.module(stage.id, module)
        return original(stage_id, module)
    parts.load = load


def pytest_unconfigure(config) -> None:
    if _connection is not None:
        _connection.stop()
