"""bench.results, bench.targets, bench.report and bench.plot on a document built the way
`python3 -m bench` builds it (its section functions), from synthetic numbers."""
from __future__ import annotations

import json

import pytest

from bench import report, results, targets

ENV = {"gpu": "NVIDIA H200", "capability": "9.0", "driver": "580.159.04",
       "torch": "2.11.0+cu130", "cuda": "13.0", "transformers": "5.17.0", "python": "3.12.3",
       "date": "2026-12-01T00:00:00+00:00", "commit": "abc123"}
SWEEP = (1, 8, 32, 64, 128, 256)


def synthetic_document() -> dict:
    doc = results.new_document(ENV, {"source": "random", "dtype": "bfloat16", "eos": "ignored"},
                               {"quick": False})
    doc["copy_bandwidth_GBps"] = 4280.0
    doc["transformers_config"] = {"name": "static cache + torch.compile", "cache": "static",
                                  "fallback_reason": None, "first_warmup_s": 70.0,
                                  "warmup_s": 80.0}
    w = doc["workloads"]
    # ours 142,248 tokens in 4 s = 35,562 tok/s; transformers 14,224.8 tok/s: 2.5x
    w["offline"] = results.offline_section(256, (4.0, 142248), (10.0, 142248), 256, "")
    w["batch1"] = results.batch1_section(32, 256, 0.58, [1.30, 1.20, 1.25], [2.5, 2.6, 2.4])
    w["sweep"] = results.sweep_section(128, 128, [
        results.sweep_row(b, 128, (0.01 * b, 0.2 + 0.001 * b), (0.02 * b, 1.0 + 0.004 * b))
        for b in reversed(SWEEP)])
    w["ttft"] = results.ttft_section(4096, [40.0, 42.0, 41.0], None,
                                     {"transformers": "not run: budget"})
    w["prefix"] = results.prefix_section(256, 1000, (2.0, 16384), (4.0, 16384), (8.0, 16384))
    doc["kernels"] = {"copy_bandwidth_GBps": 4280.0, "rows": [
        {"kernel": "rmsnorm", "tokens": "4096", "bytes": 33554432, "flops": 0, "status": "ok",
         "ours": {"median_us": 14.0, "GBps": 2400.0, "pct_copy_bw": 56.0},
         "torch": {"median_us": 125.0, "GBps": 268.0, "pct_copy_bw": 6.3},
         "pct_of_same_bytes_copy": 111.0, "speedup": 8.9},
        {"kernel": "linear 2048->8192", "tokens": "4096", "bytes": 10**8, "flops": 1.374e11,
         "status": "ok", "ours": {"median_us": 184.0, "TFLOPS": 747.0, "pct_copy_bw": 15.0},
         "torch": {"median_us": 186.0, "TFLOPS": 739.0, "pct_copy_bw": 14.8},
         "pct_of_same_bytes_copy": 17.0, "speedup": 1.01},
        {"kernel": "prefill_attention", "tokens": "4096", "bytes": 0, "flops": 1, "status":
         "WRONG: mismatch", "ours": None, "torch": {"median_us": 187.0, "pct_copy_bw": 0.0},
         "pct_of_same_bytes_copy": None, "speedup": None}]}
    doc["profile"] = {"bandwidth": 4.28e12, "results": [
        {"batch": 1, "context": 512, "graph_replay_us": 1177.0, "engine_step_us": 1467.0,
         "floor_us": 594.0, "kernels": [{"name": "gemm", "us": 690.0, "launches": 65}],
         "chain": [{"name": "gemv [2]", "us": 301.5, "launches": 16}],
         "host_us": {"launch": 180.0, "schedule": 40.0, "collect": 60.0, "step": 1467.0,
                     "wait_and_rest": 1187.0}}]}
    doc["elapsed_s"] = 300.0
    doc["targets"] = targets.check(doc)
    return doc


