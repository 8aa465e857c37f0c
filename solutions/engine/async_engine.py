"""The engine behind a server: one thread steps it, any number of asyncio tasks talk to it.

    engine = AsyncEngine(llm.engine, max_waiting=256)
    engine.start()                                   # in the event loop's thread
    stream = await engine.add(prompt_ids, params)    # ValueError: refused, with a sentence
    async for outputs in stream:                     # lists of RequestOutput, in order
        ...
    engine.abort(stream.request_id)                  # the client went away: cache freed
    engine.stop()                                    # ends every request, joins the thread

LLMEngine is synchronous and not thread-safe, so only its own thread calls it: the event loop
hands it commands (add, abort) through a queue, and the thread hands the steps' outputs back in
one `call_soon_threadsafe` per delivery. Neither side ever waits for the other: a step never
waits on a slow client (each request's outputs queue up on the event loop's side, at most
max_tokens of them), and a connection never waits on a step, only on its own request's outputs.

Deliveries: at most one per `stream_interval_s` (the outputs of the steps between are handed
over together, so a streamed chunk then carries several tokens), and at once when the engine
goes idle. The event loop and the engine thread share the interpreter's lock: every chunk the
server writes (a JSON body, an HTTP write) is Python that the engine thread, which must queue a
GPU step every few milliseconds, waits for. At 256 requests a chunk per request per step costs
more host time than the step's own work, and the GPU would idle; a chunk per interval bounds it.

Admission control: `add` raises Overloaded when `capacity` requests are already in the engine
(the ones running plus max_waiting queued), so a flood of clients gets a quick "try again"
instead of an unbounded queue.
"""
from __future__ import annotations

import asyncio
import math
import queue
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from solutions.engine.llm_engine import LLMEngine, RequestOutput, SamplingParams

IDLE_WAIT_S = 0.5   # an idle thread wakes this often to notice stop() even without a command
SWITCH_INTERVAL_S = 0.0001
STREAM_INTERVAL_S = 0.02


