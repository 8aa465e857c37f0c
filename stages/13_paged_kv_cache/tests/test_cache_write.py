"""Stage 13: the cache-write kernel (cache_write.cu) against its native twin.

The caches start as NaN-free random numbers; a kernel that writes a row it must not (a -1
slot, a padding row) or misses one differs from the twin there. k and v are views of a
fused qkv tensor, as the model passes them.
"""
from __future__ import annotations

import pytest
import torch

from course import parts
from grader import checks

# (n_heads, n_kv_heads, head_dim): Llama-3.2-1B, SmolLM2-135M, head_dim 128, one KV head
HEADS = [(32, 8, 64), (9, 3, 64), (16, 2, 128), (4, 1, 8)]


def op():
    return parts.load("13", "cache_write")


def inputs(gen, tokens: int, n_heads: int, n_kv: int, d: int, num_blocks=40, block_size=16):
    """(k, v) as views of a fused qkv [tokens, (n_heads + 2 n_kv) d] and two caches."""
    qkv = checks.randn((tokens, (n_heads + 2 * n_kv) * d), torch.bfloat16, "cuda", gen)
    k = qkv[:, n_heads * d: (n_heads + n_kv) * d].view(tokens, n_kv, d)
    v = qkv[:, (n_heads + n_kv) * d:].view(tokens, n_kv, d)
    shape = (num_blocks, block_size, n_kv, d)
    return (k, v, checks.randn(shape, torch.bfloat16, "cuda", gen),
            checks.randn(shape, torch.bfloat16, "cuda", gen))


def run_both(k, v, k_cache, v_cache, slots):
    want_k, want_v = k_cache.clone(), v_cache.clone()
    op().cache_write_native(k, v, want_k, want_v, slots)
    k_before, v_before = k.clone(), v.clone()
    op().cache_write(k, v, k_cache, v_cache, slots)
    torch.cuda.synchronize()
    checks.assert_unmodified(k_before, k, "k")
    checks.assert_unmodified(v_before, v, "v")
    hint = ("row slot_mapping[t] of the flat [num_blocks * block_size, n_kv, d] cache gets token "
            "t's row; k and v rows are k_stride / v_stride apart (views of qkv); -1 writes nowhere")
    checks.assert_equal(k_cache, want_k, what="k_cache", hint=hint)
    checks.assert_equal(v_cache, want_v, what="v_cache", hint=hint)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}x{h[1]}x{h[2]}")
@pytest.mark.parametrize("tokens", [1, 37, 600])
def test_cache_write_matches_the_twin(heads, tokens, seed):
    gen = checks.generator("cuda", seed)
    k, v, k_cache, v_cache = inputs(gen, tokens, *heads)
    rows = k_cache.shape[0] * k_cache.shape[1]
    slots = torch.randperm(rows, generator=gen, device="cuda")[:tokens]
    run_both(k, v, k_cache, v_cache, slots)


@pytest.mark.gpu
def test_minus_one_slots_write_nowhere(seed):
    gen = checks.generator("cuda", seed)
    k, v, k_cache, v_cache = inputs(gen, 50, 32, 8, 64)
    slots = torch.randperm(k_cache.shape[0] * k_cache.shape[1], generator=gen, device="cuda")[:50]
    slots[::3] = -1                                     # padding rows among real ones
    run_both(k, v, k_cache, v_cache, slots)
    before = k_cache.clone()
    op().cache_write(k, v, k_cache, v_cache, torch.full((50,), -1, device="cuda"))
    torch.cuda.synchronize()
    checks.assert_equal(k_cache, before, what="k_cache after a call of -1 slots only",
                        hint="a slot of -1 (a padding row) must return before writing anything")


@pytest.mark.gpu
def test_contiguous_inputs_and_an_empty_step(seed):
    gen = checks.generator("cuda", seed)
    k, v, k_cache, v_cache = inputs(gen, 20, 32, 8, 64)
    slots = torch.arange(20, device="cuda") * 7
    run_both(k.contiguous(), v.contiguous(), k_cache, v_cache, slots)
    empty = torch.empty(0, 8, 64, dtype=torch.bfloat16, device="cuda")
    before = k_cache.clone()
    op().cache_write(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64,
                                                                 device="cuda"))
    checks.assert_equal(k_cache, before, what="k_cache after a call with no tokens")


@pytest.mark.gpu
def test_cache_write_in_a_cuda_graph(seed):
    """A decode step is captured once and replayed: the op must not read the slot mapping on
    the host, and a replay must use the slot mapping's current values."""
    gen = checks.generator("cuda", seed)
    k, v, k_cache, v_cache = inputs(gen, 8, 32, 8, 64)
    slots = torch.full((8,), -1, dtype=torch.int64, device="cuda")
    op().cache_write(k, v, k_cache, v_cache, slots)     # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op().cache_write(k, v, k_cache, v_cache, slots)
    new_slots = torch.tensor([5, -1, 17, 300, -1, 0, 41, 9], device="cuda")
    want_k, want_v = k_cache.clone(), v_cache.clone()
    op().cache_write_native(k, v, want_k, want_v, new_slots)
    slots.copy_(new_slots)
    graph.replay()
    torch.cuda.synchronize()
    checks.assert_equal(k_cache, want_k, what="k_cache after a graph replay")
    checks.assert_equal(v_cache, want_v, what="v_cache after a graph replay")
