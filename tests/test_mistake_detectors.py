"""The stage tests' detectors of classic mistakes, fed the mistakes' outputs on the CPU.

A stage's GPU test names the mistake a wrong output matches ("likely cause: ..."); here each
detector gets exactly that wrong output (made on the CPU by the same oracle the detector
replays) and must name it, and a right output must not be called any mistake.
"""
from __future__ import annotations

import importlib.util

import torch

from course import manifest


def _stage_test(stage: str, name: str):
    path = manifest.ROOT / "stages" / manifest.find(stage).dir / "tests" / name
    spec = importlib.util.spec_from_file_location(f"_detectors_{stage}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _inputs(lens: list[int], n_heads: int, n_kv: int, d: int):
    g = torch.Generator().manual_seed(7)
    tokens = sum(lens)
    q, k, v = (torch.randn(tokens, h, d, generator=g).bfloat16() for h in (n_heads, n_kv, n_kv))
    bounds = [0] + torch.tensor(lens).cumsum(0).tolist()
    return q, k, v, bounds


def test_stage_07_names_an_output_never_divided_by_the_row_sum():
    t07 = _stage_test("07", "test_attention.py")
    q, k, v, bounds = _inputs([40, 17], 8, 2, 64)
    scale = 64 ** -0.5
    wrong = t07.sdpa_oracle(q, k, v, bounds, scale, normalized=False).bfloat16()
    assert "never divided by the row sum" in t07.likely_cause(wrong, q, k, v, bounds, scale)
    right = t07.sdpa_oracle(q, k, v, bounds, scale).bfloat16()
    assert "row sum" not in t07.likely_cause(right, q, k, v, bounds, scale)
    modulo = t07.sdpa_oracle(q, k, v, bounds, scale, kv_of_head=[h % 2 for h in range(8)])
    assert "q_head // (n_heads // n_kv_heads)" in t07.likely_cause(modulo.bfloat16(), q, k, v,
                                                                   bounds, scale)
