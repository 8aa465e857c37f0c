"""The engine's own process: it builds the engine, then steps it, taking commands from the
server and sending it outputs over two pipes.

    process = ctx.Process(target=engine_core.run, args=(build, commands, outputs, 0.02))

Why a process: the HTTP server is Python too, and in one interpreter every chunk it writes
holds the lock the engine needs to queue its next GPU step; at 256 streams that idled the
GPU. Here the engine's loop is the offline loop plus a pipe: its host time is its own, and a
thread of this process writes the pipe, so a server slow to read never holds up a step.

build: a picklable callable (the process is spawned, not forked: CUDA does not survive a
fork) that returns Served. Every message is a tuple of plain values (no engine types), so
both sides unpickle them without loading any stage (this module loads none either: `serve
--mine` chooses whose parts load after importing it):

    server -> engine   ("add", ticket, jobs)   jobs: [(prompt, raw, fields)]; fields are
                                               SamplingParams' (max_tokens left out: the
                                               rest of the context)
                       ("abort", [request ids])
                       ("stop",)               abort what runs, answer "stopped", exit
    engine -> server   ("ready", info)         info: model, max_model_len, max_num_seqs,
                                               has_text, about
                       ("unavailable", text)   build failed: the reason in a line; exits
                       ("taken", ticket, [request ids], [prompt tokens per job])
                       ("refused", ticket, kind, text)   kind: ValueError, TypeError or
                                               another exception's name (a bug: 500)
                       ("outputs", [(id, new text, new ids, finished, reason)], stats)
                       ("stats", stats)        (running, waiting, cache used, cache total)
                       ("failed", text)        a step raised: every request was aborted
                       ("stopped",)

A job's requests are taken together or not at all. Outputs go at most every
stream_interval_s (the steps between are sent together), and at once when the engine goes
idle. The server going away (its end of the pipe closed) ends this process too.
"""
from __future__ import annotations

import math
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from solutions.engine.__main__ import one_line

if TYPE_CHECKING:
    from solutions.engine.llm_engine import LLMEngine

# prompt, raw -> checked token ids; raw: a string is the whole prompt, not a user message
Prepare = Callable[[object, bool], list[int]]


@dataclass
class Served:
    """What the engine process serves: an engine nothing else drives, how it turns a prompt
    into token ids (LLM.prepare, or ids_only), whether it makes text (stop strings need it),
    the model's name in the API, and a line about the engine for logs."""
    engine: LLMEngine
    prepare: Prepare
    has_text: bool
    model: str
    about: str = ""


def ids_only(max_len: int) -> Prepare:
    """The prompt check of a model without a tokenizer: token ids only."""
    from solutions.engine.llm_engine import token_ids

    def prepare(prompt: object, raw: bool) -> list[int]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], dict)):
            raise ValueError("this server's model has no tokenizer: send token ids")
        ids = token_ids(prompt)
        if not ids:
            raise ValueError("the prompt is empty (no tokens)")
        if len(ids) > max_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than the context of "
                             f"{max_len} positions")
        return ids
    return prepare


