"""The savings frontier of an exit model (docs/method.md, Early exit: matched depth): the
learned exit controller at other thresholds against fixed exit at the same mean executed
depth, so "would a static depth do as well?" is one number with an interval.

* **The threshold sweep**: the model's own rule with its threshold moved on the logit
  scale (``sigmoid(logit(own) + k)``, ``k = ±1, ±2, ...`` nats, ``frontier_points`` of
  them), each token's exit layers read by hooks in real passes over the evaluation
  windows (so what the moved rule does to the later scores, through the exited tokens'
  keys and values, is in them), then fed as exit scores so the replay carries them out.
  A threshold whose exits equal the model's own, or an earlier one's, is dropped.
* **Fixed exit at every depth it is matched at**: every token stops after ``d`` layers,
  for the integer depths just below and above each learned point's mean depth.
* **Matched depth**: fixed exit's per-sequence loss interpolated linearly between the two
  integer depths around a learned point's mean executed depth, minus the learned
  point's: positive when a static depth of the same mean compute loses, with the paired
  bootstrap. Fixed exit as a condition is matched to the closest integer depth, which
  gives it more compute than the learned rule when the mean rounds up; the interpolated
  comparison gives both the same mean depth.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fcaudit.core.conditions import CORRECT, FRONTIER
from fcaudit.core.contract import Site
from fcaudit.core.exits import ExitPlan, exit_scores, own_exits
from fcaudit.core.nll import device_of
from fcaudit.engine.frontier import curve, estimate
from fcaudit.engine.frontier_parts import ExitFrontier, ExitMatch, ExitSweepPoint
from fcaudit.engine.metrics import Bootstrap
from fcaudit.engine.passes import batches
from fcaudit.io.examples import call_model

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


@contextlib.contextmanager
def threshold_set(net: Any, value: float) -> Iterator[None]:
    """Every exit rule reads ``value`` meanwhile (its own threshold is put back)."""
    rules = [net.get_submodule(p) for p in net.exit_rules()]
    before = [r.threshold for r in rules]
    for r in rules:
        r.threshold = value
    try:
        yield
    finally:
        for r, b in zip(rules, before, strict=True):
            r.threshold = b


@torch.no_grad()
def sweep_layers(setup: Any, net: Any, own: Tensor,
                 tick: Any = None) -> tuple[tuple[float, Tensor], ...]:
    """Each sweep threshold with the exit layers ``[N, T]`` the moved rule gives the
    evaluation tokens (real passes; ``tick(stage, done, total, info)`` once per
    threshold); thresholds that repeat ``own`` or an earlier one's exits are dropped."""
    start = own_threshold(net)
    if start is None:
        return ()
    size, device = setup.options.batch_size, device_of(setup.model)
    out: list[tuple[float, Tensor]] = []
    thresholds = sweep_thresholds(start, setup.options.frontier_points)
    for done, tau in enumerate(thresholds, start=1):
        with threshold_set(net, tau):
            layers = torch.cat([own_exits(net, lambda x=x: call_model(setup.model, x)).cpu()
                                for _, x in batches(setup.eval_source, size, device)])
        if tick is not None:
            tick("exit references: threshold sweep", done, len(thresholds), f"{tau:.3g}")
        if not any(torch.equal(layers, seen) for seen in [own, *(t for _, t in out)]):
            out.append((tau, layers))
    return tuple(out)


def mean_depth(layers: Tensor) -> float:
    """Mean executed depth (layers run) of exit layers ``layers``."""
    return float((layers + 1).double().mean())


def exit_points(plan: ExitPlan | None) -> list[ExitPoint]:
    """The sweep's points, then fixed exit at each integer depth around the mean depth of
    the model's own exits and of every sweep point, and at full depth (every layer on every
    unit: the model without exits, whose loss prices exiting), each depth once, shallowest
    first."""
    if plan is None:
        return []
    depths = [mean_depth(plan.own), *(mean_depth(t) for _, t in plan.sweep)]
    fixed = sorted({d for m in depths for d in (math.floor(m), math.ceil(m))}
                   | {plan.calibration.layers})
    return [*(ExitPoint(threshold=tau) for tau, _ in plan.sweep),
            *(ExitPoint(depth=d) for d in fixed)]


def exit_feed(point: ExitPoint, plan: ExitPlan | None, rows: range,
              correct: Mapping[Site, Tensor]) -> dict[Site, Tensor]:
    """The exit scores that carry ``point``'s exits out on the evaluation rows ``rows``."""
    assert plan is not None, "exit-frontier points are planned from an ExitPlan"
    sites = [s for s in correct if s.exit is not None]
    like = {s.name: correct[s] for s in sites}
    shape = tuple(next(iter(like.values())).shape[:2])
    layers = plan.swept(point.threshold, point.depth, rows, (shape[0], shape[1]))
    scores = exit_scores(sites, layers, like)
    return {s: scores[s.name] for s in sites}


def exit_frontier(plan: ExitPlan | None, per_seq: Mapping[str, np.ndarray],
                  boot: Bootstrap) -> ExitFrontier | None:
    """The sweep and fixed exit against ``correct``, each learned point matched with fixed
    exit at its mean depth; the model's own point is the headline."""
    points = exit_points(plan)
    if plan is None or not points:
        return None
    correct = per_seq[CORRECT]
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

