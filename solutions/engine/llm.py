"""The reference engine's front door: a model directory in, text out.

    from solutions.engine.llm import LLM
    llm = LLM("path/to/model")                       # config.json, *.safetensors, tokenizer.json
    print(llm.generate("What is the capital of France?").text)
    for piece in llm.stream("Tell me a story", max_tokens=100):
        print(piece, end="", flush=True)

It wires the stages together: config and weights (01), tokenizer, chat template, streaming
detokenizer and stop conditions (02), the forward pass (08, built from the ops of 03-07) and
the argmax op (08). Each is loaded through the parts resolver, so with TINYVLLM_STUDENT=NN
the engine runs a student's stage NN.

This is the stage-08 engine: every step recomputes the whole sequence (no KV cache), so a
reply of n tokens costs O(n^2) token-forwards. Stage 09 adds the cache.
"""
from __future__ import annotations

import os
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from course import parts

FINISH_REASONS = ("eos", "stop_string", "max_tokens", "context")
DEFAULT_MAX_TOKENS = 256


@dataclass
class GenerationResult:
    """One finished request.

    finish_reason: "eos" (an end-of-sequence token), "stop_string" (the text reached a stop
    string, which `text` leaves out), "max_tokens", or "context" (the sequence filled the
    model's positions).
    """
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str


class TextStream:
    """Iterating yields the reply's text pieces as they are decoded; afterwards `result`
    holds the GenerationResult (its text is the pieces joined)."""

    def __init__(self, pieces: Generator[str, None, GenerationResult]):
        self._pieces = pieces
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        self.result = yield from self._pieces


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" -> cuda when a GPU is visible, else cpu; "cuda" without a GPU is an error."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but torch sees no CUDA device "
                         "(use --device cpu)")
    return device


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r} (use 'bfloat16' or 'float32')")
    return found


