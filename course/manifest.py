"""The course manifest (stages.toml): the one place that orders and describes the stages."""
from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "stages.toml"


class UnknownStage(ValueError):
    """A stage id that the manifest does not list."""


class StageNotAvailable(ValueError):
    """A stage the manifest lists as planned: its lesson outline exists, its tests do not."""


@dataclass(frozen=True)
class Stage:
    id: str
    dir: str
    title: str
    status: str
    parts: tuple[str, ...]
    points: int
    gpu: bool
    needs: tuple[str, ...]
    min_cc: str | None = None   # the compute capability its kernels need ("8.0"), if above sm_75
    # Files outside the stage's own folder that its lesson asks the student to read (the
    # engine around the parts: "solutions/engine/llm_engine.py"): grader/sync.py copies each
    # into the stage folder, under its path below solutions/ (stages/11_.../engine/...).
    reading: tuple[str, ...] = ()
    # The second kernel of a two-part stage (06, 12, 14): a part the engine can do without, since
    # the stage's simple kernel stands in while it is TODO (course.ops.FirstWritten).
    fast_parts: tuple[str, ...] = ()

    @property
    def ready(self) -> bool:
        return self.status == "ready"

    @property
    def number(self) -> int:
        return int(self.id)

    def runs_on(self, capability: tuple[int, int]) -> bool:
        """Whether its kernels build and run on a GPU (or a build target) of this capability."""
        return self.min_cc is None or tuple(capability) >= parse_capability(self.min_cc)

    def solution_dir(self) -> Path:
        return ROOT / "solutions" / self.dir

    def skeleton_dir(self) -> Path:
        return ROOT / "stages" / self.dir

    def tests_dir(self) -> Path:
        return self.skeleton_dir() / "tests"


def parse_capability(text: str) -> tuple[int, int]:
    """'8.0' -> (8, 0), '7.5' -> (7, 5), '9' -> (9, 0): a capability as stages.toml writes it."""
    major, _, minor = text.strip().partition(".")
    return int(major), int(minor or 0)


@lru_cache(maxsize=1)
def stages() -> tuple[Stage, ...]:
    with open(MANIFEST, "rb") as f:
        raw = tomllib.load(f)
    out = []
    answers = tuple(f"solutions/{entry['dir']}/" for entry in raw["stage"])
    for entry in raw["stage"]:
        for rel in entry.get("reading", ()):
            if not rel.startswith("solutions/") or rel.startswith(answers) or ".." in rel:
                raise ValueError(f"stages.toml: stage {entry['id']} lists {rel!r} to read; a file "
                                 f"to read is one of solutions/ outside the stages' answer "
                                 f"folders (the engine: solutions/engine/...)")
        out.append(Stage(
            id=entry["id"], dir=entry["dir"], title=entry["title"], status=entry["status"],
            parts=tuple(entry["parts"]), points=int(entry["points"]), gpu=bool(entry["gpu"]),
            needs=tuple(entry["needs"]), min_cc=entry.get("min_cc"),
            reading=tuple(entry.get("reading", ())),
            fast_parts=tuple(entry.get("fast_parts", ())),
        ))
        if not set(out[-1].fast_parts) <= set(out[-1].parts):
            raise ValueError(f"stages.toml: stage {entry['id']}'s fast_parts must be among its "
                             f"parts {list(out[-1].parts)}")
    return tuple(out)


def normalize_id(text: str) -> str:
    """'7', '07' and '07_attention' all name stage 07 (find() checks the name)."""
    head = text.strip().split("_", 1)[0]
    return head.zfill(2) if head.isdigit() else text.strip()


def find(text: str) -> Stage:
    """The stage named by `text`, or UnknownStage listing the valid ids."""
    wanted = normalize_id(text)
    for stage in stages():
        if stage.id == wanted:
            # '04_attention' names two stages: grading or resetting 04 (rmsnorm) would be a
            # silent surprise. A folder name must be the stage's own (a completed '07_attention/'
            # too).
            name = text.strip().rstrip("/")
            if "_" in name and name != stage.dir:
                raise UnknownStage(f"there is no stage {text!r}: stage {stage.id} is {stage.dir}. "
                                   f"Valid stages: {_valid_ids()}")
            return stage
    raise UnknownStage(f"there is no stage {text!r}. Valid stages: {_valid_ids()}")


def _valid_ids() -> str:
    return ", ".join(f"{s.id} ({s.dir})" for s in stages())


def find_ready(text: str) -> Stage:
    """Like find(), but a planned stage is an error that says so plainly."""
    stage = find(text)
    if not stage.ready:
        ready = ", ".join(s.id for s in stages() if s.ready)
        raise StageNotAvailable(
            f"stage {stage.id} ({stage.dir}) is not available yet: its lesson outline is in "
            f"stages/{stage.dir}/README.md, but it has no parts or tests to grade. "
            f"Stages available now: {ready}")
    return stage


def upto(stage: Stage) -> tuple[Stage, ...]:
    """Stages 01..stage in course order (for --cumulative)."""
    return tuple(s for s in stages() if s.number <= stage.number)
