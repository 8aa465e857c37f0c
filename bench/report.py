"""The benchmark's printed summary: markdown tables from a result document (bench.results).

Built from the document alone, so a saved JSON prints the same summary as the run that wrote
it: `python3 -m bench.report FILE.json`. Standard library only.
"""
from __future__ import annotations

import sys

from bench import results, serve, targets

HF = "transformers"


def _n(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{format(x, spec)}{suffix}"


def _x(r: float | None) -> str:
    return _n(r, ".2f", "x")


def _why(section: dict, side: str) -> str:
    return section.get(f"{side}_skipped", "not run")


def header(doc: dict) -> str:
    env, model = doc.get("environment", {}), doc.get("model", {})
    hf = doc.get("transformers_config") or {}
    lines = [f"GPU {env.get('gpu')} (driver {env.get('driver')}), torch {env.get('torch')}, "
             f"CUDA {env.get('cuda')}, transformers {env.get('transformers')}, "
             f"commit {env.get('commit')}, {env.get('date')}",
             f"model: {model.get('source')}, {model.get('dtype')}; {model.get('eos')}"]
    if doc.get("copy_bandwidth_GBps"):
        lines.append(f"copy bandwidth {doc['copy_bandwidth_GBps']:.0f} GB/s (1 GiB "
                     "device-to-device, read + write): the ceiling of every floor below")
    if hf:
        warm = hf.get("first_warmup_s")
        lines.append(f"transformers ran as: {hf.get('name')}"
                     + (f" (first warm-up{', compile included' if hf.get('cache') == 'static' else ''}"
                        f": {warm:.0f} s; warm-ups {hf.get('warmup_s', 0):.0f} s in all, never "
                        "timed)" if warm else ""))
    return "\n".join(lines)


def workloads_table(doc: dict) -> str:
    w = doc.get("workloads", {})
    rows = ["| workload | ours | transformers | ours vs transformers |", "|---|---:|---:|---:|"]

    def side(s: dict, key: str, fmt: str, suffix: str, who: str) -> str:
        v = s.get(who)
        return _n(v[key], fmt, suffix) if v else _why(s, who)

    if "offline" in w:
        o = w["offline"]
        hf_note = (o.get(HF) or {}).get("note", "")
        rows.append(f"| offline throughput, {o['requests']} requests (output tok/s)"
                    f"{' (transformers: ' + hf_note + ')' if hf_note else ''} | "
                    f"{side(o, 'tok_s', ',.0f', '', 'ours')} | {side(o, 'tok_s', ',.0f', '', HF)} "
                    f"| {_x(o['ratio'])} |")
    if "batch1" in w:
        b = w["batch1"]
        share = (b.get("ours") or {}).get("share_of_floor")
        rows.append(f"| batch-1 decode, prompt {b['prompt']}, {b['new']} new (ms per token; "
                    f"floor {_n(b.get('floor_ms'), '.3f')} ms) | "
                    f"{side(b, 'ms', '.3f', ' ms', 'ours')} ({_n(share and 100 * share, '.0f')}% "
                    f"of floor) | {side(b, 'ms', '.3f', ' ms', HF)} | {_x(b['ratio'])} |")
    if "ttft" in w:
        t = w["ttft"]
        rows.append(f"| time to first token, {t['prompt']}-token prompt (ms) | "
                    f"{side(t, 'ms', '.1f', ' ms', 'ours')} | {side(t, 'ms', '.1f', ' ms', HF)} "
                    f"| {_x(t['ratio'])} |")
    if "prefix" in w:
        p = w["prefix"]
        off = p.get("ours_caching_off")
        rows.append(f"| shared {p['prefix_tokens']}-token prefix, {p['requests']} requests "
                    f"(tok/s; ours caching on, off: {_n(off and off['tok_s'], ',.0f')}, "
                    f"speedup {_x(p.get('caching_speedup'))}) | "
                    f"{side(p, 'tok_s', ',.0f', '', 'ours')} | {side(p, 'tok_s', ',.0f', '', HF)} "
                    f"| {_x(p['ratio'])} |")
    return "\n".join(rows)


def sweep_table(doc: dict) -> str:
    s = doc.get("workloads", {}).get("sweep")
    if not s:
        return ""
    rows = [f"Decode sweep: prompt {s['prompt']}, {s['new']} new tokens per request; output "
            "tok/s over the whole run (decode-only tok/s: the tokens after the first).",
            "| batch | ours tok/s | ours decode tok/s | transformers tok/s "
            "| transformers decode tok/s | ours vs transformers |",
            "|---:|---:|---:|---:|---:|---:|"]
    for r in s["rows"]:
        o, h = r.get("ours") or {}, r.get(HF) or {}
        rows.append(f"| {r['batch']} | {_n(o.get('tok_s'), ',.0f')} "
                    f"| {_n(o.get('decode_tok_s'), ',.0f')} | {_n(h.get('tok_s'), ',.0f')} "
                    f"| {_n(h.get('decode_tok_s'), ',.0f')} | {_x(r['ratio'])} |")
    return "\n".join(rows)


def kernels_table(doc: dict) -> str:
    k = doc.get("kernels")
    if not k:
        return ""
    # a document without l2_flush comes from the older method: a flush by writing
    flush = k.get("l2_flush", "write")
    rows = [f"Kernels (medians, cold L2 by a {flush} flush): share of the 1 GiB copy's bandwidth "
            "and of a copy of the same bytes (the ceiling at that size); speedup = torch us / "
            "ours us.",
            "| kernel | T | ours us | ours rate | % copy bw | % same-bytes copy | torch us "
            "| speedup |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in k["rows"]:
        o, t = r.get("ours") or {}, r.get("torch") or {}
        rate = (_n(o.get("TFLOPS"), ".1f", " TFLOP/s") if r.get("flops")
                else _n(o.get("GBps"), ".0f", " GB/s"))
        status = "" if r.get("status") == "ok" else f" ({r['status'][:50]})"
        rows.append(f"| {r['kernel']}{status} | {r['tokens']} | {_n(o.get('median_us'), '.1f')} "
                    f"| {rate} | {_n(o.get('pct_copy_bw'), '.0f', '%')} "
                    f"| {_n(r.get('pct_of_same_bytes_copy'), '.0f', '%')} "
                    f"| {_n(t.get('median_us'), '.1f')} | {_x(r.get('speedup'))} |")
    return "\n".join(rows)


def host_line(h: dict) -> str:
    """bench.profile's host_breakdown of an engine step, as one line."""
    pace = ("near zero: the host sets the pace" if h["wait_and_rest"] < 0.05 * h["step"]
            else "the GPU sets the pace")
    return (f"host per engine step: launch {h['launch']:.0f} us, schedule {h['schedule']:.0f} us, "
            f"collect {h['collect']:.0f} us, waiting for the GPU and the rest "
            f"{h['wait_and_rest']:.0f} us ({pace})")


def profile_table(doc: dict, top: int = 8) -> str:
    p = doc.get("profile")
    if not p:
        return ""
    def kernel_rows(title: str, us: str, rows: list[dict]) -> list[str]:
        return ([f"| kernel ({title}) | {us} | launches |", "|---|---:|---:|"]
                + [f"| {k['name']} | {k['us']:.1f} | {k['launches']} |" for k in rows[:top]])

    out = []
    for r in p["results"]:
        replay, floor = r["graph_replay_us"], r["floor_us"]
        out.append(f"Decode step at batch {r['batch']}, context {r['context']}: graph replay "
                   f"{replay:.0f} us, engine step {r['engine_step_us']:.0f} us "
                   f"({r['engine_step_us'] - replay:+.0f} us: what runs outside the graph, less "
                   f"the replay's own start, which steps in a row overlap), floor {floor:.0f} us "
                   f"(replay at {100 * floor / replay:.0f}% of it).")
        if r.get("host_us"):
            out.append(host_line(r["host_us"]))
        # Under PDL a kernel starts before the one before it ends: its time includes that wait.
        out += kernel_rows("one eager step; launched early under PDL: its time counts the wait "
                           "for the kernel before", "GPU us", r["kernels"])
        if r.get("chain"):
            out += [""] + kernel_rows("one graph replay: what it adds to the step, its end minus "
                                      "the end of the kernel before", "us", r["chain"])
        elif r.get("chain_skipped"):
            out.append(f"(No graph-replay chain: {r['chain_skipped']}.)")
    return "\n".join(out)


def targets_table(doc: dict) -> str:
    # judged again from the numbers: a file's stored verdicts may come from older rules
    checks = targets.check(doc) or doc.get("targets")
    if not checks:
        return ""
    return "\n".join(["Goals (set for one H200):", "| goal | result |", "|---|---|"]
                     + [f"| {c['target']} | {c['text']} |" for c in checks])


def summary(doc: dict) -> str:
    """Every table of the document that has numbers, separated by blank lines."""
    parts = [header(doc), workloads_table(doc), sweep_table(doc), serve.table(doc),
             targets_table(doc),
             profile_table(doc), kernels_table(doc)]
    return "\n\n".join(p for p in parts if p)


def main(argv: list[str] | None = None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths or paths[0] in ("-h", "--help"):
        print("usage: python3 -m bench.report FILE.json [FILE.json ...]\n"
              "prints the tables of benchmark results written by python3 -m bench")
        return 0 if paths else 2
    for path in paths:
        try:
            doc = results.read(path)
        except (OSError, ValueError) as e:   # a missing file, or not the JSON of a run
            print(f"bench.report: {e}" if str(path) in str(e) else f"bench.report: {path}: {e}")
            return 2
        print(summary(doc) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
