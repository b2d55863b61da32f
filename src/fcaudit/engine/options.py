"""What an audit is run with: its options, and the validated inputs every stage reads.

:class:`AuditOptions` are the user's knobs (recorded in ``audit.json``); :class:`Setup`
is the plain data that validation produces and every later stage takes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from fcaudit.core.conditions import FRONTIER
from fcaudit.core.contract import Site
from fcaudit.core.errors import FcauditError, arg
from fcaudit.core.interventions import Intervention
from fcaudit.engine.objectives import Objective, resolve
from fcaudit.io.data import AuditData
from fcaudit.io.loading import LoadedModel
from fcaudit.io.placement import Placement, placement

# progress(stage, done, total, info): an optional callback, never threaded through compute
Progress = Callable[[str, int, int, str], None]

MAX_BOOTSTRAP = 100_000
# Each repeat replays every random condition over every sequence once more; the intervals
# come from the sequences, so beyond this more repeats only cost hours.
MAX_REPEATS = 100
MAX_TIMING_PAIRS = 1000  # each pair times a full pass of model and dense
MAX_SEED = 2**32 - 1  # torch and numpy generators; seeds derive as seed * 1000 + k
# expert ablation costs one replay per layer and expert: on by default up to this many
# experts per routed layer (a 4-layer, 64-expert model: 256 more replays), else opt-in
AUTO_ABLATION_MAX_EXPERTS = 64
MAX_FRONTIER_POINTS = 20  # each point of each rule is one more replay
MIN_FRONTIER_POINTS = 2  # a curve needs two points
# --target-ci below this is never a precision an audit can stop at: intervals shrink as
# 1/sqrt(N), so a penalty whose per-sequence sd is 0.01 nats needs ~4e8 sequences to
# reach 1e-6, and float32 losses of a few nats round at ~1e-7 (a model with no
# dependence reaches 0 at any target; it stops at the first round at this one too)
MIN_TARGET_CI = 1e-6


SCHEDULES = ("prefix", "naive")


def silent(stage: str, done: int, total: int, info: str = "") -> None:
    """The default progress callback: report nothing."""


@dataclass(frozen=True)
class AuditOptions:
    """Knobs of one audit; every one is recorded in ``audit.json`` (``settings``)."""

    repeats: int = 3  # K seeds per random condition
    seed: int = 0
    bootstrap: int = 1000
    batch_size: int = 8
    per_layer: bool = True
    execution: bool = True
    timing_pairs: int = 10
    progress: bool = True  # the CLI shows progress bars (the engine takes a callback)
    allow_nonexact_identity: bool = False
    schedule: str = "prefix"  # "prefix": per-layer runs recompute only the suffix; "naive"
    # one replay per routed layer and expert, that expert never picked; None: on when every
    # routed layer has at most AUTO_ABLATION_MAX_EXPERTS experts
    expert_ablation: bool | None = None
    # the savings frontier: NLL penalty vs FLOPs skippable, dynamic vs static rules, with
    # frontier_points replays per rule (needs the execution audit for the FLOPs); None:
    # on for the families it covers when the execution audit runs (the study's setting)
    frontier: bool | None = False
    frontier_points: int = 6
    # precision-driven stopping (engine/stopping.py): evaluation batches are added in rounds
    # until every counted penalty's 95% interval reaches at most target_ci nats on each side
    # of its estimate, or the evaluation pool runs out; min_sequences is the first round's
    # size (None: DEFAULT_MIN_SEQUENCES, or the whole pool when smaller)
    target_ci: float | None = None
    min_sequences: int | None = None
    # models bigger than memory (a Hugging Face folder given by path): accelerate's device
    # map ("auto"), its budget ("cpu=8GiB,cuda:0=70GiB" or a dict) and the folder for the
    # weights it puts on disk; where weights sit changes no number (runtime, not settings)
    device_map: str | None = None
    max_memory: str | dict[str, str | int] | None = None
    offload_folder: str | Path | None = None
    # the per-unit loss: "token-nll" (next-token NLL of token ids), "classification"
    # (cross-entropy of [B, C] logits against integer targets, accuracy beside it), or a
    # callable (model_output, batch) -> per-unit losses [B] or [B, T]
    objective: Any = "token-nll"

    def validate(self) -> None:
        """Refuse option values no audit can run with, naming the option in the caller's
        words (the ``AuditOptions`` field, or the CLI flag)."""
        checks = (("repeats", self.repeats, 1, MAX_REPEATS), ("seed", self.seed, 0, MAX_SEED),
                  ("bootstrap", self.bootstrap, 10, MAX_BOOTSTRAP),
                  ("batch_size", self.batch_size, 1, None),
                  ("timing_pairs", self.timing_pairs, 0, MAX_TIMING_PAIRS),
                  ("frontier_points", self.frontier_points, MIN_FRONTIER_POINTS,
                   MAX_FRONTIER_POINTS))

        def name(option: str, value: object) -> str:
            return arg(option, value, owner="AuditOptions")
        for option, value, lo, hi in checks:
            if isinstance(value, bool) or not isinstance(value, int) or value < lo or (
                    hi is not None and value > hi):
                bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
                raise FcauditError(f"{name(option, value)}: must be an integer {bound}")
        if self.schedule not in SCHEDULES:
            raise FcauditError(f"{name('schedule', self.schedule)}: choose one of "
                               f"{', '.join(SCHEDULES)}")
        if self.expert_ablation is not None and not isinstance(self.expert_ablation, bool):
            raise FcauditError(f"{name('expert_ablation', self.expert_ablation)}: must be "
                               "True, False or None (on for at most "
                               f"{AUTO_ABLATION_MAX_EXPERTS} experts per routed layer)")
        if self.frontier is not None and not isinstance(self.frontier, bool):
            raise FcauditError(f"{name(FRONTIER, self.frontier)}: must be True, False or "
                               "None (on where a family is covered and execution measured)")
        if self.frontier and not self.execution:
            off = arg("execution", py="AuditOptions(execution=False)", cli="--no-execution")
            raise FcauditError(f"{arg(FRONTIER, py='AuditOptions(frontier=True)')} needs the "
                               f"execution audit (its x axis is the FLOPs it counts): drop {off} "
                               "or the frontier")
        _check_target(self.target_ci, self.min_sequences)
        self.placement()  # the device map, budget syntax and offload folder
        resolve(self.objective)
        if 0 < self.timing_pairs < 10:
            raise FcauditError(f"{name('timing_pairs', self.timing_pairs)}: use 0 (no "
                               "timing) or at least 10 pairs for a meaningful interval")

    def placement(self) -> Placement | None:
        """Where accelerate may put the weights (None: the model loads whole)."""
        return placement(self.device_map, self.max_memory, self.offload_folder)


def _check_target(target: object, floor: object) -> None:
    """``target_ci`` a finite number of nats of at least :data:`MIN_TARGET_CI`;
    ``min_sequences`` an integer of at least 2 (a derangement needs two sequences), and
    only with a target."""
    target_arg = arg("target_ci", target, owner="AuditOptions")
    if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float))
                               or not math.isfinite(target) or target <= 0):
        raise FcauditError(f"{target_arg}: must be a number of nats above 0 (the largest "
                           "half-width of a penalty's 95% interval to stop at, e.g. 0.02)")
    if target is not None and target < MIN_TARGET_CI:
        raise FcauditError(f"{target_arg}: below {MIN_TARGET_CI:g} nats is finer than an "
                           "audit resolves (float32 losses round at about 1e-07 nats, and "
                           "intervals shrink only as 1/sqrt(sequences)): give at least "
                           f"{MIN_TARGET_CI:g} (e.g. 0.02), or drop it to audit every sequence")
    if floor is None:
        return
    floor_arg = arg("min_sequences", floor, owner="AuditOptions")
    if isinstance(floor, bool) or not isinstance(floor, int) or floor < 2:
        raise FcauditError(f"{floor_arg}: must be an integer of at least 2 (reassignment "
                           "needs two sequences)")
    if target is None:
        target_name = arg("target_ci", owner="AuditOptions")
        raise FcauditError(f"{floor_arg} is the floor of {target_name}'s rounds: give a "
                           "target too, or drop it (a fixed audit uses every sequence)")


@dataclass
class Setup:
    """Everything validated before the first forward pass."""

    loaded: LoadedModel
    sites: list[Site]
    blocks: list[str] | None
    blocks_glob: str | None
    data: AuditData
    options: AuditOptions
    interventions: list[Intervention]
    dense: nn.Module | None = None
    dense_source: str = ""
    out: Path | None = None
    started: float = field(default_factory=time.perf_counter)
    layouts: dict[str, str] = field(default_factory=dict)  # site -> how its layout was found

    @property
    def model(self) -> nn.Module:
        return self.loaded.model

    @property
    def objective(self) -> Objective:
        return resolve(self.options.objective)

    @property
    def eval_source(self) -> Any:
        """What evaluation batches are cut from: token ids [N, T] or Examples."""
        return self.data.eval_ids if self.data.tokens else self.data.examples

    @property
    def calib_source(self) -> Any:
        return self.data.calib_ids if self.data.tokens else self.data.calib_examples
