"""A class graded in shards (`--shard I/N`), and what `grader merge` checks before it joins them.

A student's shard is decided by the student's name alone (a hash, not a position in a list),
so the same student lands in the same shard on every machine, whatever else SUBMISSIONS
holds. Each shard's progress file begins with a header line that says which shard it is, the
stages and the students it was given; every grade line carries its basis (the tests' digest,
the hidden tests, the time limits, the device: cli.grade_basis). `merge` joins shards only
when all N are there, all grade the same stages against the same basis, no student is graded
twice and every student a shard was given has a grade of every stage.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

HEADER = "tiny-vllm class shard"    # the header line's "kind"
LIMITS = ("timeout", "compile_timeout", "student_timeout")


class ShardError(Exception):
    """Shards that cannot be merged, or a --shard that names none: one line says why."""


def parse(text: str) -> tuple[int, int]:
    """`I/N` (1 <= I <= N) as (I, N)."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise ShardError(f"--shard {text!r} must be I/N with 1 <= I <= N (--shard 2/8: the "
                         "second of 8 shards)")
    return int(match[1]), int(match[2])


def shard_of(student: str, count: int) -> int:
    """The shard (1..count) that grades `student`: stable across machines and runs."""
    digest = hashlib.sha256(student.encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") % count + 1


def header(index: int, count: int, stages: list[str], students: list[str]) -> dict:
    return {"kind": HEADER, "shard": [index, count], "stages": stages, "students": students}


@dataclass
class Shard:
    path: Path
    index: int
    count: int
    stages: list[str]
    students: list[str]
    records: list[dict] = field(default_factory=list)


def shard_in(path: Path) -> tuple[int, int] | None:
    """The (I, N) a progress file's header names, or None (no file, no header)."""
    try:
        with open(path, errors="replace") as f:
            head = _json(f.readline())
    except OSError:
        return None
    if isinstance(head, dict) and head.get("kind") == HEADER:
        return tuple(head["shard"])
    return None


def load(path: Path) -> Shard:
    """A shard's progress file: its header and its grades (a line cut off by a kill is
    skipped, as --resume skips it)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        raise ShardError(f"cannot read {path}: {e.strerror or e}") from None
    head = _json(lines[0]) if lines else None
    if not (isinstance(head, dict) and head.get("kind") == HEADER):
        raise ShardError(f"{path} is not a shard's progress file (its first line is not the "
                         "header `grader class --shard I/N` writes)")
    (index, count), stages, students = head["shard"], head["stages"], head["students"]
    shard = Shard(path, index, count, stages, students)
    for line in lines[1:]:
        record = _json(line)
        if isinstance(record, dict) and "student" in record and "stage" in record:
            shard.records.append(record)
    return shard


def _json(line: str) -> object:
    try:
        return json.loads(line)
    except ValueError:
        return None


def basis_differences(stage: str, a: dict, b: dict, when: tuple[str, str] = ("then", "now")
                      ) -> list[str]:
    """What differs between the bases of two grades of `stage`, each a phrase; `when` names
    the two sides ("then", "now" for --resume; two files for merge)."""
    first, second = when
    differ = []
    if a.get("tests") != b.get("tests"):
        differ.append(f"stage {stage}'s tests differ" + (
            f" ({a.get('hidden_tests')} hidden tests {first}, {b.get('hidden_tests')} {second})"
            if a.get("hidden_tests") != b.get("hidden_tests") else ""))
    differ += [f"--{limit.replace('_', '-')} {_number(a.get(limit))} {first}, "
               f"{_number(b.get(limit))} {second}"
               for limit in LIMITS if a.get(limit) != b.get(limit)]
    if a.get("cuda") != b.get("cuda"):
        differ.append("graded with{} a CUDA device {}, with{} one {}".format(
            "" if a.get("cuda") else "out", first, "" if b.get("cuda") else "out", second))
    elif None not in (a.get("device"), b.get("device")) and a["device"] != b["device"]:
        differ.append(f"graded on {a.get('device')} {first}, on {b.get('device')} {second}")
    return differ


def _number(value: object) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def check(shards: list[Shard]) -> tuple[list[str], dict[tuple[str, str], dict]]:
    """The stages and every (student, stage) grade of the whole class, or ShardError naming
    what keeps these shards from being one class's run."""
    if not shards:
        raise ShardError("no shard to merge")
    first = shards[0]
    if len({s.count for s in shards}) > 1:
        raise ShardError("the shards split the class differently: " + ", ".join(
            f"{s.path} is {s.index}/{s.count}" for s in shards))
    indices = sorted(s.index for s in shards)
    missing = sorted(set(range(1, first.count + 1)) - set(indices))
    twice = sorted({i for i in indices if indices.count(i) > 1})
    if missing or twice:
        raise ShardError("; ".join(filter(None, [
            missing and f"shard {', '.join(map(str, missing))} of {first.count} missing",
            twice and f"shard {', '.join(map(str, twice))} given twice"])))
    for s in shards[1:]:
        if s.stages != first.stages:
            raise ShardError(f"{s.path} graded stages {','.join(s.stages)}, {first.path} "
                             f"{','.join(first.stages)}")
    done: dict[tuple[str, str], dict] = {}
    owner: dict[str, Path] = {}
    duplicated, bases = set(), {}
    for s in shards:
        for name in s.students:
            if name in owner:
                duplicated.add(name)
            owner[name] = s.path
        for record in s.records:
            key = (record["student"], record["stage"])
            if key in done and done[key].get("_shard") != s.path:
                duplicated.add(record["student"])
            done[key] = {**record, "_shard": s.path}
            if record["stage"] in bases:
                _same_basis(bases[record["stage"]], (s.path, record))
            else:
                bases[record["stage"]] = (s.path, record)
    if duplicated:
        raise ShardError(f"graded in more than one shard: {', '.join(sorted(duplicated))}")
    lacking = sorted(f"{name} (stage {stage}, {owner[name]})" for name in owner
                     for stage in first.stages if (name, stage) not in done)
    if lacking:
        raise ShardError(f"{len(lacking)} grades missing, the shard did not finish (run it "
                         f"again with --resume): {', '.join(lacking[:10])}"
                         + (" ..." if len(lacking) > 10 else ""))
    strays = sorted({name for name, _ in done} - set(owner))
    if strays:
        raise ShardError(f"grades of students no shard was given: {', '.join(strays[:10])}")
    return first.stages, {k: {n: v for n, v in r.items() if n != "_shard"}
                          for k, r in done.items() if k[1] in first.stages}


def _same_basis(a: tuple[Path, dict], b: tuple[Path, dict]) -> None:
    differ = basis_differences(a[1]["stage"], a[1].get("basis") or {}, b[1].get("basis") or {},
                               (f"in {a[0]}", f"in {b[0]}"))
    if differ:
        raise ShardError(f"the shards were graded differently: {'; '.join(differ)}")

