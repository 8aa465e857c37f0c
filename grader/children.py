"""The grader's children that run in sessions of their own, and their end when the grader ends.

Test processes (runner.py) and sandboxed student processes (classroom/sandbox.py) start with
start_new_session=True, so that a timeout can kill everything one of them started at once
(os.killpg). The price: they are outside the terminal's process group, so Ctrl-C does not
reach them, and they outlive a grader that is stopped. Seen on the H200: `timeout` stopped
`grader verify` in its class-grading step and a student's process went on holding the GPU.
So each such child is tracked here, and when the grader exits (at the end, on Ctrl-C, or on
SIGTERM) the sessions of those still running are killed.
"""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import threading
import weakref

_children: weakref.WeakSet[subprocess.Popen] = weakref.WeakSet()
_lock = threading.RLock()   # re-entrant: the signal handlers take it on the main thread
_installed = False


def track(proc: subprocess.Popen) -> subprocess.Popen:
    """Register a child started with start_new_session=True; returns it."""
    with _lock:
        _children.add(proc)
    return proc


def kill_all() -> int:
    """Kill the session of every tracked child still running; how many there were."""
    with _lock:
        running = [p for p in _children if p.poll() is None]
    for proc in running:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return len(running)


def _on_sigterm(signum, frame) -> None:
    kill_all()
    raise SystemExit(128 + signum)   # unwinds like Ctrl-C


def _on_sigint(signum, frame) -> None:
    kill_all()   # first: while the grader unwinds (removing workspaces) nothing writes in them
    raise KeyboardInterrupt


def install() -> None:
    """Once, from the grader's entry point: at exit every tracked session still running is
    killed; SIGTERM and Ctrl-C kill them at once, then unwind the grader (SystemExit,
    KeyboardInterrupt). A Ctrl-C that the grader was started ignoring stays ignored."""
    global _installed
    if _installed:
        return
    _installed = True
    atexit.register(kill_all)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _on_sigint)
