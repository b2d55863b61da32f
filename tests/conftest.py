from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))  # makes the `toys:FACTORY` model specs importable


@pytest.fixture(scope="session")
def tiny_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny FeatureGate and Dense twins trained briefly on the built-in corpus (shared)."""
    from fcaudit.study.train import train
    root = tmp_path_factory.mktemp("runs")
    return {arch: train(arch, "tiny", 0, root / arch, steps=40, progress=False)
            for arch in ("featuregate", "dense")}


def optional_extra(module: str):
    """Import a package of an optional extra: skipped where it is not installed, except
    in CI, which installs every extra (there a missing package fails, never skips)."""
    import importlib
    import os
    if os.environ.get("CI"):
        return importlib.import_module(module)
    return pytest.importorskip(module)
