"""`python3 -m bench` without a GPU, its flags, and transformers' side falling back (CPU)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import __main__ as cli
from bench import hf, results

ROOT = Path(__file__).resolve().parent.parent


def test_no_cuda_says_so_and_exits_0(tmp_path):
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so this is the no-CUDA path on every machine.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "bench", "--out", str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device here; nothing was measured" in proc.stdout
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["measured"] is False and "no CUDA" in doc["reason"]
    assert results.problems(doc) == []


def test_flags():
    args = cli.parse_args(["--only", "sweep, kernels", "--out", "d", "--skip-hf"])
    assert args.workloads == ["sweep", "kernels"] and args.json == str(Path("d") / "bench.json")
    assert cli.parse_args([]).workloads == list(cli.ALL)
    assert cli.parse_args(["--json", "x.json", "--out", "d"]).json == "x.json"
    with pytest.raises(SystemExit):
        cli.parse_args(["--only", "offline,nonsense"])
    with pytest.raises(SystemExit):
        cli.parse_args(["--hf-cache", "paged"])


def test_bad_flags_are_usage_errors_without_a_gpu(tmp_path, capsys):
    """Argument errors are caught before the GPU check: clear on any machine, and on a GPU
    before minutes of model loading (a file in the JSON's way would fail only at the end)."""
    (tmp_path / "file").write_text("")
    cases = [(["--only", ""], "names no workload"), (["--only", " , "], "names no workload"),
             (["--budget", "nan"], "--budget"), (["--budget", "-1"], "--budget"),
             (["--hf-compile-limit", "-5"], "--hf-compile-limit"),
             (["--model", str(tmp_path / "nope")], "not a directory"),
             (["--out", str(tmp_path / "file")], "not a directory"),
             (["--json", str(tmp_path)], "is a directory"),
             (["--shape", "gpt2"], "unknown shape 'gpt2'"),
             (["--shape", "qwen3-0.6b", "--model", str(tmp_path)], "give one")]
    for argv, needle in cases:
        with pytest.raises(SystemExit) as e:
            cli.parse_args(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and needle in err.strip().splitlines()[-1], (argv, err)
    args = cli.parse_args(["--budget", "0", "--hf-compile-limit", "0", "--model", str(tmp_path),
                           "--out", str(tmp_path / "new" / "dir")])
    assert args.budget == 0 and args.json == str(tmp_path / "new" / "dir" / "bench.json")
    assert cli.parse_args([]).shape == "Llama-3.2-1B"
    assert cli.parse_args(["--shape", "qwen3-0.6b"]).shape == "Qwen3-0.6B"


@pytest.mark.parametrize("module,argv,needle", [
    ("kernels", ["--json", "{tmp}/file/k.json"], "--json {tmp}/file/k.json cannot be written"),
    ("kernels", ["--json", "{tmp}"], "it is a directory"),
    ("kernels", ["--only", "rmsnrom"], "unknown --only name(s) ['rmsnrom']"),
    ("kernels", ["--only", ""], "--only names no kernel"),
    ("engine", ["--json", "{tmp}/file/e.json"], "cannot be written"),
    ("throughput", ["--json", "{tmp}/file/t.json"], "cannot be written"),
    ("profile", ["--json", "{tmp}/file/p.json"], "cannot be written"),
    ("profile", ["--batch", "0"], "--batch and --context must be at least 1"),
    ("plot", ["x.json", "--out", "{tmp}/file"], "--out {tmp}/file cannot be a folder"),
], ids=["kernels-json-folder", "kernels-json-dir", "kernels-only", "kernels-only-empty",
        "engine-json", "throughput-json", "profile-json", "profile-batch", "plot-out"])
def test_the_other_bench_commands_refuse_bad_flags_on_any_machine(tmp_path, capsys, module,
                                                                   argv, needle):
    """Checked before the GPU check, as `python3 -m bench` does: without a GPU a bad --json
    path was a traceback after 'nothing was measured' (on a GPU: the JSON of minutes of timing
    lost at the end), a mistyped --only name read 'nothing was measured', exit 0, and
    bench.plot's --out on a file was a traceback."""
    import importlib
    (tmp_path / "file").write_text("")
    main = importlib.import_module(f"bench.{module}").main
    with pytest.raises(SystemExit) as e:
        main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle.replace("{tmp}", str(tmp_path)) in err, err


def test_plot_names_a_file_that_is_not_json(tmp_path, capsys):
    """With several files, 'Expecting value: line 1 column 1' did not say which one."""
    from bench import plot
    (tmp_path / "bad.json").write_text("{bad")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe")
    for name in ("bad.json", "bin.json"):
        assert plot.main([str(tmp_path / name)]) == 1
        out = capsys.readouterr().out
        assert f"{tmp_path / name}: not " in out, out


class FakeModel:
    """Records generate() calls; the static cache raises, as a failed compile would."""
    device = torch.device("cpu")

    def __init__(self):
        self.calls = []

    def generate(self, **kw):
        self.calls.append(kw)
        if kw.get("cache_implementation") == "static":
            raise RuntimeError("compile went wrong\nmore detail")
        return kw["input_ids"]


def test_transformers_falls_back_to_the_dynamic_cache_and_says_so():
    model, logged = FakeModel(), []
    side = hf.Transformers(model, "static", compile_limit_s=0, log=logged.append)
    requests = [([5, 6, 7], 600), ([8, 9], 100)]
    seconds, tokens = side.serving(64, dynamic_cap=256)(requests)
    assert side.cache == "dynamic"
    assert "static + compile failed: RuntimeError: compile went wrong" in side.name
    assert any("falling back" in line for line in logged)
    assert tokens == 256 + 100, "the dynamic cache serves each request's first 256 tokens"
    static, warm, timed = model.calls
    assert static["cache_implementation"] == "static" and static["max_cache_len"] >= 64
    assert "cache_implementation" not in timed and timed["max_new_tokens"] == 256
    assert warm["max_new_tokens"] == hf.WARM_STEPS, "a warm-up of the same shape runs first"
    ids, mask = timed["input_ids"], timed["attention_mask"]
    assert ids.tolist() == [[5, 6, 7], [0, 8, 9]] and mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    # a second call of the same shape is not warmed up again
    side.serve(requests, 64, dynamic_cap=256)
    assert len(model.calls) == 4
    assert side.describe()["fallback_reason"].startswith("RuntimeError")


def test_deadline_interrupts_a_long_compile():
    import time
    with pytest.raises(hf.CompileTimeout):
        with hf.deadline(0.2):
            time.sleep(5)


def test_chain_table_adds_up_to_the_span_and_tells_the_layers_gemvs_apart():
    """bench.profile's chain: each kernel is charged its end minus the previous end (under PDL
    it starts early, so its own duration would count the overlap twice). Two layers here, each
    gemv, attn, gemv; an embedding first, alone; the lm_head's gemv after the layers."""
    from bench.profile import chain_table
    spans = [("embed", 0.0, 2.0),
             ("gemv", 1.0, 10.0), ("attn", 8.0, 15.0), ("gemv", 14.0, 18.0),   # layer 0
             ("gemv", 17.0, 27.0), ("attn", 26.0, 30.0), ("gemv", 31.0, 36.0),  # layer 1
             ("gemv", 35.0, 40.0)]                                              # lm_head
    rows = {name: (us, n) for name, us, n in chain_table(list(reversed(spans)), layers=2)}
    # increments, by hand: embed 2; gemv[0] 8 and 9; attn 5 and 3; gemv[1] 3 and 6; after 4
    assert rows == {"gemv [0]": (17.0, 2), "gemv [1]": (9.0, 2), "attn": (8.0, 2),
                    "embed": (2.0, 1), "gemv [after]": (4.0, 1)}, rows
    assert sum(us for us, _ in rows.values()) == 40.0, "the rows add up to the whole span"
    assert chain_table([], layers=2) == []


def test_host_breakdown_on_a_cpu_engine(tmp_path):
    """bench.profile's host accounting on a tiny CPU engine: the parts are measured, they add
    up to no more than the step, and the engine's own methods are back afterwards."""
    from bench.profile import host_breakdown
    from course import parts
    from course.testing import fixtures
    from solutions.engine.llm_engine import LLMEngine
    from solutions.engine.model_runner import EngineConfig
    fixtures.save_tiny_llama(tmp_path, "gqa_tied", eos_token_id=None)
    config = parts.load("01", "config").load_config(tmp_path)
    weights = parts.load("01", "checkpoint").load_weights(tmp_path, config)
    model = parts.load("08", "model").LlamaModel(config, weights, "cpu", torch.float32)
    engine = LLMEngine(model, None, (), EngineConfig(max_model_len=64))
    SamplingParams = parts.load("11", "sampling_params").SamplingParams
    for prompt in ([5, 6, 7], [8, 9], [10, 11, 12, 13]):
        engine.add_request(prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    host = host_breakdown(engine, 8)
    assert set(host) == {"launch", "schedule", "collect", "step", "wait_and_rest"}
    assert all(host[k] > 0 for k in ("launch", "schedule", "collect", "step"))
    assert host["launch"] + host["schedule"] + host["collect"] <= host["step"] * 1.001
    assert "launch" not in vars(engine.runner) and "_collect" not in vars(engine)
    assert "schedule" not in vars(engine.scheduler)
    assert engine.has_unfinished()   # 9 steps of 20 tokens: still running, as measured
