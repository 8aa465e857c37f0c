"""`grade NN --bench` without a GPU: the message and exit status, which ops a stage times, and the
pytest-benchmark plumbing (grader/bench_student.py) run on CPU stand-ins for the GPU cases."""
from __future__ import annotations

import json

import pytest
import torch

from bench.cases import FAMILIES
from course import manifest, ops
from grader import bench as gbench
from grader.__main__ import main


def test_no_gpu_says_not_measured_and_exits_0(capsys):
    assert gbench.main(manifest.find("04"), cuda=False) == 0
    assert "stage 04 benchmark: not measured: no CUDA device" in capsys.readouterr().out


def test_the_command_line_takes_bench(capsys, monkeypatch):
    monkeypatch.setattr(gbench.environment, "has_cuda", lambda: False)
    assert main(["04", "--bench"]) == 0
    assert "not measured: no CUDA device" in capsys.readouterr().out


def test_a_stage_without_kernel_cases_says_so(capsys):
    assert gbench.main(manifest.find("02"), cuda=True) == 0
    assert "stage 02 has no kernel benchmark" in capsys.readouterr().out


def test_stage_to_ops():
    assert gbench.families("04") == ["rmsnorm", "fused_add_rmsnorm"]
    assert gbench.families("4") == gbench.families("04")
    assert gbench.families("07") == gbench.families("12") == ["flash_attention"]
    assert gbench.families("08") == ["silu_mul", "argmax"]
    assert gbench.families("13") == ["rope_cache_write"]
    assert gbench.families("02") == []
    assert gbench.case_of_stage("flash_attention", "prefill_attention (07)", "07")
    assert not gbench.case_of_stage("flash_attention", "prefill_attention (12)", "07")
    # the table names only real families and real ops, and every op with a family is covered
    assert set(gbench.FAMILY_OPS) <= set(FAMILIES)
    named = {op for names in gbench.FAMILY_OPS.values() for op in names}
    assert named <= set(ops.OPS)


class _FakeTimer:
    l2_bytes = 1 << 20
    flush_mode = "read"

    def __init__(self, quick):
        pass

    def flush(self):
        pass


def _fake_cases(stage_id):
    from bench.cases import Case

    def make_set(g):
        return {"x": torch.randn(64, 32, generator=g)}
    good = Case("double", "64", 2 * 64 * 32 * 4, make_set, torch_fn=lambda s: s["x"] * 2,
                ours_fn=lambda s: s["x"] + s["x"], via="fake")
    wrong = Case("double", "128", 2 * 64 * 32 * 4, make_set, torch_fn=lambda s: s["x"] * 2,
                 ours_fn=lambda s: s["x"] * 3, via="fake")
    todo = Case("double", "256", 2 * 64 * 32 * 4, make_set, torch_fn=lambda s: s["x"] * 2,
                skip="TODO stage 99: write it")
    return [good, wrong, todo]


def test_the_pytest_benchmark_run_and_its_table(tmp_path, monkeypatch, capsys):
    """The real child file, in process, on CPU cases: timed rows land in pytest-benchmark's JSON
    with what the table needs, a wrong op is not timed and says WRONG, a missing one says why."""
    from bench import timing
    monkeypatch.setattr(gbench, "stage_cases", _fake_cases)
    monkeypatch.setattr(timing, "Timer", _FakeTimer)
    monkeypatch.setattr(timing, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    tables = {}
    for side in ("student", "reference"):
        notes = tmp_path / f"{side}.notes"
        monkeypatch.setenv(gbench.STAGE_ENV, "99")
        monkeypatch.setenv(gbench.SIDE_ENV, side)
        monkeypatch.setenv(gbench.NOTES_ENV, str(notes))
        out = tmp_path / f"{side}.json"
        pytest.main([str(gbench.BENCH_FILE), "-q", "-p", "no:cacheprovider",
                     "--benchmark-json", str(out)])
        tables[side] = (json.loads(out.read_text())["benchmarks"],
                        [json.loads(x) for x in notes.read_text().splitlines()]
                        if notes.exists() else [])
    capsys.readouterr()
    student, student_notes = tables["student"]
    assert [(r["extra_info"]["tokens"], r["extra_info"]["column"]) for r in student] == \
        [("64", "yours")]
    assert student[0]["stats"]["rounds"] == 50
    assert {n["tokens"]: n["status"].split(":")[0] for n in student_notes} == \
        {"128": "WRONG", "256": "TODO stage 99"}
    reference, _ = tables["reference"]
    assert {r["extra_info"]["column"] for r in reference} == {"reference", "torch", "copy"}
    rows = gbench.collect(student + reference, student_notes)
    text = gbench.render(rows, ("yours", "reference", "torch", "copy"))
    first = text.splitlines()[1]
    assert first.startswith("double  64") and "GB/s" in first and "% of copy)" in first
    assert "WRONG" in text.splitlines()[2] and "TODO stage 99" in text.splitlines()[3]


def test_tflops_for_a_case_with_flops():
    rows = gbench.collect([{"extra_info": {"kernel": "linear", "tokens": "64", "bytes": 10,
                                          "flops": 2 * 10**12, "column": "yours"},
                           "stats": {"median": 0.5}}], [])
    assert "4.0 TFLOP/s" in gbench.render(rows, ("yours",))


def test_a_child_that_leaves_an_empty_json_prints_its_output(tmp_path, monkeypatch, capsys):
    """pytest-benchmark opens its JSON at start and fills it at the end: a timing child that
    crashes leaves it empty. Seen on the H200 as a JSONDecodeError traceback; now the run says
    it measured nothing and shows the child's last lines."""
    import subprocess

    def crashed_child(cmd, **kwargs):
        out = cmd[cmd.index("--benchmark-json") + 1]
        open(out, "w").close()
        return subprocess.CompletedProcess(cmd, -11, stdout="collected 3 items\n",
                                           stderr="Fatal Python error: Segmentation fault\n")
    monkeypatch.setattr(gbench.environment, "has_cuda", lambda: True)
    monkeypatch.setattr(gbench.subprocess, "run", crashed_child)
    assert gbench.main(manifest.find("04"), tmp_path, solution=True) == 0
    out = capsys.readouterr().out
    assert "the reference run measured nothing" in out
    assert "Segmentation fault" in out
