"""The reference engine's front door: a model directory in, text out.

    from solutions.engine.llm import LLM, SamplingParams
    llm = LLM("path/to/model")                       # config.json, *.safetensors, tokenizer.json
    print(llm.generate("What is the capital of France?").text)
    results = llm.generate(["Hi", "Tell me a joke"], SamplingParams(max_tokens=64))  # in order
    for piece in llm.stream("Tell me a story", max_tokens=100):
        print(piece, end="", flush=True)

It wires the stages together: config and weights (01), tokenizer, chat template, streaming
detokenizer and stop conditions (02), the forward pass (08, built from the ops of 03-07), the
KV cache and decode attention (09), decode CUDA graphs (10), the scheduler that batches
requests continuously (11), the tiled prefill attention (12), the paged KV cache with prefix
caching (13) and the paged decode kernel (14), through the serving loop of llm_engine.py.
Each part is loaded through the parts resolver, so with TINYVLLM_STUDENT=NN the engine runs a
student's stage NN.
"""
from __future__ import annotations

import os
import re
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from course import parts
from solutions.engine.llm_engine import LLMEngine, token_ids
from solutions.engine.model_runner import EngineConfig, check_head_dim

SamplingParams = parts.load("11", "sampling_params").SamplingParams
# One prompt: text, chat messages [{"role": ..., "content": ...}], or token ids.
Prompt = str | Sequence[dict] | Sequence[int]
# What generate() and stream() take as keywords: SamplingParams fields (stop: str or strs).
SamplingOption = int | float | bool | str | Sequence[str] | None

DEFAULT_MAX_TOKENS = 256


