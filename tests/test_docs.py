"""The README is a front page and docs/ holds one page per topic: every relative link resolves, every page is reachable
from docs/index.md, and mkdocs builds the site in strict mode. Plain file reads only (no preflight, no torch)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
MAX_README_CHARS = 30_000  # a front page: what it is, set-up, the three uses, links; the rest lives in docs/

# [text](target) or ![alt](target), the target up to whitespace or ")"; an optional "title" after it.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
COMMENT = re.compile(r"<!--.*?-->", re.S)
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def _pages() -> list[pathlib.Path]:
    return sorted(DOCS.glob("*.md"))


def _prose(text: str) -> str:
    """``text`` without fenced code blocks, code spans and HTML comments: links there are not links."""
    return CODE_SPAN.sub("", FENCE.sub("", COMMENT.sub("", text)))


def _links(path: pathlib.Path) -> list[str]:
    return LINK.findall(_prose(path.read_text()))


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: markup dropped, lower case, characters other than letters, digits,
    spaces, hyphens and underscores removed, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    """Every heading anchor of a Markdown file; a repeated slug gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for _, text in HEADING.findall(FENCE.sub("", path.read_text())):
        slug = github_slug(text)
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def _is_external(target: str) -> bool:
    return re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) is not None  # http:, https:, mailto:, ...


def test_github_slug_follows_githubs_rule():
    assert github_slug("Depth-independent traces: `fast=True`") == "depth-independent-traces-fasttrue"
    assert github_slug("torch.compile'd models") == "torchcompiled-models"
    assert github_slug("DDP's `gradient_as_bucket_view`") == "ddps-gradient_as_bucket_view"
    assert github_slug("`preflight check`: dry-run your own script") == "preflight-check-dry-run-your-own-script"


def test_readme_is_a_front_page():
    size = len(README.read_text())
    assert size < MAX_README_CHARS, f"README.md has {size:,} characters; move detail into a docs/ page"


@pytest.mark.parametrize("path", [README, *_pages()], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = []
    for target in _links(path):
        if _is_external(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else (path.parent / file_part).resolve()
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with the anchor #{anchor} in {dest.name}")
    assert not broken, f"{path.name}: " + "; ".join(broken)


def test_docs_pages_link_only_inside_docs():
    """mkdocs --strict fails on a relative link out of docs/ (benchmarks/results/*.md, examples/*.py): docs pages name
    such files in code spans; the README may link anywhere."""
    outside = [f"{page.name}: {target}" for page in _pages() for target in _links(page)
               if not _is_external(target) and target.partition("#")[0]
               and DOCS not in (page.parent / target.partition("#")[0]).resolve().parents]
    assert not outside, outside


def test_every_docs_page_is_linked_from_the_index():
    index = DOCS / "index.md"
    linked = {(DOCS / t.partition("#")[0]).resolve() for t in _links(index) if not _is_external(t)}
    missing = [p.name for p in _pages() if p != index and p.resolve() not in linked]
    assert not missing, f"docs/index.md does not link {missing}"


def test_readme_links_the_docs_index_and_the_architecture_page():
    targets = {t.partition("#")[0] for t in _links(README)}
    assert {"docs/index.md", "docs/architecture.md"} <= targets
    assert (DOCS / "architecture.md").exists()


def test_mkdocs_config_is_strict_and_lists_every_page():
    config = (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^strict:\s*true\s*$", config, re.M)
    assert re.search(r"^docs_dir:\s*docs\s*$", config, re.M)
    nav = config[config.index("nav:"):]
    missing = [p.name for p in _pages() if p.name not in nav]
    assert not missing, f"mkdocs.yml's nav leaves out {missing}"


@pytest.mark.slow
def test_mkdocs_builds_in_strict_mode(tmp_path):
    pytest.importorskip("mkdocs")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
