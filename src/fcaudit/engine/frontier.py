"""The savings frontier (docs/method.md, Savings frontier): NLL penalty against the FLOPs
that could be skipped, for a dynamic rule driven by the recorded coefficients and static
rules that ignore the input, each point one replay of the cached coefficients.

Soft gates (one coefficient per token and layer): the dynamic rule zeroes every recorded
gate below a threshold ``tau`` (for ``h + g F(h)``, exactly what skipping the block
computes); the static rules zero whole layers (lowest calibration mean first) or whole
(layer, position) cells. Routers: the dynamic rule keeps per token the fewest top experts
whose routing weight reaches a mass ``p`` (top-p); the static rule keeps a smaller fixed
``k`` per layer. Thresholds, layer orders and cells come from the calibration set only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fcaudit.core.conditions import FRONTIER, STATIC_LAYER, STATIC_LAYER_POSITION
from fcaudit.core.contract import ExpertLayer, RoutingAdapter, Site
from fcaudit.core.hooks import hooks as hooked
from fcaudit.core.nll import logits_of
from fcaudit.core.routers import drop_experts, top_p_keep, topk_mass
from fcaudit.engine.frontier_parts import (
    FrontierCheck,
    FrontierFamily,
    FrontierMatch,
    FrontierPointResult,
)
from fcaudit.engine.metrics import Bootstrap, penalty
from fcaudit.engine.result_parts import Estimate, ExecutionSection

GATE, ROUTER = "gate", "router"
# the static rules named after the conditions whose profiles they threshold
DYNAMIC, STATIC_CELL, STATIC_K = "dynamic", STATIC_LAYER_POSITION, "static-k"
STATIC_RULES = {GATE: (STATIC_LAYER, STATIC_CELL), ROUTER: (STATIC_K,)}
MATCHED = (0.10, 0.25, 0.50)  # FLOPs-saved fractions the curves are compared at
HEADLINE = 0.25  # the one-sentence comparison
LEVEL_MAX = 0.9  # the largest target level: skipping everything says nothing
GRID = 101  # x points of the area between curves
FLOPS_TOLERANCE = 0.05  # |measured - accounted| saved fraction for the SkipGate check


@dataclass(frozen=True)
class Covered:
    """A family the frontier covers: its kind, sites in layer order and (routers) top-k."""

    family: str
    kind: str
    sites: tuple[Site, ...]
    top_k: tuple[int, ...] = ()
    # gates of a model that skips on its own: per layer, the recorded gate below which the
    # model's blocks did not run (read off its execution counts; see own_thresholds)
    own: tuple[float, ...] | None = None
    own_share: float = 0.0  # the share of token-layers the model skipped on its own
    reason: str | None = None  # why the family gets no curves (set before any replay)


@dataclass(frozen=True)
class FrontierPoint:
    """One frontier replay: a rule at one level, with everything its feed needs."""

    family: str
    kind: str
    rule: str
    level: float  # target share of the gated units skipped (calibration)
    tau: float | None = None  # gates, dynamic: zero gates below
    taus: tuple[float, ...] = ()  # gates, the model's own skips: per-layer thresholds
    layers: tuple[int, ...] = ()  # gates, static-layer: layers zeroed
    cells: tuple[tuple[int, int], ...] = ()  # gates, static-layer-position: (layer, position)
    mass: float | None = None  # routers, dynamic: top-p mass
    keep: tuple[int, ...] = ()  # routers, static-k: k per layer
    top_k: tuple[int, ...] = ()  # routers: the family's k per layer

    @property
    def key(self) -> str:
        own = ":own" if self.taus else ""
        return f"{FRONTIER}:{self.family}:{self.rule}{own}:{self.level:.4f}"


def frontier_families(sites: Sequence[Site], coefficients: Mapping[str, Tensor],
                      experts: Sequence[ExpertLayer]) -> list[Covered]:
    """Soft-gate families (one coefficient per token, not a router) and router families
    whose every layer declares its experts; others have no frontier."""
    out = []
    layers = {e.name: e for e in experts}
    for family in dict.fromkeys(s.family for s in sites):
        members = tuple(sorted((s for s in sites if s.family == family), key=lambda s: s.layer))
        shapes = [coefficients[s.name].shape for s in members]
        if all(isinstance(s.adapter, RoutingAdapter) for s in members):
            if all(s.name in layers for s in members) and all(len(x) >= 3 for x in shapes):
                out.append(Covered(family, ROUTER, members,
                                           tuple(layers[s.name].top_k for s in members)))
        elif all(int(np.prod(x[2:])) == 1 for x in shapes) and \
                not any(isinstance(s.adapter, RoutingAdapter) for s in members):
            out.append(Covered(family, GATE, members))
    return out


def levels(points: int) -> list[float]:
    return [LEVEL_MAX * j / points for j in range(1, points + 1)]


def most_points(families: Sequence[Covered], points: int) -> int:
    """The most frontier points :func:`plan_points` (and a skipping model's own point) can
    give ``families``, before calibration says which levels coincide: what the plan counts."""
    per_level = {GATE: 1 + len(STATIC_RULES[GATE]), ROUTER: 1 + len(STATIC_RULES[ROUTER])}
    return sum(per_level[f.kind] * points + (f.kind == GATE) for f in families)


def kept(site: Site, t: Tensor) -> Tensor:
    """How much of its module's update each gate of ``t`` keeps, the size every gate rule
    orders by (smallest switched off first): the distance from the site's ``off`` value,
    ``|g - off|`` (``h + g F(h)``: ``|g|``; an inverted gate ``h + (1 - g) F(h)`` declared
    with ``off=1``: ``|1 - g|``, so its gates nearest 1 go first, not its largest updates);
    for ``off=-inf`` (a logit through a sigmoid) the gate itself, for ``+inf`` its negation."""
    if math.isinf(site.gate.off):
        return t if site.gate.off < 0 else -t
    return (t - site.gate.off).abs()


def plan_points(families: Sequence[Covered], calib: Mapping[str, Tensor],
                points: int) -> list[FrontierPoint]:
    """Each rule's points at the target levels, from calibration data only (``calib``:
    site name -> its calibration coefficients); a level that gives the same feed as an
    earlier one of its rule is dropped (its replay would repeat that one)."""
    out: list[FrontierPoint] = []
    for fam in families:
        made = _gate_points(fam, calib, points) if fam.kind == GATE else \
            _router_points(fam, calib, points)
        seen = set()
        for p in made:
            what = (p.rule, p.tau, p.layers, p.cells, p.mass, p.keep)
            if what not in seen:
                seen.add(what)
                out.append(p)
    return out


def _gate_points(fam: Covered, calib: Mapping[str, Tensor],
                 points: int) -> list[FrontierPoint]:
    """Thresholds, layer and cell orders on what each calibration gate keeps (:func:`kept`)."""
    sizes = {s.name: kept(s, calib[s.name].double()) for s in fam.sites}
    pooled = torch.cat([sizes[s.name].reshape(-1) for s in fam.sites]).numpy()
    means = [float(sizes[s.name].mean()) for s in fam.sites]
    by_mean = sorted(range(len(fam.sites)), key=lambda i: (means[i], i))
    cell_means = [(float(m), i, t) for i, s in enumerate(fam.sites)
                  for t, m in enumerate(sizes[s.name].mean(0).reshape(
                      calib[s.name].shape[1], -1).mean(-1))]
    cell_order = [(i, t) for _, i, t in sorted(cell_means)]
    n = len(fam.sites)
    made = []
    for q in levels(points):
        made.append(FrontierPoint(fam.family, GATE, DYNAMIC, q, tau=float(np.quantile(pooled, q))))
        count = min(n, max(1, round(q * n)))
        made.append(FrontierPoint(fam.family, GATE, STATIC_LAYER, q,
                                  layers=tuple(sorted(by_mean[:count]))))
        cells = max(1, round(q * len(cell_order)))
        made.append(FrontierPoint(fam.family, GATE, STATIC_CELL, q,
                                  cells=tuple(sorted(cell_order[:cells]))))
    return made


def _router_points(fam: Covered, calib: Mapping[str, Tensor],
                   points: int) -> list[FrontierPoint]:
    masses = [topk_mass(calib[s.name], k).reshape(-1, k) for s, k in zip(fam.sites, fam.top_k,
                                                                        strict=True)]
    pooled = torch.cat([m[:, :-1].reshape(-1) for m in masses]).numpy()
    # static: drop one slot at a time in the layer whose tokens keep the most mass
    keep, steps = list(fam.top_k), []
    while any(k > 1 for k in keep):
        retained = [float(m[:, k - 2].mean()) if k > 1 else -1.0 for m, k in zip(masses, keep,
                                                                                strict=True)]
        layer = int(np.argmax(retained))
        keep[layer] -= 1
        steps.append(tuple(keep))
    made = []
    for q in levels(points):
        if pooled.size:
            made.append(FrontierPoint(fam.family, ROUTER, DYNAMIC, q,
                                      mass=float(np.quantile(pooled, 1 - q)),
                                      top_k=fam.top_k))
        if steps:
            made.append(FrontierPoint(fam.family, ROUTER, STATIC_K, q, top_k=fam.top_k,
                                      keep=steps[min(len(steps), max(1, round(q * len(steps))))
                                                 - 1]))
    return made


def skipped(point: FrontierPoint, site: Site, layer: int, t: Tensor) -> Tensor:
    """Per token of ``t [B, T, ...]`` (``site``, layer ``layer`` of the family): gates, True
    where the rule switches the gate off; routers, the expert slots the rule drops (float
    ``[B, T]``)."""
    if point.kind == GATE:
        shape = t.shape[:2]
        if point.rule == DYNAMIC:
            tau = point.taus[layer] if point.taus else point.tau
            return (kept(site, t).reshape(*shape, -1) < tau).any(-1)
        if point.rule == STATIC_LAYER:
            return torch.full(shape, layer in point.layers, dtype=torch.bool)
        mask = torch.zeros(shape, dtype=torch.bool)
        mask[:, [p for i, p in point.cells if i == layer]] = True
        return mask
    return (point.top_k[layer] - _kept(point, layer, t)).double()


def _kept(point: FrontierPoint, layer: int, t: Tensor) -> Tensor:
    if point.rule == DYNAMIC:
        assert point.mass is not None
        return top_p_keep(t, point.top_k[layer], point.mass)
    return torch.full(t.shape[:-1], point.keep[layer], dtype=torch.int64)


def point_feed(point: FrontierPoint, correct: Mapping[Site, Tensor]) -> dict[Site, Tensor]:
    """What the family's sites are fed under ``point`` (other sites stay correct)."""
    members = sorted((s for s in correct if s.family == point.family), key=lambda s: s.layer)
    fed = {}
    for i, site in enumerate(members):
        t = correct[site]
        if point.kind == GATE:
            mask = skipped(point, site, i, t).reshape(*t.shape[:2], *([1] * (t.dim() - 2)))
            fed[site] = t.masked_fill(mask, site.gate.off)
        else:
            fed[site] = drop_experts(t, _kept(point, i, t))
    return fed


