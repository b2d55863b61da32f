"""Each built-in condition's name is spelled once: a string literal equal to it appears in
at most two source files (its registry entry, and at most one more), and a key built from
it (``delta_static-layer-position``, ``reassign@layer``) appears in none outside the
registry; every other module asks the registry (issue 29: adding a condition must not
touch ten files; issue 39: nor rename one leave keys behind)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from fcaudit.core.conditions import CONDITIONS, REGISTRY

SRC = Path(__file__).resolve().parents[1] / "src" / "fcaudit"
REGISTRY_MODULE = "core/conditions.py"
# a key-like prefix: lowercase words joined by "_" (delta, retention, accuracy_retention)
PREFIX = re.compile(r"[a-z0-9]+(?:_[a-z0-9]+)*")


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


def derived_from(literal: str) -> set[str]:
    """The condition names a key-like literal (no whitespace) is built from, in the forms
    keys take: a prefix form ``<word>_<name>`` (``delta_reassign``; the name also with
    ``-`` written ``_``, as in ``retention_static_layer``) or a suffix form ``<name>@...``
    or ``<name>:...`` (run keys: ``reassign@layer``, ``frontier:gates:dynamic``). A name
    alone is not derived (the test above counts it)."""
    if literal in CONDITIONS or any(ch.isspace() for ch in literal):
        return set()
    found = set()
    for name in CONDITIONS:
        for form in {name, name.replace("-", "_")}:
            head = literal[:-len(form) - 1]
            if literal.endswith(f"_{form}") and PREFIX.fullmatch(head):
                found.add(name)
            if literal.startswith((f"{form}@", f"{form}:")):
                found.add(name)
    return found


def derived_outside_registry(root: Path = SRC, registry: str = REGISTRY_MODULE
                             ) -> dict[str, list[str]]:
    """``file: literal`` -> the conditions it is built from, for every module but the
    registry."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        where = str(path.relative_to(root))
        if where == registry:
            continue
        for literal in sorted(_literals(path)):
            if names := derived_from(literal):
                found[f"{where}: {literal}"] = sorted(names)
    return found


def test_no_key_built_from_a_condition_name_is_spelled_outside_the_registry():
    """Keys derive from the name (``delta_key(name)``, ``f"{name}@layer"``), never by hand."""
    assert derived_outside_registry() == {}


def test_the_derived_key_finder_catches_a_planted_one(tmp_path):
    """The detector itself: each planted derived key is found, names alone, prose, keys of
    other things and the registry module are not."""
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "conditions.py").write_text('A = "delta_reassign"\n')
    (tmp_path / "m.py").write_text(
        'K = ["delta_static-layer-position", "reassign@layer", "retention_static_layer_token",\n'
        '     "accuracy_retention_static_layer", "rerouted_static-layer-token", "nll_correct",\n'
        '     f"frontier:{1}", "reassign", "static-layer", "penalty: reassign",\n'
        '     "frontier_points", "expert_ablation", "layer_token", "_original", "reshuffle"]\n')
    assert derived_outside_registry(tmp_path) == {
        "m.py: accuracy_retention_static_layer": ["static-layer"],
        "m.py: delta_static-layer-position": ["static-layer-position"],
        "m.py: frontier:": ["frontier"],
        "m.py: nll_correct": ["correct"],
        "m.py: reassign@layer": ["reassign"],
        "m.py: rerouted_static-layer-token": ["static-layer-token"],
        "m.py: retention_static_layer_token": ["static-layer-token"],
    }
