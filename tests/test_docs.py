"""The documentation stays short and true to the tree: the README and docs/RESULTS.md within their length limits,
every relative link in README.md and docs/*.md resolving to a file of the repository (and an anchor to a heading
of it), no machine paths, and every code comment that names a docs section naming one that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LIMITS = {"README.md": 150, "docs/RESULTS.md": 300}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MACHINE_PATH = re.compile(r"(?<![\w.~])/(?:work|root|home|tmp)/")
# "docs/RESULTS.md, 'The permutation rule'" or "[RESULTS.md](RESULTS.md), "The SFT recipe"" (a comment may wrap)
SECTION_REF = re.compile(
    r"\b(RESULTS|OPERATIONS)\.md(?:\]\([^)]*\))?,\s*((?:['\"][^'\"]+['\"](?:\s*(?:,|and)\s*)?)+)"
)
# Where code and config point at documentation.
SOURCES = "gr2 components pipelines analysis serving deploy manifests profiles docs images tests".split()


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def headings(path: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in path.read_text().splitlines() if re.match(r"#{1,6} ", line)]


@pytest.mark.parametrize("name,limit", LIMITS.items())
def test_length_limits(name, limit):
    n = len((ROOT / name).read_text().splitlines())
    assert n <= limit, f"{name} has {n} lines (limit {limit})"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc):
    bad = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s), mailto
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.is_relative_to(ROOT) or not path.exists():
            bad.append(f"{target}: no such file in the repository")
        elif anchor and path.suffix == ".md" and anchor not in {slug(h) for h in headings(path)}:
            bad.append(f"{target}: no heading with that anchor")
    assert not bad, f"{doc.name}: {bad}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_machine_paths(doc):
    hits = [line for line in doc.read_text().splitlines() if MACHINE_PATH.search(line)]
    assert not hits, f"{doc.name} names machine paths: {hits}"


def test_code_points_at_sections_that_exist():
    """A comment like "(docs/RESULTS.md, 'The operating tau')" names a heading of that doc; no comment points at a
    README heading (the README is an index, its headings are not a reference)."""
    sections = {name: set(headings(ROOT / "docs" / f"{name}.md")) for name in ("RESULTS", "OPERATIONS")}
    files = [ROOT / "Makefile", ROOT / "README.md"]
    files += [p for d in SOURCES for p in (ROOT / d).rglob("*") if p.suffix in {".py", ".yaml", ".md", ""}]
    refs, missing, readme = 0, [], []
    for path in files:
        if not path.is_file() or path == Path(__file__).resolve():
            continue
        text = path.read_text(errors="replace")
        flat = re.sub(r"\n\s*(?:#\s*)?", " ", text)  # join wrapped comments and docstrings
        for doc, quoted in SECTION_REF.findall(flat):
            for title in re.findall(r"['\"]([^'\"]+)['\"]", quoted):
                refs += 1
                if title not in sections[doc]:
                    missing.append(f"{path.relative_to(ROOT)}: {doc}.md has no heading {title!r}")
        readme += [f"{path.relative_to(ROOT)}: {m}" for m in re.findall(r"\(README[:,][^)]*\)", flat)]
    assert refs >= 20, refs  # the config, the teacher, the profiles and PAPER.md point at sections
    assert not missing, missing
    assert not readme, readme
