"""Progress bars for long work (training, record, replay), silent when disabled."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


@contextlib.contextmanager
def progress_bar(enabled: bool = True) -> Iterator[Progress]:
    """A rich progress display with a free ``info`` field; disabled bars print nothing."""
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                   disable=not enabled, transient=False,
                   console=None if enabled else _null_console())
    with bar:
        yield bar


def _null_console():  # noqa: ANN202 - rich Console, imported lazily
    from rich.console import Console
    return Console(file=sys.stderr, quiet=True)
