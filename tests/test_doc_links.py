"""Every relative link in README.md and docs/ reaches a file of the repository, and every
`#anchor` into a page reaches one of its headings.

A new user's run found two pages linking `benchmarks.md#against-a-peer-server-dlmserve` after
the heading had grown a suffix: the link opened the page's top. Anchors are GitHub's: the
heading's text lowercased, punctuation other than `-` and `_` dropped, spaces made `-`, and a
repeated heading numbered `-1`, `-2`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays, its target goes
    text = re.sub(r"[^\w\- ]", "", text.replace("`", "").lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # not http:, mailto:


def test_slug_follows_github() -> None:
    assert slug("Against a peer server: dlmserve (`benchmarks/vs_peers.py`)") == (
        "against-a-peer-server-dlmserve-benchmarksvs_peerspy"
    )
    assert slug("Every core while it pays: `--thread-governor`") == "every-core-while-it-pays---thread-governor"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if path.startswith("../") and not file.is_relative_to(ROOT):
            continue  # the shared reference notes beside the clone (../shared), not in the repository
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, broken
