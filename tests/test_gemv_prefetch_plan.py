"""Stage 06's given prefetch plan (linear.plan_prefetch): which rows of which weight each GEMV
asks L2 for. Given code, so tested here rather than in the stage's graded tests."""
from __future__ import annotations

import pytest
import torch

from course import parts


def test_prefetch_plan_is_whole_rows_of_the_next_weight_in_a_cycle(monkeypatch):
    """What plan_prefetch hands each weight (CPU: only the plan, nothing is fetched): the top
    rows of the next weight that fit in max_bytes, the last weight the first's, nothing for 0;
    TINYVLLM_L2_PREFETCH_MB sets the default and a bad value is a clear error."""
    op = parts.reference("06", "linear")
    ws = [torch.zeros(3072, 2048, dtype=torch.bfloat16), torch.zeros(2048, 2048, dtype=torch.bfloat16),
          torch.zeros(2048, 8192, dtype=torch.bfloat16)]
    op.plan_prefetch(ws, 10 * 4096 + 100)          # 10 rows of 4 KB, 2 rows of 16 KB
    got = [getattr(w, "_tvllm_gemv_prefetch") for w in ws]
    assert [tuple(g.shape) for g in got] == [(10, 2048), (2, 8192), (10, 2048)], \
        "each weight's prefetch: the whole rows of the NEXT weight that fit, cyclically"
    assert got[0].data_ptr() == ws[1].data_ptr() and got[2].data_ptr() == ws[0].data_ptr()
    op.plan_prefetch(ws, 0)
    assert all(getattr(w, "_tvllm_gemv_prefetch") is None for w in ws), "0 bytes: no prefetch"
    monkeypatch.setenv("TINYVLLM_L2_PREFETCH_MB", "1")
    op.plan_prefetch(ws)
    assert getattr(ws[0], "_tvllm_gemv_prefetch").shape == (256, 2048), "1 MiB = 256 rows of 4 KB"
    for bad in ("lots", "-1", "nan", "inf"):
        monkeypatch.setenv("TINYVLLM_L2_PREFETCH_MB", bad)
        with pytest.raises(ValueError, match="TINYVLLM_L2_PREFETCH_MB must be a number"):
            op.plan_prefetch(ws)


@pytest.mark.gpu
def test_gemv_prefetch_must_be_contiguous():
    """The binding refuses a prefetch it cannot hand over as one range of bytes."""
    x = torch.randn(1, 2048, device="cuda").bfloat16()
    w = torch.randn(1024, 2048, device="cuda").bfloat16()
    out = torch.empty((1, 1024), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="prefetch must be contiguous"):
        parts.kernels().linear(x, w, out, True, w.t())
