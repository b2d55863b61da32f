"""The savings frontier as an analysis: which families it covers (decided from the probe,
so an impossible ``--frontier`` stops before any file), its points (placed once the audit
is recorded: thresholds and orders come from the calibration coefficients), and its
section, priced in the FLOPs the execution audit counted. The curves, rules and checks are
:mod:`fcaudit.engine.frontier`'s (torch: imported where used, so that reading an
audit.json loads none)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fcaudit.core.conditions import FRONTIER
from fcaudit.core.errors import FcauditError, arg
from fcaudit.engine.analyses.base import Analysis, Cost, Later, PointRun
from fcaudit.engine.frontier_parts import FrontierFamily

if TYPE_CHECKING:
    from torch import Tensor

    from fcaudit.core.contract import Site
    from fcaudit.engine.frontier import Covered, FrontierPoint

GATE = "gate"  # engine.frontier.GATE, without its torch


@dataclass(frozen=True)
class FrontierRun(PointRun):
    """A savings-frontier point: its rule's gates switched off where it skips."""

    point: FrontierPoint
    counts_rerouting = True

    def feed(self, run: Any, b: int, inputs: Any,
             correct: dict[Site, Tensor]) -> Mapping[Site, Tensor]:
        from fcaudit.engine.frontier import point_feed
        return point_feed(self.point, correct)


def frontier_runs(runs: Sequence[Any]) -> list[Any]:
    """The savings-frontier runs, in plan order."""
    return [r for r in runs if isinstance(r.target, FrontierRun)]


@dataclass(frozen=True)
class Ready:
    """The covered families made ready (those that get no curves with their reason) and
    every point replayed."""

    covered: tuple[Covered, ...]
    points: tuple[FrontierPoint, ...]


@dataclass(frozen=True)
class FrontierPlan(Later):
    """The families the frontier covers; their points once the audit is recorded."""

    covered: tuple[Covered, ...]

    def resolve(self, recorded: Any) -> tuple[Ready, list[FrontierRun]]:
        """The families made ready (off values checked, a skipping model's own thresholds
        read) and every point: the rules' points from calibration, and for a model that
        skips, the dynamic rule at its own thresholds."""
        from fcaudit.engine.frontier import (
            eval_gates,
            off_mismatch,
            own_point,
            own_thresholds,
            plan_points,
        )
        setup = recorded.setup
        sites = [s for fam in self.covered for s in fam.sites]
        calibration = recorded.whole_calibration(sites)
        gated = any(f.kind == GATE for f in self.covered)
        executed = recorded.executed_per_layer() if gated else None
        ready = []
        for fam in self.covered:
            reason = off_mismatch(setup, fam, recorded.first_batch()) if fam.kind == GATE \
                else None
            ready.append(dataclasses.replace(fam, reason=reason) if reason else own_thresholds(
                fam, executed, setup.data.eval_ids.size, eval_gates(recorded.cache, fam)))
        live = [f for f in ready if f.reason is None]
        points = plan_points(live, calibration, setup.options.frontier_points)
        points += [p for f in live if (p := own_point(f)) is not None]
        return Ready(tuple(ready), tuple(points)), [FrontierRun(p) for p in points]

    def cost(self, setup: Any, first: Any, n_eval: int, n_calib: int) -> Cost:
        """The calibration recorded whole, a skipping model's counting pass and the off
        checks; at most ``frontier_points`` replays per rule."""
        from fcaudit.engine.frontier import most_points
        gates = sum(f.kind == GATE for f in self.covered)
        record = n_calib + (n_eval if gates else 0) + 3 * gates
        return Cost(FRONTIER, record, most_points(self.covered, setup.options.frontier_points),
                    tuple(s.name for f in self.covered for s in f.sites),
                    ("frontier_points", "AuditOptions(frontier_points=2)",
                     "--frontier-points 2"))


def plan(setup: Any, first: Any) -> list[FrontierPlan]:
    """The families the savings frontier covers (none without ``frontier``, on token
    windows only); a frontier asked for a model with no soft-gate or routed family is
    refused."""
    asked = setup.options.frontier
    if asked is False or (asked is None and not setup.options.execution) or \
            not setup.inputs.next_token:  # token windows only (others refuse frontier=True)
        return []
    from fcaudit.core.discovery import declared_experts
    from fcaudit.engine.frontier import frontier_families
    covered = frontier_families(setup.sites, first.coefficients,
                                declared_experts(setup.model) or [])
    if not covered and asked:
        raise FcauditError(f"{arg(FRONTIER, py='AuditOptions(frontier=True)')}: the audited "
                           "sites have no soft gate (one coefficient per token) and no router "
                           "with declared experts, so nothing could be skipped; drop the "
                           "option")
    return [FrontierPlan(tuple(covered))] if covered else []


def summarise(measured: Any, analysis: Analysis) -> dict[str, FrontierFamily] | None:
    """Every covered family's curves in FLOPs, the matched comparisons and (a model that
    skips) the skip check."""
    ready: Ready | None = measured.states.get(analysis.name)
    if ready is None or not ready.covered:
        return None
    from fcaudit.engine.frontier import frontier_summary, frontier_units
    setup, correct = measured.setup, measured.repeats[measured.runs[0].key][0]
    per_seq = {k: v[-1] for k, v in measured.repeats.items()}
    return frontier_summary(
        ready.covered, ready.points, per_seq, correct,
        frontier_units(measured.cache, ready.covered, ready.points),
        setup.data.eval_ids.size, measured.execution, measured.boot)


def settings(measured: Any, sections: Mapping[str, Any]) -> dict[str, Any]:
    """Whether the frontier ran, at how many points, in how many runs (audit.json's
    ``settings``)."""
    ran = FRONTIER in sections
    return {"frontier": ran,
            "frontier_points": measured.setup.options.frontier_points if ran else None,
            "frontier_runs": len(frontier_runs(measured.runs))}


ANALYSIS = Analysis(FRONTIER, plan=plan, summarise=summarise,
                    section_type=dict[str, FrontierFamily], settings=settings)
