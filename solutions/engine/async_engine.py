"""The server's side of the engine: the engine runs in a process of its own (engine_core.py),
and any number of asyncio tasks talk to it.

    engine = AsyncEngine(build, max_waiting=256)     # starts the process, waits until it is
                                                     # ready; EngineUnavailable: why not
    engine.start()                                   # in the event loop's thread
    stream, prompt_tokens = await engine.add(jobs)   # ValueError / TypeError: refused
    async for batch in stream:                       # lists of (choice, RequestOutput)
        ...
    engine.abort(stream)                             # the client went away: cache freed
    engine.stop()                                    # ends the process and waits for it

Two threads of this process carry the pipes, so the event loop never waits on the engine:
one sends the commands (a flood of large prompts could fill a pipe while the engine is in
a step), one receives the engine's messages and hands each to the event loop in one
`call_soon_threadsafe`. Each request's outputs queue up on the event loop's side, at most
max_tokens of them: a slow client never holds up a step, and a step never holds up a client.

Admission control: `add` raises Overloaded when `capacity` requests are already in the engine
(the ones running plus max_waiting queued), so a flood of clients gets a quick "try again"
instead of an unbounded queue.
"""
from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import queue
import sys
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from solutions.engine import engine_core

if TYPE_CHECKING:   # it loads stage 11's parts: not before `serve --mine` has chosen whose
    from solutions.engine.llm_engine import RequestOutput

STREAM_INTERVAL_S = 0.02
STOP_TIMEOUT_S = 60      # the engine finishes its step, then aborts; past this it is killed


class Overloaded(Exception):
    """The engine holds as many requests as it may: the client should retry later."""


class EngineUnavailable(Exception):
    """The engine process could not be built, or has exited: the sentence says why."""


@dataclass
class EngineStats:
    """What /health shows: requests in the engine and how much of the KV cache they hold."""
    running: int = 0
    waiting: int = 0
    kv_cache_used: int = 0     # blocks (paged) or slots (contiguous) in use
    kv_cache_total: int = 0


