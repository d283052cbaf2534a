"""Every relative link in README.md and docs/*.md names a file that exists, without an anchor (headings
get renamed; a page is what a link promises). Web links are not fetched."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def broken_links(page: Path) -> list[str]:
    """The relative links of `page` (outside code blocks) that are anchored or name no existing file."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    problems = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        if "#" in target:
            problems.append(f"{target} (an anchor: link the page)")
        elif not (page.parent / target).exists():
            problems.append(f"{target} (no such file)")
    return problems


def test_every_relative_link_in_the_readme_and_docs_resolves_to_a_file():
    problems = {str(page.relative_to(ROOT)): broken_links(page) for page in PAGES}
    assert {page: links for page, links in problems.items() if links} == {}


def test_the_docs_index_links_every_docs_page():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    linked = set(LINK.findall(index))
    pages = {page.name for page in PAGES if page.parent.name == "docs" and page.name != "README.md"}
    assert sorted(pages - linked) == []


def test_the_checker_finds_a_missing_file_and_an_anchor(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("x", encoding="utf-8")
    page.write_text(
        "[ok](there.md) [web](https://example.com/x#y) [gone](missing.md) [anchored](there.md#part)\n"
        "```\n[in code](not-checked.md)\n```\n", encoding="utf-8",
    )  # fmt: skip
    assert broken_links(page) == ["missing.md (no such file)", "there.md#part (an anchor: link the page)"]