@dataclass
class GenerationResult:
    """One finished request.

    finish_reason: "eos" (an end-of-sequence token), "stop_string" (the text reached a stop
    string, which `text` leaves out), "max_tokens", or "context" (the sequence filled the
    engine's max_model_len positions).
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
        result = yield from self._pieces
        if result is not None:   # a second iteration yields nothing and keeps the result
            self.result = result


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
    if found not in (torch.bfloat16, torch.float32):
        raise ValueError(f"dtype must be 'bfloat16' or 'float32', got {dtype!r}")
    return found


class LLM:
    """A Llama-family model in Hugging Face layout, ready to generate.

    model_dir: config.json, model.safetensors (or shards + index) and tokenizer.json.
    device: "auto" (cuda if available, else cpu), "cpu" or "cuda". dtype: None picks bf16 on
    CUDA (the kernels' dtype) and float32 on CPU (the native twins, exact vs transformers).
    load_tokenizer=False skips tokenizer.json: the model then takes token-id prompts only
    (test checkpoints have no tokenizer). config: the engine's sizes (EngineConfig: context
    length, batch limits, KV-cache memory, CUDA graphs).
    """

    def __init__(self, model_dir: str | os.PathLike, device: str | torch.device = "auto",
                 dtype: str | torch.dtype | None = None, load_tokenizer: bool = True,
                 config: EngineConfig | None = None):
        self.model_dir = Path(model_dir)
        if self.model_dir.exists() and not self.model_dir.is_dir():
            raise NotADirectoryError(f"model directory {self.model_dir} is a file, not a "
                                     "directory (give the folder that holds config.json)")
        if not self.model_dir.is_dir():
            raise FileNotFoundError(f"model directory {self.model_dir} does not exist")
        self.device = resolve_device(device)
        dtype = _dtype(dtype)
        # Cheap checks first: a bad config or tokenizer fails before the weights load.
        self.config = parts.load("01", "config").load_config(self.model_dir)
        check_head_dim(self.config.head_dim, self.device)
        self.tokenizer = self._load_tokenizer() if load_tokenizer else None
        weights = parts.load("01", "checkpoint").load_checked(self.model_dir, self.config)
        self.model = parts.load("08", "model").LlamaModel(self.config, weights, self.device,
                                                          dtype)
        del weights
        self.eos_ids = (self.tokenizer.eos_ids if self.tokenizer is not None
                        else frozenset(self.config.eos_token_ids))
        self.engine = LLMEngine(self.model, self.tokenizer, self.eos_ids, config)
        # Each request of a generate() or stream() call, with the outputs the engine gave it
        # and its owner has not collected yet: calls overlap (two streams read in turn, a
        # generate() while a stream is open), and whichever steps the engine files them here.
        self._mail: dict[int, list] = {}

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
        """The longest sequence (prompt + reply) the engine takes."""
        return self.engine.max_model_len

    def encode_prompt(self, prompt: Prompt, raw: bool = False) -> list[int]:
        """Token ids of a prompt: a string (wrapped in the chat template unless raw), a list
        of chat messages [{"role": ..., "content": ...}], or token ids (used as they are)."""
        is_text = isinstance(prompt, str)
        if not is_text and (not isinstance(prompt, Sequence) or isinstance(prompt, bytes)):
            raise TypeError(f"a prompt is a string, a list of chat messages or a list of token "
                            f"ids, got {type(prompt).__name__}")
        is_chat = not is_text and len(prompt) > 0 and isinstance(prompt[0], dict)
        if is_text or is_chat:
            if self.tokenizer is None:
                raise ValueError(f"{self.model_dir} was loaded without a tokenizer: pass "
                                 "token ids, not text")
            if is_text and raw:
                ids = self.tokenizer.encode(_utf8(prompt), add_special_tokens=True)
            else:
                fmt = self.tokenizer.chat_format
                if fmt is None:
                    raise ValueError(f"the tokenizer in {self.model_dir} has no known chat "
                                     "format (llama3 or chatml): use a raw prompt (--raw)")
                messages = [{"role": "user", "content": prompt}] if is_text else list(prompt)
                template = parts.load("02", "chat_template")
                system = chatml_default_system(self.tokenizer.chat_template,
                                               template.SMOLLM2_DEFAULT_SYSTEM)
                text = template.apply_chat_template(messages, fmt, default_system=system)
                ids = self.tokenizer.encode(_utf8(text), add_special_tokens=False)
        else:
            ids = token_ids(prompt)
        # text too: a tokenizer.json larger than the model's vocabulary encodes ids it lacks
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            mismatch = ": the tokenizer does not match the model" if is_text or is_chat else ""
            raise ValueError(f"token id {bad[0]} is outside the model's vocabulary "
                             f"(0..{self.config.vocab_size - 1}){mismatch}")
        return ids

    def prepare(self, prompt: Prompt, raw: bool = False) -> list[int]:
        """A prompt's token ids, checked: ValueError if it is empty or longer than the
        context."""
        ids = self.encode_prompt(prompt, raw)
        if not ids:
            raise ValueError("the prompt is empty (no tokens)")
        if len(ids) > self.max_positions:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than the context of "
                             f"{self.max_positions} positions")
        return ids

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, raw: bool = False, **options: SamplingOption
                 ) -> GenerationResult | list[GenerationResult]:
        """Generate replies. prompts: one prompt (a string, chat messages, or token ids) or a
        list of them, run together; returns one GenerationResult or a list, in input order.
        sampling: one SamplingParams for all, or one per prompt; or pass its fields as keyword
        arguments (max_tokens=, temperature=, top_k=, top_p=, seed=, stop=, ignore_eos=).
        raw: no chat template (each string is the whole prompt).
        Every prompt and parameter is checked before anything runs (ValueError naming it).
        """
        if isinstance(prompts, (list, tuple)) and not prompts:
            return []   # no prompts, no replies ("" or [[]] is an empty prompt: an error)
        single = _is_one_prompt(prompts)
        batch = [prompts] if single else list(prompts)
        params = self._params(sampling, options, len(batch))
        ids = []
        for i, p in enumerate(batch):
            try:
                ids.append(self.prepare(p, raw))
            except (ValueError, TypeError) as e:
                kind = TypeError if isinstance(e, TypeError) else ValueError
                raise kind(str(e) if single else f"prompts[{i}]: {e}") from None
        rids: list[int] = []
        try:
            self._check_no_foreign_requests()
            for p, sp in zip(ids, params):
                rids.append(self.engine.add_request(p, sp))
                self._mail[rids[-1]] = []
            outputs = {rid: ([], "", None) for rid in rids}
            pending = set(rids)
            while pending:
                stepped = self._step()
                for rid in sorted(pending):
                    for out in self._mail[rid]:
                        tokens, text, _ = outputs[rid]
                        outputs[rid] = (tokens + out.new_token_ids, text + out.new_text,
                                        out.finish_reason)
                    self._mail[rid].clear()
                    if outputs[rid][2] is not None:
                        pending.discard(rid)
                    elif not stepped:   # aborted through llm.engine meanwhile
                        outputs[rid] = (*outputs[rid][:2], "abort")
                        pending.discard(rid)
        except BaseException:
            # A step that raised (or Ctrl-C) must not leave these requests queued: every later
            # generate() would run them again and fail the same way. Finished ones are no-ops.
            for rid in rids:
                self.engine.abort(rid)
            raise
        finally:
            for rid in rids:
                self._mail.pop(rid, None)
        results = [GenerationResult(prompt_ids=p, output_ids=outputs[r][0], text=outputs[r][1],
                                    finish_reason=outputs[r][2]) for p, r in zip(ids, rids)]
        return results[0] if single else results

    def stream(self, prompt: Prompt, sampling: SamplingParams | None = None, *,
               raw: bool = False, **options: SamplingOption) -> TextStream:
        """Like generate() for one prompt, but iterate over the result to get text pieces as
        they come. The prompt and parameters are checked now; the request is queued when the
        iteration starts (a stream never read runs nothing), and several streams, or a stream
        and generate(), may be read in turn: each step's outputs go to their own request."""
        params = self._params(sampling, options, 1)[0]
        prompt_ids = self.prepare(prompt, raw)
        return TextStream(self._pieces(prompt_ids, params))

    def _pieces(self, prompt_ids: list[int],
                params: SamplingParams) -> Generator[str, None, GenerationResult]:
        self._check_no_foreign_requests()
        rid = self.engine.add_request(prompt_ids, params)
        self._mail[rid] = []
        tokens, text, reason = [], "", None
        try:
            while reason is None:
                if not self._mail[rid] and not self._step():
                    reason = "abort"          # aborted through llm.engine meanwhile
                outputs, self._mail[rid] = self._mail[rid], []
                for out in outputs:
                    tokens += out.new_token_ids
                    text += out.new_text
                    reason = out.finish_reason
                    if out.new_text:
                        yield out.new_text
        finally:
            if reason is None:       # the caller stopped iterating: free the request's slot
                self.engine.abort(rid)
            self._mail.pop(rid, None)
        return GenerationResult(prompt_ids=list(prompt_ids), output_ids=tokens, text=text,
                                finish_reason=reason)

    def _step(self) -> bool:
        """One engine step, each output filed under its request; False when the engine had
        nothing left to run. Outputs of a request no call owns any more (one closed while a
        step ran) are dropped."""
        self._check_no_foreign_requests()
        if not self.engine.has_unfinished():
            return False
        for out in self.engine.step():
            box = self._mail.get(out.request_id)
            if box is not None:
                box.append(out)
        return True

    def _check_no_foreign_requests(self) -> None:
        """generate() and stream() step the whole engine: a request added to llm.engine
        directly would advance with them and its outputs would be taken. Refused, before any
        step, so nothing is lost."""
        foreign = sorted(self.engine.requests.keys() - self._mail.keys())
        if foreign:
            raise RuntimeError(
                f"llm.engine holds request(s) {foreign} added to it directly: drive them with "
                "llm.engine.step() until they finish (or abort them) before generate() or "
                "stream(), which step the whole engine and would take their outputs")

    def _params(self, sampling: SamplingParams | Sequence[SamplingParams] | None,
                options: dict, n: int) -> list[SamplingParams]:
        if sampling is not None and options:
            raise ValueError("pass either a SamplingParams or its fields as keywords, not both")
        if sampling is None:
            sampling = SamplingParams(**{"max_tokens": DEFAULT_MAX_TOKENS, **options})
        if isinstance(sampling, SamplingParams):
            sampling = [sampling] * n
        if isinstance(sampling, (str, bytes, dict)) or not isinstance(sampling, Sequence):
            raise TypeError(f"sampling must be a SamplingParams or a list of them, one per "
                            f"prompt; got {type(sampling).__name__}")
        sampling = list(sampling)
        wrong = [type(s).__name__ for s in sampling if not isinstance(s, SamplingParams)]
        if wrong:
            raise TypeError(f"sampling must be a SamplingParams or a list of them; the list "
                            f"holds a {wrong[0]}")
        if len(sampling) != n:
            raise ValueError(f"{len(sampling)} sampling parameters for {n} prompts")
        if self.tokenizer is None and any(s.stop for s in sampling):
            raise ValueError("stop strings are matched in the text, and this LLM was loaded "
                             "without a tokenizer (load_tokenizer=False): it has no text")
        return sampling


