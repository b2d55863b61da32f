"""What an audit will cost, said before the work: forward passes and the cache's size.

A real model's default audit can run for many minutes and write gigabytes (SmolLM2-135M's
30 layers of coefficients: about 47 MB per 128-token sequence), so the plan is printed
before any pass, and a cache that would not fit the disk holding it is refused before
the first shard, not discovered when the disk is full.

The evaluation shards are sized exactly from the probe's batch (every batch holds the same
tensors for its rows); calibration shards hold float64 sums per position (and per token
id, bounded by the tokens of a batch); replay shards hold a few numbers per run and row.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from fcaudit.core.errors import FcauditError, arg

# a cache may take this share of the free space before the plan warns
_WARN_SHARE = 0.5


@dataclass(frozen=True)
class RecordCost:
    """The record stage's passes and the cache's expected size in bytes."""

    eval_batches: int
    calib_batches: int
    bytes_per_sequence: int
    cache_bytes: int

    def line(self, free: int | None) -> str:
        disk = f", {_size(free)} free there" if free is not None else ""
        return (f"plan: record {self.eval_batches} evaluation + {self.calib_batches} "
                f"calibration batches (one forward pass each); cache about "
                f"{_size(self.cache_bytes)} ({_size(self.bytes_per_sequence)} per evaluation "
                f"sequence{disk})")


def record_cost(coefficients: dict[str, Tensor], nll: Tensor, rows: int, n_eval: int,
                n_calib: int, batch_size: int) -> RecordCost:
    """The cost of recording ``n_eval`` evaluation and ``n_calib`` calibration rows, from
    the probe's batch of ``rows`` rows (its coefficients and per-unit losses)."""
    per_row = sum(t.element_size() * t.numel() for t in (*coefficients.values(), nll)) / rows
    # calibration: float64 sums over a batch, by position (a row's coefficients, doubled in
    # width), and per token id (bounded by a batch's tokens times a row's width again)
    calib_shard = 2 * 2 * per_row
    n_calib_batches = -(-n_calib // batch_size)
    total = per_row * n_eval + calib_shard * n_calib_batches
    return RecordCost(-(-n_eval // batch_size), n_calib_batches, round(per_row), round(total))


def replay_line(n_runs: int, n_batches: int) -> str:
    return (f"plan: replay {n_runs} runs on each of {n_batches} evaluation batches: "
            f"{n_runs * n_batches} forward passes")


def free_bytes(folder: Path) -> int | None:
    """Free bytes on the disk that holds (or will hold) ``folder``, counting what a cache
    already there takes (a resumed audit rewrites at most that much)."""
    for parent in (folder, *folder.parents):
        if parent.exists():
            try:
                free = shutil.disk_usage(parent).free
            except OSError:
                return None
            if parent == folder and folder.is_dir():
                free += sum(p.stat().st_size for p in folder.rglob("*")
                            if p.is_file() and not p.is_symlink())
            return free
    return None


def check_disk(cost: RecordCost, free: int | None, folder: Path) -> str | None:
    """Refuse a cache that would not fit; a warning line when it would take most of the
    free space (None: nothing to say)."""
    if free is None:
        return None
    if cost.cache_bytes > free:
        raise FcauditError(
            f"the audit's cache needs about {_size(cost.cache_bytes)} but the disk holding "
            f"{folder} has {_size(free)} free: choose {arg('out')} on a larger disk, or "
            f"audit fewer sequences ({arg('max_eval', owner='DataSpec')}) or sites")
    if cost.cache_bytes > _WARN_SHARE * free:
        return (f"warning: the cache will take about {_size(cost.cache_bytes)} of the "
                f"{_size(free)} free on the disk holding {folder}")
    return None


def _size(n: float | None) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KB", "MB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
