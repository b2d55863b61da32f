"""What the whole audit will cost, said before the work: every forward pass it will make,
by stage, the time each stage takes at the pace the probe measured, the largest costs
first with the option that cuts each, and the cache's size on disk.

The probe has just recorded and replayed the first evaluation batch, so its two wall
times are this model's pace on this machine with this batch size: a replay at the
replay's pace, a record-like pass (recording, the exit references, counting executed
blocks) at the faster of the two, since the record pass was the process's first and may
carry its one-time costs (a 30-layer model's first pass took twice its later ones). A
per-layer run under the prefix schedule recomputes only the blocks after its site, so its
estimate is an upper bound, as are the frontier's points (levels that coincide are
dropped once calibration is recorded). The plan is kept in
``runtime.plan``, beside the measured times, so the estimate can be checked.
"""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from fcaudit.core.errors import FcauditError, arg
from fcaudit.core.exits import exit_sites
from fcaudit.engine.analyses.base import Cost
from fcaudit.engine.analyses.exits import asked
from fcaudit.engine.execution import TIMING_WARMUP
from fcaudit.engine.exits import PROBE_ROWS, check_passes
from fcaudit.engine.options import Prepared, Progress, say
from fcaudit.engine.plan import OneSite, Run, plan_runs
from fcaudit.engine.prepare import not_measured, runs_elsewhere
from fcaudit.engine.probe import Probe, first_batch
from fcaudit.engine.stages import calibration_shard, eval_shard

_SHOWN = 4  # stages named in the plan line, largest first


@dataclass(frozen=True)
class Stage:
    """One kind of work of the audit: its forward passes and their estimated seconds."""

    name: str
    passes: int
    seconds: float
    cut: str = ""  # the option that drops or shrinks it
    at_most: bool = False  # an upper bound (prefix reuse, frontier levels that coincide)


