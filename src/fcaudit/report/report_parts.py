"""The savings frontier's report section and the report's figures, with the ordering
helpers every section uses; :mod:`fcaudit.report.audit_report` assembles them."""

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
from fcaudit.report.format import (
    fmt_num,
    fmt_with_ci,
)
from fcaudit.report.markdown import (
    md_code,
    md_table,
    md_text,
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


def _frontier(r: AuditResult) -> list[str]:
    """The savings frontier: the sentence, matched comparisons, the SkipGate check, points."""
    if not r.frontier:
        return []
    blocks = ["## Savings frontier",
              "NLL penalty against the share of FLOPs that could be skipped: a dynamic rule "
              "driven by the recorded coefficients (soft gates: switch off every gate whose "
              "distance from its off value, the update it keeps, is below a threshold; "
              "routers: top-p) against static rules that ignore the input "
              "(whole layers or (layer, position) cells; a smaller fixed k per layer), "
              "thresholds and orders from the calibration set, one replay per point. Penalties "
              "are interpolated at matched FLOPs saved; gaps are static minus dynamic, 95% "
              "paired bootstrap intervals."]
    for fam, f in _by_family(r, r.frontier):
        blocks += [f"### Family {md_code(fam)} ({f.kind})", md_text(f.sentence)]
        if f.reason:
            continue
        statics = list(f.matched[0].static) if f.matched else []
        rows = [(f"{100 * m.saved:.0f}%", fmt_with_ci(m.dynamic.value, m.dynamic.ci95)
                 if m.dynamic else "not reached",
                 *(fmt_with_ci(m.gap[s].value, m.gap[s].ci95) if m.gap[s] else "not reached"
                   for s in statics)) for m in f.matched]
        blocks.append(md_table(("FLOPs saved", "Δ dynamic [95% CI]",
                                *(f"gap {s} [95% CI]" for s in statics)), rows,
                               "r" * (2 + len(statics))))
        area = "; ".join(f"{s} {fmt_with_ci(a.value, a.ci95)}" if a else f"{s} none"
                         for s, a in f.area.items())
        blocks.append(f"Mean gap over the x range both curves reach (area between curves / "
                      f"range): {md_text(area)}. FLOPs: {md_text(f.flops_source or '')}.")
        if f.check:
            c = f.check
            pooled = fmt_with_ci(c.pooled_curve_delta.value, c.pooled_curve_delta.ci95) \
                if c.pooled_curve_delta else "not reached"
            blocks.append(
                f"Check (the model really skips): the dynamic rule at its own per-layer "
                f"thresholds saves {100 * c.accounted_flops_saved_fraction:.1f}% of the FLOPs "
                f"by its count, {100 * c.measured_flops_saved_fraction:.1f}% measured against "
                f"the dense counterpart, at Δ {fmt_with_ci(c.delta, c.ci95)}: "
                f"{'on its curve' if c.on_curve else 'NOT on its curve'}. One threshold "
                f"pooled over layers at the same FLOPs: {pooled}.")
        blocks.append(md_table(
            ("rule", "level", "threshold", "skipped", "FLOPs saved", "Δ NLL [95% CI]"),
            [(p.rule + (" (own thresholds)" if p.own_thresholds else ""), f"{p.level:.2f}",
              fmt_num(p.threshold) if p.threshold is not None
              else md_text(str(p.layers or p.own_thresholds)), f"{100 * p.skipped_fraction:.1f}%",
              f"{100 * p.flops_saved_fraction:.1f}%", fmt_with_ci(p.delta, p.ci95))
             for p in f.points], "lrrrrr"))
    return blocks


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
