"""Every family and analysis reproduces its committed audit.json (tests/golden/) exactly,
outside ``runtime`` and the keys audit.json lists as nondeterministic: the guard that lets
the engine be reshaped without changing a number (issue 39)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from golden_audits import CASES, canonical, differences

GOLDEN = Path(__file__).parent / "golden"


def test_every_case_has_a_golden_and_every_golden_a_case() -> None:
    assert sorted(p.stem for p in GOLDEN.glob("*.json")) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_audit_reproduces_its_golden(name: str) -> None:
    golden = json.loads((GOLDEN / f"{name}.json").read_text())
    new = canonical(name)
    found = differences(golden, new) + [
        line.replace(": removed", ": added") for line in differences(new, golden)
        if line.endswith(": removed")]
    assert not found, (
        f"{name} no longer reproduces tests/golden/{name}.json:\n  " + "\n  ".join(found[:30])
        + "\n(after a deliberate change: python tests/golden_audits.py write tests/golden "
        f"{name}, and say why in the commit)")
    assert new == golden  # nothing the walk above could miss (list lengths, types)
