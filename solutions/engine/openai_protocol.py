"""OpenAI's HTTP API as this engine speaks it: request bodies checked, response bodies built.

    request = parse_request(body, chat=True)    # APIError(400) naming the field if wrong
    fields = request.choice_fields(0)           # SamplingParams' fields, checked
    part = choice(request, 0, text, token_ids, "eos", delta=False)
    response(request, [part], usage(prompt_tokens, completion_tokens))   # a whole answer
    response(request, [part], None, chunk=True)  # one streamed chunk's body
    ChunkEvents(request).event(0, text, token_ids, None, first=True)   # the same, as an event

Supported: /v1/chat/completions (`messages`) and /v1/completions (`prompt`: a string, token
ids, or a list of either), `max_tokens` (`max_completion_tokens` for chat), `temperature`,
`top_p`, `seed`, `stop`, `n`, `stream`, `stream_options.include_usage`, `user`, and vLLM's
extensions `top_k`, `ignore_eos` and `return_token_ids`. A field the engine cannot honour
(`logprobs`, `tools`, `response_format`, penalties, ...) is refused by name, not ignored;
set to its neutral value (false, 0, null) it is accepted.
"""
from __future__ import annotations

import json
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from course import parts

SamplingParams = parts.load("11", "sampling_params").SamplingParams
SEED_SPAN = 2 ** 64          # a seed is taken modulo this (the sampler folds it to 64 bits)
MAX_CHOICES = 128            # n, times the prompts of one request

FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "max_tokens": "length",
                  "context": "length"}
COMMON = {"model", "stream", "stream_options", "temperature", "top_p", "top_k", "seed",
          "stop", "n", "max_tokens", "ignore_eos", "user", "return_token_ids"}
FIELDS = {"chat": COMMON | {"messages", "max_completion_tokens"},
          "text": COMMON | {"prompt"}}
# Fields OpenAI defines that the engine does not do: accepted only at their neutral value.
NEUTRAL = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False),
           "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "best_of": (None, 1),
           "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"),
           "parallel_tool_calls": (None,), "response_format": (None, {"type": "text"}),
           "suffix": (None, ""), "functions": (None, []), "store": (None, False),
           "metadata": (None,), "modalities": (None, ["text"])}
ENDPOINTS = {"chat": "/v1/chat/completions", "text": "/v1/completions"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
               503: "server_overloaded", 500: "server_error"}


class APIError(Exception):
    """An error response: status, one sentence, the field it is about (param)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code, self.headers = code, headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


@dataclass
class GenerationRequest:
    """A checked body. prompts: chat messages (one conversation) or completion prompts
    (strings or token-id lists); each prompt gets n choices."""
    chat: bool
    model: str
    prompts: list
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    sampling: dict = field(default_factory=dict)   # SamplingParams fields the body set
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))

    def choice_fields(self, choice: int) -> dict:
        """Choice `choice`'s SamplingParams fields, checked (APIError naming the field);
        max_tokens only when the body gave it (the engine's default is the rest of the
        context, which it knows once the prompt is tokens). With a seed, choice i samples
        with seed + i, so n choices differ yet replay."""
        fields = {"temperature": 1.0, **self.sampling}
        if fields.get("seed") is not None and choice:
            fields["seed"] = (fields["seed"] + choice + SEED_SPAN // 2) % SEED_SPAN \
                - SEED_SPAN // 2
        try:
            SamplingParams(**{"max_tokens": 1, **fields})
        except ValueError as e:
            name = str(e).split(" ", 1)[0]
            raise APIError(400, str(e), name if name in fields else None) from None
        return fields


def _expect(body: Mapping, name: str, kind: type | tuple, what: str):
    value = body.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _kinds(kind)):
        raise APIError(400, f"'{name}' must be {what}, got {_show(value)}", name)
    return value


def _kinds(kind: type | tuple) -> tuple:
    return kind if isinstance(kind, tuple) else (kind,)


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_request(body: object, chat: bool) -> GenerationRequest:
    """A request body (parsed JSON) checked field by field: APIError(400) naming the first
    field that is missing, of the wrong type, or not supported."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    kind = "chat" if chat else "text"
    for name in body:
        if name in FIELDS[kind]:
            continue
        if name in NEUTRAL and any(body[name] == v and type(body[name]) is type(v)
                                   for v in NEUTRAL[name]):
            continue
        other = "text" if chat else "chat"
        why = (f"belongs to {ENDPOINTS[other]}" if name in FIELDS[other] else
               "is not supported by this server" if name in NEUTRAL else
               "is not a field this server knows")
        raise APIError(400, f"'{name}' {why}", name)
    model = _expect(body, "model", str, "the model's name (GET /v1/models lists it)")
    prompts = [_messages(body)] if chat else _prompts(body)
    request = GenerationRequest(chat=chat, model=model, prompts=prompts)
    if "n" in body:
        request.n = _expect(body, "n", int, "an integer >= 1")
    if not 1 <= request.n * len(prompts) <= MAX_CHOICES:
        raise APIError(400, f"'n' times the prompts must be 1..{MAX_CHOICES}, got "
                            f"{request.n * len(prompts)}", "n")
    request.stream = bool(_expect(body, "stream", bool, "true or false")) \
        if body.get("stream") is not None else False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise APIError(400, "'stream_options' must be {\"include_usage\": true|false}",
                           "stream_options")
        if not request.stream:
            raise APIError(400, "'stream_options' is only for stream: true", "stream_options")
        request.include_usage = bool(_expect(options, "include_usage", bool, "true or false")) \
            if "include_usage" in options else False
    if body.get("return_token_ids") is not None:
        request.return_token_ids = _expect(body, "return_token_ids", bool, "true or false")
    request.sampling = _sampling(body, chat)
    return request


