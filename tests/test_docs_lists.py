"""docs/hooks/github_lists.py: lists written for GitHub render on the site with GitHub's
structure (nesting by an item's content column, a list right after a paragraph), and code
keeps its text."""
from __future__ import annotations

import importlib.util
import re

import markdown
import pytest

from course import manifest


def _hook():
    path = manifest.ROOT / "docs" / "hooks" / "github_lists.py"
    spec = importlib.util.spec_from_file_location("github_lists", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def html(text: str) -> str:
    """The page's HTML, its white space as a browser reads it."""
    out = markdown.markdown(_hook().github_lists(text), extensions=["pymdownx.superfences"])
    return re.sub(r"\s*(</?(?:ul|ol|li|p|pre)>)\s*", r"\1", re.sub(r"\s+", " ", out))


@pytest.mark.parametrize("text, expected", [
    # nested under an ordered item by 3 spaces, under a bullet by 2: nested as on GitHub
    ("3. **schedule()** meets:\n   - one kind\n   - limits\n4. next\n",
     "<ol><li><strong>schedule()</strong> meets:<ul><li>one kind</li><li>limits</li></ul></li>"
     "<li>next</li></ol>"),
    ("- a\n  - b\n    - c\n- d\n",
     "<ul><li>a<ul><li>b<ul><li>c</li></ul></li></ul></li><li>d</li></ul>"),
    ("- a\n    - b\n", "<ul><li>a<ul><li>b</li></ul></li></ul>"),   # 4 spaces still nest
    # a list right after a paragraph line; an ordered one only when it starts at 1
    ("Python side:\n- one\n- two\n", "<p>Python side:</p><ul><li>one</li><li>two</li></ul>"),
    ("Steps:\n1. one\n2. two\n", "<p>Steps:</p><ol><li>one</li><li>two</li></ol>"),
    ("it ends in\n12. and goes on\n", "<p>it ends in 12. and goes on</p>"),
    # a wrapped item and a lazy line stay in their item
    ("1. carry this,\n   then that;\n2. at once\n",
     "<ol><li>carry this, then that;</li><li>at once</li></ol>"),
])
def test_lists_have_githubs_structure(text, expected):
    assert html(text) == expected


@pytest.mark.parametrize("text, code", [
    ("1. build:\n\n   ```\n   x = 1\n       y\n   ```\n2. run\n", "x = 1\n    y\n"),
    ("Text\n\n    - not a list\n      code\n", "- not a list\n  code\n"),
    ("```\n- a\n  - b\n```\n", "- a\n  - b\n"),
])
def test_code_keeps_its_text(text, code):
    out = markdown.markdown(_hook().github_lists(text), extensions=["pymdownx.superfences"])
    assert f"<code>{code}</code>" in out, out


def test_text_outside_lists_is_unchanged():
    plain = "# Title\n\nA paragraph\nover two lines.\n\n    indented code\n\n| a | b |\n|---|---|\n"
    assert _hook().github_lists(plain) == plain