def run(build: Callable[[], Served], commands: Connection, outputs: Connection,
        stream_interval_s: float) -> None:
    """The process's body. Ctrl-C in a terminal reaches every process of the group: this one
    ignores it and lets the server decide (it finishes what is in flight, then says stop)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        served = build()
    except Exception as e:
        if not isinstance(e, (OSError, ValueError, NotImplementedError)):
            traceback.print_exc(file=sys.stderr)
        outputs.send(("unavailable", one_line(e)))
        return
    engine = served.engine
    outputs.send(("ready", {"model": served.model, "max_model_len": engine.max_model_len,
                            "max_num_seqs": engine.scheduler.config.max_num_seqs,
                            "has_text": served.has_text, "about": served.about}))
    _Core(served, outputs, stream_interval_s).serve(commands)


class _Core:
    def __init__(self, served: Served, outputs: Connection, stream_interval_s: float):
        from course import parts
        self.served, self.engine = served, served.engine
        self.sampling_params = parts.load("11", "sampling_params").SamplingParams
        self.interval = stream_interval_s
        self.stats: tuple[int, int, int, int] | None = None
        # A thread of its own pickles and writes the messages: the step loop only queues
        # them. Written by the loop, a message waited whenever the pipe was full (the server
        # busy writing chunks), and each wait idled the GPU until the next step was queued.
        self._mail: queue.SimpleQueue = queue.SimpleQueue()
        self._postman = threading.Thread(target=self._deliver, args=(outputs,),
                                         name="engine outputs", daemon=True)
        self._postman.start()

    def _deliver(self, outputs: Connection) -> None:
        while (message := self._mail.get()) is not None:
            try:
                outputs.send(message)
            except OSError:          # the server has gone: the step loop sees it too
                return

    def serve(self, commands: Connection) -> None:
        engine = self.engine
        pending: list[tuple] = []          # outputs not sent yet
        sent = -math.inf                   # when outputs went last (the first: at once)
        while True:
            if not engine.has_unfinished():
                pending = self._send(pending)
            try:
                # idle: sleep until a command comes; busy: take what came, then step
                while commands.poll(0 if engine.has_unfinished() else None):
                    if not self._obey(commands.recv()):
                        self._abort_all()
                        self._mail.put(("stopped",))
                        self._mail.put(None)
                        self._postman.join()
                        return
            except EOFError:               # the server has gone
                return
            if not engine.has_unfinished():
                continue
            try:
                pending += [(o.request_id, o.new_text, o.new_token_ids, o.finished,
                             o.finish_reason) for o in engine.step()]
            except Exception as e:          # a bug or a device error: fail what runs, serve on
                traceback.print_exc(file=sys.stderr)
                pending = self._send(pending)   # what came before the failure
                self._abort_all()
                self._mail.put(("failed", one_line(e)))
                continue
            now = time.monotonic()
            if now - sent >= self.interval:
                pending, sent = self._send(pending), now

    def _obey(self, command: tuple) -> bool:
        """Carry out a command; False for stop."""
        if command[0] == "stop":
            return False
        if command[0] == "abort":
            for request_id in command[1]:
                self.engine.abort(request_id)
        else:
            self._add(*command[1:])
        self._send_stats()
        return True

    def _add(self, ticket: int, jobs: list[tuple[object, bool, dict]]) -> None:
        taken: list[int] = []
        lengths: list[int] = []
        try:
            for prompt, raw, fields in jobs:
                ids = self.served.prepare(prompt, raw)
                rest = max(1, self.engine.max_model_len - len(ids))   # a full prompt gets one
                params = self.sampling_params(**{"max_tokens": rest, **fields})
                taken.append(self.engine.add_request(ids, params))
                lengths.append(len(ids))
        except Exception as e:             # ValueError / TypeError: refused (400); else a bug
            for request_id in taken:
                self.engine.abort(request_id)
            self._mail.put(("refused", ticket, type(e).__name__, one_line(e)))
            return
        self._mail.put(("taken", ticket, taken, lengths))

    def _send(self, pending: list[tuple]) -> list:
        if pending:
            self.stats = self._stats()
            self._mail.put(("outputs", pending, self.stats))
        return []

    def _send_stats(self) -> None:
        stats = self._stats()
        if stats != self.stats:
            self.stats = stats
            self._mail.put(("stats", stats))

    def _stats(self) -> tuple[int, int, int, int]:
        sched = self.engine.scheduler
        alloc = sched.allocator
        if hasattr(alloc, "num_used_blocks"):      # stage 13's BlockManager
            used, total = alloc.num_used_blocks, alloc.num_total_blocks
        else:                                       # stage 11's SlotAllocator
            used, total = alloc.num_slots - len(alloc.free_slots), alloc.num_slots
        return len(sched.running), len(sched.waiting), used, total

    def _abort_all(self) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
        self._send_stats()

