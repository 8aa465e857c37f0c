"""The reference engine's sampler (solutions/engine/sampler.py) and stage 11's SamplingParams,
on the CPU.

The sampler's noise is a pure function of (seed, step, token index), so these tests are
deterministic: the statistical ones draw from fixed seeds and compare against bounds at a
false-alarm probability of 1e-6, and each also checks that the same counts REJECT a wrong
distribution, so a bound too loose to catch anything fails too.
"""
from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest
import torch

from course import parts
from course.testing import checks
from solutions.engine import sampler as S

ALPHA = 1e-6          # false-alarm probability of every statistical bound here
U64 = (1 << 64) - 1


def params_module():
    return parts.reference("11", "sampling_params")


def SP(**kw):
    return params_module().SamplingParams(**kw)


def run(logits: torch.Tensor, params: list, steps: list[int]) -> torch.Tensor:
    st = S.SamplingTensors.from_params(params, steps, logits.device)
    return S.sample(logits, st.temperature, st.top_k, st.top_p, st.seeds, st.steps,
                    needs_filter=st.needs_filter, all_greedy=st.all_greedy)


def rows(n: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
         first_seed: int = 0) -> list:
    return [SP(temperature=temperature, top_k=top_k, top_p=top_p, seed=first_seed + i)
            for i in range(n)]


