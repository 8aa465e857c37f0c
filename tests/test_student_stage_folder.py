"""A stage folder is enough: every file a lesson names is in the stage folder (or outside the
answers), the given files are there marked as given, and the grader never takes them from it."""
from __future__ import annotations

import re

import pytest

from course import manifest, parts
from grader import sync

ROOT = manifest.ROOT
READY = [s for s in manifest.stages() if s.ready]
# A backticked file name in a lesson: `stages/07_attention/attention.py`, `attention.cu`.
FILE = re.compile(r"`([^`\s]+\.(?:py|cu|cpp|h|cuh))`")
# Paths that start with one of these are this repository's; others (`csrc/...`,
# `modeling_llama.py`) are other projects' files, named for further reading.
REPO_DIRS = ("stages/", "solutions/", "grader/", "course/", "bench/", "tests/", "docs/")
# The answer folder, all of it: even the engine around the parts (solutions/engine/) sits
# beside the answers, so a lesson names the copy that stages.toml's `reading` puts in its folder.
ANSWERS = ("solutions/",)


def lesson_problems(stage: manifest.Stage) -> list[str]:
    """What is wrong with the file names of one lesson, one line each."""
    text = (stage.skeleton_dir() / "README.md").read_text()
    own = {p.name for p in stage.solution_dir().iterdir() if p.is_file()} \
        if stage.solution_dir().is_dir() else set()
    problems = []
    for name in sorted(set(FILE.findall(text))):
        if name.startswith(ANSWERS):
            problems.append(f"{name}: a student never opens the answers; name the copy in "
                            f"stages/ (grader/sync.py generates given files there)")
        elif name.startswith(REPO_DIRS) and not (ROOT / name).exists():
            problems.append(f"{name}: no such file")
        elif "/" not in name and name in own:
            problems.append(f"{name}: name it by its path, stages/{stage.dir}/{name}")
    return problems


@pytest.mark.parametrize("stage", READY, ids=lambda s: s.dir)
def test_lesson_names_files_by_their_stage_path(stage):
    problems = lesson_problems(stage)
    assert not problems, f"stages/{stage.dir}/README.md:\n" + "\n".join(problems)


def test_the_lesson_check_catches_answers_and_bare_names(tmp_path, monkeypatch):
    stage = manifest.find("07")
    fake = tmp_path / "stages" / stage.dir
    fake.mkdir(parents=True)
    (fake / "README.md").write_text("Read `solutions/07_attention/attention.py`, then "
                                    "`attention.cu`, `grader/nothing.py` and `csrc/x.cu`.")
    monkeypatch.setattr(manifest.Stage, "skeleton_dir", lambda self: tmp_path / "stages" / self.dir)
    problems = lesson_problems(stage)
    assert [p.split(":")[0] for p in problems] == [
        "attention.cu", "grader/nothing.py", "solutions/07_attention/attention.py"]


@pytest.mark.parametrize("stage", READY, ids=lambda s: s.dir)
def test_given_files_are_in_the_stage_folder_marked_given(stage):
    for src in sync.given_files(stage):
        assert src.name not in stage.parts
        copy = stage.skeleton_dir() / src.name
        assert copy.is_file(), f"{copy} is missing: run `nox -s sync-stages`"
        head = copy.read_text().splitlines()[0]
        assert "GIVEN FILE: generated from " + str(src.relative_to(ROOT)) in head


@pytest.mark.parametrize("stage", [s for s in READY if s.reading], ids=lambda s: s.dir)
def test_files_to_read_are_copied_into_the_stage_folder(stage):
    copies = sync.reading_files(stage)
    assert len(copies) == len(stage.reading), f"stages.toml lists a missing file: {stage.reading}"
    for copy, src in copies.items():
        assert copy.is_file(), f"{copy} is missing: run `nox -s sync-stages`"
        assert copy.read_text() == sync.given_header(src, "#", reading=True) + src.read_text(), \
            f"{copy} is not the marked copy of {src}: run `nox -s sync-stages`"


def test_a_file_to_read_from_the_answers_is_refused(tmp_path, monkeypatch):
    toml = tmp_path / "stages.toml"
    toml.write_text('[[stage]]\nid = "03"\ndir = "03_embedding"\ntitle = "t"\nstatus = "ready"\n'
                    'parts = []\npoints = 1\ngpu = false\nneeds = []\n'
                    'reading = ["solutions/03_embedding/embedding.py"]\n')
    monkeypatch.setattr(manifest, "MANIFEST", toml)
    manifest.stages.cache_clear()
    try:
        with pytest.raises(ValueError, match="outside the stages' answer folders"):
            manifest.stages()
    finally:
        manifest.stages.cache_clear()


def test_given_files_are_never_graded_as_the_students(monkeypatch, tmp_path):
    """Even for the student's own stage, a given file resolves to the reference copy."""
    monkeypatch.setenv(parts.STUDENT_ENV, "07")
    monkeypatch.setenv(parts.STUDENT_ROOT_ENV, str(tmp_path))
    stage = manifest.find("07")
    given = sync.given_files(stage)
    assert {p.name for p in given} >= {"attention.py", "attention_binding.cpp"}
    for src in given:
        assert parts.path("07", src.name) == src
    assert parts.path("07", "attention.cu") == tmp_path / stage.dir / "attention.cu"
