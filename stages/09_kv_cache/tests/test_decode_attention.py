"""Stage 09: the decode-attention kernel, one new query token per sequence against its cache.

Every case compares the kernel with two references computed from the same bf16 inputs:
torch.nn.functional.scaled_dot_product_attention in float32, one sequence at a time on the
keys gathered from its slot (an oracle that shares no code with this course), and the native
twin decode_attention_native. The kernel reads bf16, computes in float32 and rounds once, so
the bf16 tolerance applies.

The caches are filled with NaN everywhere except the rows each sequence owns
(k_cache[seq_slots[b], :context_lens[b]]): a kernel that reads one key too many, or the wrong
slot, returns NaN. When the output is wrong, the test also tries the usual mistakes (KV head
by modulo, slot b instead of seq_slots[b], the newest key missing, no scale) and names the one
that matches.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course import parts
from course.testing import checks

# (n_heads, n_kv_heads, head_dim): Llama-3.2-1B (group 4), SmolLM2-135M (3), TinyLlama (8),
# plain multi-head (1), and the same groups at head_dim 128.
HEADS = [(32, 8, 64), (9, 3, 64), (32, 4, 64), (4, 4, 128), (12, 4, 128), (16, 2, 128)]
LENGTHS = [1, 7, 129, 1000, 4097]


def decode_op():
    return parts.load("09", "decode_attention")


def make_inputs(gen: torch.Generator, lens: list[int], n_heads: int, n_kv: int, d: int, *,
                extra_slots: int = 3, max_len: int | None = None, fused: bool = False,
                q_scale: float = 1.0):
    """q, the caches, seq_slots (a random permutation of more slots than sequences) and
    context_lens (int32). Only each sequence's own rows of the caches hold numbers; every
    other row is NaN.

    fused=True makes q a view of a [B, (n_heads + 2 n_kv) * d] tensor, the way a fused QKV
    projection produces it (row stride (n_heads + 2 n_kv) * d, not n_heads * d).
    """
    batch = len(lens)
    num_slots = batch + extra_slots
    max_len = max_len or max(max(lens), 1) + 5
    if fused:
        qkv = checks.randn((batch, (n_heads + 2 * n_kv) * d), torch.bfloat16, "cuda", gen,
                           scale=q_scale)
        q = qkv[:, :n_heads * d].view(batch, n_heads, d)
    else:
        q = checks.randn((batch, n_heads, d), torch.bfloat16, "cuda", gen, scale=q_scale)
    k_cache = checks.poison(torch.empty((num_slots, max_len, n_kv, d), dtype=torch.bfloat16,
                                        device="cuda"))
    v_cache = checks.poison(torch.empty_like(k_cache))
    perm = torch.randperm(num_slots, generator=gen, device="cuda")[:batch]
    slots = perm.to(torch.int32)
    for b, n in enumerate(lens):
        s = int(slots[b])
        k_cache[s, :n] = checks.randn((n, n_kv, d), torch.bfloat16, "cuda", gen)
        v_cache[s, :n] = checks.randn((n, n_kv, d), torch.bfloat16, "cuda", gen)
    context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, slots, context_lens


def sdpa_oracle(q, k_cache, v_cache, slots: list[int], lens: list[int], scale: float,
                kv_of_head: list[int] | None = None) -> torch.Tensor:
    """F.scaled_dot_product_attention per sequence in float32 -> [B, n_heads, d] float32."""
    n_heads, n_kv = q.shape[1], k_cache.shape[2]
    if kv_of_head is None:
        kv_of_head = [h // (n_heads // n_kv) for h in range(n_heads)]
    index = torch.tensor(kv_of_head, device=q.device)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, (slot, n) in enumerate(zip(slots, lens)):
        if n <= 0:
            continue
        ks = k_cache[slot, :n].index_select(1, index).float().transpose(0, 1)  # [H, n, d]
        vs = v_cache[slot, :n].index_select(1, index).float().transpose(0, 1)
        qs = q[b].float()[:, None, :]                                         # [H, 1, d]
        out[b] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)[:, 0, :]
    return out


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Within the bf16 tolerance everywhere; NaN only where expected is NaN too (a mistake
    that reads rows nobody owns, NaN in these tests, is still named by its output)."""
    atol, rtol = checks.TOLERANCES[torch.bfloat16]
    return bool(torch.isclose(got.float(), expected.float(), rtol=rtol, atol=atol,
                              equal_nan=True).all())


