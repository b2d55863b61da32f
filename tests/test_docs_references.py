"""Every test the documentation names exists: the catalogue's ``A::test_name`` references
(abbreviations from the paragraph above the table), ``tests/file.py::test_name`` paths and
``::test_name`` continuations of the same file, and every ``tests/...py`` path in README.md,
docs/*.md and benchmarks/ (renaming or moving a test must update its references)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
CATALOGUE = ROOT / "docs" / "reliability.md"
REF = re.compile(r"`(?:(?P<abbr>[A-Z])|tests/(?P<path>test_\w+\.py))?::(?P<name>test_\w+)")


def abbreviations(text: str) -> dict[str, str]:
    """``{"B": "test_bad_inputs.py", ...}`` from the paragraph that defines them."""
    paragraph = text[text.index("## Catalogue"):text.index("| # |")]
    return dict(re.findall(r"`([A-Z])` =\s+`tests/(test_\w+\.py)`", paragraph))


def defined(file: str) -> set[str]:
    return set(re.findall(r"^def (test_\w+)", (ROOT / "tests" / file).read_text(), re.M))


def references(text: str, abbr: dict[str, str]) -> list[tuple[str, str]]:
    """(file, test) for every reference in a table row; ``::name`` continues the file of
    the reference before it in the same row."""
    found = []
    for line in text.splitlines():
        if not line.startswith("|"):
            continue
        file = None
        for m in REF.finditer(line):
            file = abbr[m["abbr"]] if m["abbr"] else m["path"] or file
            assert file is not None, line
            found.append((file, m["name"]))
    return found


def test_every_catalogue_reference_names_an_existing_test() -> None:
    text = CATALOGUE.read_text()
    abbr = abbreviations(text)
    assert {"B", "C", "E"} <= set(abbr)
    refs = references(text, abbr)
    assert len(refs) > 300  # the catalogue's rows, not a parse that found nothing
    missing = [f"{file}::{name}" for file, name in refs
               if not (ROOT / "tests" / file).exists() or name not in defined(file)]
    assert missing == []


def test_every_test_file_the_docs_name_exists() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "benchmarks").glob("*.py"))]
    named = {(page.name, path) for page in pages
             for path in re.findall(r"tests/(\w+\.py)", page.read_text())}
    assert named
    assert [(page, path) for page, path in sorted(named)
            if not (ROOT / "tests" / path).exists()] == []