@dataclass(frozen=True)
class AuditPlan:
    """Every stage's passes and time, and the cache's size (:func:`audit_plan`)."""

    stages: tuple[Stage, ...]
    cache: RecordCost
    n_eval: int
    pace: tuple[float, float]  # the probe's record and replay seconds for one batch
    batch_size: int = 8
    notes: list[str] = field(default_factory=list)

    @property
    def passes(self) -> int:
        return sum(s.passes for s in self.stages)

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.stages)

    def lines(self, free: int | None) -> list[str]:
        """The plan as a person reads it: the total, the largest stages with what cuts
        them, and the cache."""
        shown = sorted((s for s in self.stages if s.passes), key=lambda s: -s.seconds)
        parts = [f"{s.name} {'up to ' if s.at_most else ''}{s.passes} passes "
                 f"~{_duration(s.seconds)}{f' ({s.cut})' if s.cut else ''}"
                 for s in shown[:_SHOWN]]
        rest = shown[_SHOWN:]
        if rest:
            parts.append(f"{len(rest)} more stages {sum(s.passes for s in rest)} passes "
                         f"~{_duration(sum(s.seconds for s in rest))}")
        record, replay = self.pace
        disk = f", {size_text(free)} free there" if free is not None else ""
        return [f"plan: about {self.passes} forward passes, ~{_duration(self.seconds)} at "
                f"the probe's pace ({record:.2f} s a record pass, {replay:.2f} s a replay, "
                f"batches of {self.batch_size}): " + "; ".join(parts),
                f"plan: cache about {size_text(self.cache.cache_bytes)} "
                f"({size_text(self.per_sequence)} per evaluation sequence{disk})"]

    @property
    def per_sequence(self) -> int:
        """Bytes per evaluation sequence as ``runtime.cache`` counts them: the whole cache
        over the evaluation sequences."""
        return round(self.cache.cache_bytes / max(self.n_eval, 1))

    def to_json(self) -> dict[str, Any]:
        return {"passes": self.passes, "estimated_s": round(self.seconds, 4),
                "cache_bytes": self.cache.cache_bytes,
                "bytes_per_eval_sequence": self.per_sequence,
                "probe_record_s": round(self.pace[0], 6),
                "probe_replay_s": round(self.pace[1], 6),
                "stages": {s.name: {"passes": s.passes, "estimated_s": round(s.seconds, 3),
                                    **({"at_most": True} if s.at_most else {})}
                           for s in self.stages}}


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def audit_plan(setup: Prepared, first: Probe) -> AuditPlan:
    """Every pass the audit will make, counted from what is known after the probe."""
    opts, inputs = setup.options, setup.inputs
    size = opts.batch_size
    n_eval, n_calib = -(-inputs.n_eval // size), -(-inputs.n_calib // size)
    record_s, replay_s = _warm(first), first.replay_s
    costs = [later.cost(setup, first, n_eval, n_calib) for _, later in first.later]
    skipped = setup.not_applicable
    runs = plan_runs(setup.sites, opts, setup.conditions, setup.interventions,
                     first.planned, (), skipped)
    per_layer = sum(isinstance(r.target, OneSite) for r in runs)
    own = Counter(r.target.stage for r in runs if r.target.stage is not None)  # analyses'
    main = len(runs) - per_layer - sum(own.values())
    later = sum(c.replay_runs for c in costs)
    exits = _exit_stage(setup, n_eval, n_calib, first)
    proofs = _prefix_proofs(setup, runs)
    stages = [
        Stage("record", n_eval - 1 + n_calib, (n_eval - 1 + n_calib) * record_s),
        Stage("replay", (main + 1) * n_eval, (main + 1) * n_eval * replay_s),
        Stage("per-layer runs", (per_layer + proofs) * n_eval,
              (per_layer + proofs) * n_eval * replay_s,
              _cut("per_layer", "AuditOptions(per_layer=False)", "--no-per-layer", "drops"),
              at_most=opts.schedule == "prefix"),
        *(Stage(stage.name, n * n_eval, n * n_eval * replay_s, _cut(*stage.cut, "drops"),
                at_most=True) for stage, n in own.items()),
        exits,
        *(stage for c in costs for stage in _later_stages(c, n_eval, first)),
        *_execution_stages(setup, n_eval, record_s)]
    cache = record_cost(eval_shard(first.nll, first.coefficients, first.hits),
                        calibration_shard(setup, first.coefficients, first_batch(setup)),
                        {name: first.coefficients[name] for c in costs for name in c.stored_sites},
                        int(first.nll.shape[0]), inputs.n_eval, inputs.n_calib, size,
                        len(runs) + later)
    return AuditPlan(tuple(stages), cache, inputs.n_eval, (record_s, replay_s), size)


def _prefix_proofs(setup: Prepared, runs: Sequence[Run]) -> int:
    """The prefix schedule's proofs per batch: one per per-layer site whose prefix holds a
    block, that is every such site but those inside the first declared block (a site
    outside the blocks, such as an exit rule after one, has the blocks called before it)."""
    if setup.options.schedule != "prefix" or not setup.blocks:
        return 0
    first = setup.blocks[0]
    sites = {r.target.only_site for r in runs if isinstance(r.target, OneSite)}
    return sum(1 for s in sites if s is not None and s.path != first
               and not s.path.startswith(f"{first}."))


def _warm(first: Probe) -> float:
    """A record-like pass's seconds: the probe's record pass, unless its replay (the warm
    pass after it) was faster."""
    return min(first.record_s, first.replay_s)


def _cut(name: str, py: str, cli: str, verb: str = "shrinks") -> str:
    """The option that cuts a stage, in its reader's words."""
    return f"{arg(name, py=py, cli=cli)} {verb} it"


def _exit_stage(setup: Prepared, n_eval: int, n_calib: int, first: Probe) -> Stage:
    """The exit references' real passes (engine/exits.py): the check of the exit rule on a
    probe of a few rows, the model's own exits on calibration and evaluation and the
    oracle's full-depth pass per evaluation batch (the exit frontier's sweep is its own)."""
    if not asked(setup):
        return Stage("exit references", 0, 0.0)
    full = n_calib + n_eval * 2
    rows = int(first.nll.shape[0])
    units = PROBE_ROWS * (first.nll.numel() // rows if exit_sites(setup.sites)[0].positions
                          else 1)
    check = check_passes(len(exit_sites(setup.sites)), units)
    seconds = (full + check * min(PROBE_ROWS, rows) / rows) * _warm(first)
    return Stage("exit references", full + check, seconds)


def _later_stages(cost: Cost, n_eval: int, first: Probe) -> list[Stage]:
    """An analysis's work placed once the audit is recorded: its record-like passes, and
    at most its replays of every evaluation batch; or the passes it makes on inputs of its
    own, at its own estimate."""
    passes, seconds = cost.own
    if passes:
        return [Stage(cost.name, passes, seconds, _cut(*cost.cut), at_most=True)]
    runs = cost.replay_runs * n_eval
    return [Stage(f"{cost.name} references", cost.record_passes,
                  cost.record_passes * _warm(first)),
            Stage(f"{cost.name} points", runs, runs * first.replay_s, _cut(*cost.cut),
                  at_most=True)]


def _execution_stages(setup: Prepared, n_eval: int, record_s: float) -> list[Stage]:
    """Counting executed blocks and FLOPs (model and twin), and the timed pairs."""
    opts = setup.options
    if runs_elsewhere(setup) and opts.timing_pairs:
        timed = 1 + 2 * (TIMING_WARMUP + opts.timing_pairs)  # a record, then the pairs
        return [Stage("controller timing", timed, timed * record_s,
                      _cut("timing_pairs", "AuditOptions(timing_pairs=0)",
                           "--timing-pairs 0", "drops"))]
    if not_measured(setup) is not None:
        return []
    twin = setup.dense is not None
    counted = (1 + n_eval) * (1 + twin)  # each side: a warm pass (warm_pass), every batch
    timed = 2 * (TIMING_WARMUP + opts.timing_pairs) if twin and opts.timing_pairs else 0
    return [Stage("execution", counted + timed, (counted + timed) * record_s,
                  _cut("execution", "AuditOptions(execution=False)", "--no-execution",
                       "drops"))]


def say_plan(setup: Prepared, plan: AuditPlan, folder: Path, progress: Progress) -> None:
    """The plan's lines before any pass of the audit proper; a cache the disk cannot hold
    is refused here (see :mod:`fcaudit.engine.budget`)."""
    free = free_bytes(folder)
    warning = check_disk(plan.cache, free, folder)
    if setup.options.progress:
        for line in (*plan.lines(free), warning):
            if line:
                say(progress, line)


# ---------------------------------------------------------------------- cost
# What an audit will cost, said before the work: forward passes and the cache's size.
#
# A real model's default audit can run for many minutes and write gigabytes (SmolLM2-135M's
# 30 layers of coefficients: about 47 MB per 128-token sequence), so the plan is printed
# before any pass, and a cache that would not fit the disk holding it is refused before
# the first shard, not discovered when the disk is full.
#
# Every shard is sized from the tensors it will hold, built from the probe's batch by the
# functions that build the real shards (evaluation: coefficients and losses per row;
# calibration: float64 sums by position and by token id, whose distinct ids the probe's
# batch shows; the frontier's calibration: whole coefficients per row), and counted as a disk
# stores it: each file (a shard and its checksum, each batch's replay shard, the manifest) and
# folder takes whole blocks, with a header per tensor.

# a cache may take this share of the free space before the plan warns
_WARN_SHARE = 0.5
_BLOCK = 4096  # a file takes whole blocks of this size on common file systems
_FOLDERS = 3  # the cache's folder, its replay folder and its manifest: a block each
_HEADER = 128  # a safetensors header's bytes per tensor (name, dtype, shape, offsets)


@dataclass(frozen=True)
class RecordCost:
    """The cache's expected size in bytes."""

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
    return RecordCost(round(eval_disk + calib_disk + _FOLDERS * _BLOCK))


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
