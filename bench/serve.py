"""The serve workload: the offline workload's requests as concurrent streaming HTTP clients.

    python3 -m bench --only serve,offline      (the share of offline needs both in one run)

The OpenAI-compatible server (solutions/engine/server.py) runs in this process on uvicorn,
over an engine process (async_engine.py) warmed up like offline's engine; the clients run in
CLIENT_PROCESSES other processes (`python3 -m bench.serve --clients PORT`, so that reading 256
streams does not take the server's CPU), each sending its share of the requests at once as
streamed /v1/completions (token-id prompts, EOS ignored, `return_token_ids` so each chunk
says how many tokens it brings). Measured at the clients: output tok/s (every token, from
the first request sent to the last token received), time to first token per request, and
inter-token latency (the gap between a request's chunks, shared by the tokens a chunk
brings), p50 and p99. Each client
checks it got exactly its tokens.

transformers' own server (`transformers serve`) is compared where it can run this workload:
it needs its serving extra (fastapi and more) and takes text prompts only, so on token-id
prompts of random weights it is reported as not run, with the reason.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.workloads import Request
    from solutions.engine.engine_core import Served

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "bench"
CLIENT_PROCESSES = 8     # 32 streams each: with 64, a client process saturated its core
GOAL_SHARE_OF_OFFLINE = 0.85
START_TIMEOUT_S = 120


def measure(build: Callable[[], Served], requests: list[Request],
            clients: int = CLIENT_PROCESSES, describe: Callable[[str], None] = print,
            **options) -> dict:
    """Serve the requests to streaming HTTP clients, the engine built by build (engine_of)
    in its own process; the raw per-request records ({"sent", "times", "counts"}, in
    request order) and the client processes' count. options: AsyncEngine's."""
    return {"records": serve_engine(build, requests, clients, describe=describe, **options),
            "clients": clients}


def engine_of(max_model_len: int, max_positions: int, shape: str | None = None, seed: int = 0,
              model_dir: str | None = None, device: str = "cuda") -> Served:
    """The engine process's build (picklable with functools.partial): the bench's model,
    random weights of a shape made from seed as bench.engine.build_models makes them (the
    same weights as this process's) or a checkpoint, under an engine warmed up as offline's
    is, taking token ids only."""
    from bench.engine import SHAPES, build_models, our_model
    from bench.ours import warmed_engine
    from solutions.engine.engine_core import Served, ids_only
    if model_dir is None:
        _, model, _ = build_models(SHAPES[shape], seed, max_positions)
    else:
        model = our_model(model_dir, max_positions, device)
    engine, _ = warmed_engine(model, max_model_len, prefix_caching=True)
    return Served(engine, ids_only(max_model_len), False, MODEL_NAME,
                  about=engine.runner.describe())


def serve_engine(build: Callable[[], Served], requests: list[Request], clients: int,
                 client_nice: int = 0, describe: Callable[[str], None] | None = None,
                 **options) -> list[dict]:
    """The server over the engine build makes (in its process), on a free port in a thread
    of this process, until the clients are done; their records. options: AsyncEngine's;
    client_nice: run_clients'."""
    import uvicorn

    from solutions.engine.async_engine import AsyncEngine
    from solutions.engine.serve_cli import listen
    from solutions.engine.server import build_app
    t0 = time.perf_counter()
    serving = AsyncEngine(build, max_waiting=len(requests), **options)
    if describe is not None:
        describe(f"engine process ready in {time.perf_counter() - t0:.1f} s: {serving.about}")
    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(build_app(serving), log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return run_clients(sock.getsockname()[1], requests, clients, client_nice)
    finally:
        server.should_exit = True
        thread.join()
        sock.close()
        serving.close()


def run_clients(port: int, requests: list[Request], clients: int, nice: int = 0) -> list[dict]:
    """Start the client processes, let them go together, gather their records in order.
    nice: their scheduling priority's increment (os.nice), so that on a machine of few cores
    they do not take the server's CPU, as clients on other machines would not."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}   # keep carried packages
    procs, shares = [], [list(range(i, len(requests), clients)) for i in range(clients)]
    for share in shares:
        p = subprocess.Popen([sys.executable, "-m", "bench.serve", "--clients", str(port)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                             cwd=ROOT, preexec_fn=(lambda: os.nice(nice)) if nice else None)
        p.stdin.write(json.dumps([requests[i] for i in share]) + "\n")
        p.stdin.flush()
        procs.append(p)
    for p in procs:               # each has read its requests and made its connections ready
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError("a client process did not start")
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    records: list[dict] = [{}] * len(requests)
    for p, share in zip(procs, shares):
        out, _ = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"a client process failed (exit status {p.returncode})")
        for i, record in zip(share, json.loads(out)):
            records[i] = record
    return records


def section(requests: list[Request], raw: dict, offline_tok_s: float | None,
            hf_skipped: str) -> dict:
    """The result document's serve section from the clients' records."""
    records = raw["records"]
    wrong = [i for i, (r, (_, n)) in enumerate(zip(records, requests)) if sum(r["counts"]) != n]
    if wrong:
        raise RuntimeError(f"{len(wrong)} clients got a wrong number of tokens, e.g. request "
                           f"{wrong[0]}: {sum(records[wrong[0]]['counts'])} of "
                           f"{requests[wrong[0]][1]}")
    tokens = sum(sum(r["counts"]) for r in records)
    seconds = max(r["times"][-1] for r in records) - min(r["sent"] for r in records)
    ttft = [(r["times"][0] - r["sent"]) * 1e3 for r in records]
    itl = [gap * 1e3 / n for r in records
           for gap, n in zip(_gaps(r["times"]), r["counts"][1:]) for _ in range(n)]
    tok_s = tokens / seconds
    ours = {"tok_s": tok_s, "seconds": seconds, "tokens": tokens, "clients": len(records),
            "client_processes": raw["clients"], "ttft_ms": _percentiles(ttft),
            "itl_ms": _percentiles(itl)}
    return {"requests": len(requests), "ours": ours, "transformers": None,
            "transformers_skipped": hf_skipped, "ratio": None, "offline_tok_s": offline_tok_s,
            "share_of_offline": None if not offline_tok_s else tok_s / offline_tok_s,
            "goal_share_of_offline": GOAL_SHARE_OF_OFFLINE}


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def _percentiles(values: list[float]) -> dict:
    ordered = sorted(values)

    def at(q: float) -> float | None:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None
    return {"p50": at(0.50), "p99": at(0.99)}


def not_runnable() -> str | None:
    """Why this machine cannot run the workload (the serve extra is missing), else None."""
    import importlib.util
    missing = [m for m in ("starlette", "uvicorn") if importlib.util.find_spec(m) is None]
    if importlib.util.find_spec("httpx2") is None and importlib.util.find_spec("httpx") is None:
        missing.append("httpx")
    return (f"not run: {' and '.join(missing)} not installed here (the serve extra: "
            "pip install starlette uvicorn)") if missing else None


def skipped_section(requests: int, why: str) -> dict:
    return {"requests": requests, "ours": None, "ours_skipped": why, "transformers": None,
            "transformers_skipped": why, "ratio": None}


def transformers_skipped() -> str:
    """Why transformers' own server is not run on this workload."""
    try:
        from transformers.utils.import_utils import is_serve_available
    except ImportError:
        return "not run: this transformers has no `transformers serve`"
    if not is_serve_available():
        return ("not run: `transformers serve` needs its serving extra (fastapi, uvicorn, "
                "openai, pydantic), not installed here")
    return ("not run: `transformers serve` takes text prompts only, and this workload is "
            "token ids of random weights with no tokenizer")


def table(doc: dict) -> str:
    """The serve section as a markdown table (empty when the run had none)."""
    s = doc.get("workloads", {}).get("serve")
    if not s:
        return ""
    if s["ours"] is None:
        return f"serve: {s.get('ours_skipped', 'not run')}"
    o, share = s["ours"], s.get("share_of_offline")
    share_text = "-" if share is None else f"{100 * share:.0f}%"
    return "\n".join([
        f"serve: {s['requests']} streaming HTTP clients (OpenAI API, {o['client_processes']} "
        f"client processes); transformers serve: {s['transformers_skipped']}",
        "| output tok/s | share of offline (goal >= "
        f"{100 * s['goal_share_of_offline']:.0f}%) | TTFT p50 / p99 | ITL p50 / p99 |",
        "|---:|---:|---:|---:|",
        f"| {o['tok_s']:,.0f} | {share_text} | {_ms(o['ttft_ms'])} | {_ms(o['itl_ms'])} |"])


def _ms(p: dict) -> str:
    return "-" if p["p50"] is None else f"{p['p50']:.1f} / {p['p99']:.1f} ms"


# ------------------------------------------------------------------ a client process

async def _client(port: int, requests: list, go: Callable) -> list[dict]:
    """Each request streamed at once; per request: when it was sent, when each chunk came,
    how many tokens each brought."""
    try:
        import httpx2 as httpx
    except ImportError:
        import httpx
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    url = f"http://127.0.0.1:{port}/v1/completions"
    async with httpx.AsyncClient(limits=limits, timeout=None) as client:
        await go()

        async def one(prompt: list[int], new: int) -> dict:
            record = {"sent": time.perf_counter(), "times": [], "counts": []}
            body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": new, "stream": True,
                    "ignore_eos": True, "temperature": 0, "return_token_ids": True}
            async with client.stream("POST", url, json=body) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"status {response.status_code}: "
                                       f"{(await response.aread())[:300]!r}")
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        n = len(json.loads(line[6:])["choices"][0]["token_ids"])
                        record["times"].append(time.perf_counter())
                        record["counts"].append(n)
            return record

        return await asyncio.gather(*(one(p, n) for p, n in requests))


def client_main(port: int) -> int:
    """`python3 -m bench.serve --clients PORT`: requests (JSON) on the first line of stdin,
    "ready" on stdout, "go" on stdin, then the records as JSON on stdout."""
    requests = json.loads(sys.stdin.readline())

    async def go() -> None:
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

    records = asyncio.run(_client(port, requests, go))
    print(json.dumps(records))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["--clients"] or len(sys.argv) != 3:
        sys.exit("usage: python3 -m bench.serve --clients PORT (run by python3 -m bench)")
    sys.exit(client_main(int(sys.argv[2])))
