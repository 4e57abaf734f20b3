"""The docs point at things that exist: every relative link (and its anchor) and every
backticked repository path in README.md and docs/*.md. Reads files only: milliseconds."""

from __future__ import annotations

import pathlib
import re

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"""<a\s+(?:id|name)=["']([^"']+)["']""")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
REPO_PATH = re.compile(
    r"(?<![\w./-])(?:resilient|chaos|scripts|recipes|tests|docs)/[A-Za-z0-9_./-]*"
)
FILE_SUFFIXES = (".py", ".md", ".toml")


def _prose(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    lines, fenced = [], False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((n, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lowercased, punctuation other than
    hyphens and underscores dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in _prose(path):
        found.update(HTML_ANCHOR.findall(line))
        m = HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def _links(path: pathlib.Path) -> list[tuple[int, str]]:
    out = []
    for n, line in _prose(path):
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                out.append((n, target))
    return out


def _code_paths(path: pathlib.Path) -> list[tuple[int, str]]:
    out = []
    for n, line in _prose(path):
        for _, span in CODE_SPAN.findall(line):
            for p in REPO_PATH.findall(span):
                p = p.rstrip(".")
                if p.endswith(FILE_SUFFIXES) or p.endswith("/"):
                    out.append((n, p))
    return out


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_every_relative_link_and_anchor_exists(doc: pathlib.Path) -> None:
    broken = []
    for n, target in _links(doc):
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{_rel(doc)}:{n}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{_rel(doc)}:{n}: {target}: no heading or anchor #{anchor}")
    assert broken == []


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_every_backticked_repository_path_exists(doc: pathlib.Path) -> None:
    missing = [f"{_rel(doc)}:{n}: {p}" for n, p in _code_paths(doc) if not (ROOT / p).exists()]
    assert missing == []


def test_the_slug_follows_githubs_rules() -> None:
    assert slug("`resilient run`: restarts, preemption") == "resilient-run-restarts-preemption"
    assert slug("The hot path, second pass: 100.8 MB (2026-11-25)") == (
        "the-hot-path-second-pass-1008-mb-2026-11-25"
    )
    assert slug("Link [here](x.md) and <b>bold</b>") == "link-here-and-bold"


def test_the_checker_finds_what_is_broken(tmp_path: pathlib.Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "# Title\n\n[ok](#title) [bad](#nope) [web](https://example.org) [gone](y.md)\n\n"
        "`resilient/nope.py` and `resilient/` and `python -m chaos`\n\n"
        "```\n[in code](z.md) `resilient/also_nope.py`\n```\n"
    )
    assert [t for _, t in _links(doc)] == ["#title", "#nope", "y.md"]
    assert anchors(doc) == {"title"}
    assert [p for _, p in _code_paths(doc)] == ["resilient/nope.py", "resilient/"]