class LLM:
    """A Llama-family model in Hugging Face layout, ready to generate.

    model_dir: config.json, model.safetensors (or shards + index) and tokenizer.json.
    device: "auto" (cuda if available, else cpu), "cpu" or "cuda". dtype: None picks bf16 on
    CUDA (the kernels' dtype) and float32 on CPU (the native twins, exact vs transformers).
    load_tokenizer=False skips tokenizer.json: the model then takes token-id prompts only
    (test checkpoints have no tokenizer).
    """

    def __init__(self, model_dir: str | os.PathLike, device: str | torch.device = "auto",
                 dtype: str | torch.dtype | None = None, load_tokenizer: bool = True):
        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise FileNotFoundError(f"model directory {self.model_dir} does not exist")
        self.device = resolve_device(device)
        dtype = _dtype(dtype)
        # Cheap checks first: a bad config or tokenizer fails before the weights load.
        self.config = parts.load("01", "config").load_config(self.model_dir)
        self.tokenizer = self._load_tokenizer() if load_tokenizer else None
        weights = parts.load("01", "checkpoint").load_weights(self.model_dir, self.config)
        self.model = parts.load("08", "model").LlamaModel(self.config, weights, self.device,
                                                          dtype)
        del weights
        self.eos_ids = (self.tokenizer.eos_ids if self.tokenizer is not None
                        else frozenset(self.config.eos_token_ids))
        self._argmax = parts.load("08", "argmax").argmax

    def _load_tokenizer(self):
        try:
            return parts.load("02", "tokenizer").load_tokenizer(self.model_dir)
        except (OSError, ValueError):
            raise
        except Exception as e:  # the tokenizers library raises plain Exception on a bad file
            raise ValueError(f"{self.model_dir / 'tokenizer.json'} could not be read: {e}") \
                from None

    @property
    def max_positions(self) -> int:
        """The longest sequence (prompt + reply) the model takes."""
        return self.model.max_positions

    def encode_prompt(self, prompt: str | Sequence[int] | Sequence[dict],
                      raw: bool = False) -> list[int]:
        """Token ids of a prompt: a string (wrapped in the chat template unless raw), a list
        of chat messages [{"role": ..., "content": ...}], or token ids (used as they are)."""
        is_text = isinstance(prompt, str)
        is_chat = not is_text and len(prompt) > 0 and isinstance(prompt[0], dict)
        if is_text or is_chat:
            if self.tokenizer is None:
                raise ValueError(f"{self.model_dir} was loaded without a tokenizer: pass "
                                 "token ids, not text")
            if is_text and raw:
                return self.tokenizer.encode(prompt, add_special_tokens=True)
            fmt = self.tokenizer.chat_format
            if fmt is None:
                raise ValueError(f"the tokenizer in {self.model_dir} has no known chat format "
                                 "(llama3 or chatml): use a raw prompt (--raw)")
            messages = [{"role": "user", "content": prompt}] if is_text else list(prompt)
            text = parts.load("02", "chat_template").apply_chat_template(messages, fmt)
            return self.tokenizer.encode(text, add_special_tokens=False)
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary "
                             f"(0..{self.config.vocab_size - 1})")
        return ids

    def generate(self, prompt: str | Sequence[int] | Sequence[dict],
                 max_tokens: int = DEFAULT_MAX_TOKENS, temperature: float = 0.0,
                 raw: bool = False, stop: Sequence[str] | None = None,
                 seed: int | None = None) -> GenerationResult:
        """Generate a reply. temperature 0: greedy (argmax); > 0: sampling from
        softmax(logits / temperature), reproducible with `seed`. stop: strings that end the
        reply (left out of the text). raw: no chat template (the string is the whole prompt).
        """
        stream = self.stream(prompt, max_tokens, temperature, raw, stop, seed)
        for _ in stream:
            pass
        return stream.result

    def stream(self, prompt: str | Sequence[int] | Sequence[dict],
               max_tokens: int = DEFAULT_MAX_TOKENS, temperature: float = 0.0,
               raw: bool = False, stop: Sequence[str] | None = None,
               seed: int | None = None) -> TextStream:
        """Like generate(), but iterate over the result to get text pieces as they come."""
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        prompt_ids = self.encode_prompt(prompt, raw)
        if not prompt_ids:
            raise ValueError("the prompt is empty (no tokens)")
        if len(prompt_ids) > self.max_positions:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens, more than the model's "
                             f"context of {self.max_positions} positions")
        stopping = parts.load("02", "stopping")
        checker = stopping.StopChecker(self.eos_ids, list(stop or ()), max_tokens)
        generator = None
        if temperature > 0:
            generator = torch.Generator(device=self.device)
            if seed is None:
                generator.seed()
            else:
                generator.manual_seed(seed)
        return TextStream(self._run(prompt_ids, checker, temperature, generator))

    def _next_token(self, ids: list[int], temperature: float,
                    generator: torch.Generator | None) -> int:
        """One step without a KV cache: the whole sequence through the model."""
        tokens, positions, meta = parts.load("08", "attention_metadata").packed_inputs(
            [ids], self.device)
        logits = self.model.compute_logits(self.model.forward(tokens, positions, meta),
                                           meta.last_rows)
        if temperature == 0:
            return int(self._argmax(logits)[0])
        probs = torch.softmax(logits[0] / temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator)[0])

    def _run(self, prompt_ids: list[int], checker, temperature: float,
             generator: torch.Generator | None) -> Generator[str, None, GenerationResult]:
        detok = None
        if self.tokenizer is not None:
            detok = parts.load("02", "detokenizer").IncrementalDetokenizer(self.tokenizer,
                                                                          prompt_ids)
        ids, output, text, sent = list(prompt_ids), [], "", 0
        reason = None
        while reason is None:
            if len(ids) > self.max_positions:   # the next forward would need a new position
                reason = "context"
                break
            token = self._next_token(ids, temperature, generator)
            ids.append(token)
            output.append(token)
            if detok is not None:
                text += detok.push(token)
            reason = checker.check(token, text)
            safe = checker.safe_text(text, finished=reason is not None)
            if len(safe) > sent:
                yield safe[sent:]
                sent = len(safe)
        if detok is not None:
            text += detok.flush()   # bytes of a character the reply never completed
        text = checker.safe_text(text, finished=True)
        if len(text) > sent:
            yield text[sent:]
        return GenerationResult(prompt_ids=list(prompt_ids), output_ids=output, text=text,
                                finish_reason=reason)
