"""The routing section: each router's expert load and the top-k sets each condition
changes, beside its penalty."""

from __future__ import annotations

from fcaudit.engine.result import AuditResult, RoutingSummary
from fcaudit.report.format import fmt_num, fmt_seq, fmt_with_ci
from fcaudit.report.markdown import md_code, md_table, md_text
from fcaudit.report.report_parts import _by_family
from fcaudit.report.sections.base import Renderer


def render(r: AuditResult, routing: dict[str, RoutingSummary]) -> list[str]:
    """Routing-aware metrics of router families: expert load per layer and its entropy,
    and the share of tokens each condition re-routes (beside their penalties)."""
    blocks = ["## Routing",
              "For router sites: the expert load of the original routing per layer (share of "
              "token-slots per expert) and its entropy (1 = perfectly balanced), and the share "
              "of (token, layer) top-k expert sets each condition changes, beside its "
              f"{r.loss_name()} penalty. Layer identity's share of the router-logit variance "
              "is in the variance decomposition above."]
    for fam, summary in _by_family(r, routing):
        conditions = [c for c in r.conditions if c in summary.changed]
        rows = [(md_code(c), f"{100 * summary.changed[c]:.1f}%",
                 fmt_with_ci(r.conditions[c].delta, r.conditions[c].ci95)) for c in conditions]
        per_layer = [(str(x.layer), md_code(x.site), f"{x.entropy_normalized:.3f}",
                      fmt_seq([f"{v:.3f}" for v in x.load], str, limit=16),
                      *(f"{100 * x.changed.get(c, 0.0):.1f}%" for c in conditions[:3]))
                     for x in summary.per_layer]
        blocks += [f"### Family {md_code(fam)} ({summary.num_experts} experts, "
                   f"{fmt_num(summary.tokens)} tokens per layer)",
                   md_table(("condition", "top-k sets changed", f"Δ {r.loss_name()} [95% CI]"),
                            rows, "lrr"),
                   md_table(("layer", "site", "load entropy / log E", "expert load",
                             *(f"changed: {c}" for c in conditions[:3])), per_layer,
                            "llrl" + "r" * len(conditions[:3])),
                   f"Note: {md_text(summary.note)}."]
    return blocks


RENDERER = Renderer("routing", render)
