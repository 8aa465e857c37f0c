"""`python3 -m solutions.engine serve`: a real server process on a free port, a tiny random
Llama with a word tokenizer (every id is a word "wN"), driven by the official `openai` client.

The oracle of every greedy answer is the prompt's greedy tokens run alone by stage 09's
generate_greedy (course.testing.fixtures.Solo), in this process, not by the server.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
import torch

from course import parts
from course.testing import fixtures

ROOT = Path(__file__).resolve().parent.parent
EOS = 2                           # config.json's eos_token_id, <|im_end|> in the tokenizer
WORDS = ["[UNK]", "<|im_start|>", "<|im_end|>"] + [f"w{i}" for i in range(3, 211)]
MODEL = "tiny"                    # the served name: the model directory's name
START_TIMEOUT_S = 180             # generous: CI is a loaded 2-core machine


def write_model(directory: Path) -> None:
    """gqa_tied (vocab 211) and a word-level tokenizer.json covering every id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    fixtures.save_tiny_llama(directory, "gqa_tied")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(directory / "tokenizer.json"))


class Server:
    """A server process; `port` once it has said where it listens."""

    def __init__(self, model_dir: Path, *options: str):
        cmd = [sys.executable, "-m", "solutions.engine", "serve", "--model", str(model_dir),
               "--port", "0", "--device", "cpu", "--log-level", "warning", *options]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        self._ready = threading.Event()
        self.port = 0
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(START_TIMEOUT_S) or not self.port:
            self.proc.kill()
            pytest.fail("the server did not start:\n" + "".join(self.log))

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)
            if line.startswith("serving ") and not self.port:
                self.port = int(line.split("/v1")[0].rsplit(":", 1)[1])
                self._ready.set()
        self._ready.set()

    def client(self, key: str = "none", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key,
                             max_retries=0, timeout=120, **kw)

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict | None = None) -> tuple[int, dict, dict]:
        """(status, headers (lower-case names), JSON body) of one plain HTTP request."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        data = r.read()
        conn.close()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(data)

    def health(self) -> dict:
        return self.request("GET", "/health")[2]

    def stop(self) -> int:
        """SIGTERM, as a service manager would; the exit status."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail("the server did not exit within 120 s of SIGTERM:\n" + "".join(self.log))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("models") / MODEL
    d.mkdir()
    write_model(d)
    return d


@pytest.fixture(scope="module")
def model(model_dir):
    config = parts.load("01", "config").load_config(model_dir)
    weights = parts.load("01", "checkpoint").load_checked(model_dir, config)
    return parts.load("08", "model").LlamaModel(config, weights, "cpu", torch.float32)


@pytest.fixture(scope="module")
def solo(model) -> fixtures.Solo:
    return fixtures.Solo(model, max_new=24)


@pytest.fixture(scope="module")
def server(model_dir):
    s = Server(model_dir)
    yield s
    assert s.stop() == 0, "the server's exit status after SIGTERM:\n" + "".join(s.log)


def words(ids: list[int]) -> str:
    """The text the word tokenizer gives ids (end-of-sequence and other specials hidden)."""
    return "".join(" " + WORDS[t] for t in ids if t > EOS)


def prompt_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, len(WORDS)) for _ in range(n)]


def until(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.05)
    return value


# ----------------------------------------------------------------------------- answers

def test_models_and_health(server):
    assert [m.id for m in server.client().models.list().data] == [MODEL]
    h = server.health()
    assert h["status"] == "ok" and h["running"] == 0 and h["waiting"] == 0, h


def test_completion_whole_and_streamed_are_the_greedy_tokens(server, solo):
    prompt = prompt_ids(1, 7)
    want = solo(prompt, 12, eos={EOS})
    client = server.client()
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"return_token_ids": True})
    got = whole.choices[0].model_extra["token_ids"]
    assert got == want, f"tokens {got}, alone they are {want}"
    assert whole.choices[0].text == words(want)
    assert whole.choices[0].finish_reason == ("stop" if want[-1] == EOS else "length")
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (7, len(want))
    chunks = list(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want)
    streamed = [t for c in chunks[:-1] for t in c.choices[0].model_extra["token_ids"]]
    assert streamed == want
    assert "".join(c.choices[0].text for c in chunks[:-1]) == words(want)
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == \
        whole.choices[0].finish_reason


