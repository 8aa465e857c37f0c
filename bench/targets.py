"""The engine's goals on one H200, checked against a result document, saying by how much.

    offline throughput   >= 40,000 output tok/s, and >= 3x transformers
    batch-1 decode       >= 75% of the bandwidth floor (floor / measured ms; on the H200 the
                         floor is ~0.58 ms, so <= ~0.77 ms per token), and >= 3x transformers
    decode sweep         >= 3x transformers at every batch size
A goal whose number was not measured is reported as such, never as met.
"""
from __future__ import annotations

OFFLINE_TOK_S = 40_000.0
BATCH1_FLOOR_SHARE = 0.75
RATIO = 3.0


def verdict(target: str, value: float | None, goal: float, unit: str,
            higher_is_better: bool = True, detail: str = "") -> dict:
    """{"target", "value", "goal", "met", "text"}; text says the shortfall when missed."""
    if value is None:
        return {"target": target, "value": None, "goal": goal, "met": None,
                "text": "not measured"}
    met = value >= goal if higher_is_better else value <= goal
    gap = abs(goal - value)
    if met:
        text = f"met: {_fmt(value, unit)} (goal {_fmt(goal, unit)})"
    elif unit == "x":
        text = (f"MISSED: {_fmt(value, unit)} against {_fmt(goal, unit)}, "
                + (f"{goal / value:.1f}x short" if value > 0 else "nothing measured ahead"))
    else:
        share = value / goal if higher_is_better else goal / value
        text = (f"MISSED by {_fmt(gap, unit)}: {_fmt(value, unit)} against "
                f"{_fmt(goal, unit)} ({100 * share:.1f}% of the goal)")
    return {"target": target, "value": value, "goal": goal, "met": met,
            "text": text + (f"; {detail}" if detail else "")}


def _fmt(x: float, unit: str) -> str:
    if unit == "x":
        return f"{x:.2f}x"
    if unit == "tok/s":
        return f"{x:,.0f} tok/s"
    if unit == "ms":
        return f"{x:.3f} ms"
    if unit == "%":  # one decimal: a share just short of its goal must not read as the goal
        return f"{100 * x:.1f}%"
    return f"{x:g} {unit}"


def _get(section: dict | None, *keys):
    for k in keys:
        if not isinstance(section, dict):
            return None
        section = section.get(k)
    return section


def check(doc: dict) -> list[dict]:
    """Every goal the document's workloads bear on: offline, batch 1, the sweep."""
    w = doc.get("workloads", {})
    out = []
    if "offline" in w:
        o = w["offline"]
        out.append(verdict("offline throughput >= 40,000 output tok/s",
                           _get(o, "ours", "tok_s"), OFFLINE_TOK_S, "tok/s"))
        out.append(verdict("offline throughput >= 3x transformers", o.get("ratio"), RATIO, "x"))
    if "batch1" in w:
        b = w["batch1"]
        floor, ms = b.get("floor_ms"), _get(b, "ours", "ms")
        detail = ""
        if floor and ms:
            goal_ms = floor / BATCH1_FLOOR_SHARE
            detail = (f"{ms:.3f} ms per token, floor {floor:.3f} ms, 75% of the floor is "
                      f"{goal_ms:.3f} ms ({ms - goal_ms:+.3f} ms from it)")
        out.append(verdict("batch-1 decode >= 75% of the bandwidth floor",
                           _get(b, "ours", "share_of_floor"), BATCH1_FLOOR_SHARE, "%",
                           detail=detail))
        out.append(verdict("batch-1 decode >= 3x transformers", b.get("ratio"), RATIO, "x"))
    if "sweep" in w:
        for row in w["sweep"]["rows"]:
            out.append(verdict(f"decode sweep batch {row['batch']} >= 3x transformers",
                               row.get("ratio"), RATIO, "x"))
    return out
