"""Exit models in the audit (docs/method.md, Early exit): the references' layers, measured
before the replays, and the section of audit.json that places the learned exit controller
between fixed exit and oracle exit.

The layers come from real passes: the model's own exits (hooks on its exit rules) on the
calibration windows, for fixed exit, and on the evaluation windows, for the depth it
reports; the oracle's from one full-depth pass per evaluation batch (hooks on its exit
heads). They are recomputed by every audit that runs an exit condition (no cache: a pass
per batch, the price of a reference that is never stale).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fcaudit.core.conditions import CORRECT, FIXED_EXIT, FRONTIER, ORACLE_EXIT, needing
from fcaudit.core.contract import Exit, Site
from fcaudit.core.errors import ModelError, arg
from fcaudit.core.exits import (
    EXAMPLE,
    ExitDepth,
    ExitPlan,
    exit_depth,
    exit_model,
    exit_scores,
    exit_sites,
    exit_unit,
    head_predictions,
    oracle_layers,
    own_exits,
    plural,
)
from fcaudit.core.hooks import hooks
from fcaudit.core.nll import device_of
from fcaudit.core.replaying import replaying
from fcaudit.engine.frontier import curve, estimate
from fcaudit.engine.frontier_parts import ExitFrontier, ExitMatch, ExitSummary, ExitSweepPoint
from fcaudit.engine.metrics import Bootstrap, interval, retention
from fcaudit.engine.options import Progress
from fcaudit.engine.passes import batches
from fcaudit.engine.result_parts import Retention
from fcaudit.io.examples import call_model


def asked(setup: Any) -> bool:
    """Whether the audit runs an exit condition on a model with exit sites."""
    wanted = set(needing("exits")) & set(setup.conditions)
    return bool(wanted) and bool(exit_sites(setup.sites))


PROBE_ROWS = 2  # sequences (or examples) the exit rule is checked on


def check_passes(n_sites: int, units: int) -> int:
    """The passes :func:`check_follows` makes on its probe when the rule follows: the
    model's own exits, the record, the recorded scores replayed, every unit stopping at
    the first and at no exit site, and the mixed patterns that stop each unit after an
    exit site of its own until every site has been asked."""
    return 5 + -(-(n_sites + 1) // max(units, 1))


@torch.no_grad()
def exit_plan(setup: Any, tick: Progress) -> ExitPlan | None:
    """The references' layers for this audit, or None when it runs no exit condition;
    ``tick`` once per batch of each stage (the plan counts these passes)."""
    if not asked(setup):
        return None
    from fcaudit.engine.execution import inference
    net = exit_model(setup.model, setup.sites)
    size, device = setup.options.batch_size, device_of(setup.model)
    oracle, own = [], []
    with inference(setup.model):
        check_follows(setup, net, next(batches(setup.eval_source, PROBE_ROWS, device))[1])
        calibration = calibration_depth(setup, net, tick)
        n_eval = -(-setup.inputs.n_eval // size)
        for done, (_, x) in enumerate(batches(setup.eval_source, size, device), start=1):
            own.append(own_exits(net, lambda x=x: call_model(setup.model, x)).cpu())
            preds = head_predictions(net, lambda x=x: call_model(setup.model, x))
            oracle.append(oracle_layers(preds).cpu())
            tick("exit references: evaluation and oracle", done, n_eval, "")
    own_layers = torch.cat(own)
    with inference(setup.model):
        sweep = sweep_layers(setup, net, own_layers, tick)
    return ExitPlan(calibration, torch.cat(oracle), own_layers, exit_unit(setup.sites),
                    own_threshold(net), sweep)


@torch.no_grad()
def calibration_depth(setup: Any, net: Any, tick: Progress) -> ExitDepth:
    """The model's own exits on the calibration data (one pass a batch): what fixed exit's
    depth is chosen from (``fcaudit fold`` recomputes it with this too)."""
    from fcaudit.engine.execution import inference
    size, device = setup.options.batch_size, device_of(setup.model)
    n_calib, calib = -(-setup.inputs.n_calib // size), []
    with inference(setup.model):
        for done, (_, x) in enumerate(batches(setup.calib_source, size, device), start=1):
            calib.append(own_exits(net, lambda x=x: call_model(setup.model, x)).cpu())
            tick("exit references: calibration", done, n_calib, "")
    return exit_depth(calib, len(exit_sites(setup.sites)) + 1)


def check_follows(setup: Any, net: Any, x: Any) -> None:
    """Refuse, naming the site and the cause, an exit rule that does not follow its site's
    output, on a probe of :data:`PROBE_ROWS` rows (the exit conditions and every replayed
    score rest on it; a rule is one rule, so a few rows prove it at a fraction of one
    batch's cost): a replay of the recorded scores must reproduce the model's own exits bit
    for bit, scores that stop every unit (token, patch, example) at the first exit site,
    or at none, must do so, and scores that stop each unit after an exit site of its own
    (unit ``u`` after site ``u mod (n + 1)``, so every site is asked) must stop each one
    there. Where they do not, every site is asked alone and the cause told apart
    (:func:`_misdeclared`): its :class:`~fcaudit.core.contract.Exit` reversed, or a
    threshold its values never or always reach; else a rule reading something other than
    the site's output."""
    sites, run = exit_sites(setup.sites), lambda: call_model(setup.model, x)
    unit, n = exit_unit(sites), len(sites)
    own = own_exits(net, run)
    _, coefficients, _ = setup.executor.record(x, None)

    def exits(k: Any, values: Any = None) -> torch.Tensor:
        """The exits under the recorded scores (``k`` None), or under scores stopping each
        unit after site ``k`` (a layer for all, or a tensor of one per unit), from
        the sites' Exit or ``values(site)`` in its place."""
        declared = [dataclasses.replace(s, role=values(s)) for s in sites] if values else sites
        layers = k if isinstance(k, torch.Tensor) else torch.full_like(own, int(k or 0))
        scores = coefficients if k is None else exit_scores(declared, layers, coefficients)
        with replaying(setup.model, {s: scores[s.name] for s in sites}):
            return own_exits(net, run)

    got = exits(None)
    if not torch.equal(got, own):
        raise _refusal(sites, "replaying the recorded scores", got, own, unit)
    units = torch.arange(own.numel()).view_as(own)
    patterns = [torch.full_like(own, 0), torch.full_like(own, n)] + [
        (units + shift) % (n + 1) for shift in range(0, n + 1, max(own.numel(), 1))]
    for layers in patterns:
        got = exits(layers)
        if not torch.equal(got, layers):
            _diagnose(sites, exits, own, unit, got, layers)


def _diagnose(sites: Sequence[Any], exits: Any, own: torch.Tensor, unit: str,
              got_mixed: torch.Tensor, mixed: torch.Tensor) -> None:
    """Every exit site asked alone (scores stopping every unit after it), the first that
    fails refused with its cause; reached only when the rule did not follow (``mixed``:
    the pattern that failed, ``got_mixed`` the exits it gave)."""
    n = len(sites)
    fed = {k: exits(k) for k in range(n + 1)}
    for k, got in fed.items():
        if not torch.equal(got, torch.full_like(own, k)):
            cause = _misdeclared(sites, fed, k, exits, unit)
            if cause is not None:
                raise ModelError(f"exit site {cause[0].name}: {cause[1]}", site=cause[0].name)
            raise _refusal(sites, f"feeding scores that stop every {unit} after exit layer {k}",
                           got, torch.full_like(own, k), unit)
    raise _refusal(sites, f"feeding scores that stop each {unit} after an exit layer of its "
                   "own", got_mixed, mixed, unit)


_FAR = 1000.0  # a value this many (stop - go) steps beyond one of an Exit's values


def _misdeclared(sites: Sequence[Any], fed: dict[int, torch.Tensor], k: int, exits: Any,
                 unit: str) -> tuple[Any, str] | None:
    """The site and the cause where scores stopping every ``unit`` after site ``k``
    (``fed[k]``, exit layers) did not, when the site's Exit is at fault: reversed (its exit
    value stops no unit, its continue value every one), or a threshold the exit value
    never reaches (a value far beyond it does stop every unit) or the continue value
    always reaches (a value far below it does not); None otherwise."""
    n = len(sites)
    if bool((fed[0] == n).all()) and bool((fed[n] == 0).all()):
        go, stop = sites[0].exit.go, sites[0].exit.stop
        return sites[0], (f"{sites[0].exit!r} is reversed: the model's rule stops every "
                          f"{unit} on the continue value {go!r} and none on the exit value "
                          f"{stop!r}; declare {Exit(stop, go)!r}")
    expected = torch.full_like(fed[k], k)
    if bool((fed[k] > k).all()) and torch.equal(exits(k, lambda s: Exit(
            s.exit.go, s.exit.stop + _FAR * (s.exit.stop - s.exit.go))), expected):
        go, stop = sites[k].exit.go, sites[k].exit.stop
        return sites[k], (f"its exit value {stop!r} ({sites[k].exit!r}) stops no "
                          f"{unit}, a value {stop + _FAR * (stop - go):g} does: the rule's "
                          "threshold is never reached by the declared exit value; declare "
                          "one that reaches it")
    if bool((fed[k] < k).all()) and torch.equal(exits(k, lambda s: Exit(
            s.exit.go - _FAR * (s.exit.stop - s.exit.go), s.exit.stop)), expected):
        site = sites[int(fed[k].min())]
        go, stop = site.exit.go, site.exit.stop
        return site, (f"its continue value {go!r} ({site.exit!r}) stops every "
                      f"{unit}, a value {go - _FAR * (stop - go):g} does not: the rule's "
                      "threshold is always reached, even by the declared continue value; "
                      "declare one that does not reach it")
    return None


def _refusal(sites: Sequence[Any], what: str, got: torch.Tensor, expected: torch.Tensor,
             unit: str) -> ModelError:
    """A rule that does not follow its site's output, naming the first site where ``got``
    and ``expected`` exit layers part."""
    wrong = got != expected
    site = sites[min(int(torch.minimum(got, expected)[wrong].min()), len(sites) - 1)]
    return ModelError(f"exit site {site.name}: {what}, the model's exit rule stops "
                      f"{int(wrong.sum())} of {wrong.numel()} {plural(unit)} at another layer; its "
                      "exit decision must read the site's output and nothing else (no "
                      "recomputed score, no state kept between calls)", site=site.name)


def degenerate(own: torch.Tensor, layers: int, unit: str) -> str | None:
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


def exit_summary(plan: ExitPlan | None, gap: Retention | None, boot: Bootstrap,
                 frontier: ExitFrontier | None = None) -> ExitSummary | None:
    """The audit.json section of an exit model, or None without an exit condition (no
    depth per position where the sites have no position axis). The evaluation mean depth's
    interval resamples examples (``boot``), as every interval of the audit does."""
    if plan is None:
        return None
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
        note=degenerate(own, L, plan.unit), unit=plan.unit,
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
    share = retention(per_seq[CORRECT], per_seq[ORACLE_EXIT], per_seq[FIXED_EXIT], boot,
                      f"{FIXED_EXIT}-to-{ORACLE_EXIT} gap")
    if share.defined or share.gap_ci95[0] > 0:  # a share, or one too wide to measure
        return share
    lo, hi = share.gap_ci95
    return Retention(share.gap, share.gap_ci95, None, None, False,
                     f"the {FIXED_EXIT}-to-{ORACLE_EXIT} gap {share.gap:+.4f} has a 95% "
                     f"interval [{lo:+.4f}, {hi:+.4f}] that is not above 0: the oracle's exits "
                     f"lose no less than fixed exit's, so no share of it is reported")


def with_exit_conditions(conditions: tuple[str, ...], sites: Any, model: Any) -> tuple[str, ...]:
    """``conditions`` with the exit conditions added for a model with exit sites (checked
    now, before any pass): an exit model is always placed between fixed exit and the
    oracle (other models are left alone)."""
    if not exit_sites(sites):
        return conditions
    exit_model(model, sites)
    return (*conditions, *(n for n in needing("exits") if n not in conditions))


Shapes = dict[str, tuple[tuple[int, ...], ...]]  # block path -> its (input, output) shapes


@torch.no_grad()
def check_twin(setup: Any) -> None:
    """Refuse a dense twin of another depth or width than an exit model: executed depth
    and FLOPs are read against it, so the twin must be the same network at full depth.
    Depth: the blocks each declares; width: the shape of what each block reads and
    returns per unit that exits, on the first evaluation window (the blocks that ran there:
    one ordinary pass, as changing the rule would be a call the audit's own checks do not
    expect). A unit is an example where the exit sites have no
    position axis (``[C, H, W]`` for a convolution: the last axis alone is its image
    width, not its channels), else a token (the last axis: an exit model's blocks see the
    running tokens packed)."""
    sites = exit_sites(setup.sites)
    if setup.dense is None or not sites or setup.blocks is None:
        return
    from fcaudit.engine.inputs import resolve_block_paths
    twin_blocks = resolve_block_paths(setup.dense, setup.blocks_glob) or []
    _, x = next(batches(setup.eval_source, 1, device_of(setup.model), [0]))
    unit = exit_unit(sites)
    axes = 1 if unit != EXAMPLE else None
    mine = block_shapes(setup.model, setup.blocks, x, axes)
    twin = block_shapes(setup.dense, twin_blocks, x, axes)
    differs = _first_difference(setup.blocks, twin_blocks, mine, twin, unit)
    if differs is not None:
        raise ModelError(
            f"exit site {sites[0].name}: the dense twin is not the model's network at full "
            f"depth: {differs}; executed depth and FLOPs are read against the twin, so give "
            f"the same network run to full depth ({arg('dense')})", site=sites[0].name)


def _first_difference(blocks: Sequence[str], twin_blocks: Sequence[str], mine: Shapes,
                      twin: Shapes, unit: str) -> str | None:
    """Where a twin departs from the model, in words: another number of blocks, or the
    first block (of those the model ran) whose per-unit input or output shape differs,
    with both sides' shapes; None where it is the same network."""
    if len(blocks) != len(twin_blocks):
        return f"it has {len(twin_blocks)} blocks, the model {len(blocks)}"
    for i, (path, other) in enumerate(zip(blocks, twin_blocks, strict=True)):
        if path in mine and mine[path] != twin.get(other):
            theirs = _shapes(twin[other]) if other in twin else "did not run on the first " \
                "evaluation window"
            return (f"block {i} maps per-{unit} shapes {_shapes(mine[path])} in the model "
                    f"({path}), {theirs} in the twin ({other})")
    return None


def block_shapes(net: Any, paths: Sequence[str], x: Any, axes: int | None) -> Shapes:
    """Per block that ran, in order: the shapes of its first input and first output tensor, the last
    ``axes`` axes (None: all but the batch axis)."""
    from fcaudit.engine.execution import inference
    seen: Shapes = {}

    def unit(t: Any) -> tuple[int, ...]:
        return tuple(t.shape[-axes:] if axes else t.shape[1:])

    def keep(path: str) -> Any:
        def hook(_m: Any, args: Any, out: Any) -> None:
            first = out[0] if isinstance(out, (tuple, list)) else out
            seen.setdefault(path, (unit(args[0]), unit(first)))
        return hook

    with inference(net), hooks(net, {p: keep(p) for p in paths}):
        call_model(net, x)
    return {p: seen[p] for p in paths if p in seen}


def _shapes(shapes: tuple[tuple[int, ...], ...]) -> str:
    """A block's first input and output shapes: ``[16, 8, 8] -> [32, 4, 4]``."""
    return " -> ".join(str(list(shape)) for shape in shapes)


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
                 tick: Progress) -> tuple[tuple[float, Tensor], ...]:
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

