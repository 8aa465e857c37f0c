"""Stage 13: the cache-write kernels (cache_write.cu) against their native twins: the plain
store, and rope_cache_write (stage 05's rotation of q and k, then the store, in one kernel).

The caches start as NaN-free random numbers; a kernel that writes a row it must not (a -1
slot, a padding row) or misses one differs from the twin there. k and v are views of a
fused qkv tensor, as the model passes them.
"""
from __future__ import annotations

import pytest
import torch

from course import parts
from course.testing import checks

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


def rope_inputs(gen, tokens: int, n_heads: int, n_kv: int, d: int, max_positions: int = 4096):
    """q, k, v as views of one fused qkv, two caches, stage 05's cos/sin table and positions."""
    k, v, k_cache, v_cache = inputs(gen, tokens, n_heads, n_kv, d)
    q = k._base[:, : n_heads * d].view(tokens, n_heads, d)    # k is a view of the fused qkv
    cos_sin = parts.reference("05", "rope_tables").cos_sin_cache(d, 500000.0, None, max_positions)
    positions = torch.randint(0, max_positions, (tokens,), generator=gen, device="cuda")
    return q, k, v, k_cache, v_cache, cos_sin.cuda(), positions


def run_both_rope(q, k, v, k_cache, v_cache, cos_sin, positions, slots):
    want = [t.clone() for t in (q, k, v, k_cache, v_cache)]
    op().rope_cache_write_native(want[0], want[1], want[2], positions, cos_sin, want[3], want[4],
                                 slots)
    op().rope_cache_write(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    torch.cuda.synchronize()
    hint = ("q and k rotate in place as stage 05's rope does (HF's roundings: cos and sin to "
            "bf16, each product and the sum rounded); the rotated k and v then go to row "
            "slot_mapping[t] of the caches; -1 stores nothing")
    for got, expected, what in zip((q, k, v, k_cache, v_cache), want,
                                   ("q", "k", "v", "k_cache", "v_cache")):
        checks.assert_equal(got, expected, what=what, hint=hint)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", HEADS[:3], ids=lambda h: f"{h[0]}x{h[1]}x{h[2]}")
@pytest.mark.parametrize("tokens", [1, 37])
def test_rope_cache_write_matches_rope_then_cache_write(heads, tokens, seed):
    gen = checks.generator("cuda", seed)
    q, k, v, k_cache, v_cache, cos_sin, positions = rope_inputs(gen, tokens, *heads)
    rows = k_cache.shape[0] * k_cache.shape[1]
    slots = torch.randperm(rows, generator=gen, device="cuda")[:tokens]
    if tokens > 2:
        slots[::3] = -1                                 # padding rows: rotated, not stored
    run_both_rope(q, k, v, k_cache, v_cache, cos_sin, positions, slots)


@pytest.mark.gpu
def test_rope_cache_write_in_a_cuda_graph(seed):
    """Replays must read the current positions and slots (a decode step's inputs)."""
    gen = checks.generator("cuda", seed)
    q, k, v, k_cache, v_cache, cos_sin, positions = rope_inputs(gen, 8, 32, 8, 64)
    slots = torch.full((8,), -1, dtype=torch.int64, device="cuda")
    scratch = [t.clone() for t in (q, k)]
    op().rope_cache_write(scratch[0], scratch[1], v, positions, cos_sin, k_cache, v_cache, slots)
    torch.cuda.synchronize()                            # warm-up outside the capture
    before = [t.clone() for t in (q, k)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op().rope_cache_write(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    q.copy_(before[0])
    k.copy_(before[1])
    slots.copy_(torch.tensor([5, -1, 17, 300, -1, 0, 41, 9], device="cuda"))
    positions.copy_(torch.tensor([0, 1, 4095, 7, 300, 2, 64, 1000], device="cuda"))
    want = [t.clone() for t in (q, k, v, k_cache, v_cache)]
    op().rope_cache_write_native(want[0], want[1], want[2], positions, cos_sin, want[3], want[4],
                                 slots)
    graph.replay()
    torch.cuda.synchronize()
    for got, expected, what in zip((q, k, k_cache, v_cache), (want[0], want[1], want[3], want[4]),
                                   ("q", "k", "k_cache", "v_cache")):
        checks.assert_equal(got, expected, what=f"{what} after a graph replay")


@pytest.mark.gpu
def test_rope_cache_write_names_an_unsupported_head_dim():
    """A valid call first (the refusal alone is given code), then head_dim 8, refused."""
    gen = checks.generator("cuda", 0)
    run_both_rope(*rope_inputs(gen, 2, 4, 1, 64), torch.tensor([3, 17], device="cuda"))
    q, k, v, k_cache, v_cache, cos_sin, positions = rope_inputs(gen, 2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        op().rope_cache_write(q, k, v, positions, cos_sin, k_cache, v_cache,
                              torch.zeros(2, dtype=torch.int64, device="cuda"))
