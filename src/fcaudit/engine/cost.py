"""What an audit will cost, said before the work: forward passes and the cache's size.

A real model's default audit can run for many minutes and write gigabytes (SmolLM2-135M's
30 layers of coefficients: about 47 MB per 128-token sequence), so the plan is printed
before any pass, and a cache that would not fit the disk holding it is refused before
the first shard, not discovered when the disk is full.

Every shard is sized from the tensors it will hold, built from the probe's batch by the
functions that build the real shards (evaluation: coefficients and losses per row;
calibration: float64 sums by position and by token id, whose distinct ids the probe's
batch shows; the frontier's calibration: whole coefficients per row), and counted as a disk
stores it: each file (a shard and its checksum, each batch's replay shard, the manifest) and
folder takes whole blocks, with a header per tensor.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from fcaudit.core.errors import FcauditError, arg
from fcaudit.engine.replay_proof import ReuseSample

# a cache may take this share of the free space before the plan warns
_WARN_SHARE = 0.5
_BLOCK = 4096  # a file takes whole blocks of this size on common file systems
_FOLDERS = 3  # the cache's folder, its replay folder and its manifest: a block each
_HEADER = 128  # a safetensors header's bytes per tensor (name, dtype, shape, offsets)


@dataclass(frozen=True)
class RecordCost:
    """The record stage's passes and the cache's expected size in bytes."""

    eval_batches: int
    calib_batches: int
    bytes_per_sequence: int
    cache_bytes: int


def record_cost(eval_shard: Mapping[str, Tensor], calib_shard: Mapping[str, Tensor],
                frontier_shard: Mapping[str, Tensor], rows: int, n_eval: int, n_calib: int,
                batch_size: int, runs: int = 0) -> RecordCost:
    """The cost of recording ``n_eval`` evaluation and ``n_calib`` calibration rows, from
    the shards the probe's batch of ``rows`` rows would write (``frontier_shard``: the
    frontier's whole calibration coefficients, empty without a frontier), and of each
    batch's replay shard of ``runs`` runs."""
    n_eval_batches, n_calib_batches = -(-n_eval // batch_size), -(-n_calib // batch_size)
    per_row = _bytes(eval_shard) / rows
    eval_disk = sum(_on_disk(per_row * _rows_in(b, batch_size, n_eval), len(eval_shard))
                    + _on_disk(_replay_bytes(runs, _rows_in(b, batch_size, n_eval),
                                             "hits" in eval_shard), _REPLAY_TENSORS)
                    for b in range(n_eval_batches))
    calib_disk = n_calib_batches * _on_disk(_bytes(calib_shard), len(calib_shard))
    if frontier_shard:
        calib_disk += sum(_on_disk(_bytes(frontier_shard) / rows
                                   * _rows_in(b, batch_size, n_calib), len(frontier_shard))
                          for b in range(n_calib_batches))
    return RecordCost(n_eval_batches, n_calib_batches, round(per_row),
                      round(eval_disk + calib_disk + _FOLDERS * _BLOCK))


_REPLAY_TENSORS = 6  # losses, feed digests, identity, prefix state, plan digest, hits


def _replay_bytes(runs: int, rows: int, hits: bool) -> int:
    """A replay shard: per run a float64 loss per row (and a hit, where the objective
    scores hits) and a 32-byte feed digest; the plan's digest and two scalars."""
    return runs * ((16 if hits else 8) * rows + 32) + 32 + 16


def _rows_in(b: int, batch_size: int, n: int) -> int:
    """How many of ``n`` rows batch ``b`` holds (the last batch may be short)."""
    return min(batch_size, n - b * batch_size)


def _bytes(shard: Mapping[str, Tensor]) -> int:
    return sum(t.element_size() * t.numel() for t in shard.values())


def _on_disk(data: float, tensors: int) -> int:
    """A shard of ``data`` bytes in ``tensors`` tensors and its checksum file, in whole
    blocks as a disk stores them."""
    blocks = -(-int(data + _HEADER * tensors + _HEADER) // _BLOCK)
    return (blocks + 1) * _BLOCK


def replay_line(n_runs: int, n_batches: int, reused: int = 0,
                sample: ReuseSample | None = None) -> str | None:
    """What proves the cached replay batches, when a rerun finds some (None: none; the
    plan said the replay's passes before the work)."""
    if not reused or sample is None:
        return None
    verified = sum(len(v) for v in sample.by_batch.values())
    passes = verified + sum(2 - (0 in v) for v in sample.by_batch.values())
    how = ("every run of every cached batch" if sample.mode == "all" else
           f"a fresh random sample of {verified} runs, every run of the plan on one cached "
           f"batch (seed {sample.seed}; {arg('verify_reuse', 'all')} proves every run)")
    return (f"replay: {reused} of {n_batches} evaluation batches cached: reused only once "
            f"{how} replays bit for bit as cached (about {passes} passes), the other "
            f"{n_batches - reused} replayed ({(n_batches - reused) * n_runs} passes)")


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
            f"the audit's cache needs about {size_text(cost.cache_bytes)} but the disk holding "
            f"{folder} has {size_text(free)} free: choose {arg('out')} on a larger disk, or "
            f"audit fewer sequences ({arg('max_eval', owner='DataSpec')}) or sites")
    if cost.cache_bytes > _WARN_SHARE * free:
        return (f"warning: the cache will take about {size_text(cost.cache_bytes)} of the "
                f"{size_text(free)} free on the disk holding {folder}")
    return None


def size_text(n: float | None) -> str:
    """Bytes as a person reads them (kB, MB, GB in powers of 1000)."""
    if n is None:
        return "unknown"
    for unit in ("B", "KB", "MB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
