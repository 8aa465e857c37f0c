"""Stage 05: the rotary-embedding kernel (rope.cu), through apply_rope_ in rope.py.

Oracle: transformers' LlamaRotaryEmbedding (cos, sin for the given position ids) and
apply_rotary_pos_emb, run on the GPU in the same dtype; and the plain-torch twin. The
cos/sin table comes from the reference rope_tables.py, so this test grades the kernel alone.
Head layouts: (9, 3) like SmolLM2, (32, 8) like Llama-3.2-1B, (4, 4) plain multi-head;
head_dim 64 and 128; token counts 1, 7, 127, 129, 1031; positions shuffled and spread over
the whole table (prefill and decode are the same lookup). q and k are also given as views
into one fused QKV buffer, as the engine passes them.
"""
from __future__ import annotations

import pytest
import torch

from course import parts
from course.testing import checks

THETA = 500000.0
MAX_POSITIONS = 8192
HEADS = [(9, 3), (32, 8), (4, 4)]
TOKENS = [1, 7, 127, 129, 1031]
DTYPES = [torch.bfloat16, torch.float32]
DTYPE_IDS = ["bf16", "fp32"]
# bf16: a correct kernel that rounds once (float32 math throughout) differs from HF's three
# bf16 roundings by up to ~0.03 where the two products nearly cancel; bugs give errors ~1.
TOLERANCE = {torch.bfloat16: dict(atol=3e-2), torch.float32: {}}


def op():
    return parts.load("05", "rope")


def llama3_scaling():
    config = parts.reference("01", "config")
    return config.RopeScaling(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                              high_freq_factor=4.0, original_max_position_embeddings=8192)


def cos_sin(head_dim: int) -> torch.Tensor:
    return parts.reference("05", "rope_tables").cos_sin_cache(
        head_dim, THETA, llama3_scaling(), MAX_POSITIONS, "cuda")


