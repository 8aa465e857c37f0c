"""bench.workloads: the same requests on every run and machine, of the sizes the docs say."""
from __future__ import annotations

from bench import workloads as W

VOCAB = 128256


def test_offline_is_seeded_and_in_range():
    a, b = W.offline(256, VOCAB), W.offline(256, VOCAB)
    assert a == b, "the offline workload must be the same on every run (seeded)"
    assert a != W.offline(256, VOCAB, seed=1), "another seed must give other requests"
    lo, hi = W.OFFLINE_LENGTHS
    assert all(lo <= len(p) <= hi and lo <= n <= hi for p, n in a)
    ids = [t for p, _ in a for t in p]
    assert min(ids) >= W.FIRST_ID and max(ids) < VOCAB, "ids 0-2 are pad/BOS/EOS: never used"
    # uniform lengths: the mean sits near the middle of [100, 1024] (562), not at an end
    mean_new = W.output_tokens(a) / len(a)
    assert 480 < mean_new < 640, mean_new
    # Pinned: the workload every recorded run measured (docs/benchmarks.md: 142,248 output
    # tokens). A change to the generator would make new figures incomparable with old ones.
    assert W.output_tokens(a) == 142248
    assert (len(a[0][0]), a[0][1], a[0][0][:3]) == (964, 839, [50497, 99349, 116689])


def test_shared_prefix_shares_its_system_prompt():
    reqs = W.shared_prefix(64, VOCAB)
    assert reqs == W.shared_prefix(64, VOCAB)
    system = reqs[0][0][: W.PREFIX_TOKENS]
    assert all(p[: W.PREFIX_TOKENS] == system for p, _ in reqs)
    qlo, qhi = W.PREFIX_QUESTION
    assert all(qlo <= len(p) - W.PREFIX_TOKENS <= qhi and n == W.PREFIX_NEW for p, n in reqs)
    assert len({tuple(p) for p, _ in reqs}) == len(reqs), "each question differs"


def test_fixed_batches_and_helpers():
    reqs = W.fixed(8, W.SWEEP_PROMPT, W.SWEEP_NEW, VOCAB, seed=8)
    assert reqs == W.fixed(8, W.SWEEP_PROMPT, W.SWEEP_NEW, VOCAB, seed=8)
    assert reqs != W.fixed(8, W.SWEEP_PROMPT, W.SWEEP_NEW, VOCAB, seed=9)
    assert all(len(p) == W.SWEEP_PROMPT and n == W.SWEEP_NEW for p, n in reqs)
    assert W.output_tokens(reqs) == 8 * W.SWEEP_NEW
    mixed = [([5] * 10, 50), ([5] * 30, 5)]
    assert W.context_len(mixed) == 60          # the longest single request
    assert W.padded_len(mixed) == 30 + 50      # one padded batch: longest prompt + most new
    assert W.capped(mixed, 20) == [([5] * 10, 20), ([5] * 30, 5)]
    assert W.SWEEP_BATCHES == (1, 8, 32, 64, 128, 256)
