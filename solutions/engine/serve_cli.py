"""`python3 -m solutions.engine serve`: the OpenAI-compatible server as a command.

    python3 -m solutions.engine serve                       # SmolLM2 on http://127.0.0.1:8000/v1
    python3 -m solutions.engine serve --model ~/models/Llama-3.2-1B-Instruct --port 8080
    python3 -m solutions.engine serve --host 0.0.0.0 --api-key "$KEY"   # reachable, with a key
    python3 -m solutions.engine serve --mine                # on your own parts of the stages

It binds the port (a port in use is one line "error: ...", exit 2, before the model loads),
loads the model in a process of its own (the engine's: async_engine.py), then serves until
SIGINT / SIGTERM: it stops accepting, lets the requests in flight finish (SHUTDOWN_GRACE_S at
most; past that they are cut off and aborted), ends the engine process and exits 0.
Once it listens it says where on stderr: "serving NAME at http://HOST:PORT/v1" (--port 0
picks a free port, and this line names it).
"""
from __future__ import annotations

import argparse
import contextlib
import socket
import sys
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from solutions.engine.async_engine import STREAM_INTERVAL_S

if TYPE_CHECKING:
    from solutions.engine.engine_core import Served

SHUTDOWN_GRACE_S = 30
MAX_STREAM_INTERVAL_MS = 10_000


def parse_args(argv: list[str]) -> argparse.Namespace:
    from solutions.engine.__main__ import _Parser, add_engine_options
    p = _Parser(prog="python3 -m solutions.engine serve",
                description="Serve the model over OpenAI's HTTP API (docs/serving.md).")
    add_engine_options(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="the port (default: 8000; 0: any)")
    p.add_argument("--api-key", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/ requests")
    p.add_argument("--max-num-seqs", type=int, default=256, metavar="N",
                   help="requests the engine runs at once (default: 256)")
    p.add_argument("--max-waiting", type=int, default=256, metavar="N",
                   help="requests queued beyond those; more get 503 (default: 256)")
    p.add_argument("--stream-interval", type=float, default=STREAM_INTERVAL_S * 1e3,
                   metavar="MS", help="the least time between a stream's chunks; a chunk holds "
                   "the tokens made meanwhile (default: %(default)g; 0: a chunk per step)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                   default="info", help="uvicorn's logging; info logs each request")
    args = p.parse_args(argv)
    if not 0 <= args.port <= 65535:
        p.error(f"--port must be 0..65535, got {args.port}")
    if not 0 <= args.stream_interval <= MAX_STREAM_INTERVAL_MS:   # NaN too
        p.error(f"--stream-interval must be 0..{MAX_STREAM_INTERVAL_MS} ms, got "
                f"{args.stream_interval}")
    if args.max_waiting < 0:
        p.error(f"--max-waiting must be >= 0, got {args.max_waiting}")
    if args.api_key is not None and not args.api_key.strip():
        p.error("--api-key must not be empty")
    return args


def main(argv: list[str]) -> int:
    from solutions.engine import smollm2
    from solutions.engine.__main__ import one_line, select_mine
    args = parse_args(argv)
    try:
        sock = listen(args.host, args.port)
    except OSError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    with sock:
        try:
            if args.mine:
                select_mine()     # the engine process inherits the choice (the environment)
            from solutions.engine.async_engine import AsyncEngine, EngineUnavailable
            from solutions.engine.server import build_app
            model_dir = args.model if args.model is not None else smollm2.ensure_model()
            serving = AsyncEngine(
                partial(load_llm, str(model_dir), args.device, args.max_model_len,
                        args.max_num_seqs),
                args.max_waiting, args.stream_interval / 1e3)
        except (smollm2.ModelNotAvailable, OSError, ValueError, EngineUnavailable) as e:
            print(f"error: {one_line(e)}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130
        try:
            host = f"[{args.host}]" if ":" in args.host else args.host
            return run(build_app(serving, api_key=args.api_key), sock, args.log_level,
                       lambda port: f"serving {serving.model} at http://{host}:{port}/v1 "
                                    "(Ctrl-C stops)")
        finally:
            serving.close()


def load_llm(model_dir: str, device: str, max_model_len: int | None,
             max_num_seqs: int) -> Served:
    """The model, in the engine process (async_engine.py starts it with this)."""
    from solutions.engine.engine_core import Served
    from solutions.engine.llm import LLM, EngineConfig
    llm = LLM(model_dir, device=device, config=EngineConfig(
        max_model_len=max_model_len, max_num_seqs=max_num_seqs))
    return Served(llm.engine, llm.prepare, llm.tokenizer is not None,
                  llm.model_dir.resolve().name)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: any free one); OSError with the reason if not."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def run(app, sock: socket.socket, log_level: str, banner: Callable[[int], str]) -> int:
    """Serve app on sock until SIGINT / SIGTERM; 0 when it started and stopped cleanly."""
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn, but a shutdown by a signal is the normal end (exit 0): uvicorn raises the
        signal again once it has stopped. Says where it listens once it does."""

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                self._captured_signals.clear()

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                print(banner(sock.getsockname()[1]), file=sys.stderr, flush=True)

    config = uvicorn.Config(app, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    server = Server(config)
    server.run(sockets=[sock])
    return 0 if server.started else 1