def skipped_units(point: FrontierPoint, coefficients: Mapping[str, Tensor],
                  fam: Covered) -> np.ndarray:
    """Skipped units summed over a batch, per layer: tokens (gates) or expert slots. A
    model that skips on its own also skips, under any rule, the tokens below its own
    thresholds: those are counted too (the replay skips them as the model does)."""
    out = []
    for i, s in enumerate(fam.sites):
        t = coefficients[s.name]
        mask = skipped(point, s, i, t)
        if fam.own is not None:
            mask = mask | (kept(s, t).reshape(*t.shape[:2], -1) < fam.own[i]).any(-1)
        out.append(float(mask.double().sum()))
    return np.array(out)


# ---- a model that skips on its own (SkipGate): its thresholds and its own point ----

def own_thresholds(fam: Covered, executed: Sequence[float] | None, tokens: int,
                   gates: Mapping[str, Tensor]) -> Covered:
    """``fam`` with the model's own per-layer thresholds, when its blocks skip tokens.

    ``executed``: each block's executed fraction on the evaluation set (execution counts,
    one block per gated layer), ``gates``: site -> every evaluation gate of that layer.
    A block that ran on ``E`` of its tokens ran, under a threshold rule, on exactly the
    ``E`` largest gates: the threshold is the smallest of those. Where no threshold on the
    recorded gate splits the tokens as the counts do (ties, or a rule that is not a
    threshold), the family gets a reason instead: its rules' FLOPs could not be counted.
    """
    if fam.kind != GATE or executed is None or min(executed, default=1.0) >= 1.0:
        return fam
    if len(executed) != len(fam.sites):
        return replace(fam, reason=f"the model skips tokens on its own, and its "
                       f"{len(executed)} counted blocks are not one per gated layer "
                       f"({len(fam.sites)}): name one block per gate (--blocks)")
    taus = []
    for site, share in zip(fam.sites, executed, strict=True):
        g = kept(site, gates[site.name].double()).reshape(-1)
        ran = round(share * tokens)
        if ran >= g.numel():
            taus.append(float("-inf"))
            continue
        tau = float(g.sort(descending=True).values[ran - 1]) if ran else float("inf")
        if int((g >= tau).sum()) != ran:
            return replace(fam, reason=(
                f"the model skips tokens on its own, but no threshold on {site.name}'s "
                f"recorded gate selects the {ran} of {g.numel()} tokens its block ran on "
                "(ties, or a rule that is not a threshold on this gate): the FLOPs a rule "
                "saves on top of the model's own skips cannot be counted"))
        taus.append(tau)
    return replace(fam, own=tuple(taus), own_share=1.0 - float(np.mean(executed)))


