"""Sampling on the device: one token per row of logits, each row with its own parameters.

    st = SamplingTensors.from_params(params, steps, device)    # host: once per step
    tokens = sample(logits, st.temperature, st.top_k, st.top_p, st.seeds, st.steps,
                    needs_filter=st.needs_filter, all_greedy=st.all_greedy)

A row with temperature 0 takes the argmax (the course's stage-08 op). A random row draws from
softmax(logits / T), restricted first by top-k (the k most likely tokens) and then by top-p
(the smallest set of the most likely remaining tokens whose renormalized probability reaches
p; the top token is always kept) -- the order of Hugging Face's warpers and of vLLM.

The draw is the Gumbel-max trick: with u_i uniform in (0, 1) and g_i = -log(-log(1 - u_i)),

    argmax_i (log p_i + g_i)  is distributed exactly as  p

(the largest of independent Gumbels shifted by log p_i is the i-th with probability p_i:
softmax is exactly the distribution of a Gumbel-noised argmax; exactly for noise of unlimited
resolution, and ours reaches g = 32.6: see gumbel_noise). Adding one constant to every
log p_i changes nothing, so the scaled logits logits / T stand in for log p (no softmax
needed), and a token removed by top-k/top-p is simply set to -inf. The whole draw is
elementwise work and one argmax per row: no multinomial, no host round trip.

Why a hash and not torch.Generator: the noise u_i of a row is a pure function of (seed, step,
i) -- splitmix64's mixer applied to a counter -- not the next numbers of a stream that the
whole batch shares. So a seeded request draws the same numbers whatever else is in the batch,
at whatever row, and after a preemption it redraws the same tokens: batching is invisible in
its output (on the CPU, bit for bit). `step` is the index of the token being drawn in the
request's output (0 for the first generated token), NOT the engine's step counter.

Nothing here waits for the host: no .item(), .cpu(), .tolist() or bool(tensor); the choices
that need host knowledge (is any row filtered? is every row greedy?) are host bools that the
engine computes from its requests' SamplingParams (SamplingTensors does it).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from course import ops, parts

_U64 = (1 << 64) - 1


def _i64(c: int) -> int:
    """A 64-bit pattern as the signed int64 torch stores (same bits)."""
    c &= _U64
    return c - (1 << 64) if c >= 1 << 63 else c


# splitmix64 (Steele, Lea, Flood 2014; mixer constants from Stafford's "Mix13").
GOLDEN = _i64(0x9E3779B97F4A7C15)   # the counter's increment: 2**64 / golden ratio, odd
MIX1 = _i64(0xBF58476D1CE4E5B9)
MIX2 = _i64(0x94D049BB133111EB)
UNIFORM_BITS = 23   # each of u's two parts: k + 1/2 needs 24 bits, exact in float32


def _shr_(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic: it copies the
    sign bit, so the s top bits are masked off)."""
    return (z >> s).bitwise_and_((1 << (64 - s)) - 1)