class Overloaded(Exception):
    """The engine holds as many requests as it may: the client should retry later."""


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

    def __init__(self, size: int):
        self.request_ids: list[int | None] = [None] * size   # the engine's, once it took them
        self.index: dict[int, int] = {}
        self.unfinished: set[int] = set()
        # what arrived and was not read yet; one wake-up per delivery, not per token
        self._arrived: list[RequestOutput | BaseException] = []
        self._ready = asyncio.Event()

    def bind(self, index: int, request_id: int) -> None:
        self.request_ids[index] = request_id
        self.index[request_id] = index
        self.unfinished.add(request_id)

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
    """engine: an LLMEngine that nothing else drives. capacity: the most requests it holds
    at once (running and waiting). stream_interval_s: the least time between deliveries of
    outputs (0: one per step)."""

    def __init__(self, engine: LLMEngine, capacity: int,
                 stream_interval_s: float = STREAM_INTERVAL_S):
        self.engine, self.capacity = engine, capacity
        self.stream_interval_s = stream_interval_s
        self.stats = EngineStats()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        # the event loop's side: each request in the engine -> its client's stream
        self._streams: dict[int, RequestStream] = {}
        self._held = 0       # requests taken and not yet finished or aborted
        self.aborted = 0     # requests whose client left before they finished
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._running = False

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will await the streams.

        It also shortens the interpreter's switch interval (for the whole process): each
        torch call of the engine thread lets the GIL go, and while the event loop runs Python
        the thread waits up to that long to take it back, some ten times a step (the default
        5 ms would idle the GPU). stop() puts the interval back."""
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._loop = asyncio.get_running_loop()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Abort what is left, end the thread and wait for it (it finishes its step first)."""
        self._running = False
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            sys.setswitchinterval(self._switch_interval)

    async def add(self, jobs: list[tuple[list[int], SamplingParams]]) -> RequestStream:
        """Queue one client's requests (prompt ids, params) together; their stream once the
        engine has taken them all. Overloaded when they do not fit now (the caller sees
        that they fit an idle engine: `capacity`); ValueError or TypeError
        (the engine's sentence) when the engine refuses one, and then none is kept."""
        if not self._running:
            raise Overloaded("the server is shutting down")
        if self._held + len(jobs) > self.capacity:
            raise Overloaded(f"the server holds {self._held} requests and takes at most "
                             f"{self.capacity}")
        self._held += len(jobs)
        stream = RequestStream(len(jobs))
        taken = [self._loop.create_future() for _ in jobs]
        for index, ((prompt_ids, params), future) in enumerate(zip(jobs, taken)):
            self._commands.put(("add", prompt_ids, params, (stream, index, future)))
        self._wake.set()
        try:
            results = await asyncio.gather(*taken, return_exceptions=True)
        except asyncio.CancelledError:   # the client left: what was taken goes at once
            self._release(stream)
            raise
        refused = [r for r in results if isinstance(r, Exception)]
        if refused:
            self._held -= len(refused)
            self._release(stream)
            raise refused[0]
        return stream

    def abort(self, stream: RequestStream) -> None:
        """End a client's unfinished requests now (it went away): their cache is freed."""
        self.aborted += self._release(stream)

    def _release(self, stream: RequestStream) -> int:
        """Abort the stream's requests the engine took and has not finished; how many."""
        released = 0
        for rid in stream.request_ids:
            if rid is not None and self._streams.pop(rid, None) is not None:
                self._drop(rid)
                released += 1
        return released

    def _drop(self, request_id: int | None) -> None:
        """Let go of a request no stream owns (None: one the engine refused)."""
        self._held -= 1
        if request_id is not None:
            self._abort(request_id)

    def _abort(self, request_id: int) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    # ------------------------------------------------------------ the engine's own thread
    def _run(self) -> None:
        engine = self.engine
        pending: list[RequestOutput] = []    # outputs not delivered yet
        delivered = -math.inf                # when the last delivery went (the first: at once)
        while self._running:
            try:
                self._take_commands()
                if not engine.has_unfinished():
                    pending = self._hand_over(pending)
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                pending += engine.step()
            except Exception as e:   # a bug or a device error: fail what runs, keep serving
                traceback.print_exc(file=sys.stderr)
                pending = self._hand_over(pending)   # what came before the failure
                self._fail_all(e)
                continue
            now = time.monotonic()
            if pending and now - delivered >= self.stream_interval_s:
                pending, delivered = self._hand_over(pending), now
        for request_id in list(engine.requests):
            engine.abort(request_id)

    def _hand_over(self, outputs: list[RequestOutput]) -> list:
        """Deliver outputs on the event loop, in one callback; a new empty list."""
        if outputs:
            self._loop.call_soon_threadsafe(self._deliver, outputs)
        return []

    def _take_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "abort":
                self.engine.abort(command[1])
                continue
            _, prompt_ids, params, ticket = command
            try:
                result = self.engine.add_request(prompt_ids, params)
            except Exception as e:   # ValueError / TypeError: refused (400); else a bug (500)
                result = e
            self._loop.call_soon_threadsafe(self._settle, ticket, result)
        self._publish_stats()

    def _publish_stats(self) -> None:
        sched, alloc = self.engine.scheduler, self.engine.scheduler.allocator
        if hasattr(alloc, "num_used_blocks"):      # stage 13's BlockManager
            used, total = alloc.num_used_blocks, alloc.num_total_blocks
        else:                                       # stage 11's SlotAllocator
            used, total = alloc.num_slots - len(alloc.free_slots), alloc.num_slots
        self.stats = EngineStats(len(sched.running), len(sched.waiting), used, total)

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
        self._loop.call_soon_threadsafe(self._fail_streams, error)

    # ------------------------------------------------------------ the event loop's side
    def _settle(self, ticket: tuple[RequestStream, int, asyncio.Future],
                result: int | Exception) -> None:
        """An add's outcome, run before any output of the request (callbacks run in order).
        A client that left while the engine took its request cancelled the future: the
        request goes at once."""
        stream, index, taken = ticket
        if taken.cancelled():
            self._drop(result if isinstance(result, int) else None)
        elif isinstance(result, Exception):
            taken.set_exception(result)
        else:
            stream.bind(index, result)
            self._streams[result] = stream
            taken.set_result(result)

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