def test_chat_whole_and_streamed_agree(server):
    client = server.client()
    messages = [{"role": "system", "content": "w7 w8"}, {"role": "user", "content": "w5 w6"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                           max_completion_tokens=10)
    reply = whole.choices[0].message
    assert reply.role == "assistant" and reply.content.split() and whole.usage.prompt_tokens > 4
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                 max_tokens=10, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_a_stop_string_ends_the_text_before_it(server, solo):
    prompt = prompt_ids(2, 5)
    full = words(solo(prompt, 24, eos={EOS}))
    stop = next(f" {w} " for w in full.split()[2:] if full.find(f" {w} ") > 0)
    got = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                             temperature=0, stop=[stop, "w999"])
    assert got.choices[0].text == full[:full.find(stop)]
    assert got.choices[0].finish_reason == "stop"


def test_the_context_ends_a_reply_with_length(server):
    long_prompt = prompt_ids(3, 250)           # the tiny model has 256 positions
    got = server.client().completions.create(model=MODEL, prompt=long_prompt, max_tokens=100,
                                             temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens < 100
    full = server.client().completions.create(model=MODEL, prompt=prompt_ids(3, 256),
                                              temperature=0, extra_body={"ignore_eos": True})
    assert (full.choices[0].finish_reason, full.usage.completion_tokens) == ("length", 1), \
        "no max_tokens: the rest of the context, and a prompt that fills it gets one token"


def test_a_seed_replays_and_n_gives_seeded_choices(server):
    client = server.client()
    ask = dict(model=MODEL, prompt=prompt_ids(4, 6), max_tokens=8, temperature=1.5,
               extra_body={"return_token_ids": True, "ignore_eos": True})

    def tokens(**kw):
        return [c.model_extra["token_ids"] for c in client.completions.create(**ask, **kw).choices]

    first, again, other = tokens(seed=11), tokens(seed=11), tokens(seed=12)
    assert first == again, "the same seed sampled different tokens"
    assert tokens(seed=11, n=2) == first + other, "choice i samples with seed + i"
    two = client.completions.create(**ask, n=2)
    assert sorted(c.index for c in two.choices) == [0, 1]


def test_64_concurrent_streams_each_get_their_greedy_tokens(server, model):
    """Continuous batching across clients: every stream gets exactly what it gets alone.
    16 prompts (the oracle runs each alone, which is slow on a CPU), 4 clients each, asking
    for different lengths: the streams start and end at different steps."""
    solo = fixtures.Solo(model, max_new=8)
    asks = [(prompt_ids(100 + i % 16, 3 + i % 16), 2 + (i // 16) * 2 - i % 2)
            for i in range(64)]
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none",
                                max_retries=0, timeout=300)

    async def one(prompt, max_tokens):
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"return_token_ids": True})
        return [t async for c in stream for t in c.choices[0].model_extra["token_ids"]]

    async def everyone():
        async with client:
            return await asyncio.gather(*(one(p, m) for p, m in asks))

    got = asyncio.run(everyone())
    wrong = [i for i, (p, m) in enumerate(asks) if got[i] != solo(p, m, eos={EOS})]
    assert not wrong, f"{len(wrong)} of 64 streams differ from their prompt alone, e.g. " \
                      f"{wrong[0]}: {got[wrong[0]]} vs {solo(*asks[wrong[0]], eos={EOS})}"


def test_a_client_that_leaves_mid_stream_aborts_its_request(server):
    before = server.health()["aborted"]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({
        "model": MODEL, "prompt": prompt_ids(5, 4), "max_tokens": 240, "ignore_eos": True,
        "temperature": 0, "stream": True}), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    assert r.readline().startswith(b"data: ")
    conn.close()                         # gone after the first token of 240
    h = until(lambda: (h := server.health())["aborted"] > before and h["running"] == 0
              and h["waiting"] == 0 and h, "the request to be aborted")
    assert h["kv_cache_used"] == 0, f"its cache was not freed: {h}"


