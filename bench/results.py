"""The benchmark's JSON document: where it ran, each workload's numbers, rates and ratios.

    doc = new_document(environment(), model={...}, args={...})
    doc["workloads"]["offline"] = offline_section(requests=256, output_tokens=..., ours=(s, n), ...)
    write("bench.json", doc)          # read() checks it back (problems() lists what is wrong)

Every section is built here from raw measurements (seconds, token counts), so the rates and
ratios mean the same thing whoever fills them in: `python3 -m bench` with numbers from the GPU,
the tests with synthetic ones. Standard library only: bench.plot reads these files on machines
without torch. Units: seconds, ms, tokens/s (tok_s), GB/s; a ratio above 1 means this engine is
ahead of transformers. A side that did not run is null, with the reason in "<side>_skipped".
"""
from __future__ import annotations

import datetime
import json
import platform
import statistics
import subprocess
from pathlib import Path

SCHEMA = "tiny-vllm-bench/1"
WORKLOADS = ("offline", "batch1", "sweep", "ttft", "prefix", "serve")
ENVIRONMENT_KEYS = ("gpu", "driver", "torch", "cuda", "transformers", "python", "date", "commit")
ROOT = Path(__file__).resolve().parent.parent

Timing = tuple[float, int]    # (seconds, output tokens)


# ------------------------------------------------------------------------------ environment

def _command(args: list[str], cwd: Path = ROOT) -> str | None:
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=10, cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def commit(root: Path = ROOT) -> str | None:
    """The checkout's commit, with "+dirty" when tracked files have changed. None when `root`
    is not the top of a git checkout: a copy of the tree (e.g. `git archive`) inside some other
    repository must not be labelled with that repository's commit."""
    top = _command(["git", "rev-parse", "--show-toplevel"], root)
    if top is None or Path(top).resolve() != root.resolve():
        return None
    head = _command(["git", "rev-parse", "--short=12", "HEAD"], root)
    if head and _command(["git", "status", "--porcelain", "--untracked-files=no"], root):
        head += "+dirty"
    return head


