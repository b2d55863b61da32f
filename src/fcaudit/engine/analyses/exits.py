"""An exit model's exits as an analysis: where its units stop against fixed exit and the
oracle (the exit conditions' references, read in real passes before the replays), the share
of the fixed-to-oracle gap its learned rule closes, and its exit frontier (the rule at
other thresholds against fixed exit at the same mean depth: its points are placed once the
references are read, the sweep's exits in real passes). The exit conditions themselves are
main conditions (:mod:`fcaudit.core.conditions`) and their references are the engine's
(:mod:`fcaudit.engine.exits`); the verdict's exits answer and the execution audit read this
section. Torch is imported where used, so that reading an audit.json loads none."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fcaudit.core.conditions import CORRECT, FIXED_EXIT, FRONTIER, ORACLE_EXIT, needing
from fcaudit.engine.analyses.base import Analysis, Cost, Later, PointRun
from fcaudit.engine.frontier_parts import ExitFrontier, ExitMatch, ExitSummary, ExitSweepPoint
from fcaudit.engine.result_parts import EXITS, Retention

if TYPE_CHECKING:
    import numpy as np
    from torch import Tensor

    from fcaudit.core.contract import Site
    from fcaudit.core.exits import ExitPlan
    from fcaudit.engine.metrics import Bootstrap

CUT = ("frontier_points", "AuditOptions(frontier_points=2)", "--frontier-points 2")


def asked(setup: Any) -> bool:
    """Whether the audit runs an exit condition on a model with exit sites."""
    from fcaudit.core.exits import exit_sites
    wanted = set(needing("exits")) & set(setup.conditions)
    return bool(wanted) and bool(exit_sites(setup.sites))


def degenerate(own: Tensor, layers: int, unit: str) -> str | None:
    """A rule that does not adapt, in words: every ``unit`` (token, patch, example) stops
    at one and the same layer (none exits before the last, all after the first, or all
    after one layer between): a model of that fixed depth, whose FLOPs against the twin
    are no saving of adaptive depth (the execution answer says so:
    :func:`~fcaudit.engine.prepare.execute`)."""
    if own.numel() == 0 or bool((own != own.flatten()[0]).any()):
        return None
    depth = int(own.flatten()[0]) + 1
    if depth == layers:
        return (f"no {unit} exits before the last layer: the threshold is never reached, so "
                f"every {unit} runs all {layers} layers (no savings)")
    if depth == 1:
        return (f"every {unit} exits after the first layer: the rule does not adapt (a "
                "depth-1 model, not a saving of adaptive depth)")
    return (f"every {unit} exits after layer {depth} of {layers}: the rule does not adapt (a "
            f"depth-{depth} model, not a saving of adaptive depth)")


def plan_note(plan: ExitPlan | None) -> str | None:
    """:func:`degenerate`'s note on the model's own evaluation exits (None without an exit
    condition): the execution audit counts no saving for such a rule."""
    return None if plan is None else degenerate(plan.own, plan.calibration.layers, plan.unit)


def exit_summary(plan: ExitPlan, gap: Retention | None, boot: Bootstrap,
                 frontier: ExitFrontier) -> ExitSummary:
    """The audit.json section of an exit model (no depth per position where the sites have
    no position axis). The evaluation mean depth's interval resamples examples (``boot``),
    as every interval of the audit does."""
    from fcaudit.engine.metrics import interval
    cal, own = plan.calibration, plan.own
    L = cal.layers
    per_example = (own + 1).double().reshape(len(own), -1).mean(1).numpy()
    depth = float((own + 1).double().mean())
    return ExitSummary(
        depth=L, calibration_mean_depth=cal.mean, fixed_exit_depth=cal.fixed() + 1,
        fixed_exit_depth_per_position=[int(k) + 1 for k in cal.fixed_per_position()]
        if plan.positions else [],
        evaluation_mean_depth=depth,
        oracle_mean_depth=float((plan.oracle + 1).double().mean()),
        share_exiting_first_layer=float((own == 0).double().mean()),
        share_full_depth=float((own == L - 1).double().mean()),
        note=plan_note(plan), unit=plan.unit,
        evaluation_mean_depth_ci95=interval(boot.means(per_example), depth), gap_closed=gap,
        frontier=frontier)


def gap_closed(per_seq: dict[str, np.ndarray], boot: Bootstrap) -> Retention | None:
    """``(L(fixed) - L(learned)) / (L(fixed) - L(oracle))`` in percent with the paired
    bootstrap (the retention formula with fixed exit as the floor and the oracle as the
    top); undefined when the fixed-to-oracle gap is not clearly above 0 or the share is not
    measurable (:func:`~fcaudit.engine.metrics.retention`). None when either
    reference was not run."""
    if FIXED_EXIT not in per_seq or ORACLE_EXIT not in per_seq:
        return None
    from fcaudit.engine.metrics import retention
    share = retention(per_seq[CORRECT], per_seq[ORACLE_EXIT], per_seq[FIXED_EXIT], boot,
                      f"{FIXED_EXIT}-to-{ORACLE_EXIT} gap")
    if share.defined or share.gap_ci95[0] > 0:  # a share, or one too wide to measure
        return share
    lo, hi = share.gap_ci95
    return Retention(share.gap, share.gap_ci95, None, None, False,
                     f"the {FIXED_EXIT}-to-{ORACLE_EXIT} gap {share.gap:+.4f} has a 95% "
                     f"interval [{lo:+.4f}, {hi:+.4f}] that is not above 0: the oracle's exits "
                     f"lose no less than fixed exit's, so no share of it is reported")


# ---------------------------------------------------------------------- exit_sweep
# The savings frontier of an exit model (docs/method.md, Early exit: matched depth): the
# learned exit controller at other thresholds against fixed exit at the same mean executed
# depth, so "would a static depth do as well?" is one number with an interval.
#
# * **The threshold sweep**: the model's own rule with its threshold moved on the logit
#   scale (``sigmoid(logit(own) + k)``, ``k = ±1, ±2, ...`` nats, ``frontier_points`` of
#   them), each token's exit layers read by hooks in real passes over the evaluation
#   windows (so what the moved rule does to the later scores, through the exited tokens'
#   keys and values, is in them), then fed as exit scores so the replay carries them out.
#   A threshold whose exits equal the model's own, or an earlier one's, is dropped.
# * **Fixed exit at every depth it is matched at**: every token stops after ``d`` layers,
#   for the integer depths just below and above each learned point's mean depth.
# * **Matched depth**: fixed exit's per-sequence loss interpolated linearly between the two
#   integer depths around a learned point's mean executed depth, minus the learned
#   point's: positive when a static depth of the same mean compute loses, with the paired
#   bootstrap. Fixed exit as a condition is matched to the closest integer depth, which
#   gives it more compute than the learned rule when the mean rounds up; the interpolated
#   comparison gives both the same mean depth.

LEARNED, FIXED = "learned", "fixed"
LOGIT_STEP = 1.0  # nats between sweep thresholds, on the logit scale
EDGE = 1e-6  # a threshold of 0 or 1 is moved this far inside before its logit


@dataclass(frozen=True)
class ExitPoint:
    """One exit-frontier replay: the learned rule at ``threshold``, or fixed exit at
    ``depth`` layers for every token."""

    threshold: float | None = None
    depth: int | None = None

    @property
    def key(self) -> str:
        what = f"{LEARNED}:{self.threshold:.6g}" if self.depth is None else \
            f"{FIXED}:{self.depth}"
        return f"{FRONTIER}:exit:{what}"


def sweep_thresholds(own: float, points: int) -> list[float]:
    """``points`` thresholds around ``own`` on the logit scale, nearest first on each side
    (``own`` itself is the model's pass, not a replay)."""
    p = min(max(own, EDGE), 1 - EDGE)
    z = math.log(p / (1 - p))
    steps = [k for k in range(-(points // 2), points - points // 2 + 1) if k != 0]
    return [1 / (1 + math.exp(-(z + LOGIT_STEP * k))) for k in steps]


def own_threshold(net: Any) -> float | None:
    """The one ``threshold`` every exit rule module carries, or None (no sweep): a rule
    without one, or rules with different ones, cannot be moved as one controller."""
    found = {getattr(net.get_submodule(p), "threshold", None) for p in net.exit_rules()}
    if len(found) != 1:
        return None
    (value,) = found
    return float(value) if isinstance(value, (int, float)) else None


def mean_depth(layers: Tensor) -> float:
    """Mean executed depth (layers run) of exit layers ``layers``."""
    return float((layers + 1).double().mean())


def exit_points(plan: ExitPlan) -> list[ExitPoint]:
    """The sweep's points, then fixed exit at each integer depth around the mean depth of
    the model's own exits and of every sweep point, and at full depth (every layer on every
    unit: the model without exits, whose loss prices exiting), each depth once, shallowest
    first."""
    depths = [mean_depth(plan.own), *(mean_depth(t) for _, t in plan.sweep)]
    fixed = sorted({d for m in depths for d in (math.floor(m), math.ceil(m))}
                   | {plan.calibration.layers})
    return [*(ExitPoint(threshold=tau) for tau, _ in plan.sweep),
            *(ExitPoint(depth=d) for d in fixed)]


def exit_feed(point: ExitPoint, plan: ExitPlan, rows: range,
              correct: Mapping[Site, Tensor]) -> dict[Site, Tensor]:
    """The exit scores that carry ``point``'s exits out on the evaluation rows ``rows``."""
    from fcaudit.core.exits import exit_scores
    sites = [s for s in correct if s.exit is not None]
    like = {s.name: correct[s] for s in sites}
    shape = tuple(next(iter(like.values())).shape[:2])
    layers = plan.swept(point.threshold, point.depth, rows, (shape[0], shape[1]))
    scores = exit_scores(sites, layers, like)
    return {s: scores[s.name] for s in sites}


def exit_frontier(plan: ExitPlan, per_seq: Mapping[str, np.ndarray],
                  boot: Bootstrap) -> ExitFrontier:
    """The sweep and fixed exit against ``correct``, each learned point matched with fixed
    exit at its mean depth; the model's own point is the headline."""
    from fcaudit.engine.frontier import curve, estimate
    points, correct = exit_points(plan), per_seq[CORRECT]
    fixed = {p.depth: per_seq[p.key] for p in points if p.depth is not None}
    static = curve(list(fixed.items()), len(correct), origin=False)  # cost: the depth run
    learned = [(None, mean_depth(plan.own), correct),
               *((tau, mean_depth(t), per_seq[ExitPoint(threshold=tau).key])
                 for tau, t in plan.sweep)]
    rows = []
    for tau, depth, values in sorted(learned, key=lambda r: r[1]):
        at = static.at(depth)
        assert at is not None  # the sweep records fixed exit at the depths around each point
        rows.append(ExitSweepPoint(LEARNED, tau, depth, estimate(values - correct, boot),
                                   estimate(at - correct, boot), estimate(at - values, boot)))
    rows += [ExitSweepPoint(FIXED, None, float(d), estimate(v - correct, boot), None, None)
             for d, v in sorted(fixed.items())]
    own = next(r for r in rows if r.rule == LEARNED and r.threshold is None)
    assert own.gap is not None
    depths = sorted({math.floor(own.mean_depth), math.ceil(own.mean_depth)})
    return ExitFrontier(plan.threshold, rows, ExitMatch(own.mean_depth, depths, own.gap),
                        _sentence(own))


def _sentence(own: ExitSweepPoint) -> str:
    assert own.gap is not None
    lo, hi = own.gap.ci95
    text = f"{own.gap.value:+.4f} [{lo:+.4f}, {hi:+.4f}]"
    if lo > 0:
        verdict = f"loses to the learned rule by {text}"
    elif hi < 0:
        verdict = f"beats the learned rule by {text}"
    else:
        verdict = f"does as well as the learned rule (difference {text}, interval includes 0)"
    lo, hi = math.floor(own.mean_depth), math.ceil(own.mean_depth)
    how = f"at depth {lo}" if lo == hi else f"interpolated between depths {lo} and {hi}"
    return (f"At the learned rule's mean executed depth {own.mean_depth:.3f}, fixed exit "
            f"({how}) {verdict}.")


@dataclass(frozen=True)
class ExitRun(PointRun):
    """An exit-frontier point: the learned exit rule at another threshold, or fixed exit at
    one depth, fed as the exit scores that carry its exits out (``plan``: the references
    with the sweep's exits, which travel with the run)."""

    point: ExitPoint
    plan: ExitPlan = field(compare=False, repr=False)

    def feed(self, run: Any, b: int, inputs: Any,
             correct: dict[Site, Tensor]) -> Mapping[Site, Tensor]:
        return exit_feed(self.point, self.plan, inputs.cache.batch_range(b), correct)


@dataclass(frozen=True)
class ExitFrontierPlan(Later):
    """The exit frontier of a model whose exit conditions run: its points once the
    references are read (the sweep's from real passes at the moved thresholds)."""

    def resolve(self, recorded: Any) -> tuple[ExitPlan | None, Sequence[ExitRun]]:
        """The references with the threshold sweep's exits, and every frontier point."""
        plan: ExitPlan | None = recorded.exits
        if plan is None:
            return None, ()
        plan = dataclasses.replace(plan, sweep=recorded.exit_sweep(plan.own))
        return plan, [ExitRun(p, plan) for p in exit_points(plan)]

    def cost(self, setup: Any, first: Any, n_eval: int, n_calib: int) -> Cost:
        """The sweep's passes over every evaluation batch; at most its points and fixed
        exit at the two depths around each learned point and at full depth."""
        from fcaudit.core.exits import exit_sites
        points = setup.options.frontier_points \
            if own_threshold(setup.model) is not None else 0
        depths = len(exit_sites(setup.sites)) + 1
        return Cost("exit frontier", n_eval * points,
                    points + min(depths, 2 * (points + 1) + 1), (), CUT)


def plan(setup: Any, first: Any) -> list[ExitFrontierPlan]:
    """The frontier of an audit that runs an exit condition on a model with exit sites."""
    return [ExitFrontierPlan()] if asked(setup) else []


def summarise(measured: Any, analysis: Analysis) -> ExitSummary | None:
    """Depths, the gap closed and the exit frontier (None: no exit condition ran)."""
    plan: ExitPlan | None = measured.states.get(analysis.name)
    if plan is None:
        return None
    per_seq, boot = {k: v[-1] for k, v in measured.repeats.items()}, measured.boot
    frontier = exit_frontier(plan, per_seq, boot)
    return exit_summary(plan, gap_closed(per_seq, boot), boot, frontier)


def settings(measured: Any, sections: Mapping[str, Any]) -> dict[str, Any]:
    """The exit threshold the model ran with (audit.json's ``settings``)."""
    opts = measured.setup.options
    return {"exit_threshold": opts.exit_threshold if opts.early_exit else None}


ANALYSIS = Analysis(EXITS, plan=plan, summarise=summarise, section_type=ExitSummary,
                    settings=settings)
