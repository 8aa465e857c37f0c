"""Generate every skeleton in stages/ from its solution in solutions/ (`nox -s sync-stages`).

In a solution part, a region between two marker comments is what the student writes:

    # BEGIN SOLUTION: parse the 8-byte header length
    ...reference code...
    # END SOLUTION

becomes, in the skeleton,

    # TODO stage 01: parse the 8-byte header length (about 6 lines)
    raise NotImplementedError("TODO stage 01: parse the 8-byte header length (about 6 lines)")

Python regions get that `raise` (a `|` in a Python hint is just text). C++/CUDA regions get
only the comment, unless the marker names a stub after ` | ` (`// BEGIN SOLUTION: launch it
| return "{todo}";`), where {todo} stands for the TODO message. So every skeleton compiles
and fails with "TODO stage NN: ..." instead of crashing. Sync refuses, naming the line, a
marker it cannot pair, a comment that looks like a misspelled marker (it would leak the
answer into the skeleton), and a Python skeleton that would not parse (a marker indented
other than its region).

The other files of a solution folder (the op module with its torch-native twin, the binding,
wrappers) are given, not exercises: they are copied into the stage folder under a header that
says so, so the stage folder is all a student reads. The grader never uses those copies; the
resolver takes given files from solutions/. `--check` reports any generated file out of sync.
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

from course import manifest

BEGIN = re.compile(r"^(?P<indent>\s*)(?P<comment>#|//)\s*BEGIN SOLUTION(?::\s*(?P<hint>[^|]*?))?"
                   r"\s*(?:\|\s*(?P<stub>.*?))?\s*$")
END = re.compile(r"^\s*(#|//)\s*END SOLUTION\s*$")
# "# begin solution", "// END SOLUTON", "#BEGIN_SOLUTION": meant as markers, matched by neither
LOOKALIKE = re.compile(r"^\s*(#|//)\s*(begin|end)[\s_-]*solu", re.IGNORECASE)


class SyncError(ValueError):
    """A solution file that no skeleton can be generated from ("path:line: what")."""


class MarkerError(SyncError):
    """A solution file whose markers do not pair up."""


def skeleton_text(text: str, stage_id: str, filename: str) -> str:
    """The skeleton of one solution file."""
    out: list[str] = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        m = BEGIN.match(lines[i])
        if END.match(lines[i]):
            raise MarkerError(f"{filename}:{i + 1}: END SOLUTION without BEGIN SOLUTION")
        if not m:
            if LOOKALIKE.match(lines[i]):
                raise _lookalike(filename, i, lines[i])
            out.append(lines[i])
            i += 1
            continue
        start = i
        i += 1
        body = 0
        while i < len(lines) and not END.match(lines[i]):
            if BEGIN.match(lines[i]):
                raise MarkerError(f"{filename}:{i + 1}: BEGIN SOLUTION inside another region "
                                  f"(opened at line {start + 1})")
            if LOOKALIKE.match(lines[i]):
                raise _lookalike(filename, i, lines[i])
            body += bool(lines[i].strip())
            i += 1
        if i == len(lines):
            raise MarkerError(f"{filename}:{start + 1}: BEGIN SOLUTION is never closed")
        i += 1  # the END line
        indent, comment = m["indent"], m["comment"]
        hint, stub = (m["hint"] or "").strip(), m["stub"]
        if comment == "#" and stub is not None:   # Python has no stubs: "a | b" is the hint
            hint, stub = f"{hint} | {stub}".strip(" |"), None
        hint = hint or "complete this part"
        todo = f"TODO stage {stage_id}: {hint} (about {body} line{'s' if body != 1 else ''})"
        out.append(f"{indent}{comment} {todo}\n")
        if stub is None and comment == "#":
            stub = 'raise NotImplementedError("{todo}")'
        if stub:
            literal = todo.replace("\\", "\\\\").replace('"', '\\"')  # inside "..." in C++ and Python
            out.append(f"{indent}{stub.replace('{todo}', literal)}\n")
    return "".join(out)


def _lookalike(filename: str, i: int, line: str) -> MarkerError:
    return MarkerError(f"{filename}:{i + 1}: {line.strip()!r} looks like a marker but is not "
                       "one (exactly `BEGIN SOLUTION: hint` and `END SOLUTION`, in capitals): "
                       "the answer would be left in the skeleton")


def missing_solutions() -> list[Path]:
    """Parts (and files to read) the manifest lists that do not exist."""
    listed = [s.solution_dir() / part for s in manifest.stages() for part in s.parts]
    listed += [manifest.ROOT / rel for s in manifest.stages() for rel in s.reading]
    return [p for p in listed if not p.exists()]


def expected_skeletons() -> dict[Path, str]:
    """Every skeleton part file that sync would write, with its text. SyncError, naming the
    file and line, for a solution whose markers do not pair up or whose Python does not parse
    (its skeleton would hide the mistake behind a TODO)."""
    files: dict[Path, str] = {}
    for stage in manifest.stages():
        for part in stage.parts:
            src = stage.solution_dir() / part
            if not src.exists():
                continue
            text, rel = src.read_text(), str(src.relative_to(manifest.ROOT))
            if src.suffix == ".py":
                try:
                    ast.parse(text, filename=rel)
                except SyntaxError as e:
                    raise SyncError(f"{rel}:{e.lineno}: {e.msg}") from None
            skeleton = skeleton_text(text, stage.id, rel)
            if src.suffix == ".py":
                try:
                    ast.parse(skeleton, filename=rel)
                except SyntaxError as e:
                    raise SyncError(f"{rel}: its skeleton would not parse (skeleton line "
                                    f"{e.lineno}: {e.msg}): is a BEGIN SOLUTION marker indented "
                                    "like the code of its region?") from None
            files[stage.skeleton_dir() / part] = skeleton
    return files


# Comment syntax by suffix: a given file of another kind is not copied (none exists yet).
COMMENT = {".py": "#", ".cpp": "//", ".cu": "//", ".h": "//", ".cuh": "//"}


def given_header(source: Path, comment: str, reading: bool = False) -> str:
    """reading: a copy of stages.toml's `reading` (the engine's), not of the stage's own."""
    rel = source.relative_to(manifest.ROOT)
    why = (f"Nothing runs this copy (the engine runs the\n{comment} original)" if reading
           else f"It is not graded (the grader uses the reference\n{comment} copy)")
    return (f"{comment} GIVEN FILE: generated from {rel} by `nox -s sync-stages`.\n"
            f"{comment} Read it; do not edit it. {why}, and any edit here is overwritten.\n")