# A ChatML template's default system turn, a literal of its Jinja text (its line break a
# newline, or the escape '\n' that Jinja reads as one)
CHATML_SYSTEM_TURN = re.compile(r"<\|im_start\|>system(?:\n|\\n)([^'\"{}]*?)<\|im_end\|>")


def chatml_default_system(chat_template: str | None, fallback: str | None) -> str | None:
    """The system prompt a ChatML model's own template inserts when a conversation has none:
    SmolLM2's and Qwen2.5's write one ("You are Qwen, created by Alibaba Cloud. ..."), Qwen3's
    none (None). Without a template (tokenizer_config.json lacks one), `fallback`."""
    if chat_template is None:
        return fallback
    found = CHATML_SYSTEM_TURN.search(chat_template)
    return found.group(1) if found else None


def _is_one_prompt(prompts) -> bool:
    """A string, a list of token ids or a list of chat messages is one prompt; a list of
    those is many."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
        return True
    return isinstance(prompts[0], (int, dict)) or hasattr(prompts[0], "__index__")


def _utf8(text: str) -> str:
    """text, if it is valid Unicode: undecodable bytes (a command line or a file that is not
    UTF-8) reach Python as lone surrogates, which no tokenizer encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the prompt is not valid UTF-8 text: it holds {text[e.start]!r}, "
                         "a byte that was not UTF-8") from None
    return text