# ----------------------------------------------------------------------------- errors

def assert_error(status: int, body: dict, want: int, *needles: str, param: str | None = None):
    assert status == want, f"status {status}, expected {want}: {body}"
    error = body.get("error")
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, \
        f"not OpenAI's error shape: {body}"
    assert error["message"] and "\n" not in error["message"] and "Traceback" not in \
        error["message"], error["message"]
    for needle in needles:
        assert needle in error["message"], f"the error should mention {needle!r}: {error}"
    if param is not None:
        assert error["param"] == param, error


def post(server: Server, path: str, body: object | bytes, **headers) -> tuple[int, dict, dict]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return server.request("POST", path, raw, {"Content-Type": "application/json", **headers})


BAD_BODIES = [   # (path, body, needle, param)
    ("/v1/completions", b'{"model": "tiny", "prompt": ', "not valid JSON", None),
    ("/v1/completions", b"\xff\xfe", "not valid JSON", None),
    ("/v1/completions", [1, 2], "JSON object", None),
    ("/v1/completions", {"prompt": "w5"}, "'model'", "model"),
    ("/v1/completions", {"model": MODEL}, "'prompt'", "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "'messages'", "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
     "role", "messages"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "w5"}, "gpt-9", "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "w5", "max_tokens": "ten"}, "max_tokens",
     "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "w5", "temperature": -1}, "temperature",
     "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "w5", "n": 0}, "'n'", "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "w5", "logprobs": 2}, "'logprobs'",
     "logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, "'tools'", "tools"),
    ("/v1/completions", {"model": MODEL, "prompt": "w5", "messages": []}, "chat", "messages"),
    ("/v1/completions", {"model": MODEL, "prompt": [5, 999]}, "999", "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [5] * 300}, "300 tokens", "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": "w5 " * 300}]}, "context", "messages"),
]


@pytest.mark.parametrize("path,body,needle,param", BAD_BODIES,
                         ids=[f"{i}-{b[2].strip(chr(39))}" for i, b in enumerate(BAD_BODIES)])
def test_a_bad_request_is_a_400_naming_the_problem(server, path, body, needle, param):
    status, _, answer = post(server, path, body)
    assert_error(status, answer, 400, needle, param=param)


def test_the_openai_client_sees_a_400_as_bad_request(server):
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().completions.create(model=MODEL, prompt="w5", max_tokens=2,
                                           extra_body={"logit_bias": {"5": 3}})
    assert caught.value.status_code == 400 and "logit_bias" in caught.value.message


def test_routes_and_sizes(server):
    status, _, body = server.request("GET", "/v1/nothing")
    assert_error(status, body, 404, "/v1/nothing")
    status, _, body = server.request("GET", "/v1/completions")
    assert_error(status, body, 405, "GET")
    status, _, body = post(server, "/v1/completions", b" " * (9 << 20))
    assert_error(status, body, 413, "larger than")


