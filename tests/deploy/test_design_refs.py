"""The repo explains itself: every reference to docs/design.md names a section that exists, and
nothing refers to a document outside the repo."""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

from tests.deploy.support import ROOT

DOCS = ROOT / "docs"
DESIGN_MD = DOCS / "design.md"
GLOSSARY = DOCS / "glossary.md"
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".cfg", ".txt", ".json", ".proto"}
# Built from parts so that this file does not match its own patterns.
OUTSIDE = [
    re.compile(r"\b" + "DES" + r"IGN\b"),  # the design notes the project started from
    re.compile(r"\b" + "anc" + r"hors [A-Z]\d"),  # the notes on other projects
    re.compile(re.escape(".." + "/shared")),
    re.compile(re.escape("/work" + "/shared")),
]
SECTION_REF = re.compile(r"design\.md(?:\)|\]\([^)]*\))? §(\d+(?:\.\d+)?)")
BARE_REF = re.compile(r"§(\d+(?:\.\d+)?)")
LINK = re.compile(r"\]\(((?:[\w./-]*/)?(design|glossary)\.md)(?:#([^)]+))?\)")
# Jargon a newcomer meets in the README and the logs; the glossary explains each.
JARGON = (
    "ListAndWatch",
    "Pod-resources API",
    "Xid",
    "SM",
    "MPS",
    "MIG",
    "Work-conserving",
    "CDI",
    "Device checkpoint",
    "Slice",
    "Allocation",
    "allocation ID",
    "Duty cycle",
    "Entitlement",
    # The words of DRA mode, and the one a process's environment gives (not a DRA claim).
    "Allocation tag",
    "DRA",
    "ResourceClaim",
    "ResourceClaimTemplate",
    "ResourceSlice",
    "DeviceClass",
    "Pool",
    "Consumable capacity",
    "Request policy",
    "consumedCapacity",
    "shareID",
    "CDI",
    "NodePrepareResources",
    "NodeUnprepareResources",
    "Kubelet plugin registration",
    "Extended resource",
    "Device taint",
    "Grant",
)


def repo_files() -> list[Path]:
    """Every text file git knows (tracked, or new and not ignored)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    files = []
    for name in listed:
        path = ROOT / name
        if "_proto" in path.parts or not path.is_file():
            continue
        if path.suffix in TEXT_SUFFIXES or path.name in {"Dockerfile", "run"}:
            files.append(path)
    return files


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@cache
def headings(path: Path) -> list[str]:
    return re.findall(r"^#+ (.+)$", path.read_text(), flags=re.MULTILINE)


@cache
def design_sections() -> set[str]:
    numbers = set()
    for heading in headings(DESIGN_MD):
        found = re.match(r"(\d+(?:\.\d+)?)\.? ", heading)
        if found:
            numbers.add(found.group(1))
    return numbers


def test_design_sections_are_numbered_once() -> None:
    numbered = [h.split(" ", 1)[0].rstrip(".") for h in headings(DESIGN_MD) if h[0].isdigit()]
    assert len(numbered) == len(set(numbered)), numbered
    assert {"1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12"} <= set(numbered)


def test_sections_finds_what_a_reference_names() -> None:
    # The check below must be able to fail: a made-up section is not among the real ones.
    assert "3" in design_sections()
    assert "99" not in design_sections()
    refs = SECTION_REF.findall("see docs/design.md §3 and [docs/design.md](x) " + "§" + "99")
    assert refs == ["3", "99"]


@pytest.mark.parametrize("path", repo_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_references_name_existing_design_sections(path: Path) -> None:
    text = path.read_text(errors="replace")
    refs = SECTION_REF.findall(text)
    if path.parent == DOCS:
        refs += BARE_REF.findall(text)
    for number in refs:
        assert number in design_sections(), (
            f"{path.relative_to(ROOT)} refers to docs/design.md §{number}, which does not exist"
        )


@pytest.mark.parametrize("path", repo_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_to_the_docs_resolve(path: Path) -> None:
    for target, name, fragment in LINK.findall(path.read_text(errors="replace")):
        doc = DOCS / f"{name}.md"
        assert (path.parent / target).resolve() == doc.resolve(), (
            f"{path.relative_to(ROOT)} links to {target}, which is not docs/{name}.md"
        )
        if fragment:
            anchors = {anchor(h) for h in headings(doc)}
            assert fragment in anchors, f"{path.relative_to(ROOT)}: no heading makes #{fragment}"


@pytest.mark.parametrize("path", repo_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_refers_to_documents_outside_the_repo(path: Path) -> None:
    text = path.read_text(errors="replace")
    for pattern in OUTSIDE:
        found = pattern.search(text)
        assert found is None, (
            f"{path.relative_to(ROOT)} refers to {found.group(0)!r}, which is not in the repo: "
            "refer to a section of docs/design.md instead"
        )


def test_the_glossary_explains_the_jargon() -> None:
    text = GLOSSARY.read_text()
    terms = re.findall(r"^\*\*([^*]+)\*\*", text, flags=re.MULTILINE)
    for word in JARGON:
        assert any(word in term for term in terms) or f"**{word}**" in text, word


def test_the_readme_leads_to_the_design_and_the_glossary() -> None:
    readme = (ROOT / "README.md").read_text()
    first_screen = readme[:4000]
    assert "docs/glossary.md" in first_screen
    assert "docs/design.md" in first_screen
