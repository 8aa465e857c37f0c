"""pytest-benchmark cases of one stage's ops: run by grader/bench.py, never collected alone.

Environment (set by grader/bench.py): TINYVLLM_BENCH_STAGE (the stage), TINYVLLM_BENCH_SIDE
("student": the selected student's ops, column "yours"; "reference": the solutions' ops, torch's
equivalent and a same-bytes copy), TINYVLLM_BENCH_NOTES (a file: one JSON line per row that
was not timed, with why). The cases, their bytes and FLOPs are bench/cases.py's.
"""
from __future__ import annotations

import itertools
import json
import os

import pytest

from grader import bench

WARMUP_ROUNDS = 5
ROUNDS = 50

_timer = None


def pytest_generate_tests(metafunc):
    # read at collection, not import: the environment names this run's stage and side
    if "case" in metafunc.fixturenames:
        stage = os.environ.get(bench.STAGE_ENV, "")
        side = os.environ.get(bench.SIDE_ENV, "reference")
        cases = bench.stage_cases(stage) if stage else []
        metafunc.parametrize("case", cases, ids=[f"{c.kernel} {c.tokens}" for c in cases])
        metafunc.parametrize("column", ("yours",) if side == "student"
                             else ("reference", "torch", "copy"))


def _note(case, column: str, status: str) -> None:
    path = os.environ.get(bench.NOTES_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"kernel": case.kernel, "tokens": case.tokens, "bytes": case.bytes,
                                "flops": case.flops, "column": column, "status": status}) + "\n")


def _time(benchmark, fn, sets: list) -> None:
    """Many rounds of fn(one input set) + synchronize; the L2 flush and the set rotation are
    the round's setup, outside the timed region."""
    import torch
    turn = itertools.count()

    def setup():
        _timer.flush()
        torch.cuda.synchronize()
        return (sets[next(turn) % len(sets)],), {}

    def target(s):
        fn(s)
        torch.cuda.synchronize()
    benchmark.pedantic(target, setup=setup, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS,
                       iterations=1)


def test_op(case, column, benchmark):
    import torch

    from bench import kernels
    from bench.timing import DEVICE, Timer
    global _timer
    if _timer is None:
        _timer = Timer(quick=True)
    benchmark.extra_info.update(kernel=case.kernel, tokens=case.tokens, bytes=case.bytes,
                                flops=case.flops, column=column, via=case.via)
    g = torch.Generator(device=DEVICE)
    g.manual_seed(1234)
    first = case.make_set(g)
    set_bytes = sum(t.numel() * t.element_size() for t in first.values())
    sets = [first] + [case.make_set(g) for _ in range(kernels._n_sets(set_bytes,
                                                                      _timer.l2_bytes) - 1)]
    if column == "copy":
        src = torch.randint(0, 256, (max(case.bytes // 2, 1),), dtype=torch.uint8, device=DEVICE)
        dst = torch.empty_like(src)
        _time(benchmark, lambda s: dst.copy_(src), sets[:1])
        return
    if column == "torch":
        _time(benchmark, case.torch_fn, sets)
        return
    if case.ours_fn is None:
        _note(case, column, case.skip or "skipped: op not available")
        pytest.skip(case.skip or "op not available")
    try:
        problem = kernels.check(case, sets[0])
        if problem is None:
            _time(benchmark, case.ours_fn, sets)
    except Exception as e:  # a TODO or a crash is this row's status, then the test's error
        first = (str(e).splitlines() or [""])[0][:160]
        _note(case, column,
              first if first.startswith("TODO") else f"error: {type(e).__name__}: {first}")
        raise
    if problem:
        _note(case, column, f"WRONG: {problem}")
        pytest.fail(f"WRONG: {problem}")
