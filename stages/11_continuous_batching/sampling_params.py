# GIVEN FILE: generated from solutions/11_continuous_batching/sampling_params.py by `nox -s sync-stages`.
# Read it; do not edit it. It is not graded (the grader uses the reference
# copy), and any edit here is overwritten.
"""Stage 11: what one request asks of the sampler and of the stop checks.

    params = SamplingParams(max_tokens=64, temperature=0.8, top_p=0.95, seed=1234)
    params = SamplingParams.from_dict({"temperature": 0.8, "stop": "\\n\\n"})  # a .jsonl line

Every request carries its own parameters, so one batch mixes greedy and random rows, top-k
and top-p rows, seeded and unseeded ones. The parameters are checked ONCE, on the host, when
the object is made (and again by `validate()`, which the engine calls at admission): a bad
request gets a clear ValueError before it reaches a step, and the step itself never has to
check anything (the device must not wait for the host inside a step).

Seeds: a request with `seed=None` still needs a seed once it samples at random, and that seed
must stay the same for the request's whole life (also across preemption and recompute), so
the engine picks one when it admits the request: `params = params.with_seed()`. Greedy
requests never draw random numbers and keep `seed=None`.
"""
from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass

# torch.manual_seed's range: any int that fits in 64 bits, signed or unsigned. The sampler
# folds the seed to 64 bits, so two seeds that are equal mod 2**64 draw the same numbers.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
TOP_K_MAX = 2**63 - 1   # an int64 on the device

# Temperatures below this count as 0, i.e. greedy (vLLM's rule too): dividing logits by a
# tinier number overflows float32 to inf, and inf ties would no longer pick the argmax. At
# T = 1e-5 a logit gap of 1e-3 already makes the runner-up e**-100 times less likely.
GREEDY_BELOW = 1e-5


def _is_int(x: object) -> bool:
    # bool is an int subclass, but `max_tokens=True` is a mistake, not the number 1.
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops.

    max_tokens  the most tokens to generate (>= 1); finish reason "max_tokens" when reached.
    temperature 0 = greedy (argmax); > 0 samples from softmax(logits / temperature)
                (below GREEDY_BELOW = 1e-5 it counts as 0).
    top_k       keep the k most likely tokens (0 = off). Ignored when greedy.
    top_p       keep the smallest set of most likely tokens whose probability reaches top_p,
                measured after top-k (1.0 = off); in (0, 1]. Ignored when greedy.
    seed        makes a random request reproducible, alone or in any batch (None: the engine
                picks one at admission, see `with_seed`).
    stop        strings that end the reply (left out of the text); a single str is accepted.
    ignore_eos  keep generating past end-of-sequence tokens (benchmarks: fixed lengths).
    """
    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        # A lone string would otherwise be iterated character by character: "User:" would
        # stop at every "U", "s", ... Lists (JSON) become tuples so the object stays hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, (list, tuple)):
            object.__setattr__(self, "stop", tuple(self.stop))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError, with one sentence naming the field, if a parameter is invalid."""
        if not _is_int(self.max_tokens):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got "
                             f"{self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= TOP_K_MAX:
            # the sampler holds it in int64; any k at least the vocabulary keeps every token
            raise ValueError(f"top_k must be an integer from 0 (off) to {TOP_K_MAX}, got "
                             f"{self.top_k!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            # `not 0 < x <= 1` is also True for NaN, so NaN lands here too.
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if self.seed is not None:
            if not _is_int(self.seed):
                raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
            if not SEED_MIN <= self.seed <= SEED_MAX:
                raise ValueError(f"seed must fit in 64 bits ({SEED_MIN}..{SEED_MAX}), got "
                                 f"{self.seed}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty (an empty string would stop "
                             "before the first token)")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax (temperature 0, or below GREEDY_BELOW) and
        draws no random numbers."""
        return self.temperature < GREEDY_BELOW

    @property
    def needs_filter(self) -> bool:
        """True when the request samples and restricts the vocabulary (top-k or top-p), so
        the sampler must sort its logits."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1)

    def with_seed(self, rng: random.Random | None = None) -> SamplingParams:
        """These parameters with a seed: unchanged if greedy or already seeded, else with a
        fresh random 63-bit seed (from `rng`, default the OS's entropy).

        The engine calls this once, at admission, so that an unseeded request keeps one
        stream of random numbers for its whole life (batches, preemption, recompute)."""
        if self.greedy or self.seed is not None:
            return self
        rng = rng or random.SystemRandom()
        return dataclasses.replace(self, seed=rng.getrandbits(63))

    @classmethod
    def from_dict(cls, d: Mapping) -> SamplingParams:
        """Parameters from a JSON object, e.g. one line of a .jsonl prompts file with its
        "prompt" key removed. Missing keys keep their defaults; "stop" may be a string or a
        list of strings; unknown keys are an error (a typo must not be silently ignored)."""
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling parameters must be an object (dict), got "
                             f"{type(d).__name__}")
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(k) for k in d if k not in valid)
        if unknown:
            raise ValueError(f"unknown sampling parameter{'s' if len(unknown) > 1 else ''} "
                             f"{', '.join(map(repr, unknown))}; the valid ones are: "
                             f"{', '.join(valid)}")
        kwargs = dict(d)
        if "stop" in kwargs and kwargs["stop"] is None:
            kwargs["stop"] = ()  # JSON null = no stop strings
        if "stop" in kwargs and not isinstance(kwargs["stop"], (str, list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got "
                             f"{kwargs['stop']!r}")
        return cls(**kwargs)
