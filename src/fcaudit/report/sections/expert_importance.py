"""The expert importance section: the experts whose removal costs most and least."""

from __future__ import annotations

from fcaudit.engine.result import AuditResult, ExpertImportance, ImportanceSummary
from fcaudit.report.format import fmt_num, fmt_with_ci
from fcaudit.report.markdown import md_code, md_table, md_text
from fcaudit.report.report_parts import _by_family
from fcaudit.report.sections.base import Renderer


def render(r: AuditResult, importance: dict[str, ImportanceSummary]) -> list[str]:
    """Expert importance of router families: the 3 experts whose removal costs most and
    the 3 that cost least, with intervals and loads; experts the rule still picked."""
    blocks = ["## Expert importance",
              "For each routed layer and expert, one replay with that expert removed from every "
              "token's choice in that layer (the next expert takes its place, weighted as the "
              f"family's routing rule does): its {r.loss_name()} change vs the correct "
              "replay, beside its "
              "load under the original routing. The layer x expert map is in the figures."]
    for fam, summary in _by_family(r, importance):
        blocks += [f"### Family {md_code(fam)} ({summary.num_experts} experts, "
                   f"{summary.replays} ablation replays)",
                   *_importance_tables(summary, r.loss_name()),
                   f"Note: {md_text(summary.note)}."]
    return blocks


def _importance_tables(summary: ImportanceSummary, loss: str) -> list[str]:
    items = [(layer.layer, layer.site, x) for layer in summary.per_layer for x in layer.experts]
    measured = sorted((i for i in items if i[2].delta is not None), key=lambda i: -i[2].delta)
    ranked = [("most", i) for i in measured[:3]] + \
        [("least", i) for i in measured[max(3, len(measured) - 3):]]

    def row(rank: str, layer: int, site: str, x: ExpertImportance) -> tuple[str, ...]:
        return (rank, str(layer), md_code(site), str(x.expert), fmt_with_ci(x.delta, x.ci95),
                f"{100 * x.load:.1f}%", fmt_num(x.selected_after))
    out = [md_table(("importance", "layer", "site", "expert", f"Δ {loss} removed [95% CI]",
                     "load", "picked when removed"), [row(k, *i) for k, i in ranked], "lrlrrrr")] \
        if ranked else []
    kept = [f"layer {layer} expert {x.expert} ({fmt_num(x.selected_after)} token-slots)"
            for layer, _, x in items if x.delta is None]
    if kept:
        out.append(f"Not removable, so no importance measured: the routing rule still picked "
                   f"{md_text(', '.join(kept))} with its logit far below the others.")
    return out


RENDERER = Renderer("expert_importance", render)
