"""The exits section of audit.json (:mod:`fcaudit.engine.exits` measures it): a part of the
schema of its own, so that the result types load without the engine's measurements."""

from __future__ import annotations

from dataclasses import dataclass

from fcaudit.engine.result_parts import Estimate, Retention, _omit_none


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
