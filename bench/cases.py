"""The benchmark cases: each op of stages 03-14 at Llama-3.2-1B sizes beside its torch twin."""
from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from bench.timing import DEVICE

# Llama-3.2-1B
HIDDEN = 2048
INTER = 8192
N_HEADS = 32
N_KV_HEADS = 8
HEAD_DIM = 64
VOCAB = 128256
EPS = 1e-5
ROPE_POSITIONS = 8192
TOKENS = (1, 64, 4096)
ATTENTION_SHAPES = ((1, 4096), (8, 512))     # (sequences, tokens each)
DECODE_SHAPES = ((64, 1024), (1, 8192))      # (sequences, context length of each)
# paged decode: (sequences, context); batch 1 at 512 and 2048 keys is the chat case (split-K
# in small partitions: the latency of a few blocks, not the bandwidth, sets its time)
PAGED_SHAPES = ((64, 1024), (256, 512), (1, 512), (1, 2048), (1, 32768))
PAGED_BLOCK = 16
PAGED_LAYERS = 16     # Llama-3.2-1B's: a decode step reads each layer's cache in turn

Outputs = tuple[torch.Tensor, ...]

@dataclass
class Case:
    """One benchmark row: an op at one size, ours beside torch, on the same input sets."""
    kernel: str
    tokens: str
    bytes: int                                     # that must move: inputs once, outputs once
    make_set: Callable[[torch.Generator], dict]    # one fresh set of inputs
    torch_fn: Callable[[dict], Any]
    ours_fn: Callable[[dict], Any] | None = None
    reference: Callable[[dict], Any] | None = None  # oracle for the check (default torch_fn)
    compare: str = "close"                          # "close", "equal" or "argmax"
    flops: int = 0
    outs: list[torch.Tensor] = field(default_factory=list)   # ours' out= buffers (poisoned)
    skip: str | None = None                          # why ours does not run
    via: str = ""                                    # what "ours" calls


