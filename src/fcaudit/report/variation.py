"""The report's sections on how the coefficients vary: per layer (with the per-layer
penalties beside the spread), the variance decomposition (pooled, per component and per
named coefficient) and the variation summary; :mod:`fcaudit.report.audit_report`
assembles them."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from fcaudit.core.conditions import PER_LAYER_CONDITIONS
from fcaudit.engine.result import (
    ETA2_KEYS,
    AuditResult,
    LayerConditionResult,
    LayerVariation,
)
from fcaudit.report.figures import SHARE_LABELS
from fcaudit.report.format import fmt_num, fmt_share, fmt_with_ci
from fcaudit.report.markdown import md_code, md_table, md_text
from fcaudit.report.report_parts import _by_family, _ordered


def per_layer_section(r: AuditResult) -> list[str]:
    """One table per family joining per-layer spread and per-layer intervention penalties."""
    blocks = ["## Per layer"]
    if not any(r.per_layer.values()):
        blocks.append("Per-layer interventions were not run; coefficient spread only.")
    for fam in r.families:
        spread = {e.layer: e for e in (r.variation[fam].per_layer if fam in r.variation else [])}
        penalties = {name: by_layer for name, entries in _ordered(r.per_layer, PER_LAYER_CONDITIONS)
                     if (by_layer := {e.layer: e for e in entries if e.family == fam})}
        if spread or penalties:
            blocks += [f"### Family {md_code(fam)}", _per_layer_table(spread, penalties)]
    return blocks


def _per_layer_table(spread: Mapping[int, LayerVariation],
                     penalties: Mapping[str, Mapping[int, LayerConditionResult]]) -> str:
    layers = sorted({*spread, *(k for e in penalties.values() for k in e)})

    def site(k: int) -> str:
        entry = spread.get(k) or next(e[k] for e in penalties.values() if k in e)
        return md_code(entry.site)

    columns: list[tuple[str, str, Callable[[int], str]]] = [("layer", "r", str),
                                                            ("site", "l", site)]
    if spread:
        columns += [(header, "r", lambda k, key=key: fmt_num(getattr(spread[k], key))
                     if k in spread else "n/a")
                    for header, key in (("mean", "mean"), ("sd inputs", "sd_across_inputs"),
                                        ("sd positions", "sd_across_positions"))]
    columns += [(f"Δ {name}@layer [95% CI]", "r",
                 lambda k, e=entries: fmt_with_ci(e[k].delta, e[k].ci95) if k in e else "n/a")
                for name, entries in penalties.items()]
    return md_table([h for h, _, _ in columns],
                    ([cell(k) for _, _, cell in columns] for k in layers),
                    "".join(a for _, a, _ in columns))


def variance_section(r: AuditResult) -> list[str]:
    """Per family, the shares of the pooled decomposition and, for vector coefficients,
    of each entry decomposed alone; one value per token has no component to show (its
    share is 0 by construction and its one entry is the pooled row)."""
    blocks = ["## Variance decomposition",
              "Share of the coefficients' variance (evaluation set) explained by layer "
              "identity, position and their interaction, and for vector coefficients by the "
              "component: which entry of the vector a value is (its index on the sites' last "
              "axes; for a router, which expert a logit scores); the residual is what varies "
              "with input and token content."]
    for fam, var in _by_family(r, r.variance):
        keys = [k for k in ETA2_KEYS if k != "eta2_component" or var.component_axis]
        rows = [["pooled", fmt_num(var.n_values), *(fmt_share(getattr(var, k)) for k in keys)]]
        if var.component_axis:
            rows += [[f"{var.component_axis} {c.index} alone", "",
                      *(fmt_share(getattr(c, k, None)) for k in keys)]
                     for c in var.components or ()]
        labels = {**SHARE_LABELS, "eta2_component": var.component_axis or ""}
        blocks += [f"### Family {md_code(fam)}",
                   md_table(("scope", "values", *(labels[k] for k in keys)), rows,
                            "lr" + "r" * len(keys))]
        if var.components_note and var.component_axis:
            blocks.append(f"Rows {md_code(f'{var.component_axis} [i] alone')}: "
                          f"{md_text(var.components_note)}.")
    return blocks


def variation_section(r: AuditResult) -> list[str]:
    rows = ((md_code(fam), fmt_num(v.across_layer_sd), fmt_num(v.mean_sd_across_inputs),
             fmt_num(v.mean_sd_across_positions), fmt_num(v.ratio_inputs_to_layers),
             fmt_num(v.ratio_positions_to_layers)) for fam, v in _by_family(r, r.variation))
    return ["## Variation summary",
            "Standard deviation of coefficients across inputs and across positions within a "
            "layer (mean over layers), relative to the spread of layer means.",
            md_table(("family", "sd across layers", "sd across inputs", "sd across positions",
                      "inputs / layers", "positions / layers"), rows, "lrrrrr")]
