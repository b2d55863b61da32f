"""The savings frontier's section: per covered family, the one-sentence comparison, the
matched comparisons, the check of a model that skips on its own, and every point."""

from __future__ import annotations

from fcaudit.core.conditions import FRONTIER
from fcaudit.engine.frontier_parts import FrontierFamily
from fcaudit.engine.result import AuditResult
from fcaudit.report.format import fmt_num, fmt_with_ci
from fcaudit.report.markdown import md_code, md_table, md_text
from fcaudit.report.report_parts import _by_family
from fcaudit.report.sections.base import Renderer


def render(r: AuditResult, frontier: dict[str, FrontierFamily]) -> list[str]:
    """The savings frontier: the sentence, matched comparisons, the SkipGate check, points."""
    blocks = ["## Savings frontier",
              "NLL penalty against the share of FLOPs that could be skipped: a dynamic rule "
              "driven by the recorded coefficients (soft gates: switch off every gate whose "
              "distance from its off value, the update it keeps, is below a threshold; "
              "routers: top-p) against static rules that ignore the input "
              "(whole layers or (layer, position) cells; a smaller fixed k per layer), "
              "thresholds and orders from the calibration set, one replay per point. Penalties "
              "are interpolated at matched FLOPs saved; gaps are static minus dynamic, 95% "
              "paired bootstrap intervals."]
    for fam, f in _by_family(r, frontier):
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


RENDERER = Renderer(FRONTIER, render)
