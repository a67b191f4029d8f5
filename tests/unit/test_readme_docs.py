"""The README stays a five-minute read whose links all land, and the docs site lists every page.

The README links to files in the repository (docs pages, tests, fixtures) and to headings; GitHub
renders a link to a missing file as a 404, so each relative link must name an existing file, and an
anchor must name a heading of its target. `make docs` (MkDocs, strict) checks the pages of docs/
themselves; the nav check here runs without MkDocs, so a page added without a nav entry fails the
unit tests too.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MAX_README_LINES = 300

_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")
_INLINE = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
_REF_DEF = re.compile(r"^\[[^\]\n]+\]:\s*(\S+)", re.M)


def _prose(text: str) -> str:
    """Markdown without fenced blocks and code spans: what a renderer turns into links."""
    return _CODE.sub("", _FENCE.sub("", text))


def links(text: str) -> list[str]:
    prose = _prose(text)
    return _INLINE.findall(prose) + _REF_DEF.findall(prose)


def slug(heading: str) -> str:
    """GitHub's (and MkDocs' toc) anchor of a heading: lower case, punctuation dropped, spaces to '-'."""
    text = _CODE.sub(lambda m: m.group(0)[1:-1], heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M)}


def test_the_readme_is_at_most_300_lines() -> None:
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; move reference material to docs/"


def test_every_relative_link_in_the_readme_resolves() -> None:
    found = links(README.read_text(encoding="utf-8"))
    relative = [u for u in found if not re.match(r"^[a-z][a-z0-9+.-]*:", u)]
    assert len(relative) >= 20, relative  # the docs list alone has that many: the scan must see them
    broken = []
    for url in relative:
        target, _, anchor = url.partition("#")
        path = README if not target else (REPO / target)
        if not path.is_file():
            broken.append(f"{url}: no file {target}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{url}: no heading #{anchor} in {target or 'README.md'}")
    assert not broken, "\n".join(broken)


def test_the_link_scan_sees_what_github_renders_and_skips_code() -> None:
    text = (
        "See [a](docs/a.md) and [b][ref].\n"
        "`[not](a-link.md)`\n"
        "```\n[inside](fence.md)\n```\n"
        "[ref]: tests/b.py\n"
    )
    assert links(text) == ["docs/a.md", "tests/b.py"]
    assert slug("## `gpupipe report chargeback`".lstrip("# ")) == "gpupipe-report-chargeback"
    assert slug("Start order, outages and shutdown") == "start-order-outages-and-shutdown"


def _nav_pages(nav: list) -> list[str]:
    pages: list[str] = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


#: A curl command's port-only URL (`curl -s :9400/metrics`): curl refuses it ("URL using bad/illegal
#: format"), and with -s prints nothing at all, which reads as "no series".
_CURL_BARE_PORT = re.compile(r"\bcurl\b[^|\n]*?\s(:\d+\S*)")


def test_every_curl_in_the_readme_and_docs_names_a_host() -> None:
    pages = [README, *sorted((REPO / "docs").rglob("*.md"))]
    texts = {p.name: p.read_text(encoding="utf-8") for p in pages}
    assert sum(len(re.findall(r"\bcurl\b", t)) for t in texts.values()) >= 4  # the scan sees them
    bare = {name: _CURL_BARE_PORT.findall(t) for name, t in texts.items()}
    assert not {k: v for k, v in bare.items() if v}, "curl needs a host: http://127.0.0.1:PORT/..."
    assert _CURL_BARE_PORT.findall("`curl -s :9400/metrics \\| grep X`") == [":9400/metrics"]


def test_the_site_nav_lists_every_page_of_docs_and_nothing_else() -> None:
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))
    assert config["strict"] is True
    assert config["validation"]["omitted_files"] == "warn"  # strict turns it into a failure
    nav = _nav_pages(config["nav"])
    on_disk = sorted(p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md"))
    assert sorted(nav) == on_disk
    assert len(nav) == len(set(nav)), "a page is listed twice"


def test_every_docs_page_the_readme_lists_is_in_the_site() -> None:
    """The README's "where to read more" list and the site's nav name the same pages."""
    readme = README.read_text(encoding="utf-8")
    more = readme[readme.index("## Where to read more") :]
    listed = {u.partition("#")[0][len("docs/") :] for u in links(more) if u.startswith("docs/")}
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))
    assert listed <= set(_nav_pages(config["nav"]))
    assert {"cli.md", "metrics.md", "chargeback.md", "alerts.md", "security.md", "operations.md"} <= listed