def _gen_randn(shape, g: torch.Generator, scale: float = 1.0,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    from course.testing import checks
    return checks.randn(shape, dtype, device=DEVICE, gen=g, scale=scale)


def _accepts(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


class Ops:
    """The ops under test, loaded through the parts resolver; a missing one is a reason."""

    def __init__(self):
        self.kernels = None
        self.build_error: str | None = None
        try:
            from course import parts
            self.kernels = parts.kernels()
        except Exception as e:  # a failed build becomes every row's reason
            self.build_error = f"kernels did not build: {str(e).splitlines()[0][:200]}"

    def get(self, name: str) -> tuple[Callable | None, str | None]:
        """Op `name` from the stage that provides it (course/ops.py), or why not."""
        if self.build_error:
            return None, f"error: {self.build_error}"
        from course import ops, parts
        try:
            stage, module = ops.provider(name)
        except KeyError as e:
            return None, f"skipped: {e}"
        try:
            mod = parts.load(stage, module)
        except FileNotFoundError:
            return None, f"skipped: op not available ({stage}/{module}.py missing)"
        except Exception as e:  # a broken module is its rows' error
            return None, f"error: importing {stage}/{module}.py: {type(e).__name__}: {e}"
        fn = getattr(mod, name, None)
        if fn is None:
            return None, f"skipped: op not available ({stage}/{module}.py has no {name})"
        return fn, None

    @staticmethod
    def via(name: str) -> str:
        """Where op `name` comes from, as NN/module.py name."""
        from course import ops
        stage, module = ops.provider(name)
        return f"{stage}/{module}.py {name}"

    def raw(self, name: str) -> Callable | None:
        """torch.ops.tinyvllm.<name>, or None when the library has no such op."""
        if self.kernels is None:
            return None
        try:
            return getattr(self.kernels, name)
        except (AttributeError, RuntimeError):
            return None


def embedding_cases(ops: Ops) -> Iterator[Case]:
    fn, why = ops.get("embedding")
    raw = ops.raw("embedding")
    for T in TOKENS:
        def make_set(g, T=T):
            ids = torch.randint(0, VOCAB, (T,), generator=g, device=DEVICE, dtype=torch.int64)
            return {"ids": ids, "table": _gen_randn((VOCAB, HIDDEN), g)}
        out = torch.empty(T, HIDDEN, dtype=torch.bfloat16, device=DEVICE)
        flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        if raw is not None:
            def ours(s, out=out, flag=flag):
                raw(s["ids"], s["table"], out, flag)
                return out
            via = "torch.ops.tinyvllm.embedding (preallocated error flag)"
        elif fn is not None:
            kw = {"check": False} if _accepts(fn, "check") else {}
            ours = (lambda s, out=out, kw=kw: fn(s["ids"], s["table"], out=out, **kw))
            via = ops.via("embedding")
        else:
            ours, via = None, ""
        yield Case("embedding", str(T), T * 8 + 2 * T * HIDDEN * 2, make_set,
                   torch_fn=lambda s: F.embedding(s["ids"], s["table"]),
                   ours_fn=ours, compare="equal", outs=[out], via=via,
                   skip=None if ours else why)


def _hf_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' LlamaRMSNorm, verbatim in substance
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def rmsnorm_cases(ops: Ops) -> Iterator[Case]:
    fn, why = ops.get("rmsnorm")
    for T in TOKENS:
        def make_set(g, T=T):
            return {"x": _gen_randn((T, HIDDEN), g), "w": _gen_randn((HIDDEN,), g)}
        out = torch.empty(T, HIDDEN, dtype=torch.bfloat16, device=DEVICE)
        ours = None
        if fn is not None:
            if _accepts(fn, "out"):
                ours = (lambda s, out=out: fn(s["x"], s["w"], EPS, out=out))
            else:
                ours = (lambda s: fn(s["x"], s["w"], EPS))
        yield Case("rmsnorm", str(T), 2 * T * HIDDEN * 2 + HIDDEN * 2, make_set,
                   torch_fn=lambda s: _hf_rmsnorm(s["x"], s["w"], EPS),
                   ours_fn=ours, outs=[out] if ours and _accepts(fn, "out") else [],
                   via=ops.via("rmsnorm"), skip=None if ours else why)


def fused_add_rmsnorm_cases(ops: Ops) -> Iterator[Case]:
    fn, why = ops.get("fused_add_rmsnorm")
    for T in TOKENS:
        def make_set(g, T=T):
            return {"x": _gen_randn((T, HIDDEN), g), "r": _gen_randn((T, HIDDEN), g),
                    "w": _gen_randn((HIDDEN,), g)}

        def torch_fn(s):
            # HF's decoder layer: residual = residual + h; h = norm(residual) (new tensors;
            # the same bytes as ours, which writes both results over its inputs)
            r = s["x"] + s["r"]
            return _hf_rmsnorm(r, s["w"], EPS), r

        ours = (lambda s: fn(s["x"], s["r"], s["w"], EPS)) if fn else None
        # reads x, residual, weight; writes the normalized x and the new residual
        yield Case("fused_add_rmsnorm", str(T), 4 * T * HIDDEN * 2 + HIDDEN * 2, make_set,
                   torch_fn=torch_fn, ours_fn=ours,
                   via=ops.via("fused_add_rmsnorm") + " (in place)", skip=None if ours else why)


def _hf_rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
              cos_sin: torch.Tensor) -> Outputs:
    # transformers' apply_rotary_pos_emb: q * cos + rotate_half(q) * sin, cos/sin in q's dtype
    half = q.shape[-1] // 2
    cs = cos_sin[positions].to(q.dtype)
    cos = torch.cat((cs[:, :half], cs[:, :half]), dim=-1)[:, None, :]
    sin = torch.cat((cs[:, half:], cs[:, half:]), dim=-1)[:, None, :]
    for x in (q, k):
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_(x * cos + rotated * sin)
    return q, k


def _cos_sin_table(ops: Ops) -> tuple[torch.Tensor, str | None]:
    """Stage 05's cos/sin table; if it cannot be built, a plain torch one (cos | sin of
    pos * theta^(-2i/d)) so the torch column still runs, and why ours does not."""
    tables, why = ops.get("cos_sin_cache")
    if tables is not None:
        try:
            return tables(HEAD_DIM, 500000.0, None, ROPE_POSITIONS, torch.device(DEVICE)), None
        except Exception as e:
            why = f"error: cos_sin_cache: {type(e).__name__}: {e}"
    inv = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    ang = torch.arange(ROPE_POSITIONS, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat((ang.cos(), ang.sin()), dim=-1).to(DEVICE), why


def _rope_set(g: torch.Generator, T: int) -> dict:
    """q [T, 32, 64] and k [T, 8, 64] bf16 at T consecutive positions of the table."""
    start = int(torch.randint(0, ROPE_POSITIONS - T + 1, (1,), generator=g, device=DEVICE))
    return {"q": _gen_randn((T, N_HEADS, HEAD_DIM), g),
            "k": _gen_randn((T, N_KV_HEADS, HEAD_DIM), g),
            "pos": torch.arange(start, start + T, dtype=torch.int64, device=DEVICE)}


def rope_cases(ops: Ops) -> Iterator[Case]:
    fn, why = ops.get("apply_rope_")
    raw = ops.raw("apply_rope")
    cos_sin, why_tables = _cos_sin_table(ops)
    why = why or why_tables
    for T in TOKENS:
        def make_set(g, T=T):
            return _rope_set(g, T)
        flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        if why is None and raw is not None:
            def ours(s, flag=flag):
                raw(s["q"], s["k"], s["pos"], cos_sin, flag)
                return s["q"], s["k"]
            via = "torch.ops.tinyvllm.apply_rope (preallocated error flag, in place)"
        elif why is None and fn is not None:
            kw = {"check": False} if _accepts(fn, "check") else {}

            def ours(s, kw=kw):
                fn(s["q"], s["k"], s["pos"], cos_sin, **kw)
                return s["q"], s["k"]
            via = ops.via("apply_rope_") + " (in place)"
        else:
            ours, via = None, ""
        qk = T * (N_HEADS + N_KV_HEADS) * HEAD_DIM * 2
        yield Case("rope", str(T), 2 * qk + T * 8 + T * HEAD_DIM * 4, make_set,
                   torch_fn=lambda s: _hf_rope_(s["q"], s["k"], s["pos"], cos_sin),
                   ours_fn=ours, via=via, skip=None if ours else why)


def rope_cache_write_cases(ops: Ops) -> Iterator[Case]:
    """Stage 13's rope_cache_write (q and k rotated in place, k and v stored at their slots of
    a cache of 2T rows) beside transformers' rope then torch's index_copy_."""
    fn, why = ops.get("rope_cache_write")
    cos_sin, why_tables = _cos_sin_table(ops)
    why = why or why_tables
    for T in TOKENS:
        def make_set(g, T=T):
            s = _rope_set(g, T)
            s["v"] = _gen_randn((T, N_KV_HEADS, HEAD_DIM), g)
            s["slots"] = torch.randperm(2 * T, generator=g, device=DEVICE)[:T]
            s["kc"] = _gen_randn((2 * T, 1, N_KV_HEADS, HEAD_DIM), g)
            s["vc"] = _gen_randn((2 * T, 1, N_KV_HEADS, HEAD_DIM), g)
            return s

        def torch_fn(s):
            _hf_rope_(s["q"], s["k"], s["pos"], cos_sin)
            for src, cache in ((s["k"], s["kc"]), (s["v"], s["vc"])):
                cache.view(-1, N_KV_HEADS, HEAD_DIM).index_copy_(0, s["slots"], src)
            return s["q"], s["k"], s["kc"], s["vc"]

        ours = None
        if fn is not None and why is None:
            def ours(s):
                fn(s["q"], s["k"], s["v"], s["pos"], cos_sin, s["kc"], s["vc"], s["slots"])
                return s["q"], s["k"], s["kc"], s["vc"]
        kv = T * N_KV_HEADS * HEAD_DIM * 2
        qk = T * N_HEADS * HEAD_DIM * 2 + kv
        # q and k read and written, v read, k and v stored, positions and slots, cos/sin rows
        yield Case("rope_cache_write", str(T), 2 * qk + 3 * kv + T * 16 + T * HEAD_DIM * 4,
                   make_set, torch_fn=torch_fn, ours_fn=ours,
                   via=ops.via("rope_cache_write") if ours else "", skip=None if ours else why)


def silu_mul_cases(ops: Ops) -> Iterator[Case]:
    fn, why = ops.get("silu_mul")
    for T in TOKENS:
        def make_set(g, T=T):
            return {"x": _gen_randn((T, 2 * INTER), g)}
        out = torch.empty(T, INTER, dtype=torch.bfloat16, device=DEVICE)
        ours = None
        if fn is not None:
            ours = ((lambda s, out=out: fn(s["x"], out=out)) if _accepts(fn, "out")
                    else (lambda s: fn(s["x"])))
        yield Case("silu_mul", str(T), T * 2 * INTER * 2 + T * INTER * 2, make_set,
                   torch_fn=lambda s: F.silu(s["x"][:, :INTER]) * s["x"][:, INTER:],
                   ours_fn=ours, outs=[out] if ours and _accepts(fn, "out") else [],
                   via=ops.via("silu_mul"), skip=None if ours else why)


def argmax_cases(ops: Ops) -> Iterator[Case]:
    fn, why = ops.get("argmax")
    for T in TOKENS:
        def make_set(g, T=T):
            return {"logits": _gen_randn((T, VOCAB), g, scale=3.0)}
        out = torch.empty(T, dtype=torch.int64, device=DEVICE)
        ours = None
        if fn is not None:
            ours = ((lambda s, out=out: fn(s["logits"], out=out)) if _accepts(fn, "out")
                    else (lambda s: fn(s["logits"])))
        yield Case("argmax", str(T), T * VOCAB * 2 + T * 8, make_set,
                   torch_fn=lambda s: torch.argmax(s["logits"], dim=-1),
                   ours_fn=ours, compare="argmax",
                   outs=[out] if ours and _accepts(fn, "out") else [],
                   via=ops.via("argmax"), skip=None if ours else why)


def linear_cases(ops: Ops) -> Iterator[Case]:
    """The MLP's up projection and the lm_head at 1 and 4096 tokens, and every other decode
    projection at 1 token (where stage 06's GEMV runs and torch runs cuBLAS)."""
    fn, why = ops.get("linear")
    qkv = (N_HEADS + 2 * N_KV_HEADS) * HEAD_DIM
    shapes = [(f"linear {HIDDEN}->{INTER}", HIDDEN, INTER, TOKENS),
              (f"lm_head {HIDDEN}->{VOCAB}", HIDDEN, VOCAB, TOKENS),
              (f"qkv {HIDDEN}->{qkv}", HIDDEN, qkv, (1,)),
              (f"o_proj {HIDDEN}->{HIDDEN}", HIDDEN, HIDDEN, (1,)),
              (f"gate_up {HIDDEN}->{2 * INTER}", HIDDEN, 2 * INTER, (1,)),
              (f"down {INTER}->{HIDDEN}", INTER, HIDDEN, (1,))]
    for name, n_in, n_out, tokens in shapes:
        for T in tokens:
            def make_set(g, T=T, n_in=n_in, n_out=n_out):
                # weights scaled by 1/sqrt(in) so outputs are O(1), as in a trained model
                return {"x": _gen_randn((T, n_in), g),
                        "w": _gen_randn((n_out, n_in), g, scale=n_in ** -0.5)}
            out = torch.empty(T, n_out, dtype=torch.bfloat16, device=DEVICE)
            ours = None
            if fn is not None:
                ours = ((lambda s, out=out: fn(s["x"], s["w"], out=out)) if _accepts(fn, "out")
                        else (lambda s: fn(s["x"], s["w"])))
            yield Case(name, str(T), (T * n_in + n_out * n_in + T * n_out) * 2, make_set,
                       torch_fn=lambda s: F.linear(s["x"], s["w"]),
                       ours_fn=ours, flops=2 * T * n_in * n_out,
                       outs=[out] if ours and _accepts(fn, "out") else [],
                       via=ops.via("linear"), skip=None if ours else why)


def _sdpa_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_seq: int,
                 scale: float, upcast: bool = False) -> torch.Tensor:
    """Causal GQA attention of n_seq equal-length sequences packed as [T, heads, d]."""
    T = q.shape[0]
    S = T // n_seq
    qb, kb, vb = (t.view(n_seq, S, t.shape[1], HEAD_DIM).transpose(1, 2) for t in (q, k, v))
    if upcast:  # the oracle: float32, K/V expanded to every query head (no GQA path)
        group = N_HEADS // N_KV_HEADS
        qb = qb.float()
        kb = kb.float().repeat_interleave(group, dim=1)
        vb = vb.float().repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
        o = o.to(q.dtype)
    else:
        o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale,
                                           enable_gqa=True)
    return o.transpose(1, 2).reshape(T, N_HEADS, HEAD_DIM)