def chi2_bound(df: int, alpha: float = ALPHA) -> float:
    """The chi-square quantile 1 - alpha (Wilson-Hilferty: within 1% for df >= 3)."""
    z = NormalDist().inv_cdf(1 - alpha)
    c = 2 / (9 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


def chi2(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of drawn tokens against probs (cells with probability 0 must stay
    empty: a draw there is an infinitely bad fit)."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    if (counts[expected == 0] > 0).any():
        return math.inf
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def assert_distribution(tokens, probs, wrong_probs, what):
    df = int((probs > 0).sum()) - 1
    bound = chi2_bound(df)
    stat = chi2(tokens, probs)
    assert stat < bound, (f"{what}: chi-square {stat:.1f} over {df} degrees of freedom, above "
                          f"{bound:.1f} (false-alarm probability {ALPHA:g}): the draws do not "
                          f"follow the distribution")
    # Power: the same draws must tell the intended distribution from a plausible wrong one.
    assert chi2(tokens, wrong_probs) > bound, f"{what}: the test cannot see a wrong distribution"


# ---------------------------------------------------------------- the counter-based noise

def mix64_reference(z: int) -> int:
    z &= U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64
    return z ^ (z >> 31)


def uniform_reference_of_bits(z: int) -> float:
    """u of a 64-bit hash output: float32 (numpy's, one rounded addition) of its top 23 bits
    hi and the next 23 lo, u = (hi + (lo + 1/2) / 2**23) / 2**23, at most 1 - 2**-24."""
    hi, lo = z >> 41, (z >> 18) & (2**23 - 1)
    u = (np.float32(hi) + np.float32((lo + 0.5) / 2**23)) * np.float32(2.0**-23)
    return float(min(u, np.float32(1 - 2.0**-24)))


def uniform_reference(seed: int, step: int, i: int) -> float:
    """The specification of u(seed, step, i) in unsigned 64-bit Python integers."""
    key = mix64_reference((mix64_reference(seed) + step * 0x9E3779B97F4A7C15) & U64)
    return uniform_reference_of_bits(mix64_reference(key + (i + 1) * 0x9E3779B97F4A7C15))


def test_noise_matches_the_uint64_specification():
    # Seeds with the top bit set, near 0 and huge steps exercise the wrapping multiplication
    # and the logical (not arithmetic) right shifts of int64 tensors.
    seeds = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 0x0123456789ABCDEF]
    steps = [0, 1, 7, 2**40 + 3, 5, 2**62]
    vocab = 300
    u = S.uniform_noise(torch.tensor([S.seed_to_int64(s) for s in seeds]),
                        torch.tensor(steps), vocab)
    expected = torch.tensor([[uniform_reference(s, t, i) for i in range(vocab)]
                             for s, t in zip(seeds, steps)], dtype=torch.float32)
    checks.assert_equal(u, expected, what="uniform noise vs the uint64 reference",
                        hint="a signed right shift (mask the top bits) or a constant wrong")
    assert bool((u > 0).all() and (u < 1).all()), "u must lie strictly inside (0, 1)"


def test_the_gumbel_tail_reaches_past_30():
    """A token far below the top (logits / T 20 or more lower) wins only through a large g,
    which needs a u very close to 0: with u on a grid of 2**-23 steps g stopped at 16.6, and
    over a 128k vocabulary that cut ~1% of the probability mass. The specification above
    (test_noise_matches_the_uint64_specification) puts u's smallest value at 2**-47; here,
    the draws are off that coarse grid, and g at the smallest u is past 30."""
    u = S.uniform_noise(torch.arange(200), torch.zeros(200, dtype=torch.int64), 5000)
    off_grid = (u.double() * 2**23) % 1 != 0.5
    assert off_grid.float().mean() > 0.4, "u lies on a grid of 2**-23 steps: lo is not used"
    u_min = uniform_reference_of_bits(0)
    assert u_min == 2.0**-47 and -math.log(-math.log1p(-u_min)) > 30
    g = S.gumbel_noise(torch.arange(200), torch.zeros(200, dtype=torch.int64), 5000)
    assert torch.isfinite(g).all(), "u never reaches 0 or 1: g is always finite"


def test_noise_is_uniform():
    # 2000 x 500 draws in 50 bins: far more than enough to see a biased bit.
    u = S.uniform_noise(torch.arange(2000), torch.arange(2000) * 3, 500).flatten()
    bins = (u * 50).long()
    stat = chi2(bins, torch.full((50,), 1 / 50))
    assert stat < chi2_bound(49), f"uniform noise: chi-square {stat:.1f} over 49 dof"


def test_noise_depends_on_seed_step_and_index_only():
    seeds, steps = torch.tensor([5, 5, 6, 5]), torch.tensor([0, 1, 0, 0])
    u = S.uniform_noise(seeds, steps, 64)
    checks.assert_equal(u[3], u[0], what="same (seed, step), another row")
    for a, b, what in [(0, 1, "steps 0 and 1"), (0, 2, "seeds 5 and 6")]:
        same = int((u[a] == u[b]).sum())
        assert same <= 1, f"{what} share {same} of 64 noise values: they must be unrelated"
    # A wider vocabulary extends a row; it does not change the numbers already there.
    checks.assert_equal(S.uniform_noise(seeds, steps, 1000)[:, :64], u,
                        what="noise of the first 64 tokens with a vocabulary of 1000")


@pytest.mark.gpu
def test_noise_on_cuda_equals_noise_on_cpu():
    # Integer hashing and an exact int -> float conversion: bit for bit on any device, so a
    # seeded request draws the same numbers on the CPU and on the GPU.
    seeds, steps = torch.tensor([0, -1, 12345, 2**62]), torch.tensor([0, 9, 2**40, 3])
    cpu = S.uniform_noise(seeds, steps, 70_000)
    cuda = S.uniform_noise(seeds.cuda(), steps.cuda(), 70_000)
    checks.assert_equal(cuda.cpu(), cpu, what="uniform noise, CUDA vs CPU")


# ---------------------------------------------------------------- greedy rows

def tie_heavy_logits(rows_: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    # Small integers: most rows have their maximum several times (ties go to the lowest index).
    return torch.randint(-3, 4, (rows_, vocab), generator=gen).float()


@pytest.mark.parametrize("needs_filter", [False, True])
def test_greedy_rows_equal_torch_argmax(needs_filter, seed):
    gen = checks.generator(seed=seed)
    logits = torch.cat([tie_heavy_logits(8, 100, gen), checks.randn((8, 100), torch.float32,
                                                                    gen=gen)])
    st = S.SamplingTensors.from_params([SP() for _ in range(16)], list(range(16)), "cpu")
    assert st.all_greedy and not st.needs_filter
    checks.assert_equal(S.sample(logits, st.temperature, st.top_k, st.top_p, st.seeds,
                                 st.steps, all_greedy=True),
                        torch.argmax(logits, dim=-1), what="greedy tokens, the short cut")
    # The full path, with every row greedy (temperature 0), must agree.
    zeros_f, zeros_i = torch.zeros(16), torch.zeros(16, dtype=torch.int64)
    for all_greedy in (True, False):
        got = S.sample(logits, zeros_f, zeros_i, torch.ones(16), zeros_i, zeros_i,
                       needs_filter=needs_filter, all_greedy=all_greedy)
        checks.assert_equal(got, torch.argmax(logits, dim=-1), what="greedy tokens")


def test_mixed_batch_keeps_greedy_rows_greedy(seed):
    gen = checks.generator(seed=seed)
    logits = checks.randn((12, 64), torch.float32, gen=gen, scale=0.1)  # flat: random rows wander
    params = [SP() if i % 3 == 0 else SP(temperature=1.5, top_k=20 * (i % 2), top_p=0.9,
                                          seed=i) for i in range(12)]
    before = logits.clone()
    got = run(logits, params, [0] * 12)
    greedy = torch.tensor([p.greedy for p in params])
    checks.assert_equal(got[greedy], torch.argmax(logits, dim=-1)[greedy], what="greedy rows")
    assert bool((got[~greedy] != torch.argmax(logits, -1)[~greedy]).any()), \
        "8 random rows over near-flat logits all drew the argmax: the random path is not used"
    checks.assert_unmodified(before, logits, "logits")


def test_tiny_temperature_is_greedy():
    # Below GREEDY_BELOW, logits / T would overflow to inf and inf ties pick the lowest index.
    logits = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    got = run(logits, [SP(temperature=1e-40, seed=1), SP(temperature=1e-6, seed=2)], [0, 0])
    checks.assert_equal(got, torch.tensor([2, 0]), what="tokens at temperatures 1e-40, 1e-6")


# ---------------------------------------------------------------- top-k and top-p

def test_top_k_1_is_greedy(seed):
    gen = checks.generator(seed=seed)
    logits = torch.cat([tie_heavy_logits(100, 50, gen), checks.randn((100, 50), torch.float32,
                                                                     gen=gen)])
    got = run(logits, rows(200, temperature=5.0, top_k=1), list(range(200)))
    checks.assert_equal(got, torch.argmax(logits, dim=-1), what="top_k=1 tokens")


@pytest.mark.parametrize("k", [2, 5, 20])
def test_top_k_samples_stay_in_the_k_best(k, seed):
    gen = checks.generator(seed=seed)
    n, vocab = 2000, 100
    logits = checks.randn((1, vocab), torch.float32, gen=gen).expand(n, vocab)
    # A high temperature flattens the distribution: without the cut, the draws would leave
    # the k best most of the time.
    got = run(logits, rows(n, temperature=10.0, top_k=k), list(range(n)))
    best = set(torch.topk(logits[0], k).indices.tolist())
    outside = [t for t in got.tolist() if t not in best]
    assert not outside, f"top_k={k}: {len(outside)} of {n} draws outside the {k} best"
    # Each of the k tokens has probability >= ~1/k * e**-(range/10); 2000 draws see them all.
    assert set(got.tolist()) == best, f"top_k={k}: the draws never reached every kept token"


def nucleus(probs: torch.Tensor, p: float) -> set[int]:
    """The oracle, in float64: tokens whose more likely predecessors hold less than p."""
    sorted_p, order = torch.sort(probs.double(), descending=True, stable=True)
    before = torch.cumsum(sorted_p, 0) - sorted_p
    return set(order[before < p].tolist())


@pytest.mark.parametrize("p", [0.3, 0.75, 0.9, 0.99])
def test_top_p_samples_stay_in_the_nucleus(p, seed):
    gen = checks.generator(seed=seed)
    n, vocab = 2000, 200
    logits = checks.randn((1, vocab), torch.float32, gen=gen, scale=3.0)
    allowed = nucleus(torch.softmax(logits[0].double(), 0), p)
    got = run(logits.expand(n, vocab), rows(n, top_p=p), list(range(n)))
    outside = [t for t in got.tolist() if t not in allowed]
    assert not outside, (f"top_p={p}: {len(outside)} of {n} draws outside the nucleus of "
                         f"{len(allowed)} tokens, e.g. token {outside[0]}")
    assert len(set(got.tolist())) > 1 or len(allowed) == 1, f"top_p={p}: only one token drawn"


def test_top_p_always_keeps_the_top_token(seed):
    gen = checks.generator(seed=seed)
    logits = checks.randn((300, 100), torch.float32, gen=gen, scale=0.01)   # nearly flat
    for p in (1e-9, 1e-30):   # 1e-30 is not 0 in float32, 1e-50 would be: see the next test
        got = run(logits, rows(300, temperature=3.0, top_p=p), list(range(300)))
        checks.assert_equal(got, torch.argmax(logits, dim=-1), what=f"tokens at top_p={p}")


def test_top_p_rounding_to_zero_keeps_the_top_token():
    logits = torch.tensor([[0.0, 1.0, 0.5]])
    cut = S.filter_mask(logits, torch.tensor([0]), torch.tensor([0.0]))
    assert cut.tolist() == [[True, False, True]], "top_p 0 must still keep the top token"


def test_rows_without_a_filter_are_not_cut_in_a_filtered_batch():
    # Token 0 holds all the mass in float32: the cumulative sum is 1.0 from rank 0 on, so a
    # mass-before >= top_p test with top_p = 1 would cut every other token; the row's draws
    # would then depend on whether ANOTHER row asked for a filter.
    logits = torch.tensor([[120.0, 0.0, 1.0, -1.0], [0.0, 1.0, 2.0, 3.0]])
    # Row 1 for contrast: top_k=2 keeps 3.0 and 2.0 (renormalized 0.73, 0.27); top_p=0.8 both.
    cut = S.filter_mask(logits, torch.tensor([0, 2]), torch.tensor([1.0, 0.8]))
    assert cut.tolist() == [[False] * 4, [True, True, False, False]]


def test_top_k_beyond_the_vocabulary_cuts_nothing():
    cut = S.filter_mask(torch.tensor([[0.0, 1.0, 2.0]]), torch.tensor([10]), torch.tensor([1.0]))
    assert cut.tolist() == [[False, False, False]]


def test_top_p_measures_the_tempered_distribution():
    """Temperature first, then top-p (Hugging Face's and vLLM's order). logits 3, 2, 1, 0, -1
    at T = 2 give probabilities .391 .237 .144 .087 .053: before the third token .628 < .7,
    before the fourth .772, so top_p = .7 keeps three. On the raw logits (T = 1: .636 .234
    .086 ...) it would keep two."""
    n = 20_000
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    got = run(logits[None, :].expand(n, 5), rows(n, temperature=2.0, top_p=0.7, first_seed=5),
              [0] * n)
    kept = torch.softmax(logits.double() / 2, 0) * torch.tensor([1, 1, 1, 0, 0])
    wrong = torch.softmax(logits.double() / 2, 0) * torch.tensor([1, 1, 0, 0, 0])
    assert_distribution(got, kept / kept.sum(), wrong / wrong.sum(), "top-p after temperature")


def test_top_p_cuts_the_token_whose_predecessors_reach_p_exactly():
    """probs .5 .25 .25, top_p = .75: before the third token the mass is exactly .75 (exact
    in float32), which reaches p, so it is cut (Hugging Face keeps two as well); the first
    two are both kept, in proportion."""
    n = 20_000
    probs = torch.tensor([0.5, 0.25, 0.25])
    got = run(probs.log()[None, :].expand(n, 3), rows(n, top_p=0.75, first_seed=11), [0] * n)
    assert_distribution(got, torch.tensor([2 / 3, 1 / 3, 0]).double(), probs.double(),
                        "top-p at its boundary")


def test_top_p_measures_what_top_k_left():
    # probs 0.4, 0.3, 0.2, 0.1: top_k=3 renormalizes to 4/9, 3/9, 2/9; with top_p=0.75 the
    # third token's predecessors hold 7/9 >= 0.75, so it is cut -- measured on the original
    # probabilities (0.7 < 0.75) it would stay. Hugging Face and vLLM apply k, then p.
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()[None, :]
    cut = S.filter_mask(logits, torch.tensor([3]), torch.tensor([0.75]))
    assert cut.tolist() == [[False, False, True, True]]


# ---------------------------------------------------------------- the distribution

LOGITS8 = torch.linspace(-1.5, 1.5, 8)[torch.tensor([3, 0, 7, 5, 1, 6, 2, 4])]


@pytest.mark.parametrize("over", ["seeds", "steps"])
def test_draws_follow_softmax_of_logits_over_t(over):
    n, t = 40_000, 0.7
    logits = LOGITS8[None, :].expand(n, 8)
    if over == "seeds":   # many requests, their first token each
        got = run(logits, rows(n, temperature=t, first_seed=10**6), [0] * n)
    else:                 # one request, many steps
        got = run(logits, [SP(temperature=t, seed=42)] * n, list(range(n)))
    assert_distribution(got, torch.softmax(LOGITS8.double() / t, 0),
                        torch.softmax(LOGITS8.double(), 0), f"draws over {over}")


def test_draws_are_uniform_over_a_wide_vocabulary():
    # Equal logits: every token index must be equally likely, the whole width of the noise.
    n, vocab = 25_600, 256
    got = run(torch.zeros(n, vocab), rows(n, first_seed=7), [3] * n)
    uniform = torch.full((vocab,), 1 / vocab)
    slanted = torch.softmax(torch.linspace(0, 0.3, vocab).double(), 0)
    assert_distribution(got, uniform, slanted, "draws from equal logits")


def test_filtered_draws_follow_the_renormalized_distribution():
    n = 40_000
    probs = torch.tensor([0.05, 0.3, 0.02, 0.4, 0.2, 0.03])
    logits = probs.log()[None, :].expand(n, 6)
    # top_k=4 keeps 0.4, 0.3, 0.2, 0.05 (sum 0.95); top_p=0.9 then cuts 0.05 (before it:
    # 0.9 / 0.95 = 0.947 >= 0.9); 0.2 stays (0.7 / 0.95 = 0.737 < 0.9).
    got = run(logits, rows(n, top_k=4, top_p=0.9, first_seed=99), [1] * n)
    kept = torch.tensor([0, 0.3, 0, 0.4, 0.2, 0]).double()
    assert_distribution(got, kept / kept.sum(), probs.double(), "top-k + top-p draws")


# ---------------------------------------------------------------- batching is invisible

def test_a_seeded_row_draws_the_same_token_in_any_batch(seed):
    gen = checks.generator(seed=seed)
    vocab = 1000
    probes = checks.randn((24, vocab), torch.float32, gen=gen)
    probe_params = [SP(temperature=0.5 + 0.1 * (i % 8), top_k=[0, 50][i % 2],
                       top_p=[1.0, 0.9, 0.5][i % 3], seed=1000 + i) for i in range(24)]
    probe_steps = [i * 7 for i in range(24)]
    alone = torch.cat([run(probes[i:i + 1], [probe_params[i]], [probe_steps[i]])
                       for i in range(24)])

    others = checks.randn((64, vocab), torch.float32, gen=gen)
    other_params = [SP(), SP(temperature=1.0, seed=5), SP(temperature=2.0, top_k=3, seed=6),
                    SP(temperature=0.3, top_p=0.2, seed=7)]
    for size in (2, 5, 17, 64):
        for position in (0, size // 2, size - 1):
            batch = others[:size].clone()
            params = [other_params[j % 4] for j in range(size)]
            steps = list(range(size))
            for i in range(24):
                batch[position] = probes[i]
                params[position], steps[position] = probe_params[i], probe_steps[i]
                got = run(batch, params, steps)[position]
                assert int(got) == int(alone[i]), (
                    f"probe {i} ({probe_params[i]}) drew {int(alone[i])} alone but {int(got)} "
                    f"at row {position} of a batch of {size}")


def test_unfiltered_rows_do_not_depend_on_needs_filter(seed):
    gen = checks.generator(seed=seed)
    logits = checks.randn((64, 500), torch.float32, gen=gen)
    st = S.SamplingTensors.from_params(rows(64, temperature=1.3), list(range(64)), "cpu")
    args = (logits, st.temperature, st.top_k, st.top_p, st.seeds, st.steps)
    checks.assert_equal(S.sample(*args, needs_filter=True), S.sample(*args, needs_filter=False),
                        what="tokens with and without the sort")


def test_different_steps_and_seeds_give_different_draws():
    vocab, n = 1000, 200
    logits = torch.zeros(n, vocab)
    by_step = run(logits, [SP(temperature=1.0, seed=3)] * n, list(range(n)))
    by_seed = run(logits, rows(n), [0] * n)
    # 200 uniform draws from 1000 tokens: 181 distinct on average, standard deviation ~3.5.
    for what, got in (("steps", by_step), ("seeds", by_seed)):
        distinct = len(set(got.tolist()))
        assert distinct >= 150, f"200 {what} drew only {distinct} distinct tokens of 1000"


def test_seeds_equal_modulo_2_to_the_64_draw_the_same():
    logits = torch.zeros(2, 1000)
    got = run(logits, [SP(temperature=1.0, seed=-1), SP(temperature=1.0, seed=2**64 - 1)], [4, 4])
    assert int(got[0]) == int(got[1])


# ---------------------------------------------------------------- no host synchronisation

SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def test_sample_never_reads_a_tensor_on_the_host(monkeypatch):
    gen = checks.generator(seed=0)
    logits = checks.randn((6, 300), torch.float32, gen=gen)
    st = S.SamplingTensors.from_params(
        [SP(), SP(temperature=1.0, seed=1), SP(temperature=0.8, top_k=5, seed=2),
         SP(temperature=1.2, top_p=0.7, seed=3), SP(temperature=0.5, top_k=9, top_p=0.5, seed=4),
         SP(temperature=2.0, seed=5)], [0, 1, 2, 3, 4, 5], "cpu")
    expected = S.sample(logits, st.temperature, st.top_k, st.top_p, st.seeds, st.steps)

    def forbidden(name):
        def call(*args, **kwargs):
            raise AssertionError(f"sample() called Tensor.{name}: on a GPU that makes the host "
                                 "wait for the device in the middle of a step")
        return call

    for name in SYNCS:
        monkeypatch.setattr(torch.Tensor, name, forbidden(name))
    got = S.sample(logits, st.temperature, st.top_k, st.top_p, st.seeds, st.steps,
                   needs_filter=True)
    monkeypatch.undo()
    checks.assert_equal(got, expected, what="tokens under the no-sync guard")


@pytest.mark.gpu
def test_sample_does_not_synchronise_on_cuda():
    logits = checks.randn((8, 32000), torch.float32, device="cuda", gen=checks.generator("cuda"))
    st = S.SamplingTensors.from_params(
        [SP(), SP(temperature=1.0, seed=1), SP(temperature=0.8, top_k=50, top_p=0.9, seed=2)] * 2
        + [SP(temperature=1.2, top_p=0.7, seed=3)] * 2, list(range(8)), "cuda")
    args = (logits, st.temperature, st.top_k, st.top_p, st.seeds, st.steps)
    expected = S.sample(*args).cpu()   # also builds and loads the argmax kernel
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = S.sample(*args, needs_filter=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    checks.assert_equal(got.cpu(), expected, what="tokens under the sync guard")


def test_sample_rejects_mismatched_rows():
    logits = torch.zeros(3, 10)
    st = S.SamplingTensors.from_params([SP(temperature=1.0, seed=1)] * 3, [0, 0, 0], "cpu")
    with pytest.raises(ValueError, match=r"top_k must be a \[3\] torch.int64 tensor"):
        S.sample(logits, st.temperature, st.top_k.int(), st.top_p, st.seeds, st.steps)
    with pytest.raises(ValueError, match=r"seeds must be a \[3\]"):
        S.sample(logits, st.temperature, st.top_k, st.top_p, st.seeds[:2], st.steps)
    with pytest.raises(ValueError, match="logits must be a float"):
        S.sample(logits[0], st.temperature, st.top_k, st.top_p, st.seeds, st.steps)


# ---------------------------------------------------------------- SamplingTensors

def test_sampling_tensors_from_params():
    params = [SP(), SP(temperature=0.7, seed=2**63), SP(temperature=1.0, top_k=4, seed=3)]
    st = S.SamplingTensors.from_params(params, [0, 5, 9], "cpu")
    assert st.temperature.tolist() == pytest.approx([0.0, 0.7, 1.0])
    assert st.top_k.tolist() == [0, 0, 4] and st.top_p.tolist() == [1.0, 1.0, 1.0]
    assert st.seeds.tolist() == [0, -(2**63), 3] and st.steps.tolist() == [0, 5, 9]
    assert (st.needs_filter, st.all_greedy) == (True, False)
    unfiltered = S.SamplingTensors.from_params(params[:2], [0, 0], "cpu")
    assert (unfiltered.needs_filter, unfiltered.all_greedy) == (False, False)
    # A greedy row's top-k does not make the batch sort.
    assert not S.SamplingTensors.from_params([SP(top_k=5)], [0], "cpu").needs_filter


def test_sampling_tensors_need_a_seed_for_random_rows():
    with pytest.raises(ValueError, match="row 1 samples at random but has no seed"):
        S.SamplingTensors.from_params([SP(), SP(temperature=1.0)], [0, 0], "cpu")
    with pytest.raises(ValueError, match="2 sampling params but 1 steps"):
        S.SamplingTensors.from_params([SP(), SP()], [0], "cpu")


# ---------------------------------------------------------------- SamplingParams

@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens must be at least 1, got 0"),
    (dict(max_tokens=-3), "max_tokens must be at least 1"),
    (dict(max_tokens=2.0), "max_tokens must be an integer"),
    (dict(max_tokens=True), "max_tokens must be an integer"),
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature=float("inf")), "temperature must be a finite number"),
    (dict(temperature="hot"), "temperature must be a finite number"),
    (dict(top_k=-1), "top_k must be an integer from 0"),
    (dict(top_k=2.5), "top_k must be an integer from 0"),
    (dict(top_k=2**63), "top_k must be an integer from 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_p=float("nan")), r"top_p must be in \(0, 1\]"),
    (dict(seed=1.5), "seed must be an integer or None"),
    (dict(seed="7"), "seed must be an integer or None"),
    (dict(seed=2**64), "seed must fit in 64 bits"),
    (dict(stop=("ok", "")), "stop strings must not be empty"),
    (dict(stop=[1]), "stop must be a string or a list of strings"),
    (dict(ignore_eos="yes"), "ignore_eos must be true or false"),
])
def test_sampling_params_reject_bad_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SP(**kwargs)


def test_sampling_params_defaults_and_properties():
    p = SP()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed, p.stop, p.ignore_eos) == \
        (256, 0.0, 0, 1.0, None, (), False)
    assert p.greedy and not p.needs_filter
    assert not SP(temperature=0.5).greedy and SP(temperature=0.5, top_p=0.9).needs_filter
    assert SP(stop="User:").stop == ("User:",), "a lone stop string is one string"
    assert SP(stop=["a", "b"]) == SP(stop=("a", "b")) and hash(SP(stop=["a"])) == hash(SP(stop=("a",)))
    p.validate()   # a valid object validates again without complaint


