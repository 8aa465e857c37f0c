"""The course website (mkdocs.yml, docs/hooks/course_site.py): it builds strictly with a page
for every lesson of stages.toml, renders math, and a broken link or a missing lesson fails the
build. Each build takes about a second and a half of CPU."""
from __future__ import annotations

import html
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from course import manifest

ROOT = manifest.ROOT


def _hook():
    spec = importlib.util.spec_from_file_location("course_site", ROOT / "docs/hooks/course_site.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "-f", str(root / "mkdocs.yml"), "-d", str(site)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def test_the_site_builds_with_every_lesson_in_course_order(tmp_path):
    run = build(ROOT, tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    home = (tmp_path / "index.html").read_text()
    assert "nox -s tests" in home
    places = []
    for stage in manifest.stages():
        page = tmp_path / "lessons" / stage.dir / "index.html"
        assert page.is_file(), f"no page for stage {stage.id}'s lesson"
        heading = (stage.skeleton_dir() / "README.md").read_text().splitlines()[0]
        text = html.unescape(page.read_text())
        assert all(w in text for w in re.findall(r"\w+", heading)[:4]), \
            f"stage {stage.id}'s page does not hold its lesson ({heading!r})"
        places.append(home.index(f"lessons/{stage.dir}/"))
    assert places == sorted(places), "the navigation must follow stages.toml's order"
    assert (tmp_path / "benchmarks" / "index.html").is_file()
    assert (tmp_path / "search" / "search_index.json").is_file()


@pytest.fixture
def course_copy(tmp_path) -> Path:
    """The course with its own README.md, mkdocs.yml, stages.toml and docs/ to break; every
    other entry a link to the real one."""
    copy = tmp_path / "course"
    copy.mkdir()
    for entry in ROOT.iterdir():
        if entry.name in ("README.md", "mkdocs.yml", "stages.toml"):
            shutil.copy(entry, copy / entry.name)
        elif entry.name == "docs":
            shutil.copytree(entry, copy / "docs", ignore=shutil.ignore_patterns("__pycache__"))
        elif entry.name not in (".git", "build", ".nox"):
            (copy / entry.name).symlink_to(entry)
    return copy


def test_a_broken_link_fails_the_build(course_copy, tmp_path):
    readme = course_copy / "README.md"
    readme.write_text(readme.read_text() + "\nThe [kernel](stages/03_embedding/embedding.cu), "
                      "its [tests](stages/03_embedding/tests/), a [lesson]"
                      "(stages/04_rmsnorm/README.md#rmsnorm) and [a page](docs/benchmarks.md), "
                      "then math: $x^2$ and\n\n```math\n\\sum_i x_i\n```\n")
    run = build(course_copy, tmp_path / "good")
    assert run.returncode == 0, run.stdout + run.stderr   # links to repository files build
    home = (tmp_path / "good" / "index.html").read_text()
    assert '<span class="arithmatex">\\(x^2\\)</span>' in home
    assert '<div class="arithmatex">\\[\n\\sum_i x_i\n\\]</div>' in home
    readme.write_text(readme.read_text() + "\nA [typo](stages/03_embedding/embeding.cu).\n")
    run = build(course_copy, tmp_path / "bad")
    assert run.returncode != 0, "a link to a file that does not exist built"
    assert ("README.md: the link 'stages/03_embedding/embeding.cu' leads to "
            "stages/03_embedding/embeding.cu, which is not in the repository") in run.stderr


def test_a_missing_lesson_fails_the_build(course_copy, tmp_path):
    (course_copy / "stages.toml").write_text(
        (course_copy / "stages.toml").read_text() + '\n[[stage]]\nid = "15"\ndir = '
        '"15_speculative"\ntitle = "Speculative decoding"\nstatus = "planned"\nparts = []\n'
        'points = 100\ngpu = true\nneeds = []\n')
    run = build(course_copy, tmp_path / "site")
    assert run.returncode != 0
    assert "stages/15_speculative/README.md is missing" in run.stderr


@pytest.mark.parametrize("page, uri, link, repo_url, expected", [
    # a lesson's links to another lesson, a docs page, the home page: their pages
    ("stages/07_attention/README.md", "lessons/07_attention.md", "../08_forward/README.md#hints",
     "", "08_forward.md#hints"),
    ("stages/07_attention/README.md", "lessons/07_attention.md", "../../docs/benchmarks.md",
     "", "../benchmarks.md"),
    ("docs/benchmarks.md", "benchmarks.md", "../README.md", "", "index.md"),
    ("docs/benchmarks.md", "benchmarks.md", "img/sweep.png", "", "img/sweep.png"),
    ("README.md", "index.md", "/stages/07_attention/README.md", "", "lessons/07_attention.md"),
    # a repository file that is no page: the repository's copy, or plain text
    ("stages/07_attention/README.md", "lessons/07_attention.md", "attention.cu",
     "https://github.com/o/r", "https://github.com/o/r/blob/HEAD/stages/07_attention/attention.cu"),
    ("stages/07_attention/README.md", "lessons/07_attention.md", "tests",
     "https://github.com/o/r", "https://github.com/o/r/tree/HEAD/stages/07_attention/tests"),
    ("stages/07_attention/README.md", "lessons/07_attention.md", "attention.cu", "", None),
    # web addresses and anchors are left alone
    ("README.md", "index.md", "https://pytorch.org/", "", "https://pytorch.org/"),
    ("README.md", "index.md", "#quickstart", "", "#quickstart"),
])
def test_links_resolve_as_on_github(page, uri, link, repo_url, expected):
    site = {"README.md": "index.md", "docs/benchmarks.md": "benchmarks.md",
            "docs/img/sweep.png": "img/sweep.png",
            **{f"stages/{s.dir}/README.md": f"lessons/{s.dir}.md" for s in manifest.stages()}}
    assert _hook().rewrite(page, link, site, uri, ROOT, repo_url) == (expected, None)


@pytest.mark.parametrize("link", ["attention.cuh", "../../../etc/passwd"])
def test_a_link_outside_the_repository_files_is_reported(link):
    new, warning = _hook().rewrite("stages/07_attention/README.md", link, {},
                                   "lessons/07_attention.md", ROOT, "")
    assert warning and warning.startswith(f"stages/07_attention/README.md: the link '{link}'")