class RequestStream:
    """The outputs of one client's requests (its n choices, or its prompts) as they come:
    `async for batch in stream` yields lists of (choice index, RequestOutput) that arrived
    since the last iteration (several when the client fell behind), and ends once every
    request has finished. An engine failure ends it with RuntimeError."""

    def __init__(self, request_ids: list[int]):
        self.request_ids = request_ids
        self.index = {rid: i for i, rid in enumerate(request_ids)}
        self.unfinished = set(request_ids)
        # what arrived and was not read yet; one wake-up per delivery, not per token
        self._arrived: list[RequestOutput | BaseException] = []
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        self._arrived.append(item)
        self._ready.set()

    async def __aiter__(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        while self.unfinished:
            await self._ready.wait()
            self._ready.clear()
            items, self._arrived = self._arrived, []
            failed = next((x for x in items if isinstance(x, BaseException)), None)
            if failed is not None:
                self.unfinished.clear()
                raise RuntimeError(f"the engine failed: {failed}") from failed
            for out in items:
                if out.finished:
                    self.unfinished.discard(out.request_id)
            yield [(self.index[out.request_id], out) for out in items]


class AsyncEngine:
    """build: a picklable callable returning engine_core.Served, run in the engine process.
    max_waiting: requests queued beyond the running ones before Overloaded. stream_interval_s:
    the least time between deliveries of outputs (0: one per step). What the engine serves
    is in `model`, `max_model_len`, `has_text`, `capacity` and `about` (a line for logs) once
    this returns."""

    def __init__(self, build: Callable[[], engine_core.Served], max_waiting: int,
                 stream_interval_s: float = STREAM_INTERVAL_S):
        ctx = multiprocessing.get_context("spawn")    # CUDA does not survive a fork
        commands_in, self._commands = ctx.Pipe(duplex=False)
        self._outputs, outputs_out = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=engine_core.run, name="tiny-vllm engine", daemon=True,
                                   args=(build, commands_in, outputs_out, stream_interval_s))
        self.process.start()
        commands_in.close()       # ours closed: the engine's end alone keeps each pipe open,
        outputs_out.close()       # so either side sees the other go
        try:
            first = self._outputs.recv()
        except EOFError:
            self.process.join()
            raise EngineUnavailable(f"the engine process exited (status "
                                    f"{self.process.exitcode}) before it was ready") from None
        except BaseException:     # Ctrl-C while the model loads
            self.process.kill()
            raise
        if first[0] == "unavailable":
            self.process.join()
            raise EngineUnavailable(first[1])
        info = first[1]
        self.model, self.max_model_len = info["model"], info["max_model_len"]
        self.has_text, self.about = info["has_text"], info["about"]
        self.capacity = info["max_num_seqs"] + max_waiting
        self.stats = EngineStats()
        self.aborted = 0          # requests whose client left before they finished
        self.exited: str | None = None   # why the engine is gone, once it is
        self._streams: dict[int, RequestStream] = {}   # each request in the engine -> stream
        # adds the engine has not answered: ticket -> (the answer, how many requests)
        self._tickets: dict[int, tuple[asyncio.Future, int]] = {}
        self._ticket = itertools.count()
        self._held = 0            # requests taken or asked for, not yet finished or aborted
        self._sending: queue.SimpleQueue = queue.SimpleQueue()
        from solutions.engine.llm_engine import RequestOutput   # after `--mine` chose
        self._output = RequestOutput
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Start carrying messages; call from the event loop that will await the streams."""
        self._loop = asyncio.get_running_loop()
        self._threads = [threading.Thread(target=target, name=name, daemon=True)
                         for target, name in ((self._send_commands, "engine commands"),
                                              (self._receive, "engine outputs"))]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Abort what is left, end the process and wait for it (it finishes its step first)."""
        self._sending.put(("stop",))
        self._sending.put(None)
        for thread in self._threads:
            thread.join(STOP_TIMEOUT_S)
        self.close()

    def close(self) -> None:
        """End the process now, whatever it is doing (stop() without start(), or a hang)."""
        self.process.join(0 if not self._threads else STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._commands.close()
        self._outputs.close()

    async def add(self, jobs: list[tuple[object, bool, dict]]
                  ) -> tuple[RequestStream, list[int]]:
        """Queue one client's requests together: (prompt, raw, SamplingParams fields without
        max_tokens when the client gave none). Their stream and each job's prompt length once
        the engine has taken them all. Overloaded when they do not fit now (the caller sees
        that they fit an idle engine: `capacity`); ValueError or TypeError (the engine's
        sentence) when the engine refuses one, and then none is kept."""
        if self.exited is not None:
            raise EngineUnavailable(self.exited)
        if self._held + len(jobs) > self.capacity:
            raise Overloaded(f"the server holds {self._held} requests and takes at most "
                             f"{self.capacity}")
        self._held += len(jobs)
        ticket = next(self._ticket)
        answer = self._loop.create_future()
        self._tickets[ticket] = (answer, len(jobs))
        self._sending.put(("add", ticket, jobs))
        try:
            return await answer
        except asyncio.CancelledError:   # the client left: _settle lets the requests go
            raise
        except Exception:
            self._held -= len(jobs)
            raise

    def abort(self, stream: RequestStream) -> None:
        """End a client's unfinished requests now (it went away): their cache is freed."""
        gone = [rid for rid in stream.request_ids if self._streams.pop(rid, None) is not None]
        if gone:
            self._held -= len(gone)
            self.aborted += len(gone)
            self._sending.put(("abort", gone))

    # ------------------------------------------------------------ the pipes' threads
    def _send_commands(self) -> None:
        while (command := self._sending.get()) is not None:
            try:
                self._commands.send(command)
            except OSError:       # the engine has gone: the receiving thread says so
                return

    def _receive(self) -> None:
        while True:
            try:
                message = self._outputs.recv()
            except (EOFError, OSError):
                message = ("exited",)
            self._loop.call_soon_threadsafe(self._on_message, message)
            if message[0] in ("stopped", "exited"):
                return

    # ------------------------------------------------------------ the event loop's side
    def _on_message(self, message: tuple) -> None:
        kind = message[0]
        if kind == "outputs":
            self.stats = EngineStats(*message[2])
            self._deliver([self._output(*out) for out in message[1]])
        elif kind == "stats":
            self.stats = EngineStats(*message[1])
        elif kind == "taken":
            self._settle(message[1], (message[2], message[3]))
        elif kind == "refused":
            error = {"ValueError": ValueError, "TypeError": TypeError}.get(message[2])
            self._settle(message[1], error(message[3]) if error else
                         RuntimeError(f"{message[2]}: {message[3]}"))
        elif kind == "failed":
            self._fail_streams(RuntimeError(message[1]))
        elif kind == "exited":
            self.process.join(1)
            self.exited = (f"the engine process has exited (status {self.process.exitcode}): "
                           "restart the server")
            print(f"tiny-vllm: {self.exited}", file=sys.stderr, flush=True)
            self._fail_streams(EngineUnavailable(self.exited))
            for ticket in list(self._tickets):
                self._settle(ticket, EngineUnavailable(self.exited))

    def _settle(self, ticket: int, result: tuple[list[int], list[int]] | Exception) -> None:
        """An add's answer, before any output of its requests (messages come in order): the
        stream is in place before they come. A client that left meanwhile cancelled the
        future: its requests go at once."""
        answer, size = self._tickets.pop(ticket)
        if answer.cancelled():
            self._held -= size
            if not isinstance(result, Exception):
                self._sending.put(("abort", result[0]))
        elif isinstance(result, Exception):
            answer.set_exception(result)
        else:
            request_ids, lengths = result
            stream = RequestStream(request_ids)
            for rid in request_ids:
                self._streams[rid] = stream
            answer.set_result((stream, lengths))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue          # aborted meanwhile
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]
                self._held -= 1

    def _fail_streams(self, error: Exception) -> None:
        for stream in set(self._streams.values()):
            stream.put(error)
        self._held -= len(self._streams)
        self._streams.clear()
