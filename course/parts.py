"""The parts resolver: which file stands for a stage's part, the student's or the reference.

Grading stage NN uses the student's files for NN and the reference (solutions/) for every
other stage, so a student stuck on 07 can still do 08. `--cumulative` takes the student's
01..NN; `--solution` takes the reference everywhere. The choice travels to the child
process that runs the tests through two environment variables, read here and nowhere else:

    TINYVLLM_STUDENT       comma-separated stage ids whose parts come from the student
    TINYVLLM_STUDENT_ROOT  the student's stages/ directory (default: <repo>/stages)

A learner's own script asks for their parts with `parts.select_mine()` (every stage whose parts
hold no TODO stub any more) or `parts.select_mine(["07", "08"])`, before it loads any part;
`python3 -m solutions.engine --mine` does the same. A script that loads a part without asking
gets the reference, and is told so once on stderr: the reference never stands in silently.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from course import manifest

if TYPE_CHECKING:   # torch loads with the kernels
    from torch._ops import _OpNamespace

STUDENT_ENV = "TINYVLLM_STUDENT"
STUDENT_ROOT_ENV = "TINYVLLM_STUDENT_ROOT"

_modules: dict[Path, ModuleType] = {}


def student_stage_ids() -> frozenset[str]:
    """The stages whose parts are the student's; UnknownStage (a ValueError) for an id the
    manifest does not list: a typo would otherwise run the reference, unnoticed."""
    raw = os.environ.get(STUDENT_ENV, "")
    try:
        return frozenset(manifest.find(x).id for x in raw.split(",") if x.strip())
    except manifest.UnknownStage as e:
        raise manifest.UnknownStage(f"{STUDENT_ENV}={raw!r}: {e}") from None


def student_root() -> Path:
    return Path(os.environ.get(STUDENT_ROOT_ENV, manifest.ROOT / "stages")).resolve()


def selection_env(student_ids: list[str], root: Path | None = None) -> dict[str, str]:
    """The environment that makes a child process resolve parts this way."""
    env = {STUDENT_ENV: ",".join(student_ids)}
    if root is not None:
        env[STUDENT_ROOT_ENV] = str(Path(root).resolve())
    return env


def finished_stages(root: Path | None = None) -> list[str]:
    """The ready stages whose parts, under the student's root, exist and hold no TODO stub.

    A stub is the skeleton's `raise NotImplementedError("TODO stage NN: ...")` or `return
    "TODO stage NN: ...";`: a part cannot work while it is there, whereas a leftover `# TODO`
    comment above finished code is harmless. A stage's fast_parts (the second kernel of a
    two-part stage) may still be TODO: its simple kernel runs instead (course.ops.FirstWritten).
    """
    root = Path(root) if root is not None else student_root()
    done = []
    for stage in manifest.stages():
        if not stage.ready:
            continue
        needed = [root / stage.dir / f for f in stage.parts if f not in stage.fast_parts]
        stub = f'"TODO stage {stage.id}'
        if all(f.exists() and stub not in f.read_text(errors="replace") for f in needed):
            done.append(stage.id)
    return done


def select_mine(stage_ids: list[str] | None = None, root: Path | None = None) -> list[str]:
    """Make this process (and the processes it starts) load the student's parts of these
    stages, by default every finished one (`finished_stages`); the reference stands in for the
    rest. Call it before any part or kernel is loaded: ValueError afterwards, since modules and
    the kernel library are loaded once per process. Returns the stage ids chosen."""
    if _modules or _kernels is not None:
        raise ValueError("parts.select_mine() must come before any part is loaded (this process "
                         "has loaded parts already); call it first in your script")
    chosen = finished_stages(root) if stage_ids is None else \
        [manifest.find(x).id for x in stage_ids]
    os.environ.update(selection_env(chosen, root))
    return chosen


def describe_selection(chosen: list[str]) -> str:
    """One line naming whose parts run: 'your parts: 01-05, 07; the reference: 06, 08-14'."""
    ready = [s.id for s in manifest.stages() if s.ready]
    rest = [x for x in ready if x not in chosen]
    return (f"your parts: {_ranges(chosen) or 'none'}; "
            f"the reference: {_ranges(rest) or 'none'}")


def _ranges(ids: list[str]) -> str:
    runs: list[list[str]] = []
    for x in ids:
        if runs and int(x) == int(runs[-1][-1]) + 1:
            runs[-1].append(x)
        else:
            runs.append([x])
    return ", ".join(r[0] if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def is_student(stage: manifest.Stage, filename: str) -> bool:
    return stage.id in student_stage_ids() and filename in stage.parts


def path(stage_id: str, filename: str) -> Path:
    """The file that stands for `filename` of stage `stage_id` under the current selection."""
    stage = manifest.find(stage_id)
    if is_student(stage, filename):
        return student_root() / stage.dir / filename
    return stage.solution_dir() / filename


def load(stage_id: str, module: str) -> ModuleType:
    """Import `<module>.py` of a stage, the student's or the reference's as selected."""
    file = path(stage_id, module + ".py")
    if file not in _modules and STUDENT_ENV not in os.environ and _called_from_outside():
        _say_reference_once(stage_id, module)
    return _import(file, stage_id, module)


# The project's own code loads the reference on purpose (the reference engine, the oracles),
# and so does whoever sets TINYVLLM_STUDENT, even empty (the grader's --solution); any other
# caller is a learner's script, which must hear that it did not get its own parts.
_PROJECT_DIRS = tuple(manifest.ROOT / d for d in ("course", "grader", "solutions", "bench",
                                                  "tests", "stages"))
_told = False


def _called_from_outside() -> bool:
    frame = sys._getframe(2)
    while frame is not None and Path(frame.f_code.co_filename).resolve() == Path(__file__):
        frame = frame.f_back
    if frame is None:
        return False
    caller = Path(frame.f_code.co_filename)
    if not caller.is_absolute() or not caller.exists():   # <stdin>, -c: a learner's too
        return True
    caller = caller.resolve()
    return not any(caller.is_relative_to(d) for d in _PROJECT_DIRS)


def _say_reference_once(stage_id: str, module: str) -> None:
    global _told
    if not _told:
        _told = True
        print(f"tiny-vllm: stage {stage_id}'s {module}.py is the reference's, as is every part "
              f"this script loads; call parts.select_mine() first (or set {STUDENT_ENV}="
              f"{stage_id}) to load your own", file=sys.stderr, flush=True)


def reference(stage_id: str, module: str) -> ModuleType:
    """The reference copy of a module, whatever the selection (tests use it as an oracle)."""
    return _import(manifest.find(stage_id).solution_dir() / (module + ".py"), stage_id, module)


def _import(file: Path, stage_id: str, module: str) -> ModuleType:
    # Stage directories are not Python packages (their names start with digits), so parts
    # are imported by path and cached by path: a student's and the reference's copy of the
    # same part are different modules and never shadow each other.
    if file in _modules:
        return _modules[file]
    if not file.exists():
        raise FileNotFoundError(f"stage {stage_id}: {file} is missing (part {module}.py)")
    origin = "student" if file.is_relative_to(student_root()) else "solution"
    name = f"tinyvllm_{origin}_{manifest.normalize_id(stage_id)}_{module}"
    spec = importlib.util.spec_from_file_location(name, file)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    _modules[file] = mod
    return mod


def kernel_sources(arch_list: list[str] | None = None) -> list[Path]:
    """Every CUDA/C++ source (kernels and bindings) of every ready stage whose kernels can run
    on the architectures built for (default: build.archs(), the local GPU's), resolved under the
    current selection. A stage whose min_cc is above them is left out: on a T4 (sm_75) the
    library has no stage 12 or 14, and course/ops.py takes their ops from other stages."""
    from course import build
    target = build.target_capability(arch_list)
    sources = []
    for stage in manifest.stages():
        if not stage.ready or not stage.runs_on(target):
            continue
        for src in sorted(stage.solution_dir().glob("*")):
            if src.suffix in (".cu", ".cpp"):
                sources.append(path(stage.id, src.name))
    return sources


_kernels = None


def kernels() -> _OpNamespace:
    """`torch.ops.tinyvllm`, with every kernel built from the selected sources and loaded.

    Built once per process (the selection is fixed for a process's life), so the ops, which
    call this on every launch, pay a global lookup, not a rescan of the sources.
    """
    global _kernels
    if _kernels is None:
        from course import build
        try:
            _kernels = build.load_kernels(kernel_sources())
        except build.BuildError as e:
            _kernels = e  # every later test fails with the same compiler message, no recompile
    if isinstance(_kernels, Exception):
        raise _kernels
    return _kernels