def own_point(fam: Covered) -> FrontierPoint | None:
    """The dynamic rule at the model's own per-layer thresholds: it zeroes exactly the
    gates whose blocks the model skipped, so its replay must reproduce the model's pass."""
    if fam.own is None:
        return None
    return FrontierPoint(fam.family, GATE, DYNAMIC, fam.own_share, taus=fam.own)


# ---- the points' checks and counts, on the recorded audit ----

def eval_gates(cache: Any, fam: Covered) -> dict[str, Tensor]:
    return {s.name: torch.cat([cache.coefficients(b, s.name).reshape(-1)
                               for b in range(cache.n_batches)]) for s in fam.sites}


@torch.no_grad()
def off_mismatch(setup: Any, fam: Covered, x: Any) -> str | None:
    """Why switching the family's gates to their ``off`` value does not remove exactly one
    module per gate on the first evaluation batch ``x`` (None: it does, bit for bit). The
    module is the site's declared gated module (its output zeroed), else the block of its layer
    (the block passing its input through, as ``h + 0 F(h)`` does, or its update zeroed, as
    for SkipGate's ``body``). A coefficient that only reweights (mixing weights, a keep-score
    that reorders tokens) removes no module, and gets no frontier: it would be mispriced."""
    gated = [s.gate.gated for s in fam.sites]
    modules = gated if all(gated) else setup.blocks
    if modules is None or len(modules) != len(fam.sites):
        return (f"the {len(fam.sites)} gates are not one per declared block "
                f"({len(modules) if modules else 'no'} blocks): no module to price their skips")
    net = setup.model
    recorded = setup.executor.record(x, sites=fam.sites)[1]
    off = setup.executor.replay(x, {s: torch.full_like(recorded[s.name], s.gate.off)
                                    for s in fam.sites}).logits
    modes = (_zeroed,) if all(gated) else (_passed_through, _zeroed)
    diffs = []
    for mode in modes:
        with hooked(net, {m: mode for m in modules if m}):
            removed = logits_of(net(x))
        if torch.equal(off, removed):
            return None
        diffs.append(float((off.double() - removed.double()).abs().max()))
    return (f"setting {fam.family}'s gates to {fam.sites[0].gate.off} does not remove exactly "
            f"one module per gate ({', '.join(m for m in modules if m)[:120]}; max logit "
            f"difference {min(diffs):.3g}): these coefficients do not switch a computation "
            "off, so no skipped FLOPs can be priced")