def _sampling(body: Mapping, chat: bool) -> dict:
    """The SamplingParams fields the body sets (their values are checked by SamplingParams)."""
    out = {name: body[name] for name in ("temperature", "top_p", "top_k", "seed", "stop",
                                          "ignore_eos", "max_tokens")
           if body.get(name) is not None}
    if chat and body.get("max_completion_tokens") is not None:
        if "max_tokens" in out:
            raise APIError(400, "give 'max_tokens' or 'max_completion_tokens', not both",
                           "max_completion_tokens")
        out["max_tokens"] = body["max_completion_tokens"]
    if "stop" in out and not (isinstance(out["stop"], str) or (
            isinstance(out["stop"], list) and all(isinstance(s, str) for s in out["stop"]))):
        raise APIError(400, f"'stop' must be a string or a list of strings, got "
                            f"{_show(out['stop'])}", "stop")
    return out


def _messages(body: Mapping) -> list[dict]:
    """The conversation, each content as a string (a list of text parts is joined)."""
    messages = _expect(body, "messages", list, "a non-empty list of {role, content} objects")
    if not messages:
        raise APIError(400, "'messages' must not be empty", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(400, f"{where} must be an object, got {_show(m)}", "messages")
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise APIError(400, f"{where}.{extra[0]} is not supported by this server",
                           "messages")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise APIError(400, f"{where}.content: only text parts ({{\"type\": \"text\", "
                                    f"\"text\": ...}}) are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(400, f"{where}.content must be a string, got {_show(content)}",
                           "messages")
        if m.get("role") not in ("system", "user", "assistant"):
            raise APIError(400, f"{where}.role must be system, user or assistant, got "
                                f"{_show(m.get('role'))}", "messages")
        out.append({"role": m["role"], "content": content})
    return out


def _prompts(body: Mapping) -> list:
    """Completion prompts: a string, token ids, or a list of strings or of token-id lists."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt) or all(
                isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                            for t in p) for p in prompt):
            return list(prompt)
    raise APIError(400, f"'prompt' must be a string, a list of token ids, or a non-empty list "
                        f"of either, got {_show(prompt)}", "prompt")


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice(request: GenerationRequest, index: int, text: str, token_ids: list[int] | None,
           finish_reason: str | None, delta: bool, first: bool = False) -> dict:
    """One choice of a response (delta: of a streamed chunk). finish_reason is the engine's
    ("eos", "stop_string", "max_tokens", "context"), mapped to OpenAI's stop / length."""
    out: dict = {"index": index}
    if not request.chat:
        out["text"] = text
    elif delta:
        out["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
    else:
        out["message"] = {"role": "assistant", "content": text}
    out["logprobs"] = None
    out["finish_reason"] = None if finish_reason is None else FINISH_REASONS[finish_reason]
    if request.return_token_ids and token_ids is not None:
        out["token_ids"] = token_ids
    return out


def response(request: GenerationRequest, choices: list[dict], usage_: dict | None,
             chunk: bool = False) -> dict:
    """A whole response or a streamed chunk around its choices."""
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if request.chat \
        else "text_completion"
    out = {"id": ("chatcmpl-" if request.chat else "cmpl-") + request.id, "object": kind,
           "created": request.created, "model": request.model, "choices": choices}
    if not chunk or request.include_usage:
        out["usage"] = usage_
    return out


class ChunkEvents:
    """A streamed request's chunks as server-sent events ("data: {...}\n\n"), each the JSON of
    `response(request, [choice(request, ..., delta=True)], None, chunk=True)`, formatted into
    a template made once per request: a chunk per token per request is the server's busiest
    path, and building and encoding the nested dicts each time cost most of its CPU, taken
    from the engine's thread (they share the interpreter)."""

    def __init__(self, request: GenerationRequest):
        envelope = json.dumps(response(request, [], None, chunk=True), ensure_ascii=False)
        head, _, tail = envelope.rpartition('"choices": []')
        self._head, self._tail = f'data: {head}"choices": [{{"index": ', f"]{tail}\n\n"
        self._chat, self._ids = request.chat, request.return_token_ids

    def event(self, index: int, text: str, token_ids: list[int], finish_reason: str | None,
              first: bool) -> str:
        quoted = json.encoder.encode_basestring(text)   # escaped as json.dumps would
        content = (f'"text": {quoted}' if not self._chat else
                   f'"delta": {{"role": "assistant", "content": {quoted}}}' if first else
                   f'"delta": {{"content": {quoted}}}')
        reason = "null" if finish_reason is None else f'"{FINISH_REASONS[finish_reason]}"'
        ids = f', "token_ids": [{", ".join(map(str, token_ids))}]' if self._ids else ""
        return (f'{self._head}{index}, {content}, "logprobs": null, "finish_reason": {reason}'
                f'{ids}}}{self._tail}')
