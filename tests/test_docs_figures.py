"""Every figure in the results tables of README.md and docs/benchmarks.md is held by the JSON
of docs/bench/ that its row names (or, for a table whose rows name none, the last one named
above it under the same heading): no figure is copied by hand from anywhere else."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("README.md", "docs/benchmarks.md")
JSON_NAME = re.compile(r"h\d+[\w-]*?-\d{4}-\d\d-\d\d[\w-]*\.json")
# a figure: digits with thousands commas and decimals, not glued to a word ("FlashAttention-2")
FIGURE = re.compile(r"(?<![\w.\-/])\d[\d,]*(?:\.\d+)?(?=x\b|%|[^\w]|$)")
NOT_FIGURES = ("where", "size", "json")   # columns of names; the first column is always one


def _numbers(node) -> list[float]:
    if isinstance(node, bool):
        return []
    if isinstance(node, (int, float)):
        return [float(node)]
    items = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    return [x for item in items for x in _numbers(item)]


def _held(figure: str, numbers: list[float]) -> bool:
    """Whether a JSON value reads as this figure at its precision, or as a percentage of a
    share (a value below 1)."""
    text = figure.replace(",", "")
    places = len(text.partition(".")[2])
    return any(f"{v:.{places}f}" == text or (v < 1 and f"{100 * v:.{places}f}" == text)
               for v in numbers)


def _quoted(name: str, heading: str, cells: dict[str, str]):
    """The part of docs/bench/NAME that a row of a table under this heading quotes."""
    doc = json.loads((ROOT / "docs" / "bench" / name).read_text())
    if "kernel" in heading.lower():
        first = next(iter(cells.values()))
        return _kernel_rows(doc["kernels"], first, cells.get("size", ""))
    return doc["profile"] if "decode step goes" in heading else doc["workloads"]


def _kernel_rows(kernels: dict, name: str, size: str) -> list[dict]:
    """The kernel table's rows of a kernel ("paged decode attention (14)") at the sizes given
    ("64 x 1024", "4096 / 8 x 512"): a kernel row's figures are looked for in those only."""
    def plain(text: str) -> str:
        return text.lower().replace("_", " ")
    sizes = {s.replace(" ", "") for s in re.findall(r"\d+(?: x \d+)?", size)}
    return [r for r in kernels["rows"] if plain(name).startswith(plain(r["kernel"]))
            and str(r["tokens"]).replace(" ", "") in sizes]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def results_rows(page: str):
    """(row, figure cells, the part of each JSON it quotes) of every table row that a JSON
    stands behind."""
    lines = (ROOT / page).read_text().splitlines()
    above: list[str] = []   # JSON names since the last heading
    heading = ""
    for i, line in enumerate(lines):
        if line.startswith("#"):
            above, heading = [], line
        elif not line.startswith("|"):
            above += JSON_NAME.findall(line)
        elif i + 1 < len(lines) and set(lines[i + 1].replace("|", "").strip()) <= set("-: "):
            header = [h.lower() for h in _cells(line)]
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                named = JSON_NAME.findall(row) or above[-1:]
                cells = dict(zip(header, _cells(row)))
                figures = [c for h, c in list(cells.items())[1:]
                           if not any(word in h for word in NOT_FIGURES)]
                if named:
                    yield row, figures, [_quoted(name, heading, cells)
                                         for name in named]


@pytest.mark.parametrize("page", PAGES)
def test_every_figure_is_in_its_json(page):
    rows = list(results_rows(page))
    assert len(rows) >= 5, f"{page}: no results table found"
    for row, cells, quoted in rows:
        numbers = _numbers(quoted)
        missing = [f for cell in cells for f in FIGURE.findall(cell) if not _held(f, numbers)]
        assert not missing, f"{page}: {missing} are in no JSON it names: {row[:100]}"


def test_every_json_kept_is_cited():
    cited = {name for page in PAGES for name in JSON_NAME.findall((ROOT / page).read_text())}
    kept = {p.name for p in (ROOT / "docs" / "bench").glob("*.json")}
    assert kept == cited, (f"kept but cited nowhere: {kept - cited}; "
                           f"cited but missing: {cited - kept}")


def test_a_figure_from_elsewhere_is_caught():
    """The check can fail: figures of runs whose JSON is not kept are in no kept file."""
    workloads = _quoted("h200-2026-12-04.json", "## Results", {})
    assert _held("44,337", _numbers(workloads)) and _held("71.5", _numbers(workloads))
    assert not _held("46,073", _numbers(workloads)) and not _held("0.777", _numbers(workloads))