def environment() -> dict:
    """GPU, driver, torch, CUDA, transformers and Python versions, the date and the commit."""
    import torch
    try:
        import transformers
        hf_version = transformers.__version__
    except ImportError:
        hf_version = None
    cuda = torch.cuda.is_available()
    driver = _command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return {"gpu": torch.cuda.get_device_name(0) if cuda else None,
            "capability": ".".join(map(str, torch.cuda.get_device_capability(0))) if cuda else None,
            "driver": driver.splitlines()[0] if driver else None,
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": hf_version, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit()}


# --------------------------------------------------------------------------------- sections

def new_document(env: dict, model: dict, args: dict) -> dict:
    """An empty result document: fill its workloads, kernels, profile and targets."""
    return {"schema": SCHEMA, "measured": True, "environment": env, "model": model,
            "args": args, "copy_bandwidth_GBps": None, "transformers_config": None,
            "workloads": {}, "kernels": None, "profile": None, "targets": [],
            "elapsed_s": None}


def not_measured(reason: str) -> dict:
    """The document of a run that measured nothing (no CUDA device), saying why."""
    return {"schema": SCHEMA, "measured": False, "reason": reason, "workloads": {}}


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs, or None when either is missing (or theirs is 0)."""
    if ours is None or theirs is None or theirs == 0:
        return None
    return ours / theirs


def rate(timing: Timing | None) -> dict | None:
    """{"seconds", "output_tokens", "tok_s"} of one run, or None."""
    if timing is None:
        return None
    seconds, tokens = timing
    return {"seconds": seconds, "output_tokens": tokens, "tok_s": tokens / seconds}


def _tok_s(side: dict | None) -> float | None:
    return None if side is None else side["tok_s"]


def _ms(runs: list[float] | None) -> dict | None:
    return None if not runs else {"ms": statistics.median(runs), "runs_ms": list(runs)}


def _skipped(section: dict, skipped: dict[str, str] | None) -> dict:
    for side, why in (skipped or {}).items():
        section[f"{side}_skipped"] = why
    return section


def offline_section(requests: int, ours: Timing | None, hf: Timing | None,
                    hf_requests: int | None = None, hf_note: str = "",
                    skipped: dict[str, str] | None = None) -> dict:
    """nano-vllm's workload: output tokens/s of each side; ratio = ours / transformers."""
    theirs = rate(hf)
    if theirs is not None:
        theirs.update(requests=hf_requests or requests, note=hf_note)
    section = {"requests": requests, "ours": rate(ours), "transformers": theirs,
               "ratio": ratio(_tok_s(rate(ours)), _tok_s(theirs))}
    return _skipped(section, skipped)


def batch1_section(prompt: int, new: int, floor_ms: float | None, ours_ms: list[float] | None,
                   hf_ms: list[float] | None, skipped: dict[str, str] | None = None) -> dict:
    """ms per token alone in the batch (median of runs_ms), its share of the bandwidth floor
    (floor / measured: 1.0 is the floor itself); ratio = transformers ms / ours ms."""
    sides = {"ours": _ms(ours_ms), "transformers": _ms(hf_ms)}
    for side in sides.values():
        if side is not None:
            side["share_of_floor"] = ratio(floor_ms, side["ms"])
    section = {"prompt": prompt, "new": new, "floor_ms": floor_ms, **sides,
               "ratio": ratio(sides["transformers"] and sides["transformers"]["ms"],
                              sides["ours"] and sides["ours"]["ms"])}
    return _skipped(section, skipped)


def sweep_row(batch: int, new: int, ours: tuple[float, float] | None,
              hf: tuple[float, float] | None) -> dict:
    """One batch size. ours, hf: (seconds to the first token of every request, seconds for
    all new tokens). tok_s counts every output token over the whole run (prefill included);
    decode_tok_s the tokens after the first over the time after the first."""
    def side(t: tuple[float, float] | None) -> dict | None:
        if t is None:
            return None
        first, total = t
        decode = batch * (new - 1) / (total - first) if total > first else None
        return {"first_s": first, "seconds": total, "tok_s": batch * new / total,
                "decode_tok_s": decode}
    o, h = side(ours), side(hf)
    return {"batch": batch, "ours": o, "transformers": h, "ratio": ratio(_tok_s(o), _tok_s(h))}


def sweep_section(prompt: int, new: int, rows: list[dict],
                  skipped: dict[str, str] | None = None) -> dict:
    """The decode sweep: one sweep_row per batch size, smallest first."""
    return _skipped({"prompt": prompt, "new": new,
                     "rows": sorted(rows, key=lambda r: r["batch"])}, skipped)


def ttft_section(prompt: int, ours_ms: list[float] | None, hf_ms: list[float] | None,
                 skipped: dict[str, str] | None = None) -> dict:
    """Time to first token of one prompt alone; ratio = transformers ms / ours ms."""
    o, h = _ms(ours_ms), _ms(hf_ms)
    return _skipped({"prompt": prompt, "ours": o, "transformers": h,
                     "ratio": ratio(h and h["ms"], o and o["ms"])}, skipped)


def prefix_section(requests: int, prefix_tokens: int, caching_on: Timing | None,
                   caching_off: Timing | None, hf: Timing | None,
                   skipped: dict[str, str] | None = None) -> dict:
    """The shared-prefix workload: ours with prefix caching on ("ours") and off, transformers
    (no prefix cache: one padded batch); caching_speedup = on / off, ratio = on / transformers."""
    on, off, theirs = rate(caching_on), rate(caching_off), rate(hf)
    return _skipped({"requests": requests, "prefix_tokens": prefix_tokens, "ours": on,
                     "ours_caching_off": off, "transformers": theirs,
                     "caching_speedup": ratio(_tok_s(on), _tok_s(off)),
                     "ratio": ratio(_tok_s(on), _tok_s(theirs))}, skipped)


# ------------------------------------------------------------------------------ read, write

def problems(doc: dict) -> list[str]:
    """What is wrong with a result document (empty: it is one this module would write)."""
    out = []
    if doc.get("schema") != SCHEMA:
        out.append(f"schema is {doc.get('schema')!r}, expected {SCHEMA!r}")
    if doc.get("measured") is False:
        return out + ([] if doc.get("reason") else ["an unmeasured document gives no reason"])
    if doc.get("measured") is not True:
        return out + [f"measured is {doc.get('measured')!r}, expected true or false"]
    # the structure is checked before it is walked: a hand-edited file can hold anything
    env = doc.get("environment") or {}
    if isinstance(env, dict):
        out += [f"environment lacks {k}" for k in ENVIRONMENT_KEYS if k not in env]
    else:
        out.append(f"environment is {_kind(env)}, expected an object")
    workloads = doc.get("workloads") or {}
    if not isinstance(workloads, dict):
        out.append(f"workloads is {_kind(workloads)}, expected an object")
        workloads = {}
    for name, section in workloads.items():
        if name not in WORKLOADS:
            out.append(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")
            continue
        if not isinstance(section, dict):
            out.append(f"workloads.{name} is {_kind(section)}, expected an object")
            continue
        rows = section.get("rows", [section])
        if not isinstance(rows, list):
            out.append(f"workloads.{name}.rows is {_kind(rows)}, expected a list")
            continue
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                out.append(f"workloads.{name}.rows[{i}] is {_kind(row)}, expected an object")
                continue
            for side in ("ours", "transformers"):
                if side not in row:
                    out.append(f"workloads.{name}: no {side!r} entry (null when not run)")
                elif row[side] is not None and not isinstance(row[side], dict):
                    out.append(f"workloads.{name}.{side} is {type(row[side]).__name__}")
            if "ratio" not in row:
                out.append(f"workloads.{name}: no 'ratio'")
    kernels = doc.get("kernels")
    if kernels is not None and not isinstance(kernels, dict):
        out.append(f"kernels is {_kind(kernels)}, expected an object")
    elif kernels is not None and not isinstance(kernels.get("rows"), list):
        out.append("kernels has no list of rows")
    elif kernels is not None:
        out += [f"kernels.rows[{i}] is {_kind(row)}, expected an object"
                for i, row in enumerate(kernels["rows"]) if not isinstance(row, dict)]
    return out


def _kind(value: object) -> str:
    """What a JSON value is, in JSON's words, for an error: 'null', 'a string', 'a list'."""
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "a list", dict: "an object"}.get(type(value), f"a {type(value).__name__}")


def write(path: str | Path, doc: dict) -> Path:
    """Write doc as JSON (creating the folder); ValueError if it is not a valid document."""
    bad = problems(doc)
    if bad:
        raise ValueError("not a valid benchmark document: " + "; ".join(bad))
    path = Path(path)
    write_json(path, doc)
    return path


def write_json(path: str | Path, doc: dict) -> None:
    """Any JSON of the benchmark (a bench module's --json too): whole or not at all, its
    folder made if missing, as every report of the project (grader.report.write_text)."""
    from grader.report import write_text
    write_text(Path(path), json.dumps(doc, indent=2) + "\n")


def read(path: str | Path) -> dict:
    """A result document from path; ValueError (saying what, and naming the file) if it is not
    one; OSError (naming it) if it cannot be read."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}), so not the "
                         "JSON of a run") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e}), so not the JSON of a run") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a result document is a JSON object, not {type(doc).__name__}")
    bad = problems(doc)
    if bad:
        raise ValueError(f"{path}: " + "; ".join(bad))
    return doc
