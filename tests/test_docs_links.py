"""The documentation has no dead links, every page is in the table of contents, and the README's version is current.

Every relative markdown link in README.md, docs/, spec/ and conformance/'s READMEs names a file or directory of
the repository, and a ``#fragment`` on a markdown page names one of its headings (GitHub's slugs). Links inside
code blocks and code spans are not links; ``http(s):`` and other schemes are not checked (no network).
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

import ckptfmt

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CONTENTS = DOCS / "README.md"
PAGES = sorted(
    [ROOT / "README.md", *DOCS.glob("*.md"), *(ROOT / "spec").glob("*.md"), *(ROOT / "conformance").rglob("README.md")]
)

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) or [text](target "title"); the text may hold one level of brackets (an image's alt text)
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    out: list[str] = []
    fence: str | None = None
    for line in text.splitlines():
        found = FENCE.match(line)
        if fence is None and found:
            fence = found.group(1)[0] * len(found.group(1))
        elif fence is not None and found and found.group(1).startswith(fence):
            fence = None
        elif fence is None:
            out.append(line)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, punctuation dropped, spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link or image: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in prose_lines(page.read_text()):
        found = HEADING.match(line)
        if found:
            base = slug(found.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def links_of(text: str) -> list[str]:
    """The targets of the links in markdown ``text``, in order."""
    out: list[str] = []
    for line in prose_lines(text):
        line = CODE_SPAN.sub("", line)
        out.extend(LINK.findall(line))
        out.extend(REFERENCE.findall(line))
    return out


def links(page: Path) -> list[str]:
    return links_of(page.read_text())


def problem(page: Path, target: str) -> str | None:
    """Why ``target``, linked from ``page``, is dead; None when it resolves (or is not ours to check)."""
    if not target or SCHEME.match(target):
        return None
    path, _, fragment = target.partition("#")
    resolved = (page.parent / unquote(path)).resolve() if path else page
    if not resolved.is_relative_to(ROOT):
        return "leaves the repository"
    if not resolved.exists():
        return "no such file"
    if not fragment:
        return None
    if resolved.suffix != ".md":
        return None if re.fullmatch(r"L\d+(-L\d+)?", fragment) else "a fragment on a page that is not markdown"
    return None if unquote(fragment) in anchors(resolved) else f"no heading #{fragment} in {resolved.name}"


def test_the_slugs_are_githubs() -> None:
    assert slug("Clarifications of 1.0") == "clarifications-of-10"
    assert slug("The `ckpt` command") == "the-ckpt-command"
    assert slug("Losing a node: replicas, and a restore every rank agrees on") == (
        "losing-a-node-replicas-and-a-restore-every-rank-agrees-on"
    )
    assert slug("Saves and loads against safetensors, torch.save and DCP") == (
        "saves-and-loads-against-safetensors-torchsave-and-dcp"
    )
    assert slug("`ckpt conformance run` / `ckpt conformance vectors`") == (
        "ckpt-conformance-run--ckpt-conformance-vectors"
    )


def test_dead_links_are_found() -> None:
    page = ROOT / "docs" / "README.md"
    assert problem(page, "trainer.md") is None
    assert problem(page, "nowhere.md") == "no such file"
    assert problem(page, "trainer.md#custom-loaders") is None
    assert problem(page, "trainer.md#no-such-heading") == "no heading #no-such-heading in trainer.md"
    assert problem(page, "../../outside.md") == "leaves the repository"
    assert problem(page, "https://example.com/x#y") is None
    assert links_of('[a](x.md) `[b](y.md)` ![c](z.png) [d](<w.md> "title")') == ["x.md", "z.png", "w.md"]
    assert links_of("```\n[a](x.md)\n```\n[b](y.md)\n[r]: ref.md") == ["y.md", "ref.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    dead = [f"{target}: {why}" for target in links(page) if (why := problem(page, target)) is not None]
    assert not dead, f"dead links in {page.relative_to(ROOT)}:\n" + "\n".join(dead)


def test_every_docs_page_is_in_the_table_of_contents() -> None:
    listed = {(CONTENTS.parent / t.partition("#")[0]).resolve() for t in links(CONTENTS) if not SCHEME.match(t)}
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p != CONTENTS and p.resolve() not in listed]
    assert not missing, f"docs/README.md does not list {missing}"
    assert "docs/README.md" in links(ROOT / "README.md"), "the README does not link the table of contents"


def test_the_readme_states_the_current_format_version() -> None:
    spec = re.search(r"^\*\*Version:\*\* (\d+\.\d+)", (ROOT / "spec" / "README.md").read_text(), re.MULTILINE)
    assert spec is not None and spec.group(1) == ckptfmt.FORMAT_VERSION
    readme = (ROOT / "README.md").read_text()
    assert f"version {ckptfmt.FORMAT_VERSION}" in readme
    stated = set(re.findall(r"\b(?:v|version )(\d+\.\d+)\b", readme))
    assert stated == {ckptfmt.FORMAT_VERSION}, f"the README states format version(s) {sorted(stated)}"
