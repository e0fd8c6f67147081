"""The documentation stays inside the repository and its links resolve."""

from __future__ import annotations

import re
from pathlib import Path
from typing import List

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _relative_links(page: Path) -> List[str]:
    return [t for t in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:", t)]


def test_docs_pages_exist():
    names = {p.name for p in PAGES}
    assert {"architecture.md", "formats.md", "guarantees.md", "performance.md"} <= names, names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve_inside_the_repository(page):
    for target in _relative_links(page):
        path = target.split("#", 1)[0]
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.is_relative_to(ROOT), f"{page.name} links outside the repository: {target}"
        assert resolved.exists(), f"{page.name}: broken link {target}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_names_nothing_outside_the_repository(page):
    assert "../shared" not in page.read_text(), page.name


ARCHITECTURE = ROOT / "docs" / "architecture.md"
MODULE_PATH = re.compile(r"`(dist_checkpointing/[\w/]*?\.py|dist_checkpointing/[\w/]+/)`")


def _named_modules() -> List[str]:
    return MODULE_PATH.findall(ARCHITECTURE.read_text())


ANY_PATH = re.compile(r"`([\w./]+\.py|\w+/)`")
BASES = [ROOT, ROOT / "dist_checkpointing", ROOT / "dist_checkpointing" / "strategies"]


def test_architecture_names_only_modules_that_exist():
    named = _named_modules()
    assert len(named) > 20, named
    missing = [m for m in named if not (ROOT / m).exists()]
    assert missing == [], f"docs/architecture.md names modules that do not exist: {missing}"


def test_architecture_short_paths_exist():
    """Paths in the data flow are written short (`torch_dist/plan.py`, `storage/`)."""
    short = ANY_PATH.findall(ARCHITECTURE.read_text())
    assert len(short) > 40, short
    missing = [p for p in short if not any((base / p).exists() for base in BASES)]
    assert missing == [], f"docs/architecture.md names paths that do not exist: {missing}"


def test_architecture_names_every_module():
    named = set(_named_modules())
    # a package's __init__.py may go unnamed: the package's modules are named
    modules = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "dist_checkpointing").rglob("*.py")
        if p.name != "__init__.py"
    )
    unnamed = [m for m in modules if m not in named]
    assert unnamed == [], f"add a line for each to docs/architecture.md: {unnamed}"


def test_code_and_tests_name_only_documents_in_the_repository():
    have = {p.name for p in [*ROOT.glob("*.md"), *ROOT.glob("docs/*.md")]}
    for folder in ("dist_checkpointing", "tests", "examples", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            for name in re.findall(r"\b[\w-]+\.md\b", path.read_text()):
                assert name in have, f"{path.relative_to(ROOT)} names {name}, not in the repository"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_names_only_documents_in_the_repository(page):
    have = {p.name for p in [*ROOT.glob("*.md"), *ROOT.glob("docs/*.md")]}
    named = set(re.findall(r"\b[\w-]+\.md\b", page.read_text()))
    assert named <= have, f"{page.name} names {sorted(named - have)}, not in the repository"


TEST_REF = re.compile(r"(tests/[\w/]+\.py)((?:`?, `?::\w+|::\w+)*)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_names_only_tests_that_exist(page):
    """A test file or test a page cites as evidence (`tests/x.py::test_y`, `::test_z`) exists."""
    for m in TEST_REF.finditer(page.read_text()):
        path = ROOT / m.group(1)
        assert path.is_file(), f"{page.name} names {m.group(1)}, which does not exist"
        source = path.read_text()
        for name in re.findall(r"::(\w+)", m.group(2)):
            assert f"def {name}(" in source, f"{page.name} names {m.group(1)}::{name}, not there"
