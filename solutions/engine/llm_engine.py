"""The serving loop: requests come in, each step runs the batch, text comes out.

    engine = LLMEngine(model, tokenizer, eos_ids, EngineConfig())
    rid = engine.add_request(prompt_ids, SamplingParams(max_tokens=64))
    while engine.has_unfinished():
        for out in engine.step():          # RequestOutput: new text, finished, reason
            print(out.request_id, out.new_text, end="")
    engine.abort(rid)                      # any time between steps

Per request the engine keeps what the scheduler does not need: a streaming detokenizer and
a stop checker (stage 02). A request is validated when it is added (empty prompt, prompt
longer than the context, token ids outside the vocabulary, bad sampling parameters): a bad
one raises ValueError there and never disturbs the requests already running.

Finish reasons: "eos", "stop_string", "max_tokens" (stage 02's), "context" (the sequence
filled max_model_len positions) and "abort".
"""
from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from course import parts
from solutions.engine.model_runner import EngineConfig, ModelRunner, SampledTokens

SamplingParams = parts.load("11", "sampling_params").SamplingParams
_sequence = parts.load("11", "sequence")
Sequence = _sequence.Sequence
# Stands for a token sampled on the GPU that the host has not seen yet (never a real id).
PLACEHOLDER = -1
_sched = parts.load("11", "scheduler")
if TYPE_CHECKING:   # a stage folder is no package: parts.load names its types
    LlamaModel = parts.load("08", "model").LlamaModel
    Tokenizer = parts.load("02", "tokenizer").Tokenizer


@dataclass(slots=True)   # one per running request per step: slots make it cheaper to build
class RequestOutput:
    """What one step produced for one request: the text it can show now (held-back text
    that may start a stop string comes later), the tokens, and whether it is done."""
    request_id: int
    new_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None


class _Request:
    def __init__(self, seq, detokenizer, checker):
        self.seq, self.detokenizer, self.checker = seq, detokenizer, checker
        self.text, self.sent = "", 0

    def final_text(self) -> str:
        if self.detokenizer is not None:
            self.text += self.detokenizer.flush()   # bytes of a character never completed
        return self.checker.safe_text(self.text, finished=True)


def token_ids(prompt: Iterable) -> list[int]:
    """A prompt's token ids as ints. TypeError for anything else: int() would read 1.9 as 1
    and "12" as 12, and True is an int to Python, but none of them is a token id."""
    items = list(prompt)
    if not any(isinstance(t, bool) for t in items):
        try:
            return [operator.index(t) for t in items]
        except TypeError:
            pass
    raise TypeError("a list of token ids holds integers only, got "
                    f"{[type(t).__name__ for t in items]}")


