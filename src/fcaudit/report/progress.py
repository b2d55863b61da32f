"""Progress for long work (training, record, replay) as a callback.

On a terminal it draws rich progress bars. With stderr redirected (CI, nohup, a
cluster job) it prints one plain line per stage at a steady interval instead, so a
log shows that work goes on and how far it is.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Any, TextIO

PLAIN_INTERVAL_S = 30.0


class ProgressReporter:
    """``progress(stage, done, total, info)``: call it as often as you like."""

    def __init__(self, enabled: bool = True, stream: TextIO | None = None,
                 interval: float = PLAIN_INTERVAL_S) -> None:
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.interval = interval
        self.tty = self.stream.isatty()
        self._bar: Any = None
        self._tasks: dict[str, Any] = {}
        self._last: dict[str, float] = {}
        self._done: dict[str, int] = {}
        self._repeating: set[str] = set()
        self._started = time.monotonic()

    def __enter__(self) -> ProgressReporter:
        if self.enabled and self.tty:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            # stages and infos are printed literally (a site name may hold "[/]")
            self._bar = Progress(TextColumn("{task.description}", markup=False), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(),
                                 TimeRemainingColumn(),
                                 TextColumn("{task.fields[info]}", markup=False),
                                 console=Console(file=self.stream, markup=False))
            self._bar.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.__exit__(kind, exc, tb)
            self._bar = None

    def __call__(self, stage: str, done: int, total: int, info: str = "") -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            if stage not in self._tasks:
                self._tasks[stage] = self._bar.add_task(stage, total=total, info="")
            self._bar.update(self._tasks[stage], completed=done, total=total, info=info)
            return
        now = time.monotonic()
        first = stage not in self._last
        if done < self._done.get(stage, 0):  # it starts over (progress within each batch):
            self._repeating.add(stage)  # from now on a line at the interval only
        self._done[stage] = done
        edge = (first or done >= total) and stage not in self._repeating
        if edge or now - self._last.get(stage, -self.interval) >= self.interval:
            self._last[stage] = now
            elapsed = now - self._started
            print(f"fcaudit: {stage}: {done}/{total}{f' {info}' if info else ''} "
                  f"[{elapsed:.0f} s]", file=self.stream, flush=True)
