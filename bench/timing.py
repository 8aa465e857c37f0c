"""Timing on the GPU for the benchmarks: CUDA events, a cold L2 and the copy ceiling.

Every run flushes the L2 outside the timed region, and keeps the GPU busy (torch.cuda._sleep)
for longer than the host needs to launch the op, so the events time device work, not Python's
launch overhead (reported separately as host us per call).

The flush READS twice the L2's size (a sum over a buffer): L2 is then full of clean lines of
other data, and the op finds none of its inputs there. A flush that writes the buffer (what
`torch.zero_()`-style flushes do) leaves up
to an L2 of DIRTY lines, which the op under test must write back to memory as its own reads
evict them: up to 50 MB of extra traffic inside its timed region on an H100/H200, a third of
what a 134 MB decode-attention call reads. No kernel of a decode step starts with that (the
kernels before it write kilobytes to a few MB). The other side of it: an op's own writes
stay in the L2 (write-back) when they fit, and reach memory after its timed region, as in a
real step, where the next kernel reads them from the L2; a decode-attention call writes only
its small output, but an op that writes tens of MB (RMSNorm at 4,096 tokens: 16 MB) may then
show more than the copy's share. The "same-bytes copy" beside each op is timed the same way.
`flush="write"` keeps the old method, to compare.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.results import write_json

DEVICE = "cuda"
COPY_BYTES = 2**30
FLUSHES = ("read", "write")   # how Timer empties the L2 before each run (see above)


def report_no_cuda(module: str, json_path: str | Path | None, rows_key: str) -> int:
    """Say that nothing was measured (and write that to json_path); return the exit status, 0."""
    reason = f"{module}: no CUDA device here; nothing was measured (run it on a GPU machine)."
    print(reason)
    if json_path:
        write_json(json_path, {"measured": False, "reason": reason, rows_key: []})
    return 0


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

    def __init__(self, quick: bool, flush: str = "read"):
        if flush not in FLUSHES:
            raise ValueError(f"flush must be one of {FLUSHES}, got {flush!r}")
        props = torch.cuda.get_device_properties(0)
        self.l2_bytes = int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)
        self.flush_mode = flush
        # Reading (or writing) twice the L2's size evicts everything an op could find there.
        self.flush_buffer = torch.ones(2 * self.l2_bytes // 4, dtype=torch.int32, device=DEVICE)
        self._flush_sum = torch.empty((), dtype=torch.int64, device=DEVICE)
        self.warmup = 3 if quick else 5
        self.min_runs = 5 if quick else 20
        self.max_runs = 30 if quick else 200
        self.budget_s = 0.1 if quick else 0.35    # device time per measurement, about
        # torch.cuda._sleep spins the GPU for a number of clock cycles (no memory traffic).
        self.cycles_per_us = self._calibrate_sleep() if hasattr(torch.cuda, "_sleep") else 0.0
        self.flush_us = self._time_flush()

    def flush(self) -> None:
        if self.flush_mode == "read":
            torch.sum(self.flush_buffer, dim=0, dtype=torch.int64, out=self._flush_sum)
        else:
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

