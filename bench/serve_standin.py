"""The server's own cost per token, on any machine: the serve workload over a stand-in engine
that makes tokens at a GPU's pace and costs no compute.

    python3 -m bench.serve_standin [--step-ms 6] [--host-ms 3] [--scale 2]
                                   [--stream-interval MS] [--requests 256] [--clients 4]

The stand-in (StandInEngine) gives each running request one token per step, a step every
--step-ms (the GPU's time, spent asleep), after --host-ms of Python per step (the real
engine's scheduling, launch and collection: ~2 ms at 256 sequences and 512 positions on an
H200, bench.profile's host times, more at longer contexts). Its next step is queued before it
waits for the last, as the real engine's is, so the steps come every --step-ms as long as the
host keeps up, and later when it does not. Behind the server it runs in the engine process,
as the real engine does (async_engine.py).

It runs offline's requests (output lengths divided by --scale, to keep the run short) first
alone (the stand-in's offline tok/s), then behind the HTTP server to streaming clients
exactly as `python3 -m bench --only serve` does (bench.serve). It prints the share of offline,
TTFT and ITL, tokens per chunk, and the server's CPU time per token and per chunk: this
process's CPU time (the event loop, the HTTP protocol, the threads that carry the engine's
pipes). The clients run in other processes, at the lowest priority, and are not counted.
Where the cores are busy with other work the share varies from run to run; the CPU per
token varies less.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from types import SimpleNamespace
from typing import TYPE_CHECKING

from bench import serve
from bench import workloads as W
from solutions.engine.llm_engine import RequestOutput

if TYPE_CHECKING:
    from solutions.engine.engine_core import Served

VOCAB = 32000
CLIENT_NICE = 19    # the clients stand for other machines: they get what the server leaves


class StandInEngine:
    """LLMEngine's face to the server (add_request, abort, has_unfinished, step, requests,
    scheduler, max_model_len) with no model behind it: every running request gets a token
    (its id) per step. max_num_seqs requests run at once; the others wait. While a request
    whose prompt is fail_prompt is in it, every step raises (tests of a failing engine)."""

    def __init__(self, step_s: float, host_s: float, max_num_seqs: int = 256,
                 max_model_len: int = 4096, fail_prompt: list[int] | None = None):
        self.step_s, self.host_s, self.max_model_len = step_s, host_s, max_model_len
        self.fail_prompt = fail_prompt
        self.requests: dict[int, list[int]] = {}     # id -> [tokens left]
        self.failing: set[int] = set()     # requests whose prompt is fail_prompt
        self.scheduler = SimpleNamespace(
            config=SimpleNamespace(max_num_seqs=max_num_seqs), running=[], waiting=[],
            allocator=SimpleNamespace(num_used_blocks=0, num_total_blocks=1))
        self._next_id = 0
        self._gpu_free = 0.0           # when the step queued last is done

    def add_request(self, prompt_ids: list[int], params) -> int:
        self._next_id += 1
        self.requests[self._next_id] = [params.max_tokens]
        if self.fail_prompt is not None and list(prompt_ids) == self.fail_prompt:
            self.failing.add(self._next_id)
        return self._next_id

    def abort(self, request_id: int) -> None:
        self.requests.pop(request_id, None)
        self.failing.discard(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        if self.failing:
            raise RuntimeError("device lost")
        busy_until = time.perf_counter() + self.host_s
        while time.perf_counter() < busy_until:     # the host's own work
            pass
        # queue the next step behind the one running, then wait for the running one
        done, now = self._gpu_free, time.perf_counter()
        self._gpu_free = max(now, done) + self.step_s
        out = []
        for rid, left in list(self.requests.items())[: self.scheduler.config.max_num_seqs]:
            left[0] -= 1
            out.append(RequestOutput(rid, "", [rid], left[0] == 0,
                                     "max_tokens" if left[0] == 0 else None))
            if left[0] == 0:
                del self.requests[rid]
        if done > now:
            time.sleep(done - now)
        return out


def served(step_s: float, host_s: float, **options) -> Served:
    """The engine process's build (picklable with functools.partial): a StandInEngine
    (options: its own) taking token ids."""
    from solutions.engine.engine_core import Served, ids_only
    engine = StandInEngine(step_s, host_s, **options)
    return Served(engine, ids_only(engine.max_model_len), False, serve.MODEL_NAME,
                  about=f"a stand-in engine: a step every {step_s * 1e3:g} ms")


def offline_rate(engine: StandInEngine, requests: list[W.Request]) -> float:
    """Output tok/s of the stand-in alone: every request added at once, stepped to the end."""
    t0, tokens = time.perf_counter(), 0
    for prompt, n in requests:
        engine.add_request(prompt, SimpleNamespace(max_tokens=n))
    while engine.has_unfinished():
        tokens += len(engine.step())
    return tokens / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.serve_standin", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step-ms", type=float, default=6.0, metavar="MS",
                   help="the GPU's time per step")
    p.add_argument("--host-ms", type=float, default=3.0, metavar="MS",
                   help="the engine's own Python per step")
    p.add_argument("--requests", type=int, default=W.OFFLINE_REQUESTS, metavar="N")
    p.add_argument("--scale", type=int, default=2, metavar="K",
                   help="divide output lengths by this")
    p.add_argument("--stream-interval", type=float, default=None, metavar="MS",
                   help="the server's least time between a stream's chunks (default: serve's)")
    p.add_argument("--clients", type=int, default=serve.CLIENT_PROCESSES, metavar="N",
                   help="client processes")
    args = p.parse_args(argv)
    times = (args.step_ms, args.host_ms, args.stream_interval or 0)
    if not all(t >= 0 for t in times) or min(args.requests, args.scale, args.clients) < 1:
        p.error("--step-ms, --host-ms and --stream-interval must be >= 0; --requests, "
                "--scale and --clients >= 1")
    why = serve.not_runnable()
    if why is not None:
        print(f"serve_standin: {why}")
        return 2
    requests = [(prompt, max(1, n // args.scale))
                for prompt, n in W.offline(args.requests, VOCAB)]

    step = (args.step_ms / 1e3, args.host_ms / 1e3)
    offline = offline_rate(StandInEngine(*step), requests)
    options = {} if args.stream_interval is None else {
        "stream_interval_s": args.stream_interval / 1e3}
    cpu = time.process_time()
    records = serve.serve_engine(partial(served, *step), requests, args.clients,
                                 client_nice=CLIENT_NICE, **options)
    server_cpu = time.process_time() - cpu
    section = serve.section(requests, {"records": records, "clients": args.clients},
                            offline, "not run: a stand-in engine")
    o = section["ours"]
    chunks = sum(len(r["counts"]) for r in records)
    print(f"stand-in engine: a step every {args.step_ms:g} ms, {args.host_ms:g} ms of Python "
          f"per step; {len(requests)} requests, {o['tokens']} tokens")
    print(f"offline (the stand-in alone): {offline:,.0f} tok/s")
    print(f"served: {o['tok_s']:,.0f} tok/s = {100 * section['share_of_offline']:.0f}% of "
          f"offline (goal >= {100 * serve.GOAL_SHARE_OF_OFFLINE:.0f}%); TTFT p50 / p99 "
          f"{serve._ms(o['ttft_ms'])}; ITL p50 / p99 {serve._ms(o['itl_ms'])}; "
          f"{o['tokens'] / chunks:.2f} tokens per chunk")
    clients_cpu = sum(os.times()[2:4])     # the client processes', once they have ended
    print(f"server CPU per token: {server_cpu / o['tokens'] * 1e6:.1f} us, per chunk "
          f"{server_cpu / chunks * 1e6:.1f} us ({server_cpu:.2f} s of this process's CPU; "
          f"the clients took "
          f"{clients_cpu:.2f} s over {o['seconds']:.2f} s on {os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
