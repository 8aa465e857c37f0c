"""Stage 09: the KV cache (kv_cache.py) -- storing K/V, attention over it, cached generation.

Oracles: transformers' LlamaForCausalLM on the same weights (its generate uses its own cache),
and our own stage-08 forward without a cache (the whole sequence recomputed). On the CPU in
float32 both must agree with the cached path exactly up to float32 rounding.
"""
from __future__ import annotations


import pytest
import torch

from course import parts
from course.testing import checks, equivalence, fixtures

VARIANTS = list(fixtures.VARIANTS)
FP32_TOL = 2e-5
BF16_TOL = 2e-2


def kv():
    return parts.load("09", "kv_cache")


def model_mod():
    return parts.load("08", "model")


@pytest.fixture(scope="module", params=VARIANTS)
def tiny(request, tmp_path_factory):
    return fixtures.load_tiny(tmp_path_factory.mktemp(request.param), request.param)


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    """`seed`: the test's (printed), so that TINYVLLM_SEED replays these very prompts."""
    return torch.randint(0, vocab, (length,), generator=checks.generator("cpu", seed)).tolist()


def test_cache_shape_and_zeros():
    cache = kv().KVCache(num_layers=3, num_slots=4, max_len=10, n_kv_heads=2, head_dim=8,
                         dtype=torch.float32, device="cpu")
    assert len(cache.k) == 3 and len(cache.v) == 3, "one k and one v tensor per layer"
    for t in cache.k + cache.v:
        assert tuple(t.shape) == (5, 10, 2, 8), (
            f"each layer's cache is [num_slots + 1, max_len, n_kv_heads, head_dim] = (5, 10, 2, 8) "
            f"(the extra slot is pad_slot, for padding rows), got {tuple(t.shape)}")
        assert t.dtype == torch.float32 and bool((t == 0).all()), "start from zeros"
    assert len({t.data_ptr() for t in cache.k + cache.v}) == 6, (
        "every layer needs its own k and v tensors (not [torch.zeros(...)] * num_layers)")


def test_write_puts_rows_at_slot_times_max_len_plus_position(seed):
    cache = kv().KVCache(2, 3, 6, 2, 4, torch.float32, "cpu")
    g = checks.generator("cpu", seed)
    k = torch.randn(3, 2, 4, generator=g)
    v = torch.randn(3, 2, 4, generator=g)
    # tokens at (slot 1, position 0), (slot 2, position 5), (slot 0, position 3)
    rows = torch.tensor([1 * 6 + 0, 2 * 6 + 5, 0 * 6 + 3])
    cache.write(1, k, v, rows)
    for i, (slot, pos) in enumerate([(1, 0), (2, 5), (0, 3)]):
        checks.assert_equal(cache.k[1][slot, pos], k[i], what=f"k of token {i} in layer 1",
                            hint="row r of the flat view is slot r // max_len, position r % max_len")
        checks.assert_equal(cache.v[1][slot, pos], v[i], what=f"v of token {i} in layer 1")
    assert int((cache.k[1] != 0).any(-1).any(-1).sum()) == 3, "write exactly the 3 rows given"
    assert bool((cache.k[0] == 0).all()), "writing layer 1 must leave layer 0 alone"


def test_write_accepts_views_of_fused_qkv(seed):
    """The model passes k and v as column slices of its fused qkv tensor."""
    cache = kv().KVCache(1, 1, 4, 2, 4, torch.float32, "cpu")
    qkv = torch.randn(2, 3 * 8, generator=checks.generator("cpu", seed))
    k, v = qkv[:, 8:16].view(2, 2, 4), qkv[:, 16:].view(2, 2, 4)
    cache.write(0, k, v, torch.tensor([2, 0]))
    checks.assert_equal(cache.k[0][0, 2], k[0], what="k of token 0")
    checks.assert_equal(cache.v[0][0, 0], v[1], what="v of token 1")


def test_gather_returns_rows_in_order(seed):
    cache = kv().KVCache(1, 2, 5, 1, 2, torch.float32, "cpu")
    cache.k[0].copy_(torch.arange(cache.k[0].numel(), dtype=torch.float32).view_as(cache.k[0]))
    cache.v[0].copy_(-cache.k[0])
    rows = torch.tensor([7, 0, 9, 5])
    keys, values = cache.gather(0, rows)
    flat = cache.k[0].view(-1, 1, 2)
    checks.assert_equal(keys, flat[rows], what="gathered keys",
                        hint="row r of the flat [rows, kv_heads, head_dim] view, in the order given")
    checks.assert_equal(values, -flat[rows], what="gathered values")


def _prefill_then_decode_logits(m, cache, prompt: list[int], chunks: list[int]):
    """Feed the prompt to the cached model in chunks of these sizes; last logits of each."""
    K = kv()
    m.attention = K.KVCacheAttention()
    out, cached = [], 0
    for n in chunks:
        plan = K.StepPlan.build([K.SeqStep([0], cached, n)], cache)
        positions, meta = plan.metadata(cache, m.device)
        ids = torch.tensor(prompt[cached:cached + n], dtype=torch.int64, device=m.device)
        out.append(m.compute_logits(m.forward(ids, positions, meta), meta.last_rows))
        cached += n
    return out


@pytest.mark.points(3)
@pytest.mark.parametrize("chunks", [[12, 1, 1, 1], [5, 7, 1], [1] * 6],
                         ids=["prefill+3 decodes", "two chunks+decode", "decode from the start"])
