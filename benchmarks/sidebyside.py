"""Side-by-side timing shared by the benchmarks: ratios measured in one process.

On a shared machine absolute times drift with the load, but modes timed back to back
within one round see nearly the same load. So each round times every mode once (``reps``
calls each) after warm-up calls, the order alternating and rotating from round to round
(A B C, C B A, B C A, A C B, ...) so that no mode always runs first or last, and a mode's
cost is reported as its per-round ratio to a base mode: median and min-max over rounds.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence

import torch

Mode = Callable[[], object]


def add_timing_options(parser: argparse.ArgumentParser, seconds: float) -> None:
    """--rounds, --seconds and --threads, shared by every timing benchmark."""
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=seconds,
                        help="time per mode per round (sets the calls per round)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own; "
                        "1 is steadier on a machine shared with other jobs)")


def apply_timing_options(args: argparse.Namespace) -> str:
    """Set the thread count; the line that says how the numbers were taken."""
    if args.threads:
        torch.set_num_threads(args.threads)
    return f"{machine()}; {args.rounds} rounds of ~{args.seconds}s per mode, 2 warm-ups"


def once(fn: Mode) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def reps_for(fn: Mode, seconds: float) -> int:
    """Calls of ``fn`` that take about ``seconds`` (at least one)."""
    fn()
    return max(1, math.ceil(seconds / max(once(fn), 1e-6)))


def time_rounds(modes: Mapping[str, Mode], rounds: int, reps: int,
                warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per call of each mode in each round, interleaved as the module describes."""
    names = list(modes)
    for _ in range(warmup):
        for name in names:
            modes[name]()
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = (r // 2) % len(names)
        order = names[shift:] + names[:shift]
        for name in (order if r % 2 == 0 else order[::-1]):
            start = time.perf_counter()
            for _ in range(reps):
                modes[name]()
            seconds[name].append((time.perf_counter() - start) / reps)
    return seconds


def ratios(seconds: Mapping[str, Sequence[float]], base: str) -> dict[str, list[float]]:
    """Each mode's per-round time over the base mode's time in the same round."""
    return {name: [s / b for s, b in zip(times, seconds[base], strict=True)]
            for name, times in seconds.items()}


def summary(values: Sequence[float]) -> str:
    """``median [min-max]`` of per-round ratios."""
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def machine() -> str:
    """What the numbers were measured on, with the load average (as ``uptime`` shows it)."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"{os.cpu_count()} cores, load average {load}")