def _prefill_case(kernel: str, n_seq: int, S: int, fn: Callable | None, why: str | None,
                  via: str, torch_fn: Callable[..., torch.Tensor],
                  max_seqlen: bool = False) -> Case:
    """Causal prefill attention of n_seq sequences of S tokens (Llama-3.2-1B heads), ours
    (fn, a prefill_attention) beside torch_fn(q, k, v, n_seq, scale); the float32 SDPA oracle.
    max_seqlen: pass max_seqlen_q as the engine does (no host reads of the offsets)."""
    scale = HEAD_DIM ** -0.5
    T = n_seq * S

    def make_set(g):
        return {"q": _gen_randn((T, N_HEADS, HEAD_DIM), g),
                "k": _gen_randn((T, N_KV_HEADS, HEAD_DIM), g),
                "v": _gen_randn((T, N_KV_HEADS, HEAD_DIM), g)}
    cu = torch.arange(0, T + 1, S, dtype=torch.int32, device=DEVICE)
    out = torch.empty(T, N_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
    ours = None
    with_out = fn is not None and _accepts(fn, "out")
    if fn is not None:
        kw = {"max_seqlen_q": S} if max_seqlen else {}
        if with_out:
            ours = (lambda s: fn(s["q"], s["k"], s["v"], cu, scale, out=out, **kw))
        else:
            ours = (lambda s: fn(s["q"], s["k"], s["v"], cu, scale, **kw))
    # causal: query i of a sequence meets i + 1 keys; QK^T and PV are 2 * d flops each
    flops = n_seq * 4 * HEAD_DIM * N_HEADS * S * (S + 1) // 2
    nbytes = (T * N_HEADS * HEAD_DIM * 2) * 2 + (T * N_KV_HEADS * HEAD_DIM * 2) * 2
    return Case(kernel, f"{n_seq}x{S}" if n_seq > 1 else str(S), nbytes, make_set,
                torch_fn=lambda s: torch_fn(s["q"], s["k"], s["v"], n_seq, scale),
                reference=lambda s: _sdpa_packed(s["q"], s["k"], s["v"], n_seq, scale,
                                                 upcast=True),
                ours_fn=ours, flops=flops, outs=[out] if with_out else [], via=via,
                skip=None if ours else why)


def attention_cases(ops: Ops) -> Iterator[Case]:
    """The engine's prefill attention (the op table's: stage 12, or stage 07 where stage 12 is
    not built) beside torch's default SDPA backend (cuDNN on Hopper), called as the engine
    calls it: with max_seqlen_q, so that nothing reads the offsets back to the host."""
    fn, why = ops.get("prefill_attention")
    via = ops.via("prefill_attention")
    for n_seq, S in ATTENTION_SHAPES:
        yield _prefill_case("prefill_attention", n_seq, S, fn, why, via, _sdpa_packed,
                            max_seqlen=True)


def _sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_seq: int,
                scale: float) -> torch.Tensor:
    """_sdpa_packed pinned to torch's FlashAttention-2 backend (stage 12's yardstick)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return _sdpa_packed(q, k, v, n_seq, scale)


def _stage_op(ops: Ops, stage: str, module: str, name: str) -> tuple[Callable | None, str | None]:
    """Op `name` of one given stage's module (not the op table's choice), or why not."""
    if ops.build_error:
        return None, f"error: {ops.build_error}"
    from course import manifest, ops as op_table, parts
    found = manifest.find(stage)
    if not found.ready:
        return None, f"skipped: stage {stage} is not available yet"
    why = op_table.not_built_here(found)
    if why:
        return None, f"skipped: {why}"
    try:
        return getattr(parts.load(stage, module), name), None
    except Exception as e:  # a broken module is its rows' error
        return None, f"error: importing {stage}/{module}.py: {type(e).__name__}: {e}"


def flash_attention_cases(ops: Ops) -> Iterator[Case]:
    """Stage 12's tiled prefill and stage 07's kernel, each beside torch SDPA's flash backend.

    Same shapes, inputs and FLOP count as `attention`; 'torch' is SDPBackend.FLASH_ATTENTION
    in both rows, so ours/torch reads as a fraction of FlashAttention-2 (the goal:
    stage 12 at 50% or more of it, and 10x stage 07 or more).
    """
    for stage, module in (("12", "flash_attention"), ("07", "attention")):
        fn, why = _stage_op(ops, stage, module, "prefill_attention")
        via = f"{stage}/{module}.py prefill_attention; torch: SDPA flash backend"
        for n_seq, S in ATTENTION_SHAPES:
            yield _prefill_case(f"prefill_attention ({stage})", n_seq, S, fn, why, via,
                                _sdpa_flash, max_seqlen=True)


def _sdpa_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                 upcast: bool = False) -> torch.Tensor:
    """One query token per sequence over the whole cache, slot b = sequence b (all full).

    k_cache[b] is [S, KV, d]; transposed it is [KV, S, d], a view: SDPA reads the cache in
    place, as our kernel does. upcast: the float32 oracle with K/V expanded to every head.
    """
    qb = q[:, :, None, :]                                           # [B, H, 1, d]
    kb, vb = k_cache.transpose(1, 2), v_cache.transpose(1, 2)       # [B, KV, S, d]
    if upcast:
        group = N_HEADS // N_KV_HEADS
        kb = kb.float().repeat_interleave(group, dim=1)
        vb = vb.float().repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(qb.float(), kb, vb, scale=scale).to(q.dtype)
    else:
        o = F.scaled_dot_product_attention(qb, kb, vb, scale=scale, enable_gqa=True)
    return o[:, :, 0, :]


def decode_attention_cases(ops: Ops) -> Iterator[Case]:
    """Stage 09's decode step: every sequence's whole K/V cache is read once per token.

    GB/s counts the K and V bytes read (q and out are under 0.5% of them): the goal
    is 80% of the copy bandwidth at 64 x 1024. Sequence b owns slot b and every slot is full,
    so torch's SDPA (enable_gqa) reads the same cache through views, with no gather copy.
    """
    fn, why = ops.get("decode_attention")
    scale = HEAD_DIM ** -0.5
    for B, S in DECODE_SHAPES:
        def make_set(g, B=B, S=S):
            return {"q": _gen_randn((B, N_HEADS, HEAD_DIM), g),
                    "k": _gen_randn((B, S, N_KV_HEADS, HEAD_DIM), g),
                    "v": _gen_randn((B, S, N_KV_HEADS, HEAD_DIM), g)}
        slots = torch.arange(B, dtype=torch.int32, device=DEVICE)
        lens = torch.full((B,), S, dtype=torch.int32, device=DEVICE)
        out = torch.empty(B, N_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
        ours = None
        if fn is not None:
            ours = (lambda s, slots=slots, lens=lens, out=out:
                    fn(s["q"], s["k"], s["v"], slots, lens, scale, out=out))
        kv_bytes = 2 * B * S * N_KV_HEADS * HEAD_DIM * 2
        yield Case("decode_attention", f"{B}x{S}", kv_bytes, make_set,
                   torch_fn=lambda s: _sdpa_decode(s["q"], s["k"], s["v"], scale),
                   reference=lambda s: _sdpa_decode(s["q"], s["k"], s["v"], scale, upcast=True),
                   ours_fn=ours, outs=[out] if ours else [],
                   via=ops.via("decode_attention"), skip=None if ours else why)


def _paged_case(ops: Ops, fn: Callable | None, why: str | None, B: int, S: int,
                layers: int, kernel: str = "paged_decode_attention") -> Case:
    """B sequences of S keys over `layers` layers' paged caches, one call after another;
    `kernel` names the row (and, past the op's name, which of stage 14's kernels it times)."""
    scale = HEAD_DIM ** -0.5
    n_blocks = B * S // PAGED_BLOCK

    def make_set(g):
        k = _gen_randn((layers, B, S, N_KV_HEADS, HEAD_DIM), g)
        v = _gen_randn((layers, B, S, N_KV_HEADS, HEAD_DIM), g)
        # a layer's pool block p holds its logical block perm[p]; the table maps logical -> physical
        perm = torch.stack([torch.randperm(n_blocks, generator=g, device=DEVICE)
                            for _ in range(layers)])
        pool = (n_blocks, PAGED_BLOCK, N_KV_HEADS, HEAD_DIM)

        def paged(x: torch.Tensor) -> torch.Tensor:
            return torch.stack([x[i].reshape(pool)[perm[i]] for i in range(layers)])
        return {"q": _gen_randn((layers, B, N_HEADS, HEAD_DIM), g), "k": k, "v": v,
                "pk": paged(k), "pv": paged(v),
                "tables": torch.argsort(perm, dim=1).to(torch.int32)
                .view(layers, B, S // PAGED_BLOCK)}
    lens = torch.full((B,), S, dtype=torch.int32, device=DEVICE)
    out = torch.empty(layers, B, N_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
    ours = None
    if fn is not None:
        def ours(s):
            for i in range(layers):
                fn(s["q"][i], s["pk"][i], s["pv"][i], s["tables"][i], lens, scale, out=out[i])
            return tuple(out)

    def sdpa(s, upcast=False):
        return tuple(_sdpa_decode(s["q"][i], s["k"][i], s["v"][i], scale, upcast=upcast)
                     for i in range(layers))
    kv_bytes = 2 * layers * B * S * N_KV_HEADS * HEAD_DIM * 2
    return Case(kernel,
                f"{B}x{S}" if layers == 1 else f"{B}x{S}, {layers} layers", kv_bytes, make_set,
                torch_fn=sdpa, reference=lambda s: sdpa(s, upcast=True),
                ours_fn=ours, outs=[out] if ours else [],
                via=f"{ops.via('paged_decode_attention').rsplit(' ', 1)[0]} {fn.__name__}"
                if fn else "",
                skip=None if ours else why)


def paged_decode_attention_cases(ops: Ops) -> Iterator[Case]:
    """Stage 14's decode step over a paged cache (blocks of 16, shuffled over the pool).

    GB/s counts the K and V bytes read, as for decode_attention: the goal is 85% of
    the copy bandwidth at 64 x 1024 and 256 x 512 (the single pass) and 70% at 1 x 32768
    (split-K). Beside it, torch's SDPA (enable_gqa) on a contiguous cache of the same shapes
    holding the same keys: the speed a paged layout has to match. 1 x 512 and 1 x 2048 are a
    chat's decode step (1 MB and 4 MB per layer: latency, not bandwidth, sets their time; the
    kernel splits them in 64-key partitions on a 132-SM GPU). The last row reads 1 x 32768 in
    each of Llama-3.2-1B's 16 layers' caches, one call after another as a decode step makes
    them: an isolated call's fixed start-up (~9 us of 25 at 1 x 32768; docs/benchmarks.md)
    then overlaps the call before it (stage 14 launches early: PDL), which one call cannot show.
    """
    fast = _stage14_kernel(ops, "fast")
    for B, S in PAGED_SHAPES:
        yield _paged_case(ops, *fast, B, S, layers=1)
    yield _paged_case(ops, *fast, 1, 32768, layers=PAGED_LAYERS)


def _stage14_kernel(ops: Ops, part: str) -> tuple[Callable | None, str | None]:
    """Stage 14's op of one part, "fast" or "simple" (paged_decode_attention_<part>, beside
    the op the engine calls, which runs the fast one once it is written), or why not."""
    fn, why = ops.get("paged_decode_attention")
    if fn is None:
        return None, why
    kernel = getattr(fn, "__globals__", {}).get(f"paged_decode_attention_{part}")
    return (kernel, None) if kernel else (None, f"skipped: no paged_decode_attention_{part}")


def paged_decode_attention_simple_cases(ops: Ops) -> Iterator[Case]:
    """Stage 14's part 1 (one block per (sequence, query head), scalar math) at the same
    single-layer shapes as the fast kernel's rows."""
    simple = _stage14_kernel(ops, "simple")
    for B, S in PAGED_SHAPES:
        yield _paged_case(ops, *simple, B, S, layers=1, kernel="paged_decode_attention (simple)")


FAMILIES: dict[str, Callable[[Ops], Iterator[Case]]] = {
    "embedding": embedding_cases,
    "rmsnorm": rmsnorm_cases,
    "fused_add_rmsnorm": fused_add_rmsnorm_cases,
    "rope": rope_cases,
    "rope_cache_write": rope_cache_write_cases,
    "silu_mul": silu_mul_cases,
    "argmax": argmax_cases,
    "linear": linear_cases,
    "attention": attention_cases,
    "flash_attention": flash_attention_cases,
    "decode_attention": decode_attention_cases,
    "paged_decode_attention": paged_decode_attention_cases,
    "paged_decode_attention_simple": paged_decode_attention_simple_cases,
}

