"""The report's figures and where each is placed, with the ordering helpers every
section uses; :mod:`fcaudit.report.audit_report` assembles them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import TypeVar

from fcaudit.core.conditions import (
    CORRECT,
    FRONTIER,
    PER_LAYER_CONDITIONS,
    REPORTED_CONDITIONS,
)
from fcaudit.engine.result import (
    ETA2_KEYS,
    AuditResult,
)
from fcaudit.report.figures import (
    FigureSpec,
    Span,
    exit_frontier_figure,
    expert_importance_figure,
    expert_load_figure,
    frontier_figure,
    heatmap_figure,
    penalty_figure,
    profile_figure,
    variance_figure,
)

T = TypeVar("T")
EXIT_FRONTIER = "exit-frontier"  # the exit frontier figure's file stem


def _ordered(items: Mapping[str, T], canonical: Sequence[str]) -> list[tuple[str, T]]:
    """Known names in their canonical order, then any others sorted (audit.json sorts keys)."""
    names = [n for n in canonical if n in items] + sorted(n for n in items if n not in canonical)
    return [(n, items[n]) for n in names]


def _by_family(result: AuditResult, items: Mapping[str, T]) -> list[tuple[str, T]]:
    """Per-family entries in site order."""
    return _ordered(items, result.families)


# Where each figure is shown: beside the answer it illustrates (by the answer's key) or
# at the end of the section it illustrates (by the section's title); the report places
# every figure it draws through this map, so none waits at the end of the page.
FIGURE_PLACES = {"profile": "variation", "heatmap": "variation", "variance": "variation",
                 "penalties": "dependence", EXIT_FRONTIER: "exits",
                 "expert-load": "Routing", "expert-importance": "Expert importance",
                 FRONTIER: "Savings frontier"}


def _figure_specs(r: AuditResult) -> list[FigureSpec]:
    profiles = dict(_by_family(r, r.profiles))
    conditions = {"audit": {n: Span.of(c.delta, c.ci95)
                            for n, c in _ordered(r.conditions, REPORTED_CONDITIONS)
                            if n != CORRECT}}
    multi = len(r.families) > 1
    per_layer = {f"{name}@layer" + (f" ({fam})" if multi else ""):
                 [(e.layer, Span.of(e.delta, e.ci95)) for e in entries if e.family == fam]
                 for name, entries in _ordered(r.per_layer, PER_LAYER_CONDITIONS)
                 for fam in r.families}
    shares = {fam: {k: getattr(v, k) for k in ETA2_KEYS} for fam, v in _by_family(r, r.variance)}
    routed = dict(_by_family(r, r.routing or {}))
    positional = {fam: p for fam, p in profiles.items() if fam not in routed}
    return [
        ("profile", "Coefficient per layer: mean with ±1 sd.",
         partial(profile_figure, {fam: [("mean", p)] for fam, p in profiles.items()})),
        ("heatmap", "Mean coefficient by layer and position" + (
            " (router families: see the expert load map)." if routed else "."),
         partial(heatmap_figure, positional)),
        ("variance", "Variance shares of the coefficients.", partial(variance_figure, shares)),
        ("penalties", f"{r.loss_name()} penalties vs correct replay with 95% bootstrap CIs.",
         partial(penalty_figure, conditions, per_layer, loss=r.loss_name())),
        _exit_frontier_spec(r),
        ("expert-load", "Expert load by layer: share of token-slots routed to each expert.",
         partial(expert_load_figure, {fam: [x.load for x in summary.per_layer]
                                      for fam, summary in routed.items()})),
        ("expert-importance", f"Expert importance by layer: {r.loss_name()} change with each "
         "expert removed from every token's choice.",
         partial(expert_importance_figure, {
             fam: [[x.delta for x in layer.experts] for layer in summary.per_layer]
             for fam, summary in _by_family(r, r.expert_importance or {})},
             loss=r.loss_name())),
        (FRONTIER, "Savings frontier: NLL penalty vs FLOPs saved, dynamic vs static rules, "
         "95% CI bars.",
         partial(frontier_figure, {
             fam: {rule: [(p.flops_saved_fraction, Span.of(p.delta, p.ci95))
                          for p in f.points if p.rule == rule]
                   for rule in dict.fromkeys(p.rule for p in f.points)}
             for fam, f in _by_family(r, r.frontier or {})})),
    ]


def _exit_frontier_spec(r: AuditResult) -> FigureSpec:
    """The exit frontier's figure: the learned rule's threshold sweep and fixed exit at
    each whole depth, penalty against mean executed depth (nothing to draw without it)."""
    f = r.exits.frontier if r.exits is not None else None
    points = f.points if f is not None else []
    own = next(((p.mean_depth, p.delta.value) for p in points
                if p.rule == "learned" and p.threshold is None), None)
    curves = {name: [(p.mean_depth, Span.of(p.delta.value, p.delta.ci95))
                     for p in points if p.rule == rule]
              for rule, name in (("learned", "learned rule (threshold sweep)"),
                                 ("fixed", "fixed exit (one depth for all)"))}
    unit = (r.exits.unit if r.exits is not None else None) or "token"
    depth = r.exits.depth if r.exits is not None else 0
    return (EXIT_FRONTIER, f"Exit frontier: {r.loss_name()} penalty vs mean executed depth, "
            "the learned rule's threshold sweep against fixed exit, 95% CI bars.",
            partial(exit_frontier_figure, curves, own, depth=depth, unit=unit,
                    loss=r.loss_name()))
