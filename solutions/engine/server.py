"""An OpenAI-compatible HTTP server over the engine: the ASGI app (Starlette; serve_cli.py
runs it on uvicorn).

    engine = AsyncEngine(partial(load_llm, model_dir, "auto", None, 256), max_waiting=256)
    app = build_app(engine, api_key=None)
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}'

Endpoints: POST /v1/chat/completions, POST /v1/completions (whole or streamed as server-sent
events ending in `data: [DONE]`), GET /v1/models, GET /health (the engine's running and
waiting requests and KV-cache use). openai_protocol.py says which fields are supported.

One engine process serves every connection together (async_engine.py, engine_core.py): a
request is add_request there, a client that leaves (mid-stream, or before a whole response is
done) is abort, its cache freed at once. Streams get their tokens at most every 20 ms
(--stream-interval): a chunk then holds the tokens of the steps since the last, which keeps
the server's per-chunk work (a JSON body, an HTTP write) bounded however fast the steps come.
Errors are OpenAI's error object with the status: 400 for a body that is not JSON, a missing,
wrong or unsupported field, an unknown model, a prompt longer than the context; 401 for a
wrong or missing key (--api-key); 413 for a body over 8 MiB; 503 with Retry-After when the
engine already holds its running and max_waiting requests, 503 when its process has exited.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from solutions.engine import openai_protocol as api
from solutions.engine.async_engine import (AsyncEngine, EngineUnavailable, Overloaded,
                                           RequestStream)

MAX_BODY_BYTES = 8 << 20
RETRY_AFTER_S = 1


def build_app(serving: AsyncEngine, *, api_key: str | None = None) -> Starlette:
    """The ASGI app over an engine process (AsyncEngine, ready: it names the model, its
    context and whether it makes text). The app's lifespan starts and stops it."""
    model_name, max_len = serving.model, serving.max_model_len
    created = int(time.time())

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise api.APIError(401, "a wrong or missing API key: send the header "
                                    "'Authorization: Bearer KEY'", code="invalid_api_key")

    async def health(request: Request) -> Response:
        s = serving.stats
        if serving.exited is not None:
            return JSONResponse({"status": serving.exited}, status_code=503)
        return JSONResponse({"status": "ok", "running": s.running, "waiting": s.waiting,
                             "kv_cache_used": s.kv_cache_used,
                             "kv_cache_total": s.kv_cache_total, "aborted": serving.aborted})

    async def models(request: Request) -> Response:
        authorize(request)
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": created, "owned_by": "tiny-vllm",
             "max_model_len": max_len}]})

    async def generate(request: Request, chat: bool) -> Response:
        authorize(request)
        req = api.parse_request(await _json(request), chat)
        if req.model != model_name:
            raise api.APIError(400, f"the model '{req.model}' is not served here; this server "
                                    f"serves '{model_name}'", "model", "model_not_found")
        if "stop" in req.sampling and not serving.has_text:
            raise api.APIError(400, "'stop' needs text, and this server's model has no "
                                    "tokenizer", "stop")
        where = "messages" if chat else "prompt"
        # the engine process turns each prompt into token ids (its tokenizer, its template)
        choices = [req.choice_fields(i) for i in range(req.n)]
        jobs = [(prompt, not chat, fields) for prompt in req.prompts for fields in choices]
        if len(jobs) > serving.capacity:
            raise api.APIError(400, f"{len(jobs)} choices in one request, more than the "
                                    f"{serving.capacity} requests this server holds", "n")
        try:
            stream, lengths = await serving.add(jobs)
        except Overloaded as e:
            raise api.APIError(503, f"the server is busy ({e}): retry later",
                               headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineUnavailable as e:
            raise api.APIError(503, str(e), code="engine_exited") from None
        except (ValueError, TypeError) as e:
            raise api.APIError(400, str(e), where) from None
        prompt_tokens = sum(lengths[::req.n])    # each prompt once, not once per choice
        if req.stream:
            return StreamingResponse(_events(serving, req, stream, prompt_tokens),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _whole(serving, request, req, stream, prompt_tokens)

    async def chat(request: Request) -> Response:
        return await generate(request, chat=True)

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        serving.start()
        try:
            yield
        finally:
            serving.stop()

    app = Starlette(routes=[
        Route("/health", health), Route("/v1/models", models),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ], lifespan=lifespan, exception_handlers={
        api.APIError: _api_error, HTTPException: _http_error, Exception: _server_error})
    app.state.engine = serving
    return app


async def _json(request: Request) -> object:
    """The body as JSON: 413 past MAX_BODY_BYTES, 400 when it does not parse."""
    declared = request.headers.get("content-length", "")
    too_big = api.APIError(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_big
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > MAX_BODY_BYTES:
            raise too_big
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:   # UnicodeDecodeError is a ValueError
        raise api.APIError(400, f"the body is not valid JSON: {e}") from None


def _merge(batch: list[tuple[int, object]]) -> dict[int, tuple[str, list[int], str | None]]:
    """One step's (or several steps') outputs per choice: text, token ids, finish reason."""
    merged: dict[int, tuple[str, list[int], str | None]] = {}
    for index, out in batch:
        text, ids, _ = merged.get(index, ("", [], None))
        merged[index] = (text + out.new_text, ids + out.new_token_ids, out.finish_reason)
    return merged


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


async def _events(serving: AsyncEngine, req: api.GenerationRequest, stream: RequestStream,
                  prompt_tokens: int) -> AsyncIterator[str]:
    """The streamed response: a chunk per choice per delivery (one write for them all),
    usage if asked, [DONE]. The finally runs when the client disconnects too (Starlette
    cancels the stream)."""
    chunks, started, generated = api.ChunkEvents(req), set(), 0
    try:
        async for batch in stream:
            events = []
            for index, (text, ids, reason) in sorted(_merge(batch).items()):
                generated += len(ids)
                events.append(chunks.event(index, text, ids, reason, index not in started))
                started.add(index)
            yield "".join(events)     # one write for the choices of a delivery
        if req.include_usage:
            yield _sse(api.response(req, [], api.usage(prompt_tokens, generated), chunk=True))
    except RuntimeError as e:        # the engine failed: the stream says so and ends
        yield _sse(api.error_body(500, str(e)))
    finally:
        serving.abort(stream)
    yield _sse("[DONE]")


async def _whole(serving: AsyncEngine, request: Request, req: api.GenerationRequest,
                 stream: RequestStream, prompt_tokens: int) -> Response:
    """The whole response, once every choice has finished; a client that leaves before
    aborts its requests."""
    k = len(stream.request_ids)
    texts, ids, reasons = [""] * k, [[] for _ in range(k)], [None] * k

    async def collect() -> None:
        async for batch in stream:
            for index, (text, new_ids, reason) in _merge(batch).items():
                texts[index] += text
                ids[index] += new_ids
                reasons[index] = reason

    done, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(_left(request))
    try:
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not done.done():
            done.cancel()
            return Response(status_code=499)    # nobody reads it: the client has gone
        done.result()   # the engine's failure, if any
    except RuntimeError as e:
        raise api.APIError(500, str(e)) from None
    finally:
        gone.cancel()
        serving.abort(stream)
    choices = [api.choice(req, i, texts[i], ids[i], reasons[i], delta=False) for i in range(k)]
    return JSONResponse(api.response(req, choices, api.usage(prompt_tokens, sum(map(len, ids)))))


async def _left(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: receive waits for it)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, api.APIError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    detail = {404: f"no route {request.url.path} (see /v1/models, /v1/completions, "
                   f"/v1/chat/completions, /health)",
              405: f"{request.method} is not allowed on {request.url.path}"}
    return JSONResponse(api.error_body(exc.status_code, detail.get(exc.status_code, exc.detail)),
                        status_code=exc.status_code, headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    return JSONResponse(api.error_body(500, f"internal error: {type(exc).__name__}: {exc}"),
                        status_code=500)
