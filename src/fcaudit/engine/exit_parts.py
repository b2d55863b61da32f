"""The exits section of audit.json (:mod:`fcaudit.engine.exits` measures it): a part of the
schema of its own, so that the result types load without the engine's measurements."""

from __future__ import annotations

from dataclasses import dataclass

from fcaudit.engine.result_parts import Retention, _omit_none


@dataclass
class ExitSummary:
    """Where the model's tokens stop, and where the references stop them (depths in layers
    executed, of ``depth``)."""

    depth: int
    calibration_mean_depth: float
    fixed_exit_depth: int  # fixed exit's depth: the one closest to calibration's mean
    fixed_exit_depth_per_position: list[int]
    evaluation_mean_depth: float  # the model's own exits on the evaluation windows
    oracle_mean_depth: float
    share_exiting_first_layer: float  # evaluation tokens that stop after layer 1
    share_full_depth: float  # evaluation tokens that never exit
    # a degenerate rule, said in words (no token exits; every token after the first layer)
    note: str | None
    # (L(fixed) - L(learned)) / (L(fixed) - L(oracle)) in percent, with its interval
    gap_closed: Retention | None = _omit_none()