def test_cached_steps_match_recompute(tiny, seed, chunks):
    """Each step's logits with the cache equal a forward over the whole sequence so far."""
    m = model_mod().LlamaModel(tiny.config, tiny.weights, "cpu", torch.float32)
    prompt = random_prompt(sum(chunks), tiny.config.vocab_size, seed)
    cache = kv().KVCache.for_model(m, num_slots=2, max_len=32)
    got = _prefill_then_decode_logits(m, cache, prompt, chunks)
    ref = model_mod().LlamaModel(tiny.config, tiny.weights, "cpu", torch.float32)
    seen = 0
    for i, n in enumerate(chunks):
        seen += n
        expected = equivalence.our_logits(ref, [prompt[:seen]])
        checks.assert_close(got[i], expected, what=f"{tiny.variant}: logits after step {i} "
                            f"(chunks {chunks})", dtype=torch.float32,
                            atol=FP32_TOL * max(float(expected.abs().max()), 1.0), rtol=0.0,
                            hint="cache K after rope; the new token is at position = tokens "
                                 "cached; attend over cached + new keys; a chunk's queries "
                                 "are the last positions of its sequence")


@pytest.mark.points(4)
def test_generate_matches_transformers(tiny, seed):
    """Greedy generation with the cache: the same tokens as transformers' generate."""
    m = model_mod().LlamaModel(tiny.config, tiny.weights, "cpu", torch.float32)
    prompt = random_prompt(11, tiny.config.vocab_size, seed)
    ours = kv().generate_greedy(m, prompt, 24)
    theirs, their_logits = equivalence.hf_greedy(tiny.hf, prompt, 24)
    print(equivalence.assert_greedy_agrees(ours, theirs, their_logits, FP32_TOL,
                                           what=f"{tiny.variant}: cached greedy tokens"))
    assert len(ours) == 24, f"asked for 24 tokens without an eos, got {len(ours)}"


def test_generate_stops_at_eos(tiny, seed):
    m = model_mod().LlamaModel(tiny.config, tiny.weights, "cpu", torch.float32)
    prompt = random_prompt(6, tiny.config.vocab_size, seed)
    free = kv().generate_greedy(m, prompt, 10)
    eos = free[3]
    stopped = kv().generate_greedy(m, prompt, 10, eos_ids=[eos])
    expected = free[: free.index(eos) + 1]
    assert stopped == expected, (f"with eos_ids=[{eos}] expected {expected}, got {stopped}: "
                                 "stop right after emitting an eos id (and return it)")


def test_generate_feeds_one_token_a_step_after_the_prefill(tiny, seed, monkeypatch):
    """The point of the cache: the prompt runs once, then each step runs only the newest token.
    Re-feeding the whole sequence gives the same tokens, and throws the cache's speed away."""
    m = model_mod().LlamaModel(tiny.config, tiny.weights, "cpu", torch.float32)
    prompt = random_prompt(7, tiny.config.vocab_size, seed)
    fed = []
    forward = m.forward

    def counting_forward(ids, *args, **kwargs):
        fed.append(int(ids.numel()))
        return forward(ids, *args, **kwargs)
    monkeypatch.setattr(m, "forward", counting_forward)
    out = kv().generate_greedy(m, prompt, 5)
    assert fed == [7, 1, 1, 1, 1], (
        f"tokens fed to model.forward per step: {fed}, expected [7, 1, 1, 1, 1] for a 7-token "
        f"prompt and {len(out)} new tokens: after the prefill each step feeds only the token "
        f"picked last (its K/V are the only ones not cached yet), and the last pick is never fed")


def test_generate_one_token_prompt_and_errors(tiny):
    m = model_mod().LlamaModel(tiny.config, tiny.weights, "cpu", torch.float32)
    assert len(kv().generate_greedy(m, [5], 3)) == 3, "a one-token prompt is a valid prompt"
    with pytest.raises(ValueError, match="empty"):
        kv().generate_greedy(m, [], 3)
    with pytest.raises(ValueError, match="positions"):
        kv().generate_greedy(m, [1, 2, 3], m.max_positions)


@pytest.mark.gpu
@pytest.mark.points(4)
def test_bf16_cached_generation_on_gpu(tiny, seed):
    """bf16 on the GPU, prefill (stage 07's kernel) then decode (stage 09's kernel):
    transformers' bf16 greedy tokens, up to proven near-ties."""
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(tiny.directory, dtype=torch.bfloat16).to("cuda").eval()
    m = model_mod().LlamaModel(tiny.config, tiny.weights, "cuda", torch.bfloat16)
    prompt = random_prompt(40, tiny.config.vocab_size, seed)
    ours = kv().generate_greedy(m, prompt, 32)
    theirs, their_logits = equivalence.hf_greedy(hf, prompt, 32)
    print(equivalence.assert_greedy_agrees(ours, theirs, their_logits, BF16_TOL,
                                           what=f"{tiny.variant} bf16: cached greedy tokens"))


@pytest.mark.gpu
@pytest.mark.points(3)
def test_bf16_cached_steps_match_recompute_on_gpu(tiny, seed):
    m = model_mod().LlamaModel(tiny.config, tiny.weights, "cuda", torch.bfloat16)
    ref = model_mod().LlamaModel(tiny.config, tiny.weights, "cuda", torch.bfloat16)
    chunks = [70, 30, 1, 1]
    prompt = random_prompt(sum(chunks), tiny.config.vocab_size, seed)
    got = _prefill_then_decode_logits(m, kv().KVCache.for_model(m, 3, 128), prompt, chunks)
    seen = 0
    for i, n in enumerate(chunks):
        seen += n
        expected = equivalence.our_logits(ref, [prompt[:seen]])
        equivalence.assert_rel_close(got[i], expected, BF16_TOL,
                                     f"{tiny.variant} bf16: logits after step {i} ({chunks})")
