"""MkDocs hook: the course as a website, built from the files the repository already has.

The home page is README.md and each stage's lesson (stages/NN_name/README.md) is a page of its
own, in the order of stages.toml, so a new stage appears by itself; none of them is copied or
edited. The docs/ pages follow the lessons. Links are written for GitHub, relative to the file
that holds them, and keep working on the site:

- a link to a file that is a page or an asset of the site (README.md, a lesson, docs/...)
  points at that page;
- a link to any other file or folder of the repository (a kernel, a stage's tests/) points at
  it in the repository when mkdocs.yml sets `repo_url`, else it becomes plain text;
- a link to nothing in the repository is a broken link: one warning naming the file, the link
  and where it leads, which `mkdocs build --strict` turns into a failed build.
"""
from __future__ import annotations

import logging
import os
import posixpath
import tomllib
import xml.etree.ElementTree as etree
from pathlib import Path
from urllib.parse import urlsplit

from markdown import Extension, Markdown
from markdown.treeprocessors import Treeprocessor
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

log = logging.getLogger("mkdocs.hooks.course_site")

LESSONS = "lessons"   # the site folder of the lesson pages: lessons/07_attention/
# The docs pages in reading order; any other page of docs/ follows them, by name.
DOC_ORDER = ("setup.md", "grading.md", "engine.md", "serving.md", "benchmarks.md", "instructors.md",
             "maintainers.md")


class _Site:
    """What the link rewriter needs to know between hook calls of one build."""
    root = Path(".")
    repo_url = ""
    site_file: dict[str, str] = {}   # repository path -> the site's src_uri for it
    page: Page | None = None


def _root(config: MkDocsConfig) -> Path:
    return Path(os.path.abspath(config.config_file_path)).parent


def _repo_path(path: str) -> str | None:
    """A file's path in the repository (symbolic links not followed), None when outside it."""
    rel = Path(os.path.relpath(os.path.abspath(path), _Site.root)).as_posix()
    return None if rel.startswith("../") else rel


def _stages(root: Path) -> list[dict]:
    """stages.toml's entries, in course order."""
    with open(root / "stages.toml", "rb") as f:
        return tomllib.load(f)["stage"]


def _lesson_title(stage: dict) -> str:
    """'07 Prefill attention' from the manifest's one-line title (the part before a colon)."""
    short = stage["title"].split(":", 1)[0]
    return f"{stage['id']} {short}" + ("" if stage["status"] == "ready" else " (planned)")


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    _Site.root = _root(config)
    _Site.repo_url = (config.repo_url or "").rstrip("/")
    lessons = [{_lesson_title(s): f"{LESSONS}/{s['dir']}.md"} for s in _stages(_Site.root)]
    docs = sorted((p.name for p in Path(config.docs_dir).glob("*.md")),
                  key=lambda name: (DOC_ORDER.index(name) if name in DOC_ORDER
                                    else len(DOC_ORDER), name))
    config.nav = [{"Home": "index.md"}, {"Lessons": lessons}, *docs]
    config.markdown_extensions.append(_RepositoryLinks())
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Adds README.md as the home page and every lesson of the manifest as a page."""
    root = _Site.root
    pages = {"index.md": root / "README.md"}
    for stage in _stages(root):
        pages[f"{LESSONS}/{stage['dir']}.md"] = root / "stages" / stage["dir"] / "README.md"
    for src_uri, path in pages.items():
        if not path.is_file():
            raise PluginError(f"{path.relative_to(root)} is missing: the site needs it as "
                              f"{src_uri} (stages.toml lists every lesson)")
        files.append(File.generated(config, src_uri, abs_src_path=str(path)))
    _Site.site_file = {_repo_path(f.abs_src_path): f.src_uri for f in files
                       if f.abs_src_path and _repo_path(f.abs_src_path)}
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    _Site.page = page   # the page the next Markdown conversion renders
    return markdown


def on_serve(server, config: MkDocsConfig, builder) -> None:
    """`mkdocs serve` rebuilds when the README or a lesson changes, not only docs/."""
    server.watch(str(_Site.root / "README.md"))
    server.watch(str(_Site.root / "stages.toml"))
    for stage in _stages(_Site.root):
        server.watch(str(_Site.root / "stages" / stage["dir"] / "README.md"))


def rewrite(page_path: str, link: str, site_file: dict[str, str], page_uri: str,
            root: Path, repo_url: str) -> tuple[str | None, str | None]:
    """(new link or None for plain text, warning or None) for one link of a page.

    page_path: the page's file in the repository (stages/07_attention/README.md);
    page_uri: the same page's place in the site (lessons/07_attention.md)."""
    scheme, netloc, path, _query, fragment = urlsplit(link)
    if scheme or netloc or not path:   # a web address, mail, or an anchor on this page
        return link, None
    base = "" if path.startswith("/") else posixpath.dirname(page_path)
    target = posixpath.normpath(posixpath.join(base, path.lstrip("/")))
    anchor = f"#{fragment}" if fragment else ""
    if target in site_file:
        here = posixpath.dirname(page_uri) or "."
        return posixpath.relpath(site_file[target], here) + anchor, None
    on_disk = root / target
    if target.startswith("..") or not on_disk.exists():
        return link, (f"{page_path}: the link '{link}' leads to {target}, which is not in the "
                      "repository")
    if not repo_url:
        return None, None
    kind = "tree" if on_disk.is_dir() else "blob"
    return f"{repo_url}/{kind}/HEAD/{target}{anchor}", None


class _LinkRewriter(Treeprocessor):
    def run(self, tree: etree.Element) -> None:
        page = _Site.page
        page_path = _repo_path(page.file.abs_src_path)
        for element in tree.iter():
            key = {"a": "href", "img": "src"}.get(element.tag)
            if key is None or element.get(key) is None:
                continue
            new, warning = rewrite(page_path, element.get(key), _Site.site_file,
                                   page.file.src_uri, _Site.root, _Site.repo_url)
            if warning:
                log.warning(warning)
            elif new is None:   # a repository file with no repository URL: plain text
                element.tag = "span"
                del element.attrib[key]
            else:
                element.set(key, new)


class _RepositoryLinks(Extension):
    def extendMarkdown(self, md: Markdown) -> None:
        # after the inline patterns (20) made the links, before mkdocs' own (0) resolves them
        md.treeprocessors.register(_LinkRewriter(md), "course_site_links", 1)