def mix64_(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer, in place on int64 bit patterns: a bijection of 64-bit words
    whose every output bit depends on every input bit. int64 multiplication in torch wraps
    modulo 2**64 like unsigned C arithmetic, which is what the mixer needs."""
    z ^= _shr_(z, 30)
    z *= MIX1
    z ^= _shr_(z, 27)
    z *= MIX2
    z ^= _shr_(z, 31)
    return z


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One 64-bit key per (seed, step) pair.

    seeds, steps: [B] int64 -> [B] int64. Hashing the seed first and adding step * GOLDEN
    before the second hash makes nearby seeds and nearby steps give unrelated keys.
    """
    return mix64_(mix64_(seeds.clone()) + steps * GOLDEN)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """u[b, i] in (0, 1), a deterministic function of (seeds[b], steps[b], i) only, fine
    near 0.

    seeds, steps: [B] int64 -> [B, vocab] float32 on their device. Element i of a row is
    splitmix64's output number i + 1 from the state row_keys(seed, step): counter-based, so
    any row and any element can be computed alone, in any order, in any batch. Its top 23
    bits give hi and the next 23 lo, and u = (hi + (lo + 1/2) / 2**23) / 2**23 in float32
    (one rounded addition; the scalings by powers of two are exact): steps of 2**-46 near 0,
    where the Gumbel tail needs them (gumbel_noise), and 1 - 2**-24 at most.
    """
    counters = torch.arange(1, vocab + 1, dtype=torch.int64, device=seeds.device) * GOLDEN
    z = mix64_(row_keys(seeds, steps)[:, None] + counters[None, :])     # [B, vocab]
    hi = _shr_(z, 64 - UNIFORM_BITS).to(torch.float32)
    lo = _shr_(z, 64 - 2 * UNIFORM_BITS).bitwise_and_((1 << UNIFORM_BITS) - 1)
    u = lo.to(torch.float32).add_(0.5).mul_(2.0 ** -UNIFORM_BITS).add_(hi)
    return u.mul_(2.0 ** -UNIFORM_BITS).clamp_(max=1 - 2.0 ** -24)   # the sum may round to 1


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """g = -log(-log(1 - u)): standard Gumbel noise, [B] int64 x2 -> [B, vocab] float32.

    A large g needs a small -log(1 - u), so u's fine steps near 0 (uniform_noise) reach g =
    32.6; past that the tail is cut at 2**-47 a token, under 2**-30 over a 128k vocabulary.
    (With u of 23 bits alone g stopped at 16.6: a token more than ~19 below the top in
    logits / T could never be drawn, and over 128k such tokens that is ~1% of the mass.)
    The low tail stops at g = -2.81 (u of 1 - 2**-24): a cut of 6e-8, on one token at most.
    """
    return uniform_noise(seeds, steps, vocab).neg_().log1p_().neg_().log_().neg_()


def filter_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which tokens top-k and top-p remove, per row (True = removed).

    scaled: [B, V] float32 logits / temperature; top_k: [B] int64 (0 = off);
    top_p: [B] float32 (1 = off) -> [B, V] bool.
    One descending sort of the whole batch (stable: equal logits keep index order, as argmax
    breaks ties); then in sorted order, rank >= k is cut (exactly k tokens stay: a tie at the
    k-th value goes to the lower index, where Hugging Face and vLLM keep every tied token), and a token is cut by top-p when the
    renormalized probability of the tokens ranked before it already reaches p. The first
    token has nothing before it (mass exactly 0 < p), so it is never cut. A row with top_p = 1
    is never cut by top-p at all, even where float32 sums round up to 1 before the tail: its
    result must not depend on whether another row in the batch asked for a filter.
    """
    V = scaled.shape[1]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(V, device=scaled.device)[None, :]                      # [1, V]
    k = top_k[:, None]
    cut = (k > 0) & (rank >= k)                                                # [B, V]
    # Top-p measures the distribution that top-k left: softmax over the kept tokens only.
    probs = torch.softmax(sorted_logits.masked_fill_(cut, float("-inf")), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1).sub_(probs)   # row's rank 0: exactly 0
    p = top_p[:, None]
    cut |= (p < 1) & (mass_before >= p)
    cut[:, 0] = False   # the top token stays even if p rounded to 0 in float32
    return torch.empty_like(cut).scatter_(1, order, cut)   # back to vocabulary order


def _check(logits: torch.Tensor, **rows: torch.Tensor) -> None:
    # Shapes, dtypes and devices are host metadata: checking them costs no synchronisation.
    if logits.dim() != 2 or logits.shape[1] == 0 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float [rows, vocab] tensor with vocab >= 1, got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    dtypes = {"temperature": torch.float32, "top_k": torch.int64, "top_p": torch.float32,
              "seeds": torch.int64, "steps": torch.int64}
    for name, t in rows.items():
        if t.shape != (logits.shape[0],) or t.dtype != dtypes[name] or t.device != logits.device:
            raise ValueError(f"{name} must be a [{logits.shape[0]}] {dtypes[name]} tensor on "
                             f"{logits.device} (one value per row of logits), got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, *,
           needs_filter: bool = True, all_greedy: bool = False) -> torch.Tensor:
    """One token per row; never synchronises with the host.

    logits: [B, V] float32 (bf16 is accepted and sampled in float32);
    temperature: [B] float32, 0 = greedy; top_k: [B] int64, 0 = off; top_p: [B] float32,
    1 = off; seeds: [B] int64 (random rows); steps: [B] int64, the index of the token being
    drawn in each request's output. All on logits' device. Returns [B] int64 there.

    needs_filter: False promises that no random row has top_k > 0 or top_p < 1, and skips the
    sort (the costly part); a row that does ask for a filter is then sampled unfiltered, so
    when unsure pass True (the default: always correct). all_greedy: True promises every
    temperature is 0 and skips the random path entirely (the per-row tensors may then be
    None). Both are host facts the engine knows from its requests;
    SamplingTensors.from_params computes them.
    """
    argmax = ops.get("argmax")
    if all_greedy:   # the per-row tensors may be None: nothing random is drawn
        return argmax(logits)
    _check(logits, temperature=temperature, top_k=top_k, top_p=top_p, seeds=seeds,
           steps=steps)
    greedy_tokens = argmax(logits)
    random_rows = temperature > 0
    # Greedy rows go through the random path too (no row selection without a sync); dividing
    # them by 1 keeps their lanes finite, and torch.where drops their result at the end.
    scaled = logits.float() / torch.where(random_rows, temperature, 1.0)[:, None]
    if needs_filter:
        scaled.masked_fill_(filter_mask(scaled, top_k, top_p), float("-inf"))
    scaled += gumbel_noise(seeds, steps, logits.shape[1])
    return torch.where(random_rows, argmax(scaled), greedy_tokens)


def seed_to_int64(seed: int) -> int:
    """A Python seed (any int in -2**63 .. 2**64 - 1) as the int64 with its low 64 bits."""
    return _i64(seed)


@dataclass
class SamplingTensors:
    """The per-row arguments of `sample`, on the device, plus the two host flags.

    temperature [B] float32, top_k [B] int64, top_p [B] float32, seeds [B] int64,
    steps [B] int64; needs_filter / all_greedy as in `sample`.
    """
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor
    steps: torch.Tensor
    needs_filter: bool
    all_greedy: bool

    @classmethod
    def from_params(cls, params: Sequence, steps: Sequence[int],
                    device: str | torch.device) -> SamplingTensors:
        """Rows from SamplingParams (stage 11's sampling_params.py), one per sampled sequence.

        params: B SamplingParams, already validated; a random row must carry its seed (the
        engine gives unseeded requests one at admission: `params.with_seed()`, so the seed
        survives preemption). steps: B ints, each the number of tokens its request has
        generated so far. Built in pinned host memory and copied without blocking; a batch
        whose every row is greedy builds none (its tensors are None: `sample` needs none).
        """
        if len(params) != len(steps):
            raise ValueError(f"{len(params)} sampling params but {len(steps)} steps")
        if all(p.greedy for p in params):
            # Every row takes the argmax: no per-row tensors to build (and no copies to make).
            return cls(None, None, None, None, None, needs_filter=False, all_greedy=True)
        unseeded = [i for i, p in enumerate(params) if not p.greedy and p.seed is None]
        if unseeded:
            raise ValueError(f"row {unseeded[0]} samples at random but has no seed: give each "
                             "request one when it is admitted (SamplingParams.with_seed())")
        to_device = parts.load("08", "attention_metadata").to_device   # pinned, non-blocking

        def rows(values: list, dtype: torch.dtype) -> torch.Tensor:
            return to_device(values, dtype, device)
        return cls(
            # Greedy rows get exactly 0: the device's rule is "temperature > 0 samples".
            temperature=rows([0.0 if p.greedy else float(p.temperature) for p in params],
                             torch.float32),
            top_k=rows([p.top_k for p in params], torch.int64),
            top_p=rows([float(p.top_p) for p in params], torch.float32),
            seeds=rows([0 if p.greedy else seed_to_int64(p.seed) for p in params],
                       torch.int64),
            steps=rows([int(s) for s in steps], torch.int64),
            needs_filter=any(p.needs_filter for p in params),
            all_greedy=False,
        )