def _zeroed(_m: nn.Module, _args: tuple[Any, ...], out: Any) -> Any:
    return torch.zeros_like(out) if isinstance(out, Tensor) else out


def _passed_through(_m: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
    first = args[0] if args else None
    same = isinstance(first, Tensor) and isinstance(out, Tensor) and first.shape == out.shape
    return first if same else out


def frontier_units(cache: Any, covered: Sequence[Covered],
                   points: Sequence[FrontierPoint]) -> dict[str, np.ndarray]:
    """Point key -> skipped units per layer (tokens or expert slots), summed over the
    evaluation set's recorded coefficients."""
    by_family = {fam.family: fam for fam in covered}
    units = {p.key: np.zeros(len(by_family[p.family].sites)) for p in points}
    for b in range(cache.n_batches):
        coefficients = {s.name: cache.coefficients(b, s.name)
                        for fam in covered for s in fam.sites}
        for p in points:
            units[p.key] += skipped_units(p, coefficients, by_family[p.family])
    return units


# ---- the summary: curves in FLOPs, matched comparisons, the area between curves ----

def unit_flops(fam: Covered, execution: ExecutionSection) -> tuple[list[float], float, str] | str:
    """FLOPs per skipped unit of each layer, the denominator and where they come from; or
    why the execution audit gives none."""
    if not execution.measured:
        return f"execution not measured ({execution.reason})"
    n = len(fam.sites)
    if fam.kind == ROUTER:
        ex = execution.experts
        names = [s.name for s in fam.sites]
        if ex is None or ex.flops_per_slot_per_layer is None or \
                not set(names) <= set(ex.layers):
            return "the execution audit counted no per-expert FLOPs for these routers"
        per = [ex.flops_per_slot_per_layer[ex.layers.index(name)] for name in names]
        return per, float(execution.flops_per_token or 0.0), \
            "the model's measured FLOPs per executed expert slot (execution audit)"
    gated = [s.gate.gated for s in fam.sites]
    if all(gated):
        counted = execution.gated_flops_per_token or {}
        if not set(gated) <= set(counted) or not execution.flops_per_token:
            return "the execution audit counted no FLOPs for the gated modules"
        return [counted[g] for g in gated], float(execution.flops_per_token), \
            "the model's measured FLOPs per token of each gated module (execution audit)"
    per = execution.dense_flops_per_block
    if per is None or len(per) != n or not execution.dense_flops_per_token:
        return (f"the dense counterpart has {len(per) if per else 'no'} counted blocks for the "
                f"{n} gated layers: name the dense blocks (--blocks)")
    return list(per), float(execution.dense_flops_per_token), \
        "the dense counterpart's measured FLOPs per token of each block (execution audit)"


@dataclass
class Curve:
    """The curve engine both frontiers use: a rule's per-sequence penalties (``d``) at the
    costs it runs at (``x``, increasing: FLOPs saved, or an exit model's mean depth), read
    at any cost between by linear interpolation, so rules are compared at matched cost."""

    x: np.ndarray  # [points] costs, increasing
    d: np.ndarray  # [points, sequences] per-sequence values

    def at(self, x: float) -> np.ndarray | None:
        """Per-sequence values interpolated at ``x`` (None outside the curve's x range)."""
        if x > self.x[-1] + 1e-12 or x < self.x[0] - 1e-12:
            return None
        j = int(np.searchsorted(self.x, x))
        if j == 0 or self.x[j] == x:
            return self.d[min(j, len(self.x) - 1)]
        w = (x - self.x[j - 1]) / (self.x[j] - self.x[j - 1])
        return (1 - w) * self.d[j - 1] + w * self.d[j]


def curve(pairs: Sequence[tuple[float, np.ndarray]], n: int, origin: bool = True) -> Curve:
    """The points ``(cost, per-sequence values)`` sorted by cost, points at the same cost
    averaged; with ``origin``, the free point (0, zeros) first (not for a model that skips
    on its own: no rule saves less than it does)."""
    xs: dict[float, list[np.ndarray]] = {0.0: [np.zeros(n)]} if origin or not pairs else {}
    for x, d in pairs:
        xs.setdefault(round(x, 12), []).append(d)
    keys = sorted(xs)
    return Curve(np.array(keys), np.stack([np.mean(xs[k], axis=0) for k in keys]))


def estimate(values: np.ndarray | None, boot: Bootstrap) -> Estimate | None:
    """A per-sequence difference's mean with its paired-bootstrap interval."""
    if values is None:
        return None
    value, ci = penalty(values, np.zeros_like(values), boot)
    return Estimate(value, ci)


def summarize_family(fam: Covered, points: Sequence[FrontierPoint],
                     per_seq: Mapping[str, np.ndarray], correct: np.ndarray,
                     units: Mapping[str, np.ndarray], tokens: int, execution: ExecutionSection,
                     boot: Bootstrap) -> FrontierFamily:
    """One family's curves (``units[key]``: skipped units per layer summed over evaluation;
    ``tokens``: evaluation tokens per layer)."""
    flops = unit_flops(fam, execution)
    mine = [p for p in points if p.family == fam.family]
    rules = (DYNAMIC, *STATIC_RULES[fam.kind])
    if isinstance(flops, str):
        return FrontierFamily(fam.kind, None, None, None, [], [], {}, None, None,
                              f"No frontier in FLOPs: {flops}.", None, reason=flops)
    per_unit, total, source = flops
    results, pairs = [], {r: [] for r in rules}
    for p in mine:
        d = per_seq[p.key] - correct
        saved = float(np.dot(units[p.key], per_unit)) / tokens
        slots = sum(fam.top_k) if fam.kind == ROUTER else len(fam.sites)
        delta, ci = penalty(per_seq[p.key], correct, boot)
        results.append(FrontierPointResult(
            p.rule, p.level, p.tau if fam.kind == GATE else p.mass,
            list(p.layers) if p.rule == STATIC_LAYER else list(p.keep) if p.rule == STATIC_K
            else None, float(units[p.key].sum()) / (tokens * slots), saved, saved / total,
            float(per_seq[p.key].mean()), delta, ci,
            list(p.taus) if p.taus else None))
        pairs[p.rule].append((saved / total, d))
    n = len(correct)
    curves = {r: curve(pairs[r], n, origin=fam.own is None) for r in rules}
    matched = []
    for f in MATCHED:
        dyn = curves[DYNAMIC].at(f)
        static = {r: curves[r].at(f) for r in rules[1:]}
        matched.append(FrontierMatch(f, estimate(dyn, boot),
                                     {r: estimate(v, boot) for r, v in static.items()},
                                     {r: estimate(None if v is None or dyn is None else v - dyn,
                                                   boot) for r, v in static.items()}))
    area = {r: _area(curves[DYNAMIC], curves[r], boot) for r in rules[1:]}
    head = next(m for m in matched if m.saved == HEADLINE)
    best = min((r for r in rules[1:] if head.gap[r] is not None),
               key=lambda r: head.gap[r].value, default=None)
    return FrontierFamily(fam.kind, per_unit, total, source, results, matched, area, best,
                          head.gap[best] if best else None,
                          _sentence(head, best, curves), None)


def _area(dynamic: Curve, static: Curve, boot: Bootstrap) -> Estimate | None:
    """Mean of (static - dynamic) penalty over the x range both curves cover."""
    start, end = max(dynamic.x[0], static.x[0]), min(dynamic.x[-1], static.x[-1])
    if end <= start:
        return None
    grid = np.linspace(start, end, GRID)
    gaps = [static.at(x) - dynamic.at(x) for x in grid]  # type: ignore[operator]
    return estimate(np.mean(gaps, axis=0), boot)


def _sentence(head: FrontierMatch, best: str | None, curves: Mapping[str, Curve]) -> str:
    pct = f"{100 * HEADLINE:.0f}% of FLOPs saved"
    if best is None or head.dynamic is None:
        reach = ", ".join(f"{r} {100 * c.x[0]:.1f}% to {100 * c.x[-1]:.1f}%"
                          for r, c in curves.items())
        return f"No comparison at {pct}: the curves cover only {reach}."
    gap = head.gap[best]
    assert gap is not None
    text = f"{gap.value:+.4f} nats [{gap.ci95[0]:+.4f}, {gap.ci95[1]:+.4f}]"
    if gap.ci95[0] > 0:
        verdict = f"loses to the dynamic one by {text}"
    elif gap.ci95[1] < 0:
        verdict = f"beats the dynamic one by {text}"
    else:
        verdict = f"matches the dynamic one (gap {text}, interval includes 0)"
    return (f"At {pct}, the best static rule ({best}) {verdict}; the dynamic rule's "
            f"penalty there is {head.dynamic.value:+.4f} nats.")


def skip_check(fam: Covered, result: FrontierFamily, points: Sequence[FrontierPoint],
               per_seq: Mapping[str, np.ndarray], correct: np.ndarray, execution: ExecutionSection,
               boot: Bootstrap) -> FrontierCheck | None:
    """For a model that really skips gated blocks: the dynamic rule at its own thresholds
    (the point that zeroes exactly the gates whose blocks it skipped) must cost nothing
    (its replay is the model's own pass) at the FLOPs the model measurably saves."""
    own = own_point(fam)
    if own is None or result.total_flops_per_token is None or \
            execution.flops_per_token is None:
        return None
    mine = [p for p in points if p.family == fam.family]
    at = next(r for p, r in zip(mine, result.points, strict=True) if p.key == own.key)
    total = result.total_flops_per_token
    measured = (total - execution.flops_per_token) / total
    pooled = curve([(r.flops_saved_fraction, per_seq[p.key] - correct)
                     for p, r in zip(mine, result.points, strict=True)
                     if r.rule == DYNAMIC and p.key != own.key], len(correct))
    on = at.ci95[0] <= 0.0 <= at.ci95[1] and \
        abs(measured - at.flops_saved_fraction) <= FLOPS_TOLERANCE
    return FrontierCheck(measured, at.flops_saved_fraction, at.delta, at.ci95,
                         estimate(pooled.at(at.flops_saved_fraction), boot), on, (
        "the dynamic rule at the model's own per-layer thresholds (read off its execution "
        "counts) zeroes exactly the gates whose blocks it skipped: on its curve when that "
        "replay's penalty interval includes 0 (zeroing a gate computes what skipping does) "
        f"and its counted FLOPs saved agree within {100 * FLOPS_TOLERANCE:.0f} points with "
        "the FLOPs measured against the dense counterpart; pooled_curve_delta is the "
        "calibrated single-threshold rule at the same FLOPs, for comparison"))


def frontier_summary(covered: Sequence[Covered], points: Sequence[FrontierPoint],
                     per_seq: Mapping[str, np.ndarray], correct: np.ndarray,
                     units: Mapping[str, np.ndarray], tokens: int, execution: ExecutionSection,
                     boot: Bootstrap) -> dict[str, FrontierFamily]:
    """Every covered family's frontier, with the skip check where the model skips."""
    out = {}
    for fam in covered:
        own = own_point(fam)
        if own is not None and not np.array_equal(per_seq[own.key], correct):
            fam = replace(fam, reason=(
                "the model skips tokens on its own, but zeroing the gates below the thresholds "
                "its execution counts imply does not reproduce its pass (max per-sequence NLL "
                f"difference {float(np.abs(per_seq[own.key] - correct).max()):.3g}): its skips "
                "are not a threshold on the recorded gate, so the FLOPs a rule saves on top "
                "of them cannot be counted"))
        if fam.reason is not None:
            out[fam.family] = FrontierFamily(fam.kind, None, None, None, [], [], {}, None, None,
                                             f"No frontier: {fam.reason}.", None,
                                             reason=fam.reason)
            continue
        result = summarize_family(fam, points, per_seq, correct, units, tokens, execution, boot)
        if result.reason is None:
            result = replace(result, check=skip_check(fam, result, points, per_seq, correct,
                                                      execution, boot))
        out[fam.family] = result
    return out