def hf_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
    """HF's rotation of q [T, nh, d] and k [T, nkv, d] at `positions` (new tensors)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    d = q.shape[2]
    config = LlamaConfig(hidden_size=d * q.shape[1], num_attention_heads=q.shape[1],
                         num_key_value_heads=k.shape[1], head_dim=d, rope_theta=THETA,
                         max_position_embeddings=131072,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192})
    rotary = LlamaRotaryEmbedding(config).to(q.device)
    qh, kh = q.transpose(0, 1)[None], k.transpose(0, 1)[None]  # [1, heads, T, d]
    with torch.no_grad():
        cos, sin = rotary(qh, positions[None])
        q_out, k_out = apply_rotary_pos_emb(qh, kh, cos, sin)
    return q_out[0].transpose(0, 1), k_out[0].transpose(0, 1)


def random_positions(tokens: int, gen: torch.Generator) -> torch.Tensor:
    positions = torch.randint(0, MAX_POSITIONS, (tokens,), generator=gen, device="cuda")
    positions[0] = MAX_POSITIONS - 1  # the table's last row
    if tokens > 1:
        positions[-1] = 0
    return positions


def run(q, k, positions, table):
    positions_before, table_before = positions.clone(), table.clone()
    op().apply_rope_(q, k, positions, table)
    torch.cuda.synchronize()
    checks.assert_unmodified(positions_before, positions, "positions")
    checks.assert_unmodified(table_before, table, "cos_sin")


def check(q, k, q_in, k_in, positions, table, what):
    checks.assert_finite(q, f"{what}: q")
    checks.assert_finite(k, f"{what}: k")
    q_hf, k_hf = hf_rope(q_in, k_in, positions)
    tol = TOLERANCE[q.dtype]
    hint = ("pair i of a head is (x[i], x[i + d/2]) (rotate-half), rotated by the angle of "
            "positions[t] (not t): x[i]*cos - x[i+d/2]*sin, x[i+d/2]*cos + x[i]*sin, "
            "with cos, sin = cos_sin[pos, i], cos_sin[pos, d/2 + i]")
    checks.assert_close(q, q_hf, what=f"{what}: q vs HF", hint=hint, **tol)
    checks.assert_close(k, k_hf, what=f"{what}: k vs HF", hint=hint, **tol)
    q_twin, k_twin = q_in.clone(), k_in.clone()
    op().apply_rope_native(q_twin, k_twin, positions, table)
    checks.assert_close(q, q_twin, what=f"{what}: q vs the twin", **tol)
    checks.assert_close(k, k_twin, what=f"{what}: k vs the twin", **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}x{h[1]}")
@pytest.mark.parametrize("tokens", TOKENS)
def test_rope_matches_hf(tokens, heads, head_dim, dtype, seed):
    gen = checks.generator("cuda", seed)
    nh, nkv = heads
    q_in = checks.randn((tokens, nh, head_dim), dtype, "cuda", gen)
    k_in = checks.randn((tokens, nkv, head_dim), dtype, "cuda", gen)
    positions = random_positions(tokens, gen)
    table = cos_sin(head_dim)
    q, k = q_in.clone(), k_in.clone()
    run(q, k, positions, table)
    check(q, k, q_in, k_in, positions, table, f"rope T={tokens} heads={heads} d={head_dim}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads", [(9, 3), (32, 8)], ids=lambda h: f"{h[0]}x{h[1]}")
def test_rope_on_fused_qkv_views(heads, dtype, seed):
    """q and k are strided views of one [T, (nh + 2 nkv) * d] buffer; v must stay untouched."""
    gen = checks.generator("cuda", seed)
    nh, nkv = heads
    tokens, d = 129, 64
    qkv = checks.randn((tokens, (nh + 2 * nkv) * d), dtype, "cuda", gen)
    qkv_before = qkv.clone()
    q = qkv[:, :nh * d].view(tokens, nh, d)
    k = qkv[:, nh * d:(nh + nkv) * d].view(tokens, nkv, d)
    positions = random_positions(tokens, gen)
    table = cos_sin(d)
    run(q, k, positions, table)
    q_in = qkv_before[:, :nh * d].reshape(tokens, nh, d)
    k_in = qkv_before[:, nh * d:(nh + nkv) * d].reshape(tokens, nkv, d)
    check(q, k, q_in, k_in, positions, table, f"rope on QKV views heads={heads}")
    checks.assert_equal(qkv[:, (nh + nkv) * d:], qkv_before[:, (nh + nkv) * d:],
                        what="the v part of the fused QKV buffer",
                        hint="rows of q and k are stride(0) elements apart, not heads * d")


@pytest.mark.gpu
def test_rope_unaligned_head_dim(seed):
    """head_dim 36: halves of 18 bf16 are not whole 16-byte vectors; the kernel must cope."""
    gen = checks.generator("cuda", seed)
    tokens, nh, nkv, d = 127, 4, 2, 36
    q_in = checks.randn((tokens, nh, d), torch.bfloat16, "cuda", gen)
    k_in = checks.randn((tokens, nkv, d), torch.bfloat16, "cuda", gen)
    positions = random_positions(tokens, gen)
    table = parts.reference("05", "rope_tables").cos_sin_cache(d, THETA, llama3_scaling(),
                                                               MAX_POSITIONS, "cuda")
    q, k = q_in.clone(), k_in.clone()
    run(q, k, positions, table)
    check(q, k, q_in, k_in, positions, table, "rope with head_dim 36")


@pytest.mark.gpu
def test_bf16_rounds_like_hf(seed):
    """HF casts cos and sin to bf16 and rounds each product and the sum to bf16."""
    gen = checks.generator("cuda", seed)
    tokens, nh, nkv, d = 1031, 32, 8, 64
    q_in = checks.randn((tokens, nh, d), torch.bfloat16, "cuda", gen)
    k_in = checks.randn((tokens, nkv, d), torch.bfloat16, "cuda", gen)
    positions = random_positions(tokens, gen)
    q, k = q_in.clone(), k_in.clone()
    run(q, k, positions, cos_sin(d))
    q_hf, k_hf = hf_rope(q_in, k_in, positions)
    frac = torch.cat([(q != q_hf).flatten(), (k != k_hf).flatten()]).float().mean().item()
    assert frac < 1e-3, (
        f"{frac:.2%} of the bf16 elements differ from HF's bits (at most 0.1% may). HF computes "
        "q * cos + rotate_half(q) * sin in bf16: cos and sin rounded to bf16, each product "
        "rounded to bf16, then the sum rounded; use __fmul_rn so the compiler does not fuse a "
        "product into the sum (an fma rounds once)")


@pytest.mark.gpu
@pytest.mark.parametrize("bad", [MAX_POSITIONS, -1])
def test_position_outside_the_table_raises(bad, seed):
    gen = checks.generator("cuda", seed)
    q = checks.randn((7, 4, 64), torch.bfloat16, "cuda", gen)
    k = checks.randn((7, 4, 64), torch.bfloat16, "cuda", gen)
    positions = random_positions(7, gen)
    positions[3] = bad
    with pytest.raises(IndexError) as info:
        op().apply_rope_(q, k, positions, cos_sin(64))
    message = str(info.value)
    assert str(bad) in message and str(MAX_POSITIONS) in message, (
        f"the error must name the position ({bad}) and the table size ({MAX_POSITIONS}); "
        f"got: {message}")
    assert q[3].isnan().all() and k[3].isnan().all(), (
        "a token whose position is outside the table must get NaN q and k (nothing read from "
        "outside the table)")
