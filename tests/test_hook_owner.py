"""Hooks are put on a model only through ``core/hooks.py``: one lifetime (registered for a
``with`` block, removed whatever happens), so a failed pass never leaves a model hooked.
A source test, as for cache keys: a second registration site would slip past any run."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import fcaudit

SRC = Path(fcaudit.__file__).parent
OWNER = SRC / "core" / "hooks.py"
REGISTER = re.compile(r"register_\w*hook")


def registrations(tree: ast.AST) -> list[int]:
    """Lines that call or name a ``register_*hook`` of torch (a method or a function)."""
    return sorted({node.lineno for node in ast.walk(tree)
                   if (isinstance(node, ast.Attribute) and REGISTER.fullmatch(node.attr))
                   or (isinstance(node, ast.Name) and REGISTER.fullmatch(node.id))})


def test_hooks_are_registered_only_in_core_hooks() -> None:
    found = {str(path.relative_to(SRC)): lines for path in sorted(SRC.rglob("*.py"))
             if path != OWNER and (lines := registrations(ast.parse(path.read_text())))}
    assert not found, f"hooks registered outside core/hooks.py (use core.hooks.hooks): {found}"
    assert registrations(ast.parse(OWNER.read_text()))  # the owner itself is seen


def test_the_detector_sees_every_spelling() -> None:
    planted = ("m.register_forward_hook(f)\nm.register_forward_pre_hook(f, with_kwargs=True)\n"
               "torch.nn.modules.module.register_module_forward_hook(f)\n"
               "r = m.register_full_backward_hook\nregister_module_forward_pre_hook(f)\n"
               "m.forward(x)\n")
    assert registrations(ast.parse(planted)) == [1, 2, 3, 4, 5]