class LLMEngine:
    """model: a stage-08 LlamaModel; tokenizer: stage 02's (or None: token ids only, no text);
    eos_ids: the model's end-of-sequence ids."""

    def __init__(self, model: LlamaModel, tokenizer: Tokenizer | None, eos_ids: Iterable[int],
                 config: EngineConfig | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.eos_ids = frozenset(eos_ids)
        vocab = model.config.vocab_size
        outside = sorted(t for t in self.eos_ids if not 0 <= t < vocab)
        if outside:   # the model could never emit them: every reply would run to max_tokens
            raise ValueError(f"end-of-sequence id(s) {outside} lie outside the model's "
                             f"vocabulary (0..{vocab - 1}): check config.json, "
                             "generation_config.json and tokenizer.json")
        self.config = config or EngineConfig()
        self.runner = ModelRunner(model, self.config)
        self.max_model_len = self.runner.max_len   # positions per sequence
        c = self.config
        self.scheduler = _sched.Scheduler(_sched.SchedulerConfig(
            max_model_len=self.runner.max_len,
            max_num_seqs=min(c.max_num_seqs, self.runner.max_num_seqs),
            max_num_batched_tokens=c.step_tokens(self.runner.max_len),
            chunked_prefill=c.chunked_prefill), self.runner.allocator)
        self.requests: dict[int, _Request] = {}
        # The step queued on the GPU: (its sequences, their sampled tokens, whether it is a
        # decode step), collected by the next call of step().
        self._inflight: tuple[list, SampledTokens, bool] | None = None
        self._ids = itertools.count()
        self._stopping = parts.load("02", "stopping")
        self._detokenizer = parts.load("02", "detokenizer").IncrementalDetokenizer

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. ValueError if it can never run."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__} "
                            "(SamplingParams.from_dict makes one from a dict)")
        params.validate()
        ids = token_ids(prompt_ids)
        if not ids:
            raise ValueError("the prompt is empty (no tokens)")
        if len(ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than the context of "
                             f"{self.max_model_len} positions")
        try:
            self.model.check_inputs(torch.tensor(ids, dtype=torch.int64),
                                    torch.zeros(1, dtype=torch.int64))
        except IndexError as e:   # a token id outside the vocabulary: a request that cannot run
            raise ValueError(str(e)) from None
        rid = next(self._ids)
        seq = Sequence(rid, ids, params.with_seed())
        checker = self._stopping.StopChecker(() if params.ignore_eos else self.eos_ids,
                                             list(params.stop), params.max_tokens)
        detok = (self._detokenizer(self.tokenizer, ids) if self.tokenizer is not None else None)
        self.scheduler.add(seq)
        self.requests[rid] = _Request(seq, detok, checker)
        return rid

    def has_unfinished(self) -> bool:
        return self._inflight is not None or self.scheduler.has_unfinished()

    def abort(self, request_id: int) -> RequestOutput | None:
        """Stop a request now (between steps); its cache is freed at once (a step still in
        flight may write into it: the GPU runs that step before any later one)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish(req.seq, "abort")
        return RequestOutput(request_id, "", [], True, "abort")

    def step(self) -> list[RequestOutput]:
        """Collect the step in flight and queue the next; return what each request that got
        a token produced. A step's tokens come back one call after it is queued.

        While a decode step runs on the GPU the host already prepares and queues the next
        one, whose input ids are the running step's samples, still on the device: the host
        puts a placeholder in each sequence and the real token replaces it when it arrives.
        So the GPU never waits for the host's scheduling and bookkeeping. The next step is
        queued this way only when it is sure to be a decode of the running sequences
        (nothing waiting, room in the context, each of them in the step in flight; those of
        that step that finished meanwhile are left out, so a request ending does not stall
        the GPU), and not when the step in flight gives every one of them its last token
        (max_tokens); a sequence that turns out to have stopped had one row of wasted work,
        whose sample is dropped."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None and self._can_run_ahead(inflight):
            seqs, tokens, _ = inflight
            for seq in self.scheduler.running:
                seq.complete_step(PLACEHOLDER)
            upcoming = self.scheduler.schedule()   # empty if the pool preempted everyone
            if upcoming:
                self._inflight = (upcoming, self.runner.launch(upcoming, (seqs, tokens)), True)
            return self._collect(seqs, tokens.tolist(), ahead=True)
        outputs = [] if inflight is None else self._collect(inflight[0], inflight[1].tolist())
        seqs = self.scheduler.schedule()
        if seqs:
            decode = all(seq.num_scheduled == 1 and seq.num_cached == seq.num_tokens - 1
                         for seq in seqs)
            self._inflight = (seqs, self.runner.launch(seqs), decode)
        return outputs

    def _can_run_ahead(self, inflight) -> bool:
        """Whether the next step is surely a decode of the running sequences, each of which
        is in the step in flight (whose sequences that finished since are simply left out)."""
        seqs, _, decode = inflight
        running = self.scheduler.running
        if not decode or self.scheduler.waiting:
            return False
        max_len = self.max_model_len
        if not all(len(seq.token_ids) < max_len for seq in running):
            return False
        # each of them ends with the step in flight: a step queued now would be wasted work
        if all(seq.num_tokens - seq.num_prompt_tokens + 1 >= seq.params.max_tokens
               for seq in running):
            return False
        # running keeps the step's order, less the finished: most steps, the same list
        if len(running) == len(seqs) and all(a is b for a, b in zip(running, seqs)):
            return True
        in_flight = {id(seq) for seq in seqs}
        return all(id(seq) in in_flight for seq in running)

    def _collect(self, seqs, tokens: list[int], ahead: bool = False) -> list[RequestOutput]:
        """The tokens of a finished step: ahead, each sequence's placeholder becomes its real
        token; else the step completes now. Sequences that stopped meanwhile are skipped: a
        finished or aborted request has left self.requests (one lookup per sequence)."""
        outputs, requests = [], self.requests
        for seq, token in zip(seqs, tokens):
            req = requests.get(seq.seq_id)
            if req is None:
                continue                     # finished or aborted while this step ran
            if ahead:
                seq.token_ids[-1] = token        # its placeholder, the newest token
            else:
                kept = seq.complete_step(token)
                self.scheduler.allocator.computed(seq)
                if not kept:
                    continue                 # a prompt chunk: its sample means nothing
            outputs.append(self._emit(req, token))
        return outputs

    def _emit(self, req: _Request, token: int) -> RequestOutput:
        seq = req.seq
        if req.detokenizer is not None:
            req.text += req.detokenizer.push(token)
        reason = req.checker.check(token, req.text)
        if reason is None and len(seq.token_ids) > self.max_model_len:
            reason = "context"   # its next token would need a position past the context
        if reason is None:
            if not req.text:     # token ids only: no text to hold back or send
                return RequestOutput(seq.seq_id, "", [token], False, None)
            safe = req.checker.safe_text(req.text, finished=False)
        else:
            safe = req.final_text()
            self.scheduler.finish(seq, reason)
            del self.requests[seq.seq_id]
        new_text, req.sent = safe[req.sent:], max(req.sent, len(safe))
        return RequestOutput(seq.seq_id, new_text, [token], reason is not None, reason)