def test_sections_compute_rates_and_ratios():
    doc = synthetic_document()
    w = doc["workloads"]
    assert w["offline"]["ours"]["tok_s"] == pytest.approx(35562.0)
    assert w["offline"]["ratio"] == pytest.approx(2.5)
    b = w["batch1"]
    assert b["ours"]["ms"] == pytest.approx(1.25)          # the median of the runs
    assert b["ours"]["share_of_floor"] == pytest.approx(0.58 / 1.25)
    assert b["ratio"] == pytest.approx(2.5 / 1.25)          # transformers ms / ours ms
    rows = w["sweep"]["rows"]
    assert [r["batch"] for r in rows] == list(SWEEP), "rows sorted by batch"
    r8 = rows[1]
    assert r8["ours"]["tok_s"] == pytest.approx(8 * 128 / 0.208)
    assert r8["ours"]["decode_tok_s"] == pytest.approx(8 * 127 / (0.208 - 0.08))
    assert r8["ratio"] == pytest.approx((8 * 128 / 0.208) / (8 * 128 / 1.032))
    assert w["ttft"]["transformers"] is None and w["ttft"]["ratio"] is None
    assert w["ttft"]["transformers_skipped"] == "not run: budget"
    assert w["prefix"]["caching_speedup"] == pytest.approx(2.0)
    assert w["prefix"]["ratio"] == pytest.approx(4.0)


def test_write_read_round_trip_and_schema(tmp_path):
    doc = synthetic_document()
    path = results.write(tmp_path / "sub" / "bench.json", doc)
    back = results.read(path)
    assert back == json.loads(json.dumps(doc))
    assert back["schema"] == results.SCHEMA
    assert set(results.ENVIRONMENT_KEYS) <= set(back["environment"])
    # what problems() must catch
    broken = json.loads(json.dumps(doc))
    del broken["environment"]["driver"]
    del broken["workloads"]["sweep"]["rows"][0]["transformers"]
    broken["workloads"]["nonsense"] = {}
    found = " | ".join(results.problems(broken))
    assert "environment lacks driver" in found
    assert "workloads.sweep: no 'transformers'" in found
    assert "unknown workload 'nonsense'" in found
    with pytest.raises(ValueError, match="driver"):
        results.write(tmp_path / "bad.json", broken)
    (tmp_path / "old.json").write_text(json.dumps({**doc, "schema": "other/0"}))
    with pytest.raises(ValueError, match="schema"):
        results.read(tmp_path / "old.json")
    unmeasured = results.not_measured("no CUDA device")
    assert results.problems(unmeasured) == []


def test_targets_say_by_how_much():
    checks = {c["target"]: c for c in synthetic_document()["targets"]}
    offline = checks["offline throughput >= 40,000 output tok/s"]
    assert offline["met"] is False
    assert "MISSED by 4,438 tok/s" in offline["text"] and "88.9% of the goal" in offline["text"]
    ratio = checks["offline throughput >= 3x transformers"]
    assert ratio["met"] is False and "2.50x against 3.00x" in ratio["text"]
    b1 = checks["batch-1 decode >= 75% of the bandwidth floor"]
    assert b1["met"] is False and b1["value"] == pytest.approx(0.464)
    assert "75% of the floor is 0.773 ms" in b1["text"]
    assert sum(c["target"].startswith("decode sweep batch") for c in checks.values()) == 6
    assert all(c["met"] for t, c in checks.items() if t.startswith("decode sweep batch"))
    # a share just short of its goal says so (0.748 must not print as 75% against 75%)
    close = targets.verdict("share", 0.748, 0.75, "%")
    assert close["met"] is False and "MISSED by 0.2%: 74.8% against 75.0%" in close["text"]
    # not measured is never met
    assert targets.verdict("x", None, 3.0, "x")["met"] is None


def test_summary_prints_every_table():
    text = report.summary(synthetic_document())
    for piece in ("NVIDIA H200", "driver 580.159.04", "35,562", "2.50x", "1.250 ms",
                  "46% of floor", "not run: budget", "| 256 |", "MISSED", "rmsnorm",
                  "747.0 TFLOP/s", "WRONG", "graph replay 1177 us", "| gemv [2] | 301.5 | 16 |",
                  "launch 180 us, schedule 40 us, collect 60 us, waiting for the GPU and the "
                  "rest 1187 us"):
        assert piece in text, f"{piece!r} missing from the summary:\n{text}"


