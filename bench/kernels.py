"""Kernel benchmark: every op of stages 03-08 beside its torch equivalent, at Llama-3.2-1B sizes.

    python3 -m bench.kernels [--json FILE] [--quick]

Needs a CUDA GPU; without one it says so and exits 0, having measured nothing.

Method (llm.c's dev/cuda, and the course's METHOD):
  - the copy bandwidth is measured first (a 1 GiB device-to-device copy, bytes read + written):
    it is the ceiling of every memory-bound kernel here;
  - each op's output is checked once against torch (grader.checks tolerances) before it is
    timed; a wrong op is reported WRONG and not timed;
  - timing uses CUDA events around one call, after a warm-up, and reports the median of many
    runs; inputs rotate among several freshly drawn sets and the L2 cache is flushed (a write
    of twice its size) before every run, outside the timed region, so no run reads warm data;
  - before each run the GPU is also kept busy (torch.cuda._sleep) for longer than the host
    needs to launch the op, so the events time the device work, not Python's launch overhead
    (which is reported separately as "host us per call");
  - GB/s counts the bytes that must move: each input read once, each output written once;
    GEMM and attention are also reported in TFLOP/s.

Ours calls the op modules through the parts resolver (the selected stage files), with their
out= buffers so allocation is not timed; embedding and rope call their torch.ops kernels
directly, because their Python wrappers allocate (and may wait on) an error flag per call.
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

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
COPY_BYTES = 2**30
DEVICE = "cuda"     # a module global only so that a CPU dry run of the plumbing can patch it

NO_CUDA = "bench.kernels: no CUDA device here; nothing was measured (run it on a GPU machine)."

Outputs = tuple[torch.Tensor, ...]


# ----------------------------------------------------------------------------------- timing

@dataclass
class Timing:
    median_us: float
    min_us: float
    max_us: float
    runs: int
    host_us: float      # median host time to launch one call (Python + dispatch)

    def as_dict(self) -> dict:
        return {"median_us": self.median_us, "min_us": self.min_us, "max_us": self.max_us,
                "runs": self.runs, "host_us_per_call": self.host_us}


class Timer:
    """CUDA-event timing with an L2 flush and a launch head start before every run."""

    def __init__(self, quick: bool):
        props = torch.cuda.get_device_properties(0)
        self.l2_bytes = int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)
        # Writing twice the L2's size evicts everything an op could find there.
        self.flush_buffer = torch.empty(2 * self.l2_bytes // 4, dtype=torch.int32, device=DEVICE)
        self.warmup = 3 if quick else 5
        self.min_runs = 5 if quick else 20
        self.max_runs = 30 if quick else 200
        self.budget_s = 0.1 if quick else 0.35    # device time per measurement, about
        # torch.cuda._sleep spins the GPU for a number of clock cycles (no memory traffic).
        self.cycles_per_us = self._calibrate_sleep() if hasattr(torch.cuda, "_sleep") else 0.0
        self.flush_us = self._time_flush()

    def flush(self) -> None:
        self.flush_buffer.zero_()

    def _calibrate_sleep(self) -> float:
        torch.cuda._sleep(1000)
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        cycles = 2_000_000
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        return cycles / (start.elapsed_time(end) * 1e3)

    def _time_flush(self) -> float:
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        self.flush()
        start.record()
        for _ in range(10):
            self.flush()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / 10

    def _runs(self, fn: Callable[[int], Any], n_sets: int, runs: int, head_start_us: float,
              first: int = 0) -> list[float]:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
        cycles = int(head_start_us * self.cycles_per_us)
        for r in range(runs):
            self.flush()
            if cycles > 0:
                torch.cuda._sleep(cycles)
            starts[r].record()
            fn((first + r) % n_sets)
            ends[r].record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]

    def measure(self, fn: Callable[[int], Any], n_sets: int) -> Timing:
        """Time fn(i) (i picks the input set), each run on a cold L2."""
        host = []
        for i in range(self.warmup):
            self.flush()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(i % n_sets)
            host.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
        host_us = statistics.median(host[1:])
        # The sleep must outlast the host's launch of fn, or the GPU idles inside the timed
        # region waiting for Python; once the GPU is ahead, it stays ahead.
        head_start = min(1.5 * host_us + 20.0, 100_000.0)
        probe = statistics.median(self._runs(fn, n_sets, 3, head_start))
        per_run_us = probe + self.flush_us + head_start
        runs = int(min(self.max_runs, max(self.min_runs, self.budget_s * 1e6 / per_run_us)))
        times = self._runs(fn, n_sets, runs, head_start, first=1)
        return Timing(statistics.median(times), min(times), max(times), runs, host_us)


def copy_bandwidth(timer: Timer) -> tuple[float, Timing]:
    """GB/s of a 1 GiB device-to-device copy, counting bytes read + bytes written."""
    n = COPY_BYTES
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    t = timer.measure(lambda i: dst.copy_(src), 1)
    return 2 * n / (t.median_us * 1e3), t


# ------------------------------------------------------------------------------------ cases

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
    from grader import checks
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
            from grader import parts
            self.kernels = parts.kernels()
        except Exception as e:  # a failed build becomes every row's reason
            self.build_error = f"kernels did not build: {str(e).splitlines()[0][:200]}"

    def get(self, stage: str, module: str, name: str) -> tuple[Callable | None, str | None]:
        if self.build_error:
            return None, f"error: {self.build_error}"
        from grader import parts
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

    def raw(self, name: str) -> Callable | None:
        """torch.ops.tinyvllm.<name>, or None when the library has no such op."""
        if self.kernels is None:
            return None
        try:
            return getattr(self.kernels, name)
        except (AttributeError, RuntimeError):
            return None


def embedding_cases(ops: Ops) -> Iterator[Case]:
    fn, why = ops.get("03", "embedding", "embedding")
    raw = ops.raw("embedding")
    for T in TOKENS:
        def make_set(g, T=T):
            ids = torch.randint(0, VOCAB, (T,), generator=g, device=DEVICE, dtype=torch.int64)
            return {"ids": ids, "table": _gen_randn((VOCAB, HIDDEN), g)}
        out = torch.empty(T, HIDDEN, dtype=torch.bfloat16, device=DEVICE)
        flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        ours, via = None, ""
        if raw is not None:
            def ours(s, out=out, flag=flag):
                raw(s["ids"], s["table"], out, flag)
                return out
            via = "torch.ops.tinyvllm.embedding (preallocated error flag)"
        elif fn is not None:
            kw = {"check": False} if _accepts(fn, "check") else {}
            ours = (lambda s, out=out, kw=kw: fn(s["ids"], s["table"], out=out, **kw))
            via = "03/embedding.py embedding"
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
    fn, why = ops.get("04", "rmsnorm", "rmsnorm")
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
                   via="04/rmsnorm.py rmsnorm", skip=None if ours else why)


def fused_add_rmsnorm_cases(ops: Ops) -> Iterator[Case]:
    fn, why = ops.get("04", "rmsnorm", "fused_add_rmsnorm")
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
                   via="04/rmsnorm.py fused_add_rmsnorm (in place)", skip=None if ours else why)


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


def rope_cases(ops: Ops) -> Iterator[Case]:
    fn, why = ops.get("05", "rope", "apply_rope_")
    tables, why_tables = ops.get("05", "rope_tables", "cos_sin_cache")
    raw = ops.raw("apply_rope")
    cos_sin = None
    if tables is not None:
        try:
            cos_sin = tables(HEAD_DIM, 500000.0, None, ROPE_POSITIONS, torch.device(DEVICE))
        except Exception as e:  # the torch column still runs
            why_tables = f"error: cos_sin_cache: {type(e).__name__}: {e}"
    if cos_sin is None:
        # Plain torch table (cos | sin of pos * theta^(-2i/d)) so the torch column still runs.
        inv = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
        ang = torch.arange(ROPE_POSITIONS, dtype=torch.float32)[:, None] * inv[None, :]
        cos_sin = torch.cat((ang.cos(), ang.sin()), dim=-1).to(DEVICE)
        why = why or why_tables
    for T in TOKENS:
        def make_set(g, T=T):
            start = int(torch.randint(0, ROPE_POSITIONS - T + 1, (1,), generator=g,
                                      device=DEVICE))
            return {"q": _gen_randn((T, N_HEADS, HEAD_DIM), g),
                    "k": _gen_randn((T, N_KV_HEADS, HEAD_DIM), g),
                    "pos": torch.arange(start, start + T, dtype=torch.int64, device=DEVICE)}
        flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        ours, via = None, ""
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
            via = "05/rope.py apply_rope_ (in place)"
        qk = T * (N_HEADS + N_KV_HEADS) * HEAD_DIM * 2
        yield Case("rope", str(T), 2 * qk + T * 8 + T * HEAD_DIM * 4, make_set,
                   torch_fn=lambda s: _hf_rope_(s["q"], s["k"], s["pos"], cos_sin),
                   ours_fn=ours, via=via, skip=None if ours else why)


def silu_mul_cases(ops: Ops) -> Iterator[Case]:
    fn, why = ops.get("08", "activation", "silu_mul")
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
                   via="08/activation.py silu_mul", skip=None if ours else why)


def argmax_cases(ops: Ops) -> Iterator[Case]:
    fn, why = ops.get("08", "argmax", "argmax")
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
                   via="08/argmax.py argmax", skip=None if ours else why)


def linear_cases(ops: Ops) -> Iterator[Case]:
    fn, why = ops.get("06", "linear", "linear")
    for name, n_out in ((f"linear {HIDDEN}->{INTER}", INTER),
                        (f"lm_head {HIDDEN}->{VOCAB}", VOCAB)):
        for T in TOKENS:
            def make_set(g, T=T, n_out=n_out):
                # weights scaled by 1/sqrt(in) so outputs are O(1), as in a trained model
                return {"x": _gen_randn((T, HIDDEN), g),
                        "w": _gen_randn((n_out, HIDDEN), g, scale=HIDDEN ** -0.5)}
            out = torch.empty(T, n_out, dtype=torch.bfloat16, device=DEVICE)
            ours = None
            if fn is not None:
                ours = ((lambda s, out=out: fn(s["x"], s["w"], out=out)) if _accepts(fn, "out")
                        else (lambda s: fn(s["x"], s["w"])))
            yield Case(name, str(T), (T * HIDDEN + n_out * HIDDEN + T * n_out) * 2, make_set,
                       torch_fn=lambda s: F.linear(s["x"], s["w"]),
                       ours_fn=ours, flops=2 * T * HIDDEN * n_out,
                       outs=[out] if ours and _accepts(fn, "out") else [],
                       via="06/linear.py linear", skip=None if ours else why)


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


def attention_cases(ops: Ops) -> Iterator[Case]:
    fn, why = ops.get("07", "attention", "prefill_attention")
    scale = HEAD_DIM ** -0.5
    for n_seq, S in ATTENTION_SHAPES:
        T = n_seq * S

        def make_set(g, T=T):
            return {"q": _gen_randn((T, N_HEADS, HEAD_DIM), g),
                    "k": _gen_randn((T, N_KV_HEADS, HEAD_DIM), g),
                    "v": _gen_randn((T, N_KV_HEADS, HEAD_DIM), g)}
        cu = torch.arange(0, T + 1, S, dtype=torch.int32, device=DEVICE)
        out = torch.empty(T, N_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
        ours = None
        if fn is not None:
            if _accepts(fn, "out"):
                ours = (lambda s, cu=cu, out=out: fn(s["q"], s["k"], s["v"], cu, scale, out=out))
            else:
                ours = (lambda s, cu=cu: fn(s["q"], s["k"], s["v"], cu, scale))
        # causal: query i of a sequence meets i + 1 keys; QK^T and PV are 2 * d flops each
        flops = n_seq * 4 * HEAD_DIM * N_HEADS * S * (S + 1) // 2
        nbytes = (T * N_HEADS * HEAD_DIM * 2) * 2 + (T * N_KV_HEADS * HEAD_DIM * 2) * 2
        yield Case("prefill_attention", f"{n_seq}x{S}" if n_seq > 1 else str(S), nbytes,
                   make_set,
                   torch_fn=lambda s, n=n_seq: _sdpa_packed(s["q"], s["k"], s["v"], n, scale),
                   reference=lambda s, n=n_seq: _sdpa_packed(s["q"], s["k"], s["v"], n, scale,
                                                             upcast=True),
                   ours_fn=ours, flops=flops,
                   outs=[out] if ours and _accepts(fn, "out") else [],
                   via="07/attention.py prefill_attention", skip=None if ours else why)


FAMILIES: dict[str, Callable[[Ops], Iterator[Case]]] = {
    "embedding": embedding_cases,
    "rmsnorm": rmsnorm_cases,
    "fused_add_rmsnorm": fused_add_rmsnorm_cases,
    "rope": rope_cases,
    "silu_mul": silu_mul_cases,
    "argmax": argmax_cases,
    "linear": linear_cases,
    "attention": attention_cases,
}


# ------------------------------------------------------------------------------ correctness

def _as_outputs(result: Any) -> Outputs:
    if isinstance(result, torch.Tensor):
        return (result,)
    return tuple(t for t in result if isinstance(t, torch.Tensor))


def _clone_set(s: dict) -> dict:
    return {k: v.clone() for k, v in s.items()}


def check(case: Case, s: dict) -> str | None:
    """None when ours matches the oracle on set s, else why not (the first lines of it)."""
    from grader import checks
    for buf in case.outs:
        checks.poison(buf)
    got = tuple(t.clone() for t in _as_outputs(case.ours_fn(_clone_set(s))))
    expected = _as_outputs((case.reference or case.torch_fn)(_clone_set(s)))
    torch.cuda.synchronize()
    if len(got) != len(expected):
        return f"ours returned {len(got)} tensors, torch {len(expected)}"
    try:
        for i, (g, e) in enumerate(zip(got, expected)):
            what = f"{case.kernel} output {i}" if len(got) > 1 else f"{case.kernel} output"
            if case.compare == "argmax":
                _check_argmax(g, e, s["logits"], what)
            elif case.compare == "equal":
                _check_rows(g, e, what, exact=True)
            else:
                _check_rows(g, e, what, exact=False)
    except AssertionError as err:
        return "\n".join(str(err).splitlines()[:4])
    return None


def _check_rows(got: torch.Tensor, expected: torch.Tensor, what: str, exact: bool) -> None:
    """checks.assert_close / assert_equal, prefiltered on the GPU so 1 GB outputs stay fast.

    grader.checks compares in float64 on the CPU; for outputs of millions of elements the
    same criterion runs on the GPU first, and only the rows around the first mismatch go
    through grader.checks to produce its message.
    """
    from grader import checks
    if got.shape != expected.shape or got.dtype != expected.dtype:
        raise AssertionError(f"{what}: expected {expected.dtype} {tuple(expected.shape)}, "
                             f"got {got.dtype} {tuple(got.shape)}")
    if got.numel() <= 4 * 2**20:
        if exact:
            checks.assert_equal(got, expected, what=what)
        else:
            checks.assert_close(got, expected, what=what)
        return
    if exact:
        bad = got != expected
        if got.is_floating_point():
            bad &= ~(got.isnan() & expected.isnan())
    else:
        atol, rtol = checks.TOLERANCES.get(expected.dtype, (0.0, 0.0))
        g, e = got.float(), expected.float()
        bad = ~((g - e).abs() <= atol + rtol * e.abs()) & ~(g == e)
    if not bool(bad.any()):
        return
    row = int(bad.reshape(got.shape[0], -1).any(dim=1).nonzero()[0])
    rows = slice(row, min(row + 8, got.shape[0]))
    n_bad = int(bad.sum())
    try:
        if exact:
            checks.assert_equal(got[rows], expected[rows], what=f"{what} rows {row}..")
        else:
            checks.assert_close(got[rows], expected[rows], what=f"{what} rows {row}..")
    except AssertionError as err:
        raise AssertionError(f"{what}: {n_bad} of {got.numel()} elements differ; {err}") from None
    raise AssertionError(f"{what}: {n_bad} of {got.numel()} elements differ (first in row {row})")


def _check_argmax(got: torch.Tensor, expected: torch.Tensor, logits: torch.Tensor,
                  what: str) -> None:
    """Exactly torch.argmax (ties to the lowest index), saying so when only ties differ."""
    from grader import checks
    if got.shape != expected.shape or got.dtype != expected.dtype:
        raise AssertionError(f"{what}: expected {expected.dtype} {tuple(expected.shape)}, "
                             f"got {got.dtype} {tuple(got.shape)}")
    bad = got != expected
    if not bool(bad.any()):
        return
    valid = (got >= 0) & (got < logits.shape[1])
    picked = logits.gather(1, got.clamp(0, logits.shape[1] - 1)[:, None])[:, 0]
    is_max = valid & (picked == logits.max(dim=1).values)
    hint = ("only ties differ: each picked value is its row's maximum, but torch.argmax "
            "returns the LOWEST index among equal maxima" if bool(is_max[bad].all()) else
            "some picked indices are not their row's maximum")
    checks.assert_equal(got, expected, what=what, hint=hint)


# ------------------------------------------------------------------------------------- run

@dataclass
class Row:
    kernel: str
    tokens: str
    bytes: int
    flops: int
    status: str                 # "ok", "WRONG: ...", "skipped: ...", "error: ..."
    via: str = ""
    ours: Timing | None = None
    torch: Timing | None = None
    torch_status: str = "ok"


def _n_sets(set_bytes: int, l2_bytes: int) -> int:
    # Enough sets that together they are several times the L2 (2 to 8 of them).
    return max(2, min(8, math.ceil(3 * l2_bytes / max(set_bytes, 1))))


def _is_fatal(err: BaseException) -> bool:
    text = str(err)
    return any(s in text for s in ("illegal memory access", "unspecified launch failure",
                                   "misaligned address", "device-side assert",
                                   "an illegal instruction"))


def run_case(case: Case, timer: Timer, seed: int) -> Row:
    row = Row(case.kernel, case.tokens, case.bytes, case.flops, "ok", via=case.via)
    g = torch.Generator(device=DEVICE)
    g.manual_seed(seed)
    sets = [case.make_set(g)]
    set_bytes = sum(t.numel() * t.element_size() for t in sets[0].values())
    sets += [case.make_set(g) for _ in range(_n_sets(set_bytes, timer.l2_bytes) - 1)]
    try:
        if case.ours_fn is None:
            row.status = case.skip or "skipped: op not available"
        else:
            try:
                problem = check(case, sets[0])
            except Exception as e:  # a crash is a result to report
                if _is_fatal(e):
                    raise
                problem = None
                row.status = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            if problem:
                row.status = f"WRONG: {problem}"
            elif row.status == "ok":
                row.ours = timer.measure(lambda i: case.ours_fn(sets[i]), len(sets))
        try:
            row.torch = timer.measure(lambda i: case.torch_fn(sets[i]), len(sets))
        except Exception as e:  # likewise for torch
            if _is_fatal(e):
                raise
            row.torch_status = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    finally:
        sets.clear()
        case.outs.clear()
        try:
            torch.cuda.empty_cache()
        except RuntimeError:
            pass    # a broken context: the caller reports it
    return row


# ---------------------------------------------------------------------------------- report

def _rate(row: Row, t: Timing | None) -> str:
    if t is None:
        return "-"
    if row.flops:
        return f"{row.flops / (t.median_us * 1e6):.1f} TFLOP/s"
    return f"{row.bytes / (t.median_us * 1e3):.0f} GB/s"


def _pct(row: Row, t: Timing | None, copy_gbs: float) -> str:
    if t is None:
        return "-"
    return f"{100 * row.bytes / (t.median_us * 1e3) / copy_gbs:.0f}%"


def markdown(rows: list[Row], copy_gbs: float) -> str:
    lines = [("| kernel | T | ours us | ours rate | ours % copy bw | torch us | torch rate "
              "| speedup |"),
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.ours is not None:
            ours = [f"{r.ours.median_us:.1f}", _rate(r, r.ours), _pct(r, r.ours, copy_gbs)]
        else:
            ours = [r.status.splitlines()[0][:70].replace("|", "/"), "", ""]
        torch_cols = ([f"{r.torch.median_us:.1f}", _rate(r, r.torch)] if r.torch is not None
                      else [r.torch_status[:40].replace("|", "/"), ""])
        speed = (f"{r.torch.median_us / r.ours.median_us:.2f}x"
                 if r.ours is not None and r.torch is not None else "-")
        lines.append(f"| {r.kernel} | {r.tokens} | " + " | ".join(ours + torch_cols + [speed])
                     + " |")
    return "\n".join(lines)


def row_dict(r: Row, copy_gbs: float) -> dict:
    d = {"kernel": r.kernel, "tokens": r.tokens, "bytes": r.bytes, "flops": r.flops,
         "status": r.status, "via": r.via, "torch_status": r.torch_status}
    for name, t in (("ours", r.ours), ("torch", r.torch)):
        if t is None:
            d[name] = None
            continue
        d[name] = t.as_dict()
        d[name]["GBps"] = r.bytes / (t.median_us * 1e3)
        d[name]["pct_copy_bw"] = 100 * d[name]["GBps"] / copy_gbs
        if r.flops:
            d[name]["TFLOPS"] = r.flops / (t.median_us * 1e6)
    d["speedup"] = (r.torch.median_us / r.ours.median_us
                    if r.ours is not None and r.torch is not None else None)
    return d


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="FILE", help="write every number to FILE")
    parser.add_argument("--quick", action="store_true", help="fewer runs per measurement")
    parser.add_argument("--only", metavar="NAMES",
                        help=f"comma-separated subset of: {', '.join(FAMILIES)}")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the random inputs")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print(NO_CUDA)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"measured": False, "reason": NO_CUDA, "rows": []}, f, indent=2)
        return 0
    families = list(FAMILIES)
    if args.only:
        families = [f.strip() for f in args.only.split(",") if f.strip()]
        unknown = [f for f in families if f not in FAMILIES]
        if unknown:
            parser.error(f"unknown --only name(s) {unknown}; choose from {list(FAMILIES)}")

    started = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False
    name = torch.cuda.get_device_name(0)
    print(f"bench.kernels on {name}, torch {torch.__version__}, seed {args.seed}"
          f"{', quick' if args.quick else ''}", flush=True)
    t0 = time.perf_counter()
    ops = Ops()
    print(f"kernels: {ops.build_error or 'built and loaded'} "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    timer = Timer(args.quick)
    copy_gbs, copy_t = copy_bandwidth(timer)
    print(f"L2 {timer.l2_bytes / 2**20:.0f} MiB (flush {timer.flush_us:.1f} us); "
          f"copy bandwidth {copy_gbs:.0f} GB/s ({COPY_BYTES / 2**30:g} GiB device-to-device, "
          f"read + write, median of {copy_t.runs})", flush=True)

    rows: list[Row] = []
    fatal: str | None = None
    for fam in families:
        cases = FAMILIES[fam](ops)
        while True:
            if fatal:
                break
            try:
                case = next(cases)
            except StopIteration:
                break
            except Exception as e:  # setting up failed: report it, go on
                if _is_fatal(e):
                    fatal = f"{fam}: {e}"
                rows.append(Row(fam, "-", 0, 0, f"error: setting up: {type(e).__name__}: {e}",
                                torch_status="not run"))
                break
            try:
                row = run_case(case, timer, args.seed)
            except Exception as e:  # report it, go on
                if _is_fatal(e):
                    fatal = f"{case.kernel} T={case.tokens}: {str(e).splitlines()[0]}"
                row = Row(case.kernel, case.tokens, case.bytes, case.flops,
                          f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}",
                          via=case.via, torch_status="not run")
                traceback.print_exc()
            rows.append(row)
            ours = f"{row.ours.median_us:9.1f} us ({row.ours.host_us:.0f} us host)" \
                if row.ours else row.status.splitlines()[0][:90]
            torch_s = f"{row.torch.median_us:9.1f} us" if row.torch else row.torch_status
            print(f"  {row.kernel:22s} T={row.tokens:6s} ours {ours:40s} torch {torch_s}",
                  flush=True)
        if fatal:
            break
    if fatal:
        print(f"\nSTOPPED: a kernel broke the CUDA context ({fatal}); the rows after it were "
              "not run. Rerun with --only to measure the others.")

    for r in rows:
        if r.status.startswith("WRONG"):
            print(f"\n{r.kernel} T={r.tokens} is WRONG (not timed):\n{r.status[7:]}")
    elapsed = time.perf_counter() - started
    print(f"\nDevice: {name}; copy bandwidth {copy_gbs:.0f} GB/s; medians of CUDA-event "
          f"timings, cold L2, {elapsed:.0f} s in all. speedup = torch us / ours us (above 1: "
          "ours is faster).\n")
    print(markdown(rows, copy_gbs))
    if args.json:
        report = {"measured": True, "device": name, "torch": torch.__version__, "seed": args.seed,
                  "quick": args.quick, "l2_bytes": timer.l2_bytes,
                  "copy_bandwidth_GBps": copy_gbs, "copy": copy_t.as_dict(),
                  "kernels_build": ops.build_error or "ok", "stopped": fatal,
                  "rows": [row_dict(r, copy_gbs) for r in rows], "elapsed_s": elapsed}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
