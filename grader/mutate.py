"""Mutants of a stage's parts: the mistakes its lesson names, and automatic ones.

A mutant is a part's reference file with one small change, the kind a learner makes. Two
sources:

- listed: `stages/NN_name/tests/mutants.toml`, one `[[mutant]]` per common mistake the
  lesson names: `name` (the mistake), `file` (a part), `pattern` (text that occurs exactly
  once in the reference; or a list of such, for a mistake of several edits), `replacement`
  (or a list, one per pattern), and `expect` (words the failing test's message must
  contain, so that the learner is told which mistake it is). Kernels (.cu) have only these.
- automatic: every small change of the Python code inside the SOLUTION regions (what the
  learner writes): an operator or comparison swapped, a condition negated, `and`/`or`
  swapped, `not` dropped, a constant changed, a statement removed, two arguments swapped.
  Some change nothing observable; `[[equivalent]]` entries of the same file (`mutant`: the
  mutant's id, `reason`) list them, each with why no test can tell.

The automatic mutator works on the source text (the AST gives each node's span), not
through mutmut: the parts are imported by path under names of their own (course/parts.py),
which mutmut's import hook cannot map back to a file, and the mutants must be confined to the
SOLUTION regions.
"""
from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

from course import manifest
from grader import sync


@dataclass(frozen=True)
class Mutant:
    """One mutated part: `text` replaces the reference `file` of the stage."""
    id: str
    file: str
    text: str
    listed: bool = False
    expect: str = ""


class MutantListError(ValueError):
    """A mutants.toml entry that no longer fits the reference (its pattern is gone)."""


def list_file(stage: manifest.Stage) -> Path:
    return manifest.ROOT / "stages" / stage.dir / "tests" / "mutants.toml"


def _entries(stage: manifest.Stage) -> dict:
    path = list_file(stage)
    return tomllib.loads(path.read_text()) if path.exists() else {}


def listed(stage: manifest.Stage) -> list[Mutant]:
    """The stage's named mistakes, each applied to its reference file."""
    out = []
    for entry in _entries(stage).get("mutant", []):
        file = entry["file"]
        if file not in stage.parts:
            raise MutantListError(f"{list_file(stage)}: {entry['name']}: {file} is not a part")
        text = (stage.solution_dir() / file).read_text()
        patterns, replacements = entry["pattern"], entry["replacement"]
        if isinstance(patterns, str):   # one edit, or several: lists of the same length
            patterns, replacements = [patterns], [replacements]
        for pattern, replacement in zip(patterns, replacements, strict=True):
            count = text.count(pattern)
            if count != 1:
                raise MutantListError(f"{list_file(stage)}: {entry['name']}: a pattern occurs "
                                      f"{count} times in {file} (it must occur once)")
            text = text.replace(pattern, replacement)
        out.append(Mutant(entry["name"], file, text, True, entry.get("expect", "")))
    return out


def equivalents(stage: manifest.Stage) -> dict[str, str]:
    """Automatic mutant id -> why it is equivalent (no test can tell it from the reference)."""
    return {e["mutant"]: e["reason"] for e in _entries(stage).get("equivalent", [])}


def regions(text: str) -> list[tuple[int, int]]:
    """The (first, last) 1-based line numbers of each SOLUTION region's body."""
    out, start = [], None
    for i, line in enumerate(text.splitlines(), 1):
        if sync.BEGIN.match(line):
            start = i + 1
        elif sync.END.match(line) and start is not None:
            out.append((start, i - 1))
            start = None
    return out


_SWAPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult,
          ast.Div: ast.Mult, ast.Mod: ast.FloorDiv, ast.Lt: ast.LtE, ast.LtE: ast.Lt,
          ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
          ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In,
          ast.And: ast.Or, ast.Or: ast.And}
_REMOVABLE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Return, ast.If, ast.For,
              ast.While, ast.Break, ast.Continue, ast.Delete)


def _changes(node: ast.AST) -> list[tuple[ast.AST, str]]:
    """(the node whose span is replaced, the replacement text) for each mutation of node."""
    def swapped(**fields) -> str:
        copy = type(node)(**{**{f: getattr(node, f) for f in node._fields}, **fields})
        return f"({ast.unparse(copy)})"
    out: list[tuple[ast.AST, str]] = []
    if isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in _SWAPS:
        text = swapped(op=_SWAPS[type(node.op)]())
        out.append((node, text[1:-1] if isinstance(node, ast.AugAssign) else text))
    elif isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _SWAPS:
        out.append((node, swapped(ops=[_SWAPS[type(node.ops[0])]()])))
    elif isinstance(node, ast.BoolOp):
        out.append((node, swapped(op=_SWAPS[type(node.op)]())))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        out.append((node, f"({ast.unparse(node.operand)})"))
    elif isinstance(node, ast.Constant) and type(node.value) in (int, bool):
        value = (not node.value) if isinstance(node.value, bool) else node.value + 1
        out.append((node, repr(value)))
    elif isinstance(node, ast.Call) and len(node.args) >= 2 and not (
            isinstance(node.func, ast.Name) and node.func.id in ("min", "max")):
        args = [node.args[1], node.args[0], *node.args[2:]]
        out.append((node, swapped(args=args)))
    if isinstance(node, (ast.If, ast.While)):
        out.append((node.test, f"(not ({ast.unparse(node.test)}))"))
    if isinstance(node, _REMOVABLE):
        out.append((node, "pass"))
    return out


def _splice(lines: list[bytes], node: ast.AST, new: str) -> str:
    """The source with node's span (AST offsets count UTF-8 bytes) replaced by `new`."""
    head = b"".join(lines[: node.lineno - 1]) + lines[node.lineno - 1][: node.col_offset]
    tail = lines[node.end_lineno - 1][node.end_col_offset:] + b"".join(lines[node.end_lineno:])
    return (head + new.encode() + tail).decode()


def _one_line(text: str, limit: int = 70) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def automatic(stage: manifest.Stage) -> list[Mutant]:
    """Every automatic mutant of the stage's Python parts, inside their SOLUTION regions."""
    out: list[Mutant] = []
    for file in (p for p in stage.parts if p.endswith(".py")):
        text = (stage.solution_dir() / file).read_text()
        lines = text.encode().splitlines(keepends=True)
        spans = regions(text)
        tree = ast.parse(text)
        seen, ids = {text}, set()
        for func in (n for n in ast.walk(tree)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(func):
                if not hasattr(node, "lineno") or not any(
                        a <= node.lineno and node.end_lineno <= b for a, b in spans):
                    continue
                for target, new in _changes(node):
                    mutated = _splice(lines, target, new)
                    if mutated in seen or not _parses(mutated):
                        continue
                    seen.add(mutated)
                    old = _one_line(ast.get_source_segment(text, target) or "")
                    base = f"{file}::{func.name} `{old}` -> `{_one_line(new)}`"
                    mid, k = base, 1
                    while mid in ids:
                        k += 1
                        mid = f"{base} (#{k})"
                    ids.add(mid)
                    out.append(Mutant(mid, file, mutated))
    return out


def _parses(text: str) -> bool:
    try:
        ast.parse(text)
    except SyntaxError:
        return False
    return True
