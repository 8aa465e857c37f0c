"""The benchmark gives each engine's memory back when its session ends: the next engine sizes
its KV pool from the memory free then, and transformers runs after them all (on a GPU, a pool
of tens of GiB left behind makes the rest of the run run out of memory)."""
from __future__ import annotations

import weakref

import pytest
import torch

from bench import ours
from course import parts
from course.testing import fixtures


GiB, MiB = 1 << 30, 1 << 20


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return fixtures.load_tiny(tmp_path_factory.mktemp("tiny"), "gqa_tied")


@pytest.fixture(scope="module")
def tiny(saved):
    return parts.load("08", "model").LlamaModel(saved.config, saved.weights, "cpu", torch.float32)


def watch_engines(monkeypatch) -> list[tuple[weakref.ref, weakref.ref]]:
    """Weak references to (each engine the benchmark makes, the owner of its KV tensors)."""
    made = []
    make = ours.new_engine

    def spy(*args, **kwargs):
        engine, params_type = make(*args, **kwargs)
        made.append((weakref.ref(engine), weakref.ref(engine.runner.cache)))
        return engine, params_type
    monkeypatch.setattr(ours, "new_engine", spy)
    return made


def assert_released(made: list[tuple[weakref.ref, weakref.ref]]) -> None:
    assert made, "no engine was made"
    alive = [what for refs in made for what, ref in zip(("engine", "KV cache"), refs) if ref()]
    assert not alive, (f"after the session, the {' and the '.join(alive)} of an engine are "
                       "still alive: something still refers to them")


def test_an_engine_session_frees_its_engine_though_the_caller_keeps_serve(tiny, monkeypatch):
    made = watch_engines(monkeypatch)
    with ours.engine_session(tiny, 16) as serve:
        _, tokens = serve([([3, 4, 5], 3)])
    assert tokens == 3
    assert_released(made)          # `serve` is still a name here, as in bench.__main__
    with pytest.raises(RuntimeError, match="session has ended"):
        serve([([3, 4, 5], 3)])


@pytest.mark.gpu
def test_on_a_gpu_the_session_gives_its_kv_pool_and_graphs_back(saved):
    """A session's KV pool and decode graphs are freed when it ends: the memory allocated after
    a second session is what it was before it (the first one allocates what stays for good:
    cuBLAS's workspace, the kernels' buffers). The tiny model's pool is a few MiB (an H100: 6),
    so the test asks for most of it back, not for a size."""
    model = parts.load("08", "model").LlamaModel(saved.config, saved.weights, "cuda",
                                                 torch.bfloat16)
    with ours.engine_session(model, 64) as serve:
        serve([([3, 4, 5], 3)])
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with ours.engine_session(model, 64) as serve:
        serve([([3, 4, 5], 3)])
        during = torch.cuda.memory_allocated()
    after = torch.cuda.memory_allocated()
    took, left = during - before, after - before
    assert took > 2 * MiB, f"the engine took only {took / MiB:.0f} MiB: nothing to give back"
    assert left < took / 4, (
        f"{left / MiB:.0f} MiB still allocated after the session (of {took / MiB:.0f} MiB "
        f"during it): the engine was not freed")
