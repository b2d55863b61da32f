"""The source tree's structure targets (issue 29), measured on src/ as a reader would:
small files and functions, cache keys built in one module, condition names in one place."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "fcaudit"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 60
MAX_ENGINE_MODULES = 24  # issue 39: the engine's own modules (its analyses are plugins)


def _modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _rel(path: Path) -> str:
    return str(path.relative_to(SRC.parent))


def test_no_source_file_is_longer_than_600_lines():
    long = {_rel(p): n for p in _modules()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES}
    assert long == {}


def test_no_function_is_longer_than_60_lines():
    long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{_rel(path)}:{node.lineno} {node.name}"] = lines
    assert long == {}


def test_the_engine_holds_at_most_24_modules_of_its_own():
    """Its steps' modules; each analysis is a plugin module under engine/analyses/."""
    own = sorted(p.name for p in (SRC / "engine").glob("*.py") if p.name != "__init__.py")
    assert len(own) <= MAX_ENGINE_MODULES, own
    assert (SRC / "engine" / "analyses" / "__init__.py").is_file()


def _key_prefixes(path: Path) -> set[str]:
    """String pieces that end in '::', the cache's key separator (``site::NAME``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.endswith("::"):
            found.add(node.value)
    return found


def test_cache_key_strings_are_built_in_the_cache_module_only():
    owners = {_rel(p): keys for p in _modules() if (keys := _key_prefixes(p))}
    assert set(owners) == {"fcaudit/engine/cache.py"}, owners
