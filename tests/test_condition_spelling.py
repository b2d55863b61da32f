"""Each built-in condition's name is spelled once: a string literal equal to it appears in
at most two source files (its registry entry, and at most one more); every other module
asks the registry (issue 29: adding a condition must not touch ten files)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fcaudit.core.conditions import CONDITIONS, REGISTRY

SRC = Path(__file__).resolve().parents[1] / "src" / "fcaudit"


def _literals(path: Path) -> set[str]:
    """Every string constant of the module (f-string pieces included, docstrings too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def spelled_in() -> dict[str, list[str]]:
    """Condition name -> the source files with a string literal equal to it."""
    found: dict[str, list[str]] = {name: [] for name in CONDITIONS}
    for path in sorted(SRC.rglob("*.py")):
        for name in found.keys() & _literals(path):
            found[name].append(str(path.relative_to(SRC)))
    return found


@pytest.mark.parametrize("name", [c.name for c in REGISTRY])
def test_condition_name_spelled_in_at_most_two_files(name):
    files = spelled_in()[name]
    assert "core/conditions.py" in files  # the registry entry itself
    assert len(files) <= 2, f"{name!r} is spelled in {files}: ask the registry instead"


def test_literal_finder_counts_what_it_should(tmp_path):
    """The counter itself: an exact literal counts, a longer string or a name does not."""
    module = tmp_path / "m.py"
    module.write_text('A = "shuffle"\nB = f"x {A} shuffle"\nshuffle = 1\nC = "reshuffle"\n')
    assert _literals(module) & {"shuffle", "reshuffle"} == {"shuffle", "reshuffle"}
    assert "x " in _literals(module) and " shuffle" in _literals(module)
