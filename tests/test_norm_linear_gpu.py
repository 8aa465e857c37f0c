"""Stage 08's add_rmsnorm_linear on a GPU: at one bf16 token on an sm_90 GPU, stage 06's
bulk-copy GEMV with the RMSNorm as its prologue (gemv.cu, `Prologue`); elsewhere the two ops
it stands for. Both must give what stage 04's norm then stage 06's linear give."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course import ops, parts
from course.testing import checks


def _hopper() -> bool:
    return torch.cuda.get_device_capability() >= (9, 0)


# (tokens, in, out, silu_mul, add): Llama-3.2-1B's qkv and gate_up at one token, layer 0 (no
# add), 8192 columns; 1024 columns (less than a warp's run of 2048), SmolLM2's 576 and two tokens
# take the two-op path.
CASES = [(1, 2048, 3072, False, True), (1, 2048, 8192, True, True), (1, 2048, 3072, False, False),
         (1, 8192, 512, False, True), (1, 1024, 512, False, True), (1, 576, 960, False, True),
         (2, 2048, 3072, False, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,in_features,out_features,silu_mul,add", CASES,
                         ids=lambda v: str(v))
def test_add_rmsnorm_linear_equals_norm_then_linear(seed, tokens, in_features, out_features,
                                                     silu_mul, add):
    """The stream equals stage 04's x + residual exactly; y equals rmsnorm then linear (or
    linear_silu_mul) within bf16 rounding -- the norm's sum of squares is added in another
    order in the GEMV's blocks; and on sm_90 one token runs as one kernel, gemv_kernel_tma,
    with no RMSNorm kernel beside it."""
    gen = checks.generator("cuda", seed)
    x = checks.randn((tokens, in_features), torch.bfloat16, "cuda", gen)
    residual = checks.randn((tokens, in_features), torch.bfloat16, "cuda", gen)
    norm = (1 + 0.1 * checks.randn((in_features,), torch.float32, "cuda", gen)).bfloat16()
    rows = 2 * out_features if silu_mul else out_features
    w = (checks.randn((rows, in_features), torch.float32, "cuda", gen)
         * in_features ** -0.5).bfloat16()
    op = ops.get("add_rmsnorm_linear")
    x0, r0 = x.clone(), residual.clone()
    (y, stream), ran = checks.kernels_of(
        lambda: op(x.clone(), residual.clone() if add else None, norm, 1e-5, w, silu_mul=silu_mul))
    rms = parts.reference("04", "rmsnorm")
    if add:
        normed, expected_stream = rms.fused_add_rmsnorm_native(x0, r0, norm, 1e-5)
    else:
        normed, expected_stream = rms.rmsnorm_native(x0, norm, 1e-5), x0
    checks.assert_equal(stream, expected_stream, what="the stream x + residual")
    expected = F.linear(normed.float(), w.float())
    if silu_mul:
        expected = parts.reference("08", "activation").silu_mul_native(expected.bfloat16())
    checks.assert_close(y, expected, dtype=torch.bfloat16, what="y = linear(rmsnorm(x + residual))")
    one_kernel = tokens == 1 and in_features % 2048 == 0 and _hopper()
    tma = [n for n in ran if "gemv_kernel_tma" in n]
    norms = [n for n in ran if "rmsnorm" in n]
    assert bool(tma and not norms) == one_kernel, (
        f"expected {'one gemv_kernel_tma and no RMSNorm kernel' if one_kernel else 'the norm, then the projection'}"
        f", the GPU ran {sorted(set(ran))}")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2])
def test_add_rmsnorm_linear_gives_float32_logits(seed, tokens):
    """out_dtype=torch.float32 (the model's final norm and lm_head, LlamaModel.stream_logits):
    y keeps the float32 accumulator -- no bf16 rounding of the scores -- and equals the norm,
    then linear(out_dtype=float32); on sm_90 one token is still one kernel, no RMSNorm beside
    it."""
    gen = checks.generator("cuda", seed)
    x = checks.randn((tokens, 2048), torch.bfloat16, "cuda", gen)
    residual = checks.randn((tokens, 2048), torch.bfloat16, "cuda", gen)
    norm = (1 + 0.1 * checks.randn((2048,), torch.float32, "cuda", gen)).bfloat16()
    w = (checks.randn((5000, 2048), torch.float32, "cuda", gen) * 2048 ** -0.5).bfloat16()
    op = ops.get("add_rmsnorm_linear")
    normed, _ = parts.reference("04", "rmsnorm").fused_add_rmsnorm_native(x.clone(),
                                                                         residual.clone(), norm,
                                                                         1e-5)
    (y, _), ran = checks.kernels_of(
        lambda: op(x.clone(), residual.clone(), norm, 1e-5, w, out_dtype=torch.float32))
    assert y.dtype == torch.float32 and y.shape == (tokens, 5000), (
        f"logits are [tokens, out] float32, got {tuple(y.shape)} {y.dtype}")
    expected = F.linear(normed.float(), w.float())
    # x is bf16 either way: the difference is the order of float32 sums, and a bf16 step of x
    # where the norm's sum of squares came out a rounding apart
    checks.assert_close(y, expected, dtype=torch.bfloat16, what="float32 logits of rmsnorm(x + r)")
    assert (y.view(torch.int32) & 0xFFFF).any(), (
        "every logit has the low 16 bits of a bf16: rounded to bf16, not float32 accumulators")
    one_kernel = tokens == 1 and _hopper()
    tma = [n for n in ran if "gemv_kernel_tma" in n]
    norms = [n for n in ran if "rmsnorm" in n]
    assert bool(tma and not norms) == one_kernel, f"the GPU ran {sorted(set(ran))}"
    with pytest.raises(ValueError, match="silu_mul"):
        op(x, residual, norm, 1e-5, torch.cat([w, w]), silu_mul=True, out_dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2])
def test_add_rmsnorm_linear_picks_the_greedy_token(seed, tokens):
    """pick= (the decode graph's greedy tokens, LlamaModel.stream_logits): each row's
    torch.argmax of the logits the op returned, in pick and in the host row at the slot. The
    vocabulary of Llama 3 with the largest logit planted twice, at rows 1000 and 120000 (in
    different blocks: the lower index must win), then a NaN (it beats every number). Four
    calls: the kernel's ticket and key must be back at 0 after each, and the fourth names a
    slot outside the host buffer (nothing stored). On sm_90 one token is one kernel, with no
    argmax kernel after it (from the second call: the first may zero the kept counters)."""
    gen = checks.generator("cuda", seed)
    x = checks.randn((tokens, 2048), torch.bfloat16, "cuda", gen)
    norm = (1 + 0.1 * checks.randn((2048,), torch.float32, "cuda", gen)).bfloat16()
    w = (checks.randn((128256, 2048), torch.float32, "cuda", gen) * 2048 ** -0.5).bfloat16()
    normed = parts.reference("04", "rmsnorm").rmsnorm_native(x, norm, 1e-5)
    op = ops.get("add_rmsnorm_linear")
    host = torch.full((3, tokens), -1, dtype=torch.int64).pin_memory()
    for call, (slot, plant) in enumerate([(0, None), (2, "tie"), (1, "nan"), (5, None)]):
        if plant == "tie":
            w[1000] = w[120000] = (normed[0] * 4).bfloat16()
        elif plant == "nan":
            w[77777, 3] = float("nan")
        pick = torch.full((tokens,), -1, dtype=torch.int64, device="cuda")
        host_slot = torch.tensor([slot], device="cuda")
        before = host.clone()
        (y, _), ran = checks.kernels_of(lambda: op(
            x, None, norm, 1e-5, w, out_dtype=torch.float32, pick=pick, host=host,
            host_slot=host_slot))
        expected = torch.argmax(y, dim=-1)
        checks.assert_equal(pick, expected,
                            what=f"call {call + 1}: the pick against torch.argmax of the logits "
                                 "(ties: the lower index; a NaN beats every number)")
        if plant == "tie" and tokens == 1 and _hopper():  # one GEMV: equal rows, equal sums
            assert float(y[0, 1000]) == float(y[0, 120000]) and int(pick[0]) == 1000, (
                f"rows 1000 and 120000 tie at the top ({float(y[0, 1000])}, "
                f"{float(y[0, 120000])}): the pick must be 1000, got {int(pick[0])}")
        after = before.clone()
        if slot < host.shape[0]:
            after[slot] = expected.cpu()
        assert torch.equal(host, after), (
            f"call {call + 1}: the host buffer should be {after.tolist()} (the row at slot "
            f"{slot} only; nothing outside the buffer), got {host.tolist()}")
        if tokens == 1 and _hopper() and call > 0:  # the first call may zero the counters
            others = sorted({n for n in ran if "gemv_kernel_tma" not in n})
            assert any("gemv_kernel_tma" in n for n in ran) and not others, (
                f"one token on sm_90: the GEMV alone, picking in its epilogue; the GPU also "
                f"ran {others}")


@pytest.mark.gpu
def test_rmsnorm_linear_refuses_what_it_cannot_run(seed):
    """The binding names what is wrong: two tokens, a norm of the wrong length, a paired
    weight of the wrong height, a sum that is x itself, a misaligned norm weight, a pick of
    bf16 output, a host row without a pick or without its slot."""
    if not (_hopper() and parts.kernels().rmsnorm_linear_fits(2048, 64)):
        pytest.skip("the GEMV with the norm runs on sm_90 code only")
    gen = checks.generator("cuda", seed)
    x = checks.randn((2, 2048), torch.bfloat16, "cuda", gen)
    norm = torch.ones(2048, dtype=torch.bfloat16, device="cuda")
    w = checks.randn((64, 2048), torch.bfloat16, "cuda", gen)
    out = torch.empty((1, 64), dtype=torch.bfloat16, device="cuda")
    k = parts.kernels()
    with pytest.raises(RuntimeError, match="one token"):
        k.rmsnorm_linear(x, None, None, norm, 1e-5, w, out, 0)
    with pytest.raises(RuntimeError, match="norm must be"):
        k.rmsnorm_linear(x[:1], None, None, norm[:1024], 1e-5, w, out, 0)
    with pytest.raises(RuntimeError, match="paired weight"):
        k.rmsnorm_linear(x[:1], None, None, norm, 1e-5, w[:63], out, 31)
    with pytest.raises(RuntimeError, match="own buffer"):
        k.rmsnorm_linear(x[:1], x[1:], x[:1], norm, 1e-5, w, out, 0)
    with pytest.raises(RuntimeError, match="out must be|expected"):  # float32 out, paired
        k.rmsnorm_linear(x[:1], None, None, norm, 1e-5, w, out.float()[:, :32], 32)
    flat = torch.ones(2056, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        k.rmsnorm_linear(x[:1], None, None, flat[1:2049], 1e-5, w, out, 0)
    pick = torch.zeros(1, dtype=torch.int64, device="cuda")
    with pytest.raises(RuntimeError, match="float32 logits"):
        k.rmsnorm_linear(x[:1], None, None, norm, 1e-5, w, out, 0, pick)
    host = torch.zeros((2, 1), dtype=torch.int64).pin_memory()
    with pytest.raises(RuntimeError, match="pass pick too"):
        k.rmsnorm_linear(x[:1], None, None, norm, 1e-5, w, out.float(), 0, None, host,
                         torch.zeros(1, dtype=torch.int64, device="cuda"))
    with pytest.raises(RuntimeError, match="come together"):
        k.rmsnorm_linear(x[:1], None, None, norm, 1e-5, w, out.float(), 0, pick, host)
