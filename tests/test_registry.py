"""The one registry type: order, aliases, refusal of duplicates and late entries, and an
unknown name refused in one line with the closest choice; every registry fcaudit keeps is
one, frozen, and no other module writes its own "choose one of" line."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

import fcaudit
from fcaudit.core.conditions import CONDITIONS
from fcaudit.core.discovery import BLOCK_RULES, EXPERT_RULES, SITE_RULES
from fcaudit.core.errors import UsageError
from fcaudit.core.registry import Registry, refusal
from fcaudit.engine.analyses import ANALYSES
from fcaudit.engine.objectives import OBJECTIVES, TASKS
from fcaudit.io.arches import ARCHES, get_arch
from fcaudit.report.sections import RENDERERS

SRC = Path(fcaudit.__file__).parent


@dataclass(frozen=True)
class Thing:
    name: str


def test_entries_keep_their_order_and_aliases_resolve() -> None:
    reg: Registry[Thing] = Registry("thing", frozen=False)
    a, b = reg.register(Thing("alpha"), aliases=["a"]), reg.register(Thing("beta"))
    reg.freeze()
    assert list(reg) == ["alpha", "beta"] and list(reg.values()) == [a, b] and len(reg) == 2
    assert reg["a"] is a and "a" in reg and reg.get("gamma") is None
    with pytest.raises(RuntimeError, match="frozen"):
        reg.register(Thing("gamma"))


@pytest.mark.parametrize("name", ["alpha", "a"])
def test_a_name_or_alias_is_registered_once(name: str) -> None:
    reg: Registry[Thing] = Registry("thing", frozen=False)
    reg.register(Thing("alpha"), aliases=["a"])
    with pytest.raises(ValueError, match=f"thing '{name}' is registered twice"):
        reg.register(Thing("other"), aliases=[name] if name == "a" else []) if name == "a" \
            else reg.register(Thing(name))


def test_an_unknown_name_is_one_line_with_the_closest_choice() -> None:
    reg = Registry("thing", [Thing("featuregate"), Thing("dense")], option="arch")
    with pytest.raises(UsageError) as near:
        reg.lookup("featuregat")
    assert str(near.value) == ("unknown thing 'featuregat': choose one of featuregate, dense; "
                               "did you mean featuregate?")
    assert near.value.option == "arch"
    with pytest.raises(UsageError) as far:
        reg.lookup("zzz", said="--kind zzz", also=", or a callable")
    assert str(far.value) == "--kind zzz: choose one of featuregate, dense, or a callable"
    assert str(refusal("x", 3, ["a"])) == "x: choose one of a"  # not a string: no guess


def test_get_arch_suggests() -> None:
    with pytest.raises(UsageError, match="did you mean mamba"):
        get_arch("mambo")


@pytest.mark.parametrize("registry", [CONDITIONS, OBJECTIVES, TASKS, ARCHES, SITE_RULES,
                                      BLOCK_RULES, EXPERT_RULES, ANALYSES, RENDERERS],
                         ids=["conditions", "objectives", "tasks", "arches", "site-rules",
                              "block-rules", "expert-rules", "analyses", "renderers"])
def test_every_registry_is_frozen(registry: Registry) -> None:
    assert isinstance(registry, Registry) and len(registry) > 0
    with pytest.raises(RuntimeError, match="frozen"):
        registry.register(next(iter(registry.values())))


def test_no_module_writes_its_own_choice_line() -> None:
    """Every 'choose one of' comes from core/registry.py (else no suggestion, and the
    wording drifts)."""
    found = sorted(
        f"{path.relative_to(SRC)}:{node.lineno}" for path in SRC.rglob("*.py")
        if path != SRC / "core" / "registry.py" and path != SRC / "core" / "hooks.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        and "choose one of" in node.value)
    assert not found, found


def test_added_lasts_for_its_block_only() -> None:
    reg = Registry("thing", [Thing("alpha")])
    with reg.added(Thing("beta"), aliases=["b"]) as beta:
        assert reg["b"] is beta and list(reg) == ["alpha", "beta"]
    assert list(reg) == ["alpha"] and "b" not in reg
    with pytest.raises(RuntimeError, match="frozen"):
        reg.register(Thing("gamma"))