NAN_HINT = ("NaN in the output: the kernel read cache rows that are not this sequence's. "
            "Sequence b owns k_cache[seq_slots[b], j] for j < context_lens[b] only -- attending "
            "past context_lens reads garbage (NaN here), and 0 * NaN is NaN, so masked keys must "
            "not be loaded at all (use zeros). Also check exp2(-inf - -inf) for a state that "
            "has seen no key yet, and l = 0 in the final division")


def likely_cause(got, q, k_cache, v_cache, slots: list[int], lens: list[int],
                 scale: float) -> str:
    """Name the classic mistake whose output matches `got`, if one does."""
    n_heads, n_kv = q.shape[1], k_cache.shape[2]
    right = sdpa_oracle(q, k_cache, v_cache, slots, lens, scale)
    mistakes = [
        (dict(kv_of_head=[h % n_kv for h in range(n_heads)]),
         "the KV head must be h // (n_heads // n_kv_heads): neighbouring query heads share a "
         "KV head (this output matches h % n_kv_heads)"),
        (dict(slots=list(range(len(slots)))),
         "sequence b's keys are in cache slot seq_slots[b], not in slot b"),
        (dict(lens=[max(n - 1, 0) for n in lens]),
         "the newest key is missing: context_lens[b] counts the token just written, so attend "
         "to keys 0 .. context_lens[b] - 1 inclusive"),
        (dict(scale=1.0),
         "the scores must be multiplied by `scale` (1/sqrt(head_dim)) before the softmax"),
    ]
    for change, hint in mistakes:
        args = dict(slots=slots, lens=lens, scale=scale) | change
        wrong = sdpa_oracle(q, k_cache, v_cache, args.pop("slots"), args.pop("lens"),
                            args.pop("scale"), **args)
        if not _close(wrong, right) and _close(got, wrong):
            return hint
    if got.isnan().any():
        return NAN_HINT
    return ("compare with decode_attention_native in decode_attention.py: per head, scores = "
            "scale * q.k over the sequence's keys, softmax, then P @ V; in the online softmax, "
            "when the running max grows from m to m', l and o must both be multiplied by "
            "exp(m - m') before the new key is added")


def run_and_check(q, k_cache, v_cache, slots, lens, scale: float, what: str) -> torch.Tensor:
    """Launch into a poisoned buffer; compare with SDPA and the twin; inputs untouched."""
    inputs = dict(q=q, k_cache=k_cache, v_cache=v_cache, seq_slots=slots, context_lens=lens)
    before = {name: t.clone() for name, t in inputs.items()}
    out = checks.poison(torch.empty(q.shape, dtype=q.dtype, device="cuda"))
    got = decode_op().decode_attention(q, k_cache, v_cache, slots, lens, scale, out=out)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr(), "decode_attention(..., out=buf) must return buf"
    slot_list, len_list = slots.tolist(), lens.tolist()
    expected = sdpa_oracle(q, k_cache, v_cache, slot_list, len_list, scale)
    hint = "" if _close(got, expected) else likely_cause(got, q, k_cache, v_cache, slot_list,
                                                           len_list, scale)
    checks.assert_close(got, expected, what=f"{what} vs scaled_dot_product_attention",
                        dtype=torch.bfloat16, hint=hint)
    twin = parts.reference("09", "decode_attention").decode_attention_native(
        q, k_cache, v_cache, slots, lens, scale)
    checks.assert_close(got, twin, what=f"{what} vs decode_attention_native", hint=hint)
    for name, t in inputs.items():  # inputs are read-only
        checks.assert_unmodified(before[name], t, name)
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("n_heads,n_kv,d", HEADS, ids=lambda v: str(v))
def test_one_sequence(seed, n, n_heads, n_kv, d):
    """One sequence in a random slot of a cache with several: contexts of 1 to 4097 keys."""
    args = make_inputs(checks.generator("cuda", seed), [n], n_heads, n_kv, d)
    run_and_check(*args, d ** -0.5, f"context {n}, heads {n_heads}/{n_kv}, head_dim {d}")


@pytest.mark.gpu
@pytest.mark.parametrize("n_heads,n_kv,d", [(32, 8, 64), (9, 3, 64), (8, 1, 128)],
                         ids=lambda v: str(v))
def test_batch_of_mixed_lengths(seed, n_heads, n_kv, d):
    """64 sequences of different lengths in shuffled slots (a real decode batch)."""
    gen = checks.generator("cuda", seed)
    lens = [1, 7, 129, 1000, 2049] + torch.randint(1, 1500, (59,), generator=gen,
                                                   device="cuda").tolist()
    args = make_inputs(gen, lens, n_heads, n_kv, d, extra_slots=16)
    run_and_check(*args, d ** -0.5, f"batch of 64, heads {n_heads}/{n_kv}, head_dim {d}")


