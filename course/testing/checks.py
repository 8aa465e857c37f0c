"""Assertions and inputs for the stage tests: messages that teach, inputs that catch bugs.

Every kernel test follows the same recipe (llm.c dev/cuda style):
  1. fresh random inputs from a seeded generator (the seed is printed on failure);
  2. the output buffer poisoned (NaN) before the launch, so an unwritten element fails;
  3. the result compared with an oracle at the tolerance of its dtype (TOLERANCES);
  4. the inputs checked unmodified.

TOLERANCES is the one place where tolerances live. bf16 keeps 8 significant bits, so one
rounding is a relative error up to 2**-8 ~ 3.9e-3; a kernel that accumulates in float32 and
rounds once lands well inside 1.6e-2. float32 results differ from a float64 oracle only by
summation order.
"""
from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    # dtype: (atol, rtol) -- |got - expected| <= atol + rtol * |expected|
    torch.float32: (1e-5, 1e-4),
    torch.float16: (1e-3, 5e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
}

_current_seed: int | None = None


def fresh_seed() -> int:
    """A new seed each run ($TINYVLLM_SEED replays one), remembered for failure messages."""
    global _current_seed
    replay = os.environ.get("TINYVLLM_SEED")
    try:
        _current_seed = int(replay) if replay else random.randrange(2**31)
    except ValueError:
        raise ValueError(f"TINYVLLM_SEED={replay!r} is not an integer (it replays a test's "
                         "random inputs; unset it for a fresh seed)") from None
    return _current_seed


def generator(device: str | torch.device = "cpu", seed: int | None = None) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(fresh_seed() if seed is None else seed)
    return g


def randn(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu",
          gen: torch.Generator | None = None, scale: float = 1.0) -> torch.Tensor:
    """Normal random values (never zeros): drawn in float32 on the device, then cast."""
    gen = gen or generator(device)
    return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with values no correct kernel writes (NaN, or -1 for integers)."""
    return t.fill_(float("nan") if t.is_floating_point() else -1)


def _replay() -> str:
    return f" [replay with TINYVLLM_SEED={_current_seed}]" if _current_seed is not None else ""


def first_mismatches(bad: torch.Tensor, limit: int = 5) -> list[tuple[int, ...]]:
    idx = bad.nonzero()[:limit]
    return [tuple(int(v) for v in row) for row in idx]


def tolerance(dtype: torch.dtype, atol: float | None = None,
              rtol: float | None = None) -> tuple[float, float]:
    """(atol, rtol): the given ones, else TOLERANCES[dtype] (0, 0 for a dtype not listed)."""
    d_atol, d_rtol = TOLERANCES.get(dtype, (0.0, 0.0))
    return (d_atol if atol is None else atol), (d_rtol if rtol is None else rtol)


def mismatch(got: torch.Tensor, expected: torch.Tensor, *, atol: float,
             rtol: float) -> torch.Tensor:
    """Which elements differ: |got - expected| > atol + rtol |expected|, NaN where the other
    is not, an infinity that is not the expected one. A bool tensor of got's shape (on the CPU)."""
    g, e = got.detach().double().cpu(), expected.detach().double().cpu()
    bad = (g - e).abs() > atol + rtol * e.abs()
    bad |= g.isnan() != e.isnan()
    bad |= g.isinf() & (g != e)
    return bad


def assert_close(got: torch.Tensor, expected: torch.Tensor, *, what: str = "output",
                 dtype: torch.dtype | None = None, hint: str = "",
                 atol: float | None = None, rtol: float | None = None) -> None:
    """Fail with expected vs got, the first mismatching indices and a likely cause."""
    if got.shape != expected.shape:
        raise AssertionError(f"{what}: expected shape {tuple(expected.shape)}, "
                             f"got {tuple(got.shape)}{_replay()}")
    dtype = dtype or got.dtype
    atol, rtol = tolerance(dtype, atol, rtol)
    g = got.detach().double().cpu()
    e = expected.detach().double().cpu()
    unwritten = g.isnan() & ~e.isnan()
    bad = mismatch(g, e, atol=atol, rtol=rtol)
    if not bad.any():
        return
    lines = [f"{what}: {int(bad.sum())} of {bad.numel()} elements differ "
             f"(tolerance atol={atol:g}, rtol={rtol:g} for {dtype}){_replay()}"]
    for ix in first_mismatches(bad):
        lines.append(f"  at {ix}: expected {e[ix].item():.6g}, got {g[ix].item():.6g}")
    finite = ~bad | (g.isfinite() & e.isfinite())
    if finite.any():
        lines.append(f"  max abs error {(g - e)[finite].abs().max().item():.3g}")
    if unwritten.any():
        lines.append(f"  {int(unwritten.sum())} elements are still NaN, the poison written "
                     "before the launch: the kernel never wrote them (grid too small? an "
                     "early return? a wrong stride?)")
    if hint:
        lines.append(f"  likely cause: {hint}")
    raise AssertionError("\n".join(lines))


def assert_equal(got: torch.Tensor, expected: torch.Tensor, *, what: str = "output",
                 hint: str = "") -> None:
    """Exact equality (integers, bit patterns), with the same teaching message."""
    if got.shape != expected.shape:
        raise AssertionError(f"{what}: expected shape {tuple(expected.shape)}, "
                             f"got {tuple(got.shape)}{_replay()}")
    g, e = got.detach().cpu(), expected.detach().cpu()
    bad = g != e
    if not bad.any():
        return
    lines = [f"{what}: {int(bad.sum())} of {bad.numel()} elements differ{_replay()}"]
    for ix in first_mismatches(bad):
        lines.append(f"  at {ix}: expected {e[ix].item()}, got {g[ix].item()}")
    if hint:
        lines.append(f"  likely cause: {hint}")
    raise AssertionError("\n".join(lines))


def assert_finite(t: torch.Tensor, what: str = "output") -> None:
    bad = ~t.detach().isfinite()
    if bad.any():
        ix = first_mismatches(bad)
        raise AssertionError(f"{what}: {int(bad.sum())} NaN/Inf values, first at {ix}{_replay()}")


def assert_unmodified(before: torch.Tensor, after: torch.Tensor, name: str) -> None:
    """Inputs are read-only: a kernel that writes into one corrupts the caller's data."""
    a, b = before.cpu(), after.cpu()
    same = (a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else a == b
    if a.shape != b.shape or not bool(same.all()):
        raise AssertionError(f"input {name} was modified by the kernel; it must only be read")


def kernels_of(call: Callable[[], T]) -> tuple[T, list[str]]:
    """call()'s result and the names of the GPU kernels it ran (torch.profiler), to check
    which kernel an op dispatched to."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        result = call()
        torch.cuda.synchronize()
    return result, [e.name for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA]