def test_plot_from_written_json(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is in the test extra; "
                        "nox -s bench-plot installs it too")
    from bench import plot
    path = results.write(tmp_path / "bench.json", synthetic_document())
    series = plot.sweep_series(results.read(path))
    assert series["batch"] == list(SWEEP)
    assert series["ours"][0] == pytest.approx(128 / 0.201)
    kseries = plot.kernel_series(results.read(path))
    # the roofline of the run: 4280 GB/s, and 747 TFLOP/s (the best GEMM row, ours)
    assert kseries["peak_TFLOPS"] == 747.0 and kseries["note"][1] == "747 TFLOP/s"
    assert kseries["ours"][0] == pytest.approx(100 * 33554432 / 4280e9 / 14e-6)   # bytes-bound
    assert kseries["ours"][1] == pytest.approx(100 * 1.374e11 / 747e12 / 184e-6)  # FLOP-bound
    assert kseries["torch"][1] == pytest.approx(100 * 1.374e11 / 747e12 / 186e-6)
    assert kseries["ours"][2] is None
    assert plot.main([str(path), "--out", str(tmp_path / "png")]) == 0
    for name in ("sweep.png", "kernels.png"):
        png = (tmp_path / "png" / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name


def test_plot_refuses_what_it_cannot_draw(tmp_path, capsys):
    from bench import plot
    empty = results.write(tmp_path / "nothing.json", results.not_measured("no CUDA device"))
    assert plot.main([str(empty)]) == 1
    assert "nothing to plot" in capsys.readouterr().out
    (tmp_path / "junk.json").write_text("{}")
    assert plot.main([str(tmp_path / "junk.json")]) == 1


def test_report_says_what_is_wrong_with_a_file(tmp_path, capsys):
    from bench import report
    (tmp_path / "bad.json").write_text("{bad")
    assert report.main(["--help"]) == 0, "--help was read as a file name"
    assert report.main([]) == 2
    assert report.main([str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().out
    assert report.main([str(tmp_path / "bad.json")]) == 2
    assert "bad.json" in capsys.readouterr().out
    (tmp_path / "list.json").write_text("[1]")
    assert report.main([str(tmp_path / "list.json")]) == 2
    assert "a JSON object, not list" in capsys.readouterr().out


def wrong_structure(doc: dict, where: str) -> dict:
    """doc (a copy) with one piece replaced by a value of the wrong JSON type."""
    doc = json.loads(json.dumps(doc))
    if where == "workload":
        doc["workloads"]["offline"] = "fast"
    elif where == "rows":
        doc["workloads"]["sweep"]["rows"] = None
    elif where == "row":
        doc["workloads"]["sweep"]["rows"][0] = 7
    elif where == "workloads":
        doc["workloads"] = [1]
    elif where == "kernels":
        doc["kernels"] = "fast"
    elif where == "kernel-row":
        doc["kernels"]["rows"][0] = None
    elif where == "environment":
        doc["environment"] = ["H200"]
    return doc


STRUCTURES = {
    "workload": "workloads.offline is a string, expected an object",
    "rows": "workloads.sweep.rows is null, expected a list",
    "row": "workloads.sweep.rows[0] is a number, expected an object",
    "workloads": "workloads is a list, expected an object",
    "kernels": "kernels is a string, expected an object",
    "kernel-row": "kernels.rows[0] is null, expected an object",
    "environment": "environment is a list, expected an object",
}


@pytest.mark.parametrize("where", list(STRUCTURES))
def test_a_file_of_the_wrong_structure_is_one_line(tmp_path, capsys, where):
    """The right schema with a workload that is a string, or "rows": null, crashed the
    validator (AttributeError, TypeError) in bench.report and bench.plot."""
    from bench import plot
    path = tmp_path / "odd.json"
    path.write_text(json.dumps(wrong_structure(synthetic_document(), where)))
    assert report.main([str(path)]) == 2
    assert capsys.readouterr().out == f"bench.report: {path}: {STRUCTURES[where]}\n"
    assert plot.main([str(path)]) == 1   # plot's status for a file it cannot read
    assert capsys.readouterr().out == f"bench.plot: {path}: {STRUCTURES[where]}\n"


def test_commit_is_only_read_from_the_checkout_itself(tmp_path):
    """A tree copied into a folder of another git repository (a snapshot on a GPU machine) has
    no commit of its own: it must not be labelled with the outer repository's."""
    import subprocess
    from bench import results
    outer = tmp_path / "outer"
    inner = outer / "snapshot"
    inner.mkdir(parents=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(outer)], check=True)
    (outer / "f").write_text("x")
    subprocess.run(git + ["-C", str(outer), "add", "f"], check=True)
    subprocess.run(git + ["-C", str(outer), "commit", "-qm", "c"], check=True)
    assert results.commit(inner) is None, "the snapshot took the outer repository's commit"
    head = results.commit(outer)
    assert head is not None and len(head) == 12, f"the checkout itself has a commit: {head!r}"


def test_kernel_table_names_its_l2_flush():
    """The kernel table says how the L2 was emptied: documents from before the read flush
    have no l2_flush and were written with the write flush."""
    doc = synthetic_document()
    assert "cold L2 by a write flush" in report.kernels_table(doc)
    doc["kernels"]["l2_flush"] = "read"
    assert "cold L2 by a read flush" in report.kernels_table(doc)
