"""Every benchmark's imports resolve: a benchmark reads fcaudit's internals and shared test
helpers, so a module or name that a refactor moved must fail here, not when someone runs
the benchmark months later (moe_families.py once imported a test file that had been
renamed)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LOCAL = {p.stem: p for folder in ("tests", "benchmarks") for p in (ROOT / folder).glob("*.py")}


def _defined(path: Path) -> set[str]:
    """Top-level names a local module defines or imports (read, not imported)."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _guarded(tree: ast.AST) -> set[int]:
    """Imports inside a ``try`` (optional packages the script reports as absent)."""
    return {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try)
            for stmt in t.body for n in ast.walk(stmt)}


def _unresolved(script: Path) -> list[str]:
    missing: list[str] = []
    tree = ast.parse(script.read_text(encoding="utf-8"))
    optional = _guarded(tree)
    module_level = {id(n) for n in tree.body}  # imports in functions may be optional extras
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            module, names = node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            module, names = None, [a.name for a in node.names]
        else:
            continue
        for name in ([module] if module else names):
            top = name.split(".")[0]
            if top not in LOCAL and top != "fcaudit":
                if id(node) in module_level and importlib.util.find_spec(top) is None:
                    missing.append(name)  # a renamed local file, or a package not installed
                continue
            if top in LOCAL:
                wanted = set(names) if module else set()
                missing += [f"{module}.{n}" for n in wanted - _defined(LOCAL[top])]
                continue
            try:
                found = importlib.import_module(name)
            except ImportError as exc:
                missing.append(f"{name} ({exc})")
                continue
            for attr in names if module else []:
                if not hasattr(found, attr):
                    try:
                        importlib.import_module(f"{name}.{attr}")
                    except ImportError:
                        missing.append(f"{name}.{attr}")
    return missing


@pytest.mark.parametrize("script", sorted((ROOT / "benchmarks").glob("*.py")),
                         ids=lambda p: p.name)
def test_every_import_of_a_benchmark_resolves(script: Path) -> None:
    assert _unresolved(script) == []


def test_a_moved_helper_is_caught() -> None:
    """The check itself: a renamed test file, a removed helper and a removed engine name
    are each reported; an optional import inside ``try`` is not."""
    probe = ROOT / "tests" / "_probe_benchmark.py"
    probe.write_text("from test_hf import FAMILIES\nfrom conftest import no_such_helper\n"
                     "from fcaudit.engine.plan import no_such_name, plan_runs\n"
                     "try:\n    import nnsight_absent\nexcept ImportError:\n    pass\n",
                     encoding="utf-8")
    try:
        assert _unresolved(probe) == ["test_hf", "conftest.no_such_helper",
                                      "fcaudit.engine.plan.no_such_name"]
    finally:
        probe.unlink()
