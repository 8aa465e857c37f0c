"""Who handed in whose code: shared lines between submissions and with the reference.

The solutions are public in this course, so a copy of the reference is the cheat no sandbox
stops. Each part is reduced to its meaningful lines: comments and blank lines dropped,
whitespace collapsed, string literals and identifiers replaced by placeholders numbered per
line (renaming variables changes nothing), and every line the skeleton already has removed
(everyone starts from it). A pair is suspicious when most of one side's lines appear in the
other; the share is |lines of A also in B| / |lines of A|.
"""
from __future__ import annotations

import keyword
import re
from dataclasses import dataclass

from course import manifest

REFERENCE = "reference"   # the course's solution, as the report names it (no student may be)
THRESHOLD = 0.8
MIN_LINES = 8
_TOKEN = re.compile(r"""("(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*')|([A-Za-z_]\w*)|(\S)""")
_C_WORDS = {"if", "else", "for", "while", "return", "const", "int", "float", "void", "auto",
            "struct", "template", "typename", "unsigned", "__global__", "__device__",
            "__shared__", "break", "continue", "do", "switch", "case", "static"}
KEEP = set(keyword.kwlist) | _C_WORDS


@dataclass
class Pair:
    stage: str
    a: str
    b: str          # a classmate, or REFERENCE
    share: float    # of a's meaningful lines that b has too
    lines: int      # a's meaningful lines

    def as_dict(self) -> dict:
        return {"stage": self.stage, "student": self.a, "other": self.b,
                "share": round(self.share, 3), "lines": self.lines}


def normalize(text: str, suffix: str) -> set[str]:
    out = set()
    comment = "#" if suffix == ".py" else "//"
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S) if suffix != ".py" else text
    for line in text.splitlines():
        line = line.split(comment, 1)[0].strip()
        if not line:
            continue
        names: dict[str, str] = {}
        tokens = []
        for string, name, other in _TOKEN.findall(line):
            if string:
                tokens.append("S")
            elif name:
                tokens.append(name if name in KEEP else names.setdefault(name, f"v{len(names)}"))
            else:
                tokens.append(other)
        norm = " ".join(tokens)
        if len(norm) > 3:
            out.add(norm)
    return out


def meaningful(files: dict[str, bytes], stage: manifest.Stage) -> set[tuple[str, str]]:
    """(part, normalized line) for every line that is not already in the skeleton."""
    lines = set()
    for part, data in files.items():
        suffix = "." + part.rsplit(".", 1)[-1]
        skeleton = stage.skeleton_dir() / part
        base = normalize(skeleton.read_text(errors="replace"), suffix) if skeleton.exists() \
            else set()
        lines |= {(part, ln) for ln in normalize(data.decode("utf-8", errors="replace"),
                                                 suffix) - base}
    return lines


def report(stage: manifest.Stage, submissions: dict[str, dict[str, bytes]],
           threshold: float = THRESHOLD) -> list[Pair]:
    """Suspicious pairs for one stage, most similar first."""
    return report_lines(stage, {name: meaningful(files, stage)
                                for name, files in submissions.items()}, threshold)


def report_lines(stage: manifest.Stage, lines: dict[str, set[tuple[str, str]]],
                 threshold: float = THRESHOLD) -> list[Pair]:
    """report() from each submission's meaningful lines (what a class grade keeps)."""
    reference = {p: (stage.solution_dir() / p).read_bytes() for p in stage.parts
                 if (stage.solution_dir() / p).exists()}
    others = {**lines, REFERENCE: meaningful(reference, stage)}
    pairs = []
    for a, mine in lines.items():
        if len(mine) < MIN_LINES:
            continue
        for b, theirs in others.items():
            if b != a:
                share = len(mine & theirs) / len(mine)
                if share >= threshold:
                    pairs.append(Pair(stage.id, a, b, share, len(mine)))
    return sorted(pairs, key=lambda p: (-p.share, p.a, p.b))
