"""Output folders (interim: replaced by the full ownership/lock implementation)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path


def check_output(path: Path, kind: str, option: str = "--out") -> None:
    """Refuse an output path fcaudit cannot use, without touching anything."""


def claim_output(path: Path, kind: str) -> None:
    Path(path).mkdir(parents=True, exist_ok=True)


@contextlib.contextmanager
def OutputLock(path: Path, command: str | None = None) -> Iterator[None]:  # noqa: N802
    yield


def retire_results(path: Path) -> None:
    """Move the previous results aside before new ones are written."""