def test_with_seed_seeds_only_unseeded_random_requests():
    import random
    assert SP().with_seed() == SP(), "greedy requests keep seed=None"
    assert SP(temperature=1.0, seed=5).with_seed().seed == 5
    a = SP(temperature=1.0).with_seed(random.Random(0))
    b = SP(temperature=1.0).with_seed(random.Random(0))
    assert a.seed is not None and a == b
    assert SP(temperature=1.0).with_seed().seed != SP(temperature=1.0).with_seed().seed


def test_from_dict():
    cls = params_module().SamplingParams
    assert cls.from_dict({}) == SP()
    assert cls.from_dict({"temperature": 0.7, "top_p": 0.9, "seed": 3, "stop": "\n\n",
                          "max_tokens": 20, "ignore_eos": True}) == \
        SP(temperature=0.7, top_p=0.9, seed=3, stop=("\n\n",), max_tokens=20, ignore_eos=True)
    assert cls.from_dict({"stop": ["a", "b"], "seed": None}).stop == ("a", "b")
    assert cls.from_dict({"stop": None}).stop == ()


@pytest.mark.parametrize("d, message", [
    ({"temprature": 1.0}, r"unknown sampling parameter 'temprature'; the valid ones are: "
                          r"max_tokens, temperature, top_k, top_p, seed, stop, ignore_eos"),
    ({"prompt": "hi", "n": 2}, r"unknown sampling parameters 'n', 'prompt'"),
    ({"stop": 3}, "stop must be a string or a list of strings"),
    ({"max_tokens": 0}, "max_tokens must be at least 1"),
    ({"top_p": 2}, r"top_p must be in \(0, 1\]"),
    (["temperature", 1.0], "sampling parameters must be an object"),
])
def test_from_dict_errors(d, message):
    with pytest.raises(ValueError, match=message):
        params_module().SamplingParams.from_dict(d)
