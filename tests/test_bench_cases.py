"""bench.cases on the CPU: a case's inputs must mean what its row says, or the GPU run that
checks ours against torch reports WRONG (or worse, times the wrong thing) far from here."""
from __future__ import annotations

import pytest
import torch

from bench import cases
from course import parts
from course.testing import checks


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(cases, "DEVICE", "cpu")


@pytest.mark.parametrize("B, S, layers", [(1, 64, 1), (2, 48, 3)])
def test_paged_case_tables_map_each_layers_pool(on_cpu, B, S, layers):
    twin = parts.load("14", "paged_attention").paged_decode_attention_native
    case = cases._paged_case(cases.Ops.__new__(cases.Ops), twin, None, B, S, layers)
    g = torch.Generator().manual_seed(0)
    s = case.make_set(g)
    assert case.bytes == 2 * layers * B * S * cases.N_KV_HEADS * cases.HEAD_DIM * 2, \
        "GB/s counts every layer's K and V bytes once"
    for i in range(layers):
        # the paged pool and the contiguous cache SDPA reads must hold the same keys
        blocks = s["pk"][i][s["tables"][i].long()]           # [B, S/16, 16, KV, d]
        assert torch.equal(blocks.reshape(s["k"][i].shape), s["k"][i]), \
            f"layer {i}: the block table does not map the contiguous keys to the pool's blocks"
    for buf in case.outs:
        checks.poison(buf)
    got = case.ours_fn(s)
    expected = case.reference(s)
    torch_out = case.torch_fn(s)
    assert len(got) == len(expected) == len(torch_out) == layers
    for i in range(layers):
        checks.assert_close(got[i], expected[i], what=f"paged case, layer {i}: ours")
        checks.assert_close(torch_out[i], expected[i], what=f"paged case, layer {i}: SDPA")
    assert case.tokens == (f"{B}x{S}" if layers == 1 else f"{B}x{S}, {layers} layers")


def test_the_paged_family_ends_with_a_decode_steps_worth_of_layers(on_cpu, monkeypatch):
    ops = cases.Ops.__new__(cases.Ops)
    monkeypatch.setattr(cases.Ops, "get", lambda self, name: (None, "skipped: not here"))
    rows = [c.tokens for c in cases.paged_decode_attention_cases(ops)]
    assert rows[:-1] == [f"{B}x{S}" for B, S in cases.PAGED_SHAPES]
    assert rows[-1] == f"1x32768, {cases.PAGED_LAYERS} layers"
