"""The two frontiers' sections of audit.json: the savings frontier
(:mod:`fcaudit.engine.frontier` measures it) and the exits section with its exit frontier
(:mod:`fcaudit.engine.exits`): parts of the schema of their own, so that the result types
load without the engine's measurements."""

from __future__ import annotations

from dataclasses import dataclass

from fcaudit.engine.result_parts import Estimate, Interval, Retention, _omit_none


@dataclass
class ExitSweepPoint:
    """One point of the exit frontier: the learned rule at a threshold (None: its own), or
    fixed exit at an integer depth; penalties against ``correct``."""

    rule: str  # "learned" or "fixed"
    threshold: float | None
    mean_depth: float  # layers executed per unit, mean over the evaluation units
    delta: Estimate  # loss(rule) - loss(correct)
    # learned points: fixed exit interpolated at this mean depth, and fixed - learned
    fixed: Estimate | None
    gap: Estimate | None


@dataclass
class ExitMatch:
    """Would a static depth do as well? Fixed exit at the learned rule's own mean executed
    depth (interpolated between the integer depths around it) against the learned rule."""

    mean_depth: float
    fixed_depths: list[int]  # the integer depths fixed exit is interpolated between
    # loss(fixed at mean_depth) - loss(learned): positive, the static depth loses
    gap: Estimate


@dataclass
class ExitFrontier:
    """The savings frontier of an exit model: the threshold sweep and fixed exit."""

    own_threshold: float | None  # the rules' threshold (None: no sweep, own point only)
    points: list[ExitSweepPoint]  # learned points by mean depth, then fixed by depth
    matched_depth: ExitMatch
    sentence: str


@dataclass
class ExitSummary:
    """Where the model's units (tokens, patches, examples: ``unit``) stop, and where the
    references stop them (depths in layers executed, of ``depth``)."""

    depth: int
    calibration_mean_depth: float
    fixed_exit_depth: int  # fixed exit's depth: the one closest to calibration's mean
    fixed_exit_depth_per_position: list[int]
    evaluation_mean_depth: float  # the model's own exits on the evaluation data
    oracle_mean_depth: float
    share_exiting_first_layer: float  # evaluation units that stop after layer 1
    share_full_depth: float  # evaluation units that never exit
    # a degenerate rule, said in words: every unit stops at one layer (none exits early,
    # all after the first, all after one layer between); never counted as a saving
    note: str | None
    # what one exit stops, in the exit sites' words ("token", "patch", "example"); absent
    # in results written before it was recorded
    unit: str | None = _omit_none()
    # the evaluation mean depth's 95% interval: the paired bootstrap over examples
    evaluation_mean_depth_ci95: list[float] | None = _omit_none()
    # (L(fixed) - L(learned)) / (L(fixed) - L(oracle)) in percent, with its interval
    gap_closed: Retention | None = _omit_none()
    frontier: ExitFrontier | None = _omit_none()  # the threshold sweep, matched depth


@dataclass
class FrontierPointResult:
    """One frontier replay: a rule at one level (docs/method.md, Savings frontier)."""

    rule: str  # dynamic, static-layer, static-layer-position (gates); dynamic, static-k
    level: float  # target share of gated units skipped, set on calibration
    threshold: float | None  # gates: tau on |g - off| (off below); routers, dynamic: top-p mass
    layers: list[int] | None  # static-layer: layers zeroed; static-k: k per layer
    skipped_fraction: float  # of the gated units (token-layers or expert slots), evaluation
    flops_saved_per_token: float
    flops_saved_fraction: float  # of total_flops_per_token
    nll: float
    delta: float
    ci95: Interval
    # the dynamic rule at the model's own per-layer thresholds (a model that skips)
    own_thresholds: list[float] | None = _omit_none()


@dataclass
class FrontierMatch:
    """The curves interpolated at one FLOPs-saved fraction (None: beyond a curve's reach);
    ``gap[rule]``: that static rule's penalty minus the dynamic one's, paired interval."""

    saved: float
    dynamic: Estimate | None
    static: dict[str, Estimate | None]
    gap: dict[str, Estimate | None]


@dataclass
class FrontierCheck:
    """A model that really skips (SkipGate): its measured point against its dynamic curve."""

    measured_flops_saved_fraction: float  # dense FLOPs minus the model's, counted
    accounted_flops_saved_fraction: float  # the own-threshold point's skips x block FLOPs
    delta: float  # the own-threshold point's replay penalty (0: zeroing = skipping)
    ci95: Interval
    pooled_curve_delta: Estimate | None  # the calibrated dynamic rule at the same FLOPs
    on_curve: bool
    note: str


@dataclass
class FrontierFamily:
    """One family's savings frontier: every point, the matched comparisons at 10/25/50%
    saved, the mean gap over the common range (``area``) and the one sentence."""

    kind: str  # gate or router
    flops_per_unit: list[float] | None  # per layer: per skipped token (gate) or slot (router)
    total_flops_per_token: float | None  # the denominator of the saved fractions
    flops_source: str | None
    points: list[FrontierPointResult]
    matched: list[FrontierMatch]
    area: dict[str, Estimate | None]  # static rule -> mean (static - dynamic) penalty
    best_static: str | None  # the static rule with the smallest gap at 25% saved
    gap_at_25: Estimate | None
    sentence: str
    check: FrontierCheck | None = _omit_none()
    reason: str | None = _omit_none()
