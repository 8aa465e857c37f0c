"""bench.serve on the CPU: the serve workload's whole path (the server in this process, its
engine in another, client processes streaming over HTTP, the section and its table) on a tiny
model and a few requests. Speed is the GPU run's business: here only that every client gets
its tokens and the numbers are there."""
from __future__ import annotations

import math
import multiprocessing
from functools import partial

from bench import results, serve
from bench import __main__ as cli
from course.testing import fixtures


def test_serve_is_a_workload_of_the_cli():
    assert cli.parse_args(["--only", "serve,offline"]).workloads == ["offline", "serve"]


def test_the_serve_workload_on_a_tiny_model(tmp_path):
    fixtures.save_tiny_llama(tmp_path, "gqa_tied", eos_token_id=None)
    requests = [([3 + i, 4 + i, 5 + i][: 1 + i % 3] * 2, 2 + i % 4) for i in range(6)]
    # 16 positions: the engine's warm-up then runs 8-token prompts, cheap on a CPU
    build = partial(serve.engine_of, 16, 64, model_dir=str(tmp_path), device="cpu")
    described: list[str] = []
    # a chunk per step: every request then has several, and inter-token latencies
    raw = serve.measure(build, requests, clients=2, describe=described.append,
                        stream_interval_s=0)
    assert multiprocessing.active_children() == [], "the engine process has ended"
    assert described and "KV cache" in described[0], described
    section = serve.section(requests, raw, 1000.0, serve.transformers_skipped())
    ours = section["ours"]
    assert ours["tokens"] == sum(n for _, n in requests)
    assert [sum(r["counts"]) for r in raw["records"]] == [n for _, n in requests]
    assert ours["clients"] == 6 and ours["client_processes"] == 2
    for key in ("ttft_ms", "itl_ms"):
        assert all(math.isfinite(v) and v >= 0 for v in ours[key].values()), ours
    assert section["share_of_offline"] == ours["tok_s"] / 1000.0
    assert section["transformers"] is None and section["transformers_skipped"].startswith("not")
    doc = {"schema": results.SCHEMA, "measured": True,
           "environment": dict.fromkeys(results.ENVIRONMENT_KEYS), "workloads": {"serve": section}}
    assert results.problems(doc) == []
    assert "| output tok/s |" in serve.table(doc) and "6 streaming HTTP clients" in \
        serve.table(doc)


def test_the_stand_in_measure_runs_end_to_end(capsys):
    """bench.serve_standin on a few short requests: the stand-in engine in the engine process,
    a client process, every token counted (section() raises otherwise), the figures printed."""
    from bench import serve_standin
    assert serve_standin.main(["--requests", "8", "--scale", "64", "--clients", "1",
                               "--step-ms", "1", "--host-ms", "0"]) == 0
    out = capsys.readouterr().out
    assert "offline (the stand-in alone)" in out and "of offline" in out, out
    assert "server CPU per token" in out, out