def test_a_key_and_a_full_server(model_dir):
    """--api-key: 401 without it; --max-num-seqs 2 --max-waiting 1: a fourth request while
    three are held (two running, one waiting) gets 503 with Retry-After, and works once they
    leave; SIGTERM while a reply
    streams lets it finish, then exits 0."""
    s = Server(model_dir, "--api-key", "sesame", "--max-num-seqs", "2", "--max-waiting", "1")
    key = {"Authorization": "Bearer sesame"}
    ask = {"model": MODEL, "prompt": [5, 6], "max_tokens": 2, "temperature": 0}
    try:
        assert s.health()["status"] == "ok", "/health needs no key"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            status, _, body = post(s, "/v1/completions", ask, **headers)
            assert_error(status, body, 401, "API key")
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").models.list()
        assert s.client("sesame").completions.create(**ask).choices[0].finish_reason
        status, _, body = post(s, "/v1/completions", {**ask, "n": 4}, **key)
        assert_error(status, body, 400, "4 choices", param="n")

        streams = [open_stream(s, {**ask, "max_tokens": 240, "ignore_eos": True}, key)
                   for _ in range(3)]
        status, headers, body = post(s, "/v1/completions", ask, **key)
        assert_error(status, body, 503, "busy")
        assert headers.get("retry-after") == "1", headers
        for conn in streams:
            conn.close()
        until(lambda: s.health()["running"] + s.health()["waiting"] == 0, "the streams to end")
        status, _, body = post(s, "/v1/completions", ask, **key)
        assert status == 200, body

        conn = open_stream(s, {**ask, "max_tokens": 12, "ignore_eos": True}, key)
        first = conn.response.readline()
        assert first.startswith(b"data: ")
        s.proc.send_signal(signal.SIGTERM)
        rest = conn.getresponse_rest()
        assert rest.endswith(b"data: [DONE]\n\n"), rest[-300:]
        # a chunk carries the tokens of --stream-interval's steps: the first one may already
        # hold the whole reply and its finish reason
        done = [json.loads(line.strip()[6:]) for line in (first + rest).split(b"\n\n")
                if line.strip().startswith(b"data: {")]
        assert done[-1]["choices"][0]["finish_reason"] == "length"
    finally:
        code = s.stop() if s.proc.poll() is None else s.proc.returncode
    assert code == 0, "exit status after SIGTERM:\n" + "".join(s.log)


class _Stream(http.client.HTTPConnection):
    def getresponse_rest(self) -> bytes:
        return self.response.read()


def open_stream(server: Server, body: dict, headers: dict) -> _Stream:
    """A streamed completion the server has taken (its headers come once the engine holds
    the request, before its first token)."""
    conn = _Stream("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json", **headers})
    conn.response = conn.getresponse()
    assert conn.response.status == 200, conn.response.read()
    return conn


# ----------------------------------------------------------------------------- fuzz

def _cases():
    """(path, body bytes): a valid body for the path, often with one or two fields replaced
    by junk or unknown fields added; sometimes bytes that are not JSON at all."""
    from hypothesis import strategies as st
    junk = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.integers(2**63, 2**70),
                     st.floats(), st.text(max_size=6), st.lists(st.integers(-2, 300), max_size=3),
                     st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
    ids = st.lists(st.integers(3, 210), min_size=1, max_size=6)
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                     "content": st.text(max_size=16)})
    options = {"temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1),
               "top_k": st.integers(0, 50), "seed": st.integers(0, 2**64 - 1),
               "stop": st.one_of(st.text(min_size=1, max_size=3),
                                 st.lists(st.text(min_size=1, max_size=3), max_size=2)),
               "n": st.integers(1, 2), "stream": st.booleans(), "ignore_eos": st.booleans(),
               "return_token_ids": st.booleans(),
               "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()})}
    prompts = {
        "/v1/completions": {"prompt": st.one_of(st.text(max_size=16), ids,
                                                st.lists(st.text(max_size=8), min_size=1,
                                                         max_size=2))},
        "/v1/chat/completions": {"messages": st.lists(message, min_size=1, max_size=2)}}
    names = sorted({*options, "model", "prompt", "messages", "logprobs", "tools", "frobnicate"})
    spoil = st.one_of(st.just({}), st.dictionaries(st.sampled_from(names), junk, max_size=2))

    def body(path):
        valid = st.fixed_dictionaries({"model": st.just(MODEL), "max_tokens": st.integers(1, 4),
                                       **prompts[path]}, optional=options)
        # a missing max_tokens runs to the context: slow on a CPU, and tested elsewhere
        return st.tuples(valid, spoil).map(lambda vs: json.dumps({**vs[0], **vs[1]}).encode())

    paths = st.sampled_from(sorted(prompts))
    return st.one_of(paths.flatmap(lambda p: st.tuples(st.just(p), body(p))),
                     st.tuples(paths, st.binary(max_size=40)))


def test_fuzzed_bodies_get_an_answer_or_a_400_and_leave_the_server_sound(server, solo):
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=40, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(_cases())
    def one(case):
        path, raw = case
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        conn.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        conn.close()
        if r.status == 200 and r.getheader("content-type", "").startswith("text/event-stream"):
            assert data.endswith(b"data: [DONE]\n\n"), data[-200:]
            return
        body = json.loads(data)
        if r.status == 200:
            assert body["choices"] and body["usage"]["completion_tokens"] >= 0, body
        else:
            assert_error(r.status, body, 400)

    one()
    until(lambda: (h := server.health())["running"] + h["waiting"] == 0, "an idle engine")
    prompt = prompt_ids(6, 5)
    got = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                             temperature=0, extra_body={"return_token_ids": True})
    assert got.choices[0].model_extra["token_ids"] == solo(prompt, 6, eos={EOS})