def given_files(stage: manifest.Stage) -> list[Path]:
    """The solution files of a stage that are not parts: copied into its folder, never graded."""
    if not stage.solution_dir().is_dir():
        return []
    return [p for p in sorted(stage.solution_dir().iterdir())
            if p.is_file() and p.name not in stage.parts and p.suffix in COMMENT]


def reading_files(stage: manifest.Stage) -> dict[Path, Path]:
    """The files of stages.toml's `reading` (the engine around the parts), each mapped to its
    copy in the stage folder: solutions/engine/llm.py -> stages/NN_name/engine/llm.py."""
    solutions = manifest.ROOT / "solutions"
    return {stage.skeleton_dir() / (manifest.ROOT / rel).relative_to(solutions): manifest.ROOT / rel
            for rel in stage.reading if (manifest.ROOT / rel).is_file()}


def expected_given() -> dict[Path, str]:
    """Every given file that sync would write into stages/, with its text."""
    copies = {}
    for stage in manifest.stages():
        for src in given_files(stage):
            copies[stage.skeleton_dir() / src.name] = (given_header(src, COMMENT[src.suffix])
                                                       + src.read_text())
        for copy, src in reading_files(stage).items():
            copies[copy] = given_header(src, COMMENT[src.suffix], reading=True) + src.read_text()
    return copies


def expected_files() -> dict[Path, str]:
    """Everything sync generates under stages/: skeletons and given files."""
    return {**expected_skeletons(), **expected_given()}


def out_of_sync(expected: dict[Path, str] | None = None) -> list[Path]:
    """The generated files that differ from `expected` (default: expected_files())."""
    expected = expected_files() if expected is None else expected
    return [p for p, text in expected.items() if not p.exists() or p.read_text() != text]


README = manifest.ROOT / "README.md"
MAP_BEGIN, MAP_END = "<!-- stage map: generated from stages.toml by grader/sync.py -->", "<!-- end of stage map -->"


def stage_map() -> str:
    """The README's stage table, from the manifest."""
    rows = ["| stage | title | GPU | status |", "| --- | --- | --- | --- |"]
    for s in manifest.stages():
        status = "ready" if s.ready else "planned (lesson outline)"
        rows.append(f"| [{s.dir}](stages/{s.dir}/README.md) | {s.title} | "
                    f"{'yes' if s.gpu else 'no'} | {status} |")
    return "\n".join(rows)


def readme_text() -> str | None:
    """README.md with its stage map regenerated (None when README has no map markers)."""
    text = README.read_text() if README.exists() else ""
    if MAP_BEGIN not in text or MAP_END not in text:
        return None
    head, rest = text.split(MAP_BEGIN, 1)
    _, tail = rest.split(MAP_END, 1)
    return f"{head}{MAP_BEGIN}\n{stage_map()}\n{MAP_END}{tail}"


def main(argv: list[str]) -> int:
    """Exit status 0 done (or in sync), 1 out of sync (--check), 2 a solution that sync cannot
    use: listed but missing, unbalanced markers, Python that does not parse; or a bad
    argument. On 2 nothing is written."""
    parser = argparse.ArgumentParser(
        prog="python3 -m grader.sync",
        description="Regenerate stages/ (skeletons, given files) and README's stage map from "
                    "solutions/ and stages.toml.")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a generated file is out of sync")
    try:
        check = parser.parse_args(argv).check
    except SystemExit as e:   # --help (0) or a typo (2): never a sync nobody asked for
        return int(e.code or 0)
    missing = missing_solutions()
    for src in missing:   # sync cannot create it: say what can
        print(f"error: missing solution: {src.relative_to(manifest.ROOT)} is listed in "
              "stages.toml: create it, or remove it from stages.toml", file=sys.stderr)
    if missing:
        return 2
    try:
        expected = expected_files()
    except SyncError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    readme = readme_text()
    if check:
        stale = out_of_sync(expected)
        if readme is not None and readme != README.read_text():
            stale.append(README)
        for p in stale:
            print(f"out of sync: {p.relative_to(manifest.ROOT)}")
        if stale:
            print("skeletons are generated from solutions/: run `nox -s sync-stages` "
                  "(or python3 -m grader.sync) and commit the result")
            return 1
        print("every skeleton and given file is in sync with its solution")
        return 0
    for path, text in expected.items():
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(manifest.ROOT)}")
    if readme is not None and readme != README.read_text():
        README.write_text(readme)
        print("wrote README.md (stage map)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
