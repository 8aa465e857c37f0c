"""MkDocs hook: lists read on the site as GitHub shows them.

The pages are written for GitHub (CommonMark), where an item's content, nested lists included,
starts where its text starts (3 spaces under `1. `, 2 under `- `), and a list may follow a
paragraph line directly. Python-Markdown, which MkDocs uses, nests only by 4 spaces and needs a
blank line before a list. So before a page is converted, each line inside a list is moved to
where Python-Markdown expects it: an item's content 4 spaces right of its marker, every line
keeping its place relative to its item; and a blank line goes before a list that interrupts a
paragraph (a bullet, or an ordered list starting at 1, as CommonMark allows). Fenced code moves
with its item and is otherwise untouched; nothing outside lists changes.
"""
from __future__ import annotations

import re

ITEM = re.compile(r"^ *([-*+]|\d{1,9}[.)])( {1,4}|$)")
FENCE = re.compile(r"^ *(```|~~~)")


def on_page_markdown(markdown: str, **kwargs) -> str:
    return github_lists(markdown)


def _interrupts_paragraph(marker: str) -> bool:
    """A bullet list may start right after a paragraph line; an ordered one only at 1."""
    return not marker[0].isdigit() or marker[:-1] == "1"


def github_lists(text: str) -> str:
    """The markdown with every list's lines indented as Python-Markdown reads GitHub's."""
    out: list[str] = []
    items: list[tuple[int, int]] = []   # open items: (content column in, content column out)
    fence, fence_shift = "", 0
    blank_before = True
    for line in text.split("\n"):
        if fence:   # fenced code: moved with the line that opened it, otherwise as it is
            out.append(" " * fence_shift + line if line.strip() else line)
            fence = "" if line.strip().startswith(fence) else fence
            continue
        if not line.strip():
            out.append(line)
            blank_before = True
            continue
        n = len(line) - len(line.lstrip(" "))
        item = ITEM.match(line)
        if item and n >= (items[-1][0] if items else 0) + 4:
            item = None   # indented code, in an item or outside any list
        in_list = bool(items)
        while items and n < items[-1][0] and (item or blank_before):
            items.pop()   # a line left of an item's content, after a blank line: the item ends
        if items and n >= items[-1][0]:
            at = items[-1][1] + n - items[-1][0]
        else:
            at = n        # outside lists, or a lazy continuation line: where it is
        if item:
            if not in_list and not blank_before and _interrupts_paragraph(item.group(1)):
                out.append("")
            items.append((n + len(item.group(1)) + len(item.group(2)), at + 4))
        opened = FENCE.match(line)
        if opened:
            fence, fence_shift = opened.group(1), at - n
        out.append(" " * at + line[n:])
        blank_before = False
    return "\n".join(out)