# ----------------------------------------------------------------------------- the command

@pytest.mark.parametrize("argv,needle", [
    (["--model", "/nonexistent/model"], "does not exist"),
    (["--port", "70000"], "--port"),
    (["--max-waiting", "-1"], "--max-waiting"),
    (["--stream-interval", "-1"], "--stream-interval"),
    (["--stream-interval", "nan"], "--stream-interval"),
    (["--host", "256.0.0.1"], "cannot listen"),
], ids=["no-model", "bad-port", "bad-waiting", "bad-interval", "nan-interval", "bad-host"])
def test_bad_serve_options_are_one_line(capsys, argv, needle):
    from solutions.engine import __main__ as cli
    try:
        code = cli.main(["serve", "--port", "0", "--device", "cpu", *argv])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and needle in err[0], \
        (code, err)


def test_a_port_in_use_is_one_line_before_the_model_loads(capsys, tmp_path):
    from solutions.engine import __main__ as cli
    from solutions.engine.serve_cli import listen
    with listen("127.0.0.1", 0) as taken:
        taken.listen()
        port = str(taken.getsockname()[1])
        code = cli.main(["serve", "--port", port, "--model", str(tmp_path / "absent")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f"127.0.0.1:{port}" in err[0], (code, err)


def test_a_client_that_leaves_before_a_whole_answer_aborts_it(server):
    before = server.health()["aborted"]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({
        "model": MODEL, "prompt": prompt_ids(7, 4), "max_tokens": 240, "ignore_eos": True,
        "temperature": 0}), headers={"Content-Type": "application/json"})
    until(lambda: server.health()["running"] == 1, "the request to run")
    conn.close()
    until(lambda: (h := server.health())["aborted"] > before and h["running"] == 0,
          "the request to be aborted")


# ----------------------------------------------------------------------------- streamed chunks

@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
@pytest.mark.parametrize("options", [{}, {"return_token_ids": True},
                                     {"stream_options": {"include_usage": True}}],
                         ids=["plain", "token-ids", "usage"])
def test_a_chunk_event_is_the_json_of_its_response(chat, options):
    """ChunkEvents' templates against the dicts of response() and choice(), through json."""
    from solutions.engine import openai_protocol as api
    body = {"model": 'a "model", "choices": []', "stream": True, **options}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": [5]})
    req = api.parse_request(body, chat)
    events = api.ChunkEvents(req)
    for text in ("", "w5 w6", 'quote " back \\ newline \n tab \t \x01 \u2028 é 😀'):
        for reason in (None, "eos", "stop_string", "max_tokens", "context"):
            for first in (False, True):
                got = events.event(3, text, [5, 60], reason, first)
                want = api.response(req, [api.choice(req, 3, text, [5, 60], reason, delta=True,
                                                     first=first)], None, chunk=True)
                assert got.startswith("data: ") and got.endswith("\n\n"), got
                assert json.loads(got[6:]) == want, (got, want)


def engine_process(server: Server) -> int:
    """The pid of the server's engine process (Linux: /proc names a process's children)."""
    pid = server.proc.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    engines = [int(c) for c in children
               if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(engines) == 1, f"the server's children: {children}"
    return engines[0]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")
def test_an_engine_process_that_dies_is_a_503_and_the_server_still_stops(model_dir):
    s = Server(model_dir)
    try:
        os.kill(engine_process(s), signal.SIGKILL)       # as the kernel's OOM killer would
        status, _, body = until(lambda: (r := s.request("GET", "/health"))[0] == 503 and r,
                                "/health to say the engine is gone")
        assert "engine process has exited" in body["status"], body
        status, _, body = s.request("POST", "/v1/completions", json.dumps(
            {"model": MODEL, "prompt": [5, 6], "max_tokens": 2}).encode(),
            {"Content-Type": "application/json"})
        assert (status, body["error"]["code"]) == (503, "engine_exited"), body
    finally:
        assert s.stop() == 0, "".join(s.log)
    assert any("engine process has exited" in line for line in s.log), "said on stderr"


# ----------------------------------------------------------------------------- the engine process

FAIL = [13]        # the stand-in engine's steps raise while a request of this prompt runs


def standin(max_num_seqs: int, **options):
    """An AsyncEngine over bench.serve_standin's stand-in engine (each step gives every
    request one token, its request id, every 2 ms), whose steps fail while a request whose
    prompt is FAIL runs."""
    from functools import partial

    from bench.serve_standin import served
    from solutions.engine.async_engine import AsyncEngine
    return AsyncEngine(partial(served, 0.002, 0.0, max_num_seqs=max_num_seqs,
                               fail_prompt=FAIL), max_waiting=0, **options)


def test_a_failing_step_ends_the_streams_and_the_engine_serves_on():
    serving = standin(max_num_seqs=4)

    async def scenario():
        serving.start()
        try:
            stream, _ = await serving.add([(FAIL, True, {"max_tokens": 3}), ([5], True, {})])
            with pytest.raises(RuntimeError, match="device lost"):
                async for _ in stream:
                    pass
            stream, lengths = await serving.add([([5, 6], True, {"max_tokens": 3})] * 4)
            assert lengths == [2] * 4, "each job's prompt length"
            got = [out.new_token_ids[0] async for batch in stream for _, out in batch]
            assert sorted(got) == sorted(stream.request_ids * 3), got
            return serving._held
        finally:
            serving.stop()

    assert asyncio.run(scenario()) == 0, "every request was let go of"
    assert serving.process.exitcode == 0, "stop() ends the engine process cleanly"


def test_a_refused_job_refuses_its_whole_request_and_an_engine_that_dies_is_said():
    from solutions.engine.async_engine import EngineUnavailable
    serving = standin(max_num_seqs=4)

    async def scenario():
        serving.start()
        try:
            with pytest.raises(ValueError, match="more than the context of 4096"):
                await serving.add([([5], True, {"max_tokens": 2}), ([5] * 5000, True, {})])
            assert serving._held == 0, "a refused request holds no place"
            stream, _ = await serving.add([([5], True, {"max_tokens": 10_000})])
            serving.process.kill()        # as the kernel's OOM killer would
            with pytest.raises(RuntimeError, match="engine process has exited"):
                async for _ in stream:
                    pass
            with pytest.raises(EngineUnavailable, match="restart the server"):
                await serving.add([([5], True, {})])
        finally:
            serving.stop()

    asyncio.run(scenario())


def test_the_stream_interval_gathers_the_steps_between_deliveries():
    """The first step's outputs go at once; with an interval longer than the run, the others
    wait and go together when the engine goes idle: two deliveries, no token lost."""
    serving, sizes = standin(max_num_seqs=2, stream_interval_s=3600), []

    async def scenario():
        deliver = serving._deliver
        serving._deliver = lambda outputs: (sizes.append(len(outputs)), deliver(outputs))
        serving.start()
        try:
            stream, _ = await serving.add([([5], True, {"max_tokens": 6})])
            got = [t async for batch in stream for _, out in batch for t in out.new_token_ids]
            return got, stream.request_ids
        finally:
            serving.stop()

    got, (request_id,) = asyncio.run(scenario())
    assert got == [request_id] * 6, got
    assert sizes == [1, 5], f"deliveries of {sizes} outputs; expected the first step's alone, " \
                            "then the other five together"