@pytest.mark.gpu
def test_padding_rows_give_zeros(seed):
    """context_lens 0 marks a padding row: its output is exactly 0, whatever its slot says."""
    q, k_cache, v_cache, slots, lens = make_inputs(checks.generator("cuda", seed),
                                                   [5, 0, 300, 0, 1], 8, 2, 64)
    slots[3] = -1  # a padding row's slot is never looked at
    got = run_and_check(q, k_cache, v_cache, slots, lens, 0.125, "padding rows")
    for b in (1, 3):
        checks.assert_equal(got[b], torch.zeros_like(got[b]), what=f"padding row {b}",
                            hint="a row with context_lens 0 must be written with zeros (not "
                                 "left unwritten, not 0/0 = NaN)")


@pytest.mark.gpu
@pytest.mark.parametrize("n_heads,n_kv,d", [(9, 3, 64), (32, 8, 128)], ids=lambda v: str(v))
def test_q_is_a_view_of_fused_qkv(seed, n_heads, n_kv, d):
    """q sliced out of one fused QKV projection: its rows are (H + 2 KV) * d elements apart."""
    args = make_inputs(checks.generator("cuda", seed), [7, 129, 1, 64], n_heads, n_kv, d,
                       fused=True)
    assert not args[0].is_contiguous()
    run_and_check(*args, d ** -0.5, "q as a view of a fused qkv tensor (use its row stride)")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [8, 32, 96, 120])
def test_other_head_dims(seed, d):
    """The generic path: any head_dim that is a multiple of 8, up to 128 (tiny test models)."""
    args = make_inputs(checks.generator("cuda", seed), [5, 130, 1, 1000], 6, 2, d)
    run_and_check(*args, d ** -0.5, f"head_dim {d}")


@pytest.mark.gpu
@pytest.mark.parametrize("n_heads,n_kv", [(10, 2), (12, 2), (14, 2), (16, 1), (24, 2)],
                         ids=lambda v: str(v))
def test_other_group_sizes(seed, n_heads, n_kv):
    """Groups of 5, 6, 7, 16 (multi-query) and 12 query heads per KV head."""
    args = make_inputs(checks.generator("cuda", seed), [3, 257, 1], n_heads, n_kv, 64)
    run_and_check(*args, 0.125, f"heads {n_heads}/{n_kv}")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [40, 3000])
def test_growing_scores(seed, n):
    """Scores that rise key after key: the running max grows at every step of the softmax."""
    gen = checks.generator("cuda", seed)
    q, k_cache, v_cache, slots, lens = make_inputs(gen, [n, n], 8, 2, 64)
    ramp = torch.linspace(0.0, 3.0, n, device="cuda")[:, None, None]
    for b in range(2):
        s = int(slots[b])
        # keys along q's direction, longer and longer: key j scores about 3 * j / n * |q|^2 / 8
        direction = q[b, :4].float().mean(0) if b == 0 else q[b, 4:].float().mean(0)
        k_cache[s, :n] = (ramp * direction).to(torch.bfloat16).expand(n, 2, 64)
    try:
        run_and_check(q, k_cache, v_cache, slots, lens, 0.125, f"rising scores, {n} keys")
    except AssertionError as e:
        raise AssertionError(f"{e}\n  when the scores keep rising: did you forget to rescale "
                             "the accumulator (and the sum l) when the max grows? o and l "
                             "must be multiplied by exp(m_old - m_new)") from None


@pytest.mark.gpu
@pytest.mark.parametrize("q_scale", [8.0, 40.0])
def test_large_scores_stay_finite(seed, q_scale):
    """Scores in the hundreds: exp(s) overflows float32 unless the running max is subtracted."""
    args = make_inputs(checks.generator("cuda", seed), [200, 1000, 1], 8, 2, 64,
                       q_scale=q_scale)
    got = run_and_check(*args, 64 ** -0.5, f"queries scaled by {q_scale}")
    checks.assert_finite(got, "decode attention output with large scores")


@pytest.mark.gpu
def test_scale_is_a_parameter(seed):
    """scale is the caller's (models may set it); 1/sqrt(head_dim) must not be hard-coded."""
    args = make_inputs(checks.generator("cuda", seed), [100, 37], 4, 4, 64)
    run_and_check(*args, 0.31, "scale 0.31")


