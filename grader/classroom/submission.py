"""Submissions are data: find the students, check their files, copy what grading needs.

A student is a folder under SUBMISSIONS (a clone of the course, or just its NN_name/ stage
folders). Nothing of a submission is used in place: the part files of the stage being graded
are read (regular files only, size-capped) and copied into a fresh workspace; everything else
a stage folder holds is never seen by the grader's Python. Symlinks (of the student folder,
the stage folder or a part), stray bytecode and special files are reported, never followed.
"""
from __future__ import annotations

import os
import re
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

from course import manifest

MAX_PART_BYTES = 1 << 20


@dataclass
class Student:
    name: str
    path: Path
    invalid: str = ""                 # why this entry is not a submission at all (scores 0)

    @property
    def root(self) -> Path:
        """The folder that holds the NN_name/ stage folders."""
        inner = self.path / "stages"
        return inner if inner.is_dir() and not inner.is_symlink() else self.path


@dataclass
class Parts:
    files: dict[str, bytes] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


SKIPPED = ("__MACOSX",)   # what a zip made on a Mac holds beside the folders zipped


def students(submissions: Path, reports: tuple[Path, ...] = ()) -> list[Student]:
    """Every entry under SUBMISSIONS but dot-entries, a zip's __MACOSX/ and the grader's own
    reports (`--csv grades.csv` run inside SUBMISSIONS: the next run graded it as a student);
    the ones that are not plain folders are invalid."""
    out = []
    ours = {r.resolve() for r in reports}
    for entry in sorted(submissions.iterdir()):
        if entry.name.startswith(".") or entry.name in SKIPPED or entry.resolve() in ours:
            continue
        if entry.is_symlink():
            out.append(Student(entry.name, entry, "a symbolic link, not a folder: not graded"))
        elif not entry.is_dir():
            out.append(Student(entry.name, entry, "a plain file, not a folder of stage "
                                                  "folders: not a valid submission"))
        else:
            out.append(Student(entry.name, entry))
    return out


def read_parts(student: Student, stage: manifest.Stage) -> Parts:
    """The student's part files of `stage`, as bytes, with what was wrong with the folder."""
    found = Parts()
    folder = student.root / stage.dir
    if folder.is_symlink() or student.root.is_symlink():
        found.problems.append(f"{stage.dir} is a symbolic link: rejected")
        return found
    if not folder.is_dir():
        found.problems.append(f"no {stage.dir}/ folder")
        return found
    for part in stage.parts:
        why = _unusable(folder / part)
        if why:
            found.problems.append(f"{stage.dir}/{part}: {why}")
            continue
        data = (folder / part).read_bytes()
        why = foreign_include(data) if part.endswith((".cu", ".cpp", ".h", ".cuh")) else ""
        if why:
            found.problems.append(f"{stage.dir}/{part}: {why}: rejected")
            continue
        found.files[part] = data
    found.problems += _strays(folder)
    return found


def _unusable(path: Path) -> str:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    if stat.S_ISLNK(st.st_mode):
        return f"a symbolic link (to {os.readlink(path)}): rejected"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file (a FIFO? a device?): rejected"
    if st.st_size > MAX_PART_BYTES:
        return f"{st.st_size} bytes, over the {MAX_PART_BYTES >> 10} KiB limit: rejected"
    return ""


_INCLUDE = re.compile(r"^[ \t]*#[ \t]*(include_next|include|import|embed)\b[ \t]*(.*)$", re.M)
_HAS_INCLUDE = re.compile(r"__has_include(?:_next)?\s*\(\s*(.*?)\s*\)")


