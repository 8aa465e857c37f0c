"""Stage 10: decode from fixed buffers and CUDA graphs (decode_graphs.py), batched generation
(static_batch.py).

Oracles: stage 09's generate_greedy for each prompt alone (on the CPU in float32 a batch must
give exactly the solo tokens), transformers' generate, and -- for graphs -- the same steps run
eagerly.
"""
from __future__ import annotations


import pytest
import torch

from course import parts
from course.testing import checks, equivalence, fixtures

BF16_TOL = 2e-2


def graphs_mod():
    return parts.load("10", "decode_graphs")


def batch_mod():
    return parts.load("10", "static_batch")


def kv():
    return parts.load("09", "kv_cache")


@pytest.fixture(scope="module", params=["gqa_tied", "llama3_untied"])
def tiny(request, tmp_path_factory):
    return fixtures.load_tiny(tmp_path_factory.mktemp(request.param), request.param)


def new_model(tiny, device="cpu"):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    return parts.load("08", "model").LlamaModel(tiny.config, tiny.weights, device, dtype)


def random_prompts(lengths, vocab: int, seed: int) -> list[list[int]]:
    """`seed`: the test's (printed), so that TINYVLLM_SEED replays these very prompts."""
    g = checks.generator("cpu", seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _decode_setup(tiny, device, n_seqs: int, use_graphs: bool, seed: int):
    """A model with n_seqs prompts prefilled into their slots, and a DecodeGraphs over them."""
    m = new_model(tiny, device)
    prompts = random_prompts([5 + 3 * i for i in range(n_seqs)], tiny.config.vocab_size, seed)
    cache = kv().KVCache.for_model(m, num_slots=n_seqs, max_len=64)
    m.attention = kv().KVCacheAttention()
    plan = kv().StepPlan.build([kv().SeqStep([i], 0, len(p)) for i, p in enumerate(prompts)], cache)
    positions, meta = plan.metadata(cache, m.device)
    ids = torch.tensor([t for p in prompts for t in p], device=m.device)
    m.forward(ids, positions, meta)
    decoder = graphs_mod().DecodeGraphs(m, cache, max_batch=8, use_graphs=use_graphs)
    return m, cache, prompts, decoder


def test_decode_run_equals_a_plain_decode_step(tiny, seed):
    """run() pads the batch (3 -> 4) and must give the plain forward's hidden states, write
    the new K/V where the plan says, and leave every other slot alone."""
    m, cache, prompts, decoder = _decode_setup(tiny, "cpu", 3, use_graphs=False, seed=seed)
    new_ids = [7, 8, 9]
    plan = kv().StepPlan.build([kv().SeqStep([i], len(p), 1) for i, p in enumerate(prompts)], cache)
    tensors = list(cache.k) + list(cache.v)
    before = [t.clone() for t in tensors]
    got = decoder.run(new_ids, plan).clone()
    after = [t.clone() for t in tensors]
    for t, old in zip(tensors, before):   # the same step again, the plain way
        t.copy_(old)
    positions, meta = plan.metadata(cache, m.device)
    expected = m.forward(torch.tensor(new_ids), positions, meta)
    assert got.shape == expected.shape, (
        f"run returned hidden states of shape {tuple(got.shape)}, expected "
        f"{tuple(expected.shape)}: return the batch's real rows only (the first len(ids) rows "
        f"of the padded buffer), not the padding rows")
    checks.assert_close(got, expected, what="hidden states of a padded decode step",
                        dtype=torch.float32, atol=1e-5, rtol=1e-5,
                        hint="write ids, positions, slot_mapping and context_lens into the host "
                             "rows (the block tables are written for you) and copy them into "
                             "the fixed buffer; padding rows attend over nothing")
    required = {(i, len(p)) for i, p in enumerate(prompts)}
    allowed = required | {(cache.pad_slot, 0)}
    layers = len(cache.k)
    for j, (old, new) in enumerate(zip(before, after)):
        which = f"{'k' if j < layers else 'v'} of layer {j % layers}"
        changed = {tuple(x) for x in (new != old).any(-1).any(-1).nonzero().tolist()}
        assert changed <= allowed, (
            f"{which}: the step wrote cache rows {sorted(changed)}; only each sequence's new "
            f"position {sorted(required)} (and the pad slot's row 0) may change: padding rows "
            "must write to pad_slot")
        assert required <= changed, (
            f"{which}: the new token's K/V of {sorted(required - changed)} were not written: "
            "the step must store them at the plan's slot_mapping")


@pytest.mark.points(4)
@pytest.mark.parametrize("lengths", [[7], [1, 9, 4], [12, 3, 3, 30, 1]],
                         ids=lambda v: "+".join(map(str, v)))
def test_batch_equals_each_prompt_alone(tiny, seed, lengths):
    """On the CPU in float32, a prompt's tokens must not depend on its batch-mates."""
    prompts = random_prompts(lengths, tiny.config.vocab_size, seed)
    got = batch_mod().generate_batch(new_model(tiny), prompts, 12)
    for i, p in enumerate(prompts):
        alone = kv().generate_greedy(new_model(tiny), p, 12)
        assert got[i] == alone, (f"{tiny.variant}: prompt {i} (length {len(p)}) in a batch of "
                                 f"{lengths} gave {got[i]}, alone {alone}: each sequence needs its "
                                 "own positions, cache slot and context length")


def test_finished_sequences_leave_the_batch(tiny, seed):
    """An eos ends one sequence; the others go on to max_new_tokens."""
    prompts = random_prompts([6, 6, 10], tiny.config.vocab_size, seed)
    free = batch_mod().generate_batch(new_model(tiny), prompts, 10)
    eos = free[1][2]
    stopped = batch_mod().generate_batch(new_model(tiny), prompts, 10, eos_ids=[eos])
    for i in range(3):
        expected = free[i][: free[i].index(eos) + 1] if eos in free[i] else free[i]
        assert stopped[i] == expected, (f"sequence {i} with eos {eos}: expected {expected}, got "
                                        f"{stopped[i]}")


def test_batch_matches_transformers(tiny, seed):
    prompts = random_prompts([3, 17], tiny.config.vocab_size, seed)
    got = batch_mod().generate_batch(new_model(tiny), prompts, 16)
    for i, p in enumerate(prompts):
        theirs, logits = equivalence.hf_greedy(tiny.hf, p, 16)
        print(equivalence.assert_greedy_agrees(got[i], theirs, logits, 2e-5,
                                               what=f"{tiny.variant}: prompt {i}"))


@pytest.mark.gpu
@pytest.mark.points(4)
def test_graph_replay_equals_eager(tiny, seed):
    """The same decode steps replayed from CUDA graphs and run eagerly."""
    m, cache, prompts, graphs = _decode_setup(tiny, "cuda", 5, use_graphs=True, seed=seed)
    assert sorted(graphs.graphs) == graphs.sizes, (
        f"capture one graph per batch size {graphs.sizes}, got {sorted(graphs.graphs)}")
    eager = graphs_mod().DecodeGraphs(m, cache, max_batch=8, use_graphs=False)
    for n in (5, 3, 1):   # 5 pads to 8, 3 to 4
        plan = kv().StepPlan.build([kv().SeqStep([i], len(prompts[i]), 1) for i in range(n)], cache)
        ids = list(range(10, 10 + n))
        got = graphs.run(ids, plan).clone()
        expected = eager.run(ids, plan).clone()
        torch.cuda.synchronize()
        equivalence.assert_rel_close(got, expected, 1e-3, f"batch {n}: graph replay vs eager",
                                     hint="a buffer the graph reads was replaced instead of "
                                          "updated in place (copy_ into it), or the graph "
                                          "was captured without a warm-up")


@pytest.mark.gpu
@pytest.mark.points(4)
def test_bf16_batch_with_graphs_matches_transformers(tiny, seed):
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(tiny.directory, dtype=torch.bfloat16).to("cuda").eval()
    prompts = random_prompts([1, 40, 9, 17, 64], tiny.config.vocab_size, seed)
    got = batch_mod().generate_batch(new_model(tiny, "cuda"), prompts, 24, use_graphs=True)
    for i, p in enumerate(prompts):
        theirs, logits = equivalence.hf_greedy(hf, p, 24)
        print(equivalence.assert_greedy_agrees(got[i], theirs, logits, BF16_TOL,
                                               what=f"{tiny.variant} bf16 graphs: prompt {i}"))