@pytest.mark.gpu
def test_bad_slot_or_length_is_nan_not_a_crash(seed):
    """The kernel cannot raise: a slot outside the cache or a length past max_len reads
    nothing and gives NaN for that row only; the other rows are right."""
    q, k_cache, v_cache, slots, lens = make_inputs(checks.generator("cuda", seed),
                                                   [5, 9, 12, 3], 4, 2, 64)
    slots[1] = k_cache.shape[0]
    lens[2] = k_cache.shape[1] + 1
    out = checks.poison(torch.empty(q.shape, dtype=q.dtype, device="cuda"))
    decode_op().decode_attention(q, k_cache, v_cache, slots, lens, 0.125, out=out)
    torch.cuda.synchronize()
    assert out[1:3].isnan().all(), "rows with an invalid slot or length must be NaN"
    good = [0, 3]
    expected = sdpa_oracle(q[good], k_cache, v_cache, [int(slots[b]) for b in good],
                           [int(lens[b]) for b in good], 0.125)
    checks.assert_close(out[good], expected, what="the valid rows beside invalid ones",
                        dtype=torch.bfloat16)


@pytest.mark.gpu
def test_captured_in_a_cuda_graph(seed):
    """A decode step runs inside a CUDA graph (stage 10): the op must not read seq_slots or
    context_lens on the host, and a replay must see the values written into them since."""
    gen = checks.generator("cuda", seed)
    q, k_cache, v_cache, slots, lens = make_inputs(gen, [30, 300, 3, 1], 8, 2, 64,
                                                   extra_slots=4, max_len=400)
    op = decode_op().decode_attention
    out = torch.empty(q.shape, dtype=q.dtype, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture (builds, loads the library)
        op(q, k_cache, v_cache, slots, lens, 0.125, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op(q, k_cache, v_cache, slots, lens, 0.125, out=out)
    # The next step: every sequence one token longer, new queries, new slots for two of them.
    n_slots = k_cache.shape[0]
    new_slots = torch.tensor([int(slots[0]), int(slots[2]), int(slots[1]), int(slots[3])],
                             dtype=torch.int32, device="cuda")
    new_lens = torch.tensor([31, 4, 301, 0], dtype=torch.int32, device="cuda")
    for b, (s, n) in enumerate(zip(new_slots.tolist(), new_lens.tolist())):
        if n:
            k_cache[s, :n] = checks.randn((n, 2, 64), torch.bfloat16, "cuda", gen)
            v_cache[s, :n] = checks.randn((n, 2, 64), torch.bfloat16, "cuda", gen)
    assert max(new_slots.tolist()) < n_slots
    q.copy_(checks.randn(q.shape, torch.bfloat16, "cuda", gen))
    slots.copy_(new_slots)
    lens.copy_(new_lens)
    checks.poison(out)
    graph.replay()
    torch.cuda.synchronize()
    expected = sdpa_oracle(q, k_cache, v_cache, new_slots.tolist(), new_lens.tolist(), 0.125)
    checks.assert_close(out, expected, what="graph replay with new slots and lengths",
                        dtype=torch.bfloat16,
                        hint="" if not out.isnan().any() else NAN_HINT)


@pytest.mark.gpu
def test_rejects_bad_input(seed):
    q, k_cache, v_cache, slots, lens = make_inputs(checks.generator("cuda", seed), [3, 5], 4, 2,
                                                   64)
    run_and_check(q, k_cache, v_cache, slots, lens, 0.125, "a valid call")
    kernel = parts.kernels().decode_attention
    out = torch.empty(q.shape, dtype=q.dtype, device="cuda")
    q136 = torch.zeros((2, 2, 136), dtype=q.dtype, device="cuda")
    c136 = torch.zeros((3, 8, 2, 136), dtype=q.dtype, device="cuda")
    bad = {
        "head_dim": (q136, c136, c136, slots, lens, 0.1, q136.clone()),
        "multiple of n_kv_heads": (q[:, :3].contiguous(), k_cache, v_cache, slots, lens, 0.1,
                                   out[:, :3].contiguous()),
        "bfloat16": (q.float(), k_cache, v_cache, slots, lens, 0.1, out),
        "seq_slots": (q, k_cache, v_cache, slots.long(), lens, 0.1, out),
        "context_lens": (q, k_cache, v_cache, slots, lens[:1], 0.1, out),
        "k_cache must be contiguous": (q, k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                                       slots, lens, 0.1, out),
        "one shape": (q, k_cache, v_cache[:, :4].contiguous(), slots, lens, 0.1, out),
        "out must be": (q, k_cache, v_cache, slots, lens, 0.1, out[:1]),
    }
    for needle, args in bad.items():
        with pytest.raises(RuntimeError) as info:
            kernel(*args)
        assert needle in str(info.value), (
            f"bad input should be refused with a message about {needle!r}, got: {info.value}")
