"""Passes behind one executor (issue 39): every record and replay pass of an audit goes
through ``Prepared.executor`` (:class:`fcaudit.engine.passes.Executor`), so another engine
is one new implementation of its two methods, not a change to the stages. Checked at the
source (no module but passes.py calls the pass functions) and at run time (from the probe
on, every forward pass the model makes is one the executor was asked for; prepare's looks
at the model, its vocabulary and its sites' layouts, come before any audit pass)."""

from __future__ import annotations

import ast
import dataclasses
import functools
from pathlib import Path
from typing import Any

import pytest
import toys
from conftest import FAST, toy_data

import fcaudit
from fcaudit.core.hooks import hooks
from fcaudit.engine.options import Prepared
from fcaudit.engine.passes import Local

SRC = Path(fcaudit.__file__).parent
OWNER = SRC / "engine" / "passes.py"
PASSES = {"record_batch", "replay_batch"}


def _named(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.name if isinstance(node, ast.alias) else None


def callers(tree: ast.AST) -> list[int]:
    """Lines that import, name or call a pass function."""
    return sorted({n.lineno for n in ast.walk(tree) if _named(n) in PASSES})


def test_only_the_executor_calls_the_pass_functions() -> None:
    found = {str(p.relative_to(SRC)): lines for p in sorted(SRC.rglob("*.py"))
             if p != OWNER and (lines := callers(ast.parse(p.read_text())))}
    assert not found, f"passes made outside the executor (use setup.executor): {found}"
    assert callers(ast.parse(OWNER.read_text()))  # the detector sees the owner's own
    assert callers(ast.parse("from x import record_batch\nm.replay_batch(a)\n")) == [1, 2]


@dataclasses.dataclass(frozen=True)
class Counting:
    """The local executor, counting what it is asked for."""

    inner: Local
    asked: list[str]

    def record(self, x: Any, *args: Any, **kw: Any) -> Any:
        self.asked.append("record")
        return self.inner.record(x, *args, **kw)

    def replay(self, x: Any, fed: Any, **kw: Any) -> Any:
        self.asked.append("replay")
        return self.inner.replay(x, fed, **kw)


def test_every_pass_of_an_audit_is_one_the_executor_was_asked_for(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    asked: list[str] = []
    monkeypatch.setattr(Prepared, "executor", functools.cached_property(
        lambda self: Counting(Local(self.model, self.sites), asked)))
    Prepared.executor.__set_name__(Prepared, "executor")
    model, forwards = toys.content_model(), []

    def count(*_: Any) -> None:  # a pre-hook returning None leaves the inputs as they are
        if asked:
            forwards.append(1)

    with hooks(model, {model: count}, kind="pre"):
        result = fcaudit.audit(model, tmp_path / "a", sites=["gates.*"], data=toy_data(),
                               options=FAST, report=False)
    assert result.identity_replay_max_abs_diff == 0.0
    batches = 3  # 12 evaluation and 12 calibration sequences, 4 per batch
    assert asked.count("record") >= 2 * batches and asked.count("replay") >= batches
    assert len(forwards) == len(asked)