def foreign_include(data: bytes) -> str:
    """Why a kernel source reaches for a file outside the course's headers, or "".

    A kernel may include system, toolkit and torch headers (`<cuda_bf16.h>`, `<cub/cub.cuh>`)
    and the course's shared headers ("tvllm.h", "vec.cuh"), all by a plain relative name.
    An absolute path or `..` (the reference's .cu, a classmate's, /dev/zero), a computed
    include (`#include MACRO`), `#embed` and the assembler's `.incbin` are refused: with
    bubblewrap such a path would not be there anyway, without it it would be read.
    Line splices, comments and the `%:` digraph are undone first."""
    text = data.decode("utf-8", errors="replace").replace("\\\r\n", "").replace("\\\n", "")
    text = text.replace("%:", "#").replace("??=", "#")
    operands = []
    # as written and without comments: a comment cannot hide an include from both
    for version in (text, _without_comments(text)):
        operands += [(m.group(1), m.group(2).strip()) for m in _INCLUDE.finditer(version)]
        operands += [("__has_include", m.group(1)) for m in _HAS_INCLUDE.finditer(version)]
    if ".incbin" in text:
        return "uses the assembler's .incbin (embeds a file)"
    for kind, operand in operands:
        if kind == "embed":
            return "uses #embed (embeds a file)"
        m = re.fullmatch(r'(?:"([^"]*)"|<([^>]*)>)\s*(?://.*|/\*.*)?', operand)
        if not m:
            return f"#{kind} {operand[:80]!r}: a computed include (only a literal name may be included)"
        name = m.group(1) if m.group(1) is not None else m.group(2)
        if name.startswith(("/", "\\", "~")) or ".." in re.split(r"[/\\]+", name):
            return f"#{kind} {operand[:120]}: a path outside the course's headers"
    return ""


def _without_comments(text: str) -> str:
    """C comments replaced by a space; string and character literals kept as they are."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        elif text.startswith("//", i):
            i = text.find("\n", i)
            i = n if i < 0 else i
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            out.append(" ")
            i = n if j < 0 else j + 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _strays(folder: Path) -> list[str]:
    """Bytecode, symlinks and special files in the stage folder: never used, reported."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):   # does not follow symlinks
        here = Path(dirpath)
        for name in dirnames + filenames:
            p = here / name
            rel = p.relative_to(folder.parent)
            if name == "__pycache__" or name.endswith((".pyc", ".pyo")):
                out.append(f"{rel}: stray bytecode, ignored (only source is graded)")
            elif p.is_symlink():
                out.append(f"{rel}: a symbolic link, ignored")
            elif not p.is_dir() and not p.is_file():
                out.append(f"{rel}: a special file (FIFO, socket, device), ignored")
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        if len(out) > 20:
            return out[:20] + ["... (more not listed)"]
    return out


def write_student(dest: Path, stage: manifest.Stage, files: dict[str, bytes]) -> Path:
    """A fresh student root holding only these part files; returns the root."""
    folder = dest / stage.dir
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    _publish(dest)
    return dest


def write_worker_root(dest: Path, graded: manifest.Stage) -> Path:
    """What the student's process may see of the course: the runtime and the reference parts
    of other stages, but none of the graded stage's reference parts (so nothing can call or
    exec them) and no tests."""
    root = manifest.ROOT
    dest.mkdir(parents=True)
    shutil.copy2(root / "stages.toml", dest / "stages.toml")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(root / "course", dest / "course", ignore=ignore)
    (dest / "grader").mkdir()
    (dest / "grader" / "__init__.py").write_text("")
    shutil.copytree(root / "grader" / "classroom", dest / "grader" / "classroom", ignore=ignore)

    def skip(directory: str, names: list[str]) -> set[str]:
        hidden = set(ignore(directory, names))
        if Path(directory).resolve() == graded.solution_dir().resolve():
            hidden |= set(graded.parts) & set(names)
        return hidden
    shutil.copytree(root / "solutions", dest / "solutions", ignore=skip)
    _publish(dest)
    return dest


def _publish(tree: Path) -> None:
    """Read-only for everyone: the fallback's `nobody` can read it, nobody can change it."""
    for dirpath, dirnames, filenames in os.walk(tree):
        for name in filenames:
            os.chmod(Path(dirpath) / name, 0o444)
        os.chmod(dirpath, 0o555)
