"""Views of an audit result: its flat metrics (one naming, for the study, the trend, the
comparison and the notebook), and its tables as rows (one row builder per table, for
the report, the notebook view and the CLI summary)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from fcaudit.core.conditions import (
    CONDITIONS,
    CORRECT,
    FRONTIER,
    REASSIGN,
    REPORTED_RETENTION,
    SHUFFLE,
    STATIC_LAYER,
    STATIC_LAYER_POSITION,
    STATIC_LAYER_TOKEN,
    audited,
    by_role,
)
from fcaudit.core.errors import FcauditError
from fcaudit.engine.analyses import analysis_intervals, analysis_metrics
from fcaudit.engine.result_parts import ETA2_KEYS, TOKEN_ID_KEYS

if TYPE_CHECKING:
    from fcaudit.engine.result import AuditResult
    from fcaudit.engine.result_parts import (
        ConditionResult,
        Estimate,
        ExecutionSection,
    )

EXIT_THRESHOLD, EXIT_MEAN_DEPTH = "exit_threshold", "exit_mean_depth"  # exit models' keys


def delta_key(condition: str) -> str:
    """The metric key of a condition's penalty against correct."""
    return f"delta_{condition}"


def retention_key(profile: str) -> str:
    """The metric key of a static profile's gap retention."""
    return f"retention_{profile.replace('-', '_')}"


def accuracy_retention_key(profile: str) -> str:
    """The metric key of a static profile's retention on accuracy (objectives with one)."""
    return f"accuracy_{retention_key(profile)}"


def rerouted_key(condition: str) -> str:
    """The metric key of the share of expert sets a condition re-routes."""
    return f"rerouted_{condition}"


# the correct replay's loss and accuracy
NLL_CORRECT, ACCURACY_CORRECT = f"nll_{CORRECT}", f"accuracy_{CORRECT}"
# the keys the studies quote by name, derived from the registry's names
DELTA_REASSIGN, DELTA_SHUFFLE = delta_key(REASSIGN), delta_key(SHUFFLE)
RETENTION_LAYER, RETENTION_LAYER_POSITION, RETENTION_LAYER_TOKEN = (
    retention_key(p) for p in (STATIC_LAYER, STATIC_LAYER_POSITION, STATIC_LAYER_TOKEN))
# the conditions whose share of re-routed expert sets the metrics give
REROUTED = (*by_role("rerouted"), STATIC_LAYER_TOKEN)


def _accuracy_retention(r: AuditResult, part: str) -> dict[str, Any]:
    """Each profile's accuracy retention ``part`` ("value" or "ci95") by its metric key;
    none for objectives without accuracy."""
    return {accuracy_retention_key(p): getattr(r.retention[p].accuracy, part)
            for p in audited(r.retention, REPORTED_RETENTION)
            if r.retention[p].accuracy is not None}


def with_interval(key: str, value: float | None,
                  ci95: Sequence[float] | None) -> dict[str, float | None]:
    """A number with its 95% interval's bounds (``<key>_ci_low``, ``<key>_ci_high``)."""
    return {key: value, **_bounds(ci95, f"{key}_")}


def metrics(r: AuditResult) -> dict[str, float | None]:
    """The result's numbers, flat: NLL of correct (and accuracy for classification), every
    condition's penalty (None where it does not apply; custom ones too), the interaction,
    each profile's retention, the main family's variance shares with the token-id share,
    its chance level and the share beyond chance, execution fractions, the frontier and
    re-routing, and the analyses' numbers; intervals are in :func:`metric_intervals`."""
    c = r.conditions
    out: dict[str, float | None] = {NLL_CORRECT: c[CORRECT].nll}
    if c[CORRECT].accuracy is not None:  # a classification objective
        out[ACCURACY_CORRECT] = c[CORRECT].accuracy
    for name in (n for n in audited(c) if n != CORRECT):  # None: not applicable
        out[delta_key(name)] = c[name].delta if name in c else None
    out |= {delta_key(n): x.delta for n, x in (r.custom_conditions or {}).items()}
    out["interaction"] = r.interaction.value if r.interaction else None
    out |= {retention_key(p): r.retention[p].value
            for p in audited(r.retention, REPORTED_RETENTION)} | _accuracy_retention(r, "value")
    main = r.variance[r.families[0]]  # the first family in site order is the main one
    out |= {key: getattr(main, key) for key in (*ETA2_KEYS, *TOKEN_ID_KEYS)}
    out |= _execution_metrics(r) | _frontier_metrics(r) | _rerouted(r) | _exit_metrics(r)
    extra = analysis_metrics(r.analyses or {})
    if clash := sorted(set(extra) & set(out)):
        raise FcauditError(f"analysis metrics {clash} are named like fcaudit's own: rename them")
    return out | extra


def metric_intervals(r: AuditResult) -> dict[str, list[float] | None]:
    """The 95% intervals of the :func:`metrics` that have one, by the same keys."""
    out: dict[str, list[float] | None] = {
        delta_key(n): c.ci95 for n, c in [*r.conditions.items(),
                                          *(r.custom_conditions or {}).items()] if n != CORRECT}
    out["interaction"] = r.interaction.ci95 if r.interaction else None
    out |= {retention_key(p): r.retention[p].ci95 for p in audited(r.retention, REPORTED_RETENTION)}
    out |= _accuracy_retention(r, "ci95")
    gap = _gap_25(r)
    out["frontier_gap_25"] = None if gap is None else gap.ci95
    if r.exits is not None:
        out[EXIT_MEAN_DEPTH] = r.exits.evaluation_mean_depth_ci95
    return out | analysis_intervals(r.analyses or {})


def _exit_metrics(r: AuditResult) -> dict[str, float | None]:
    """An exit model's threshold (None: its rules carry no one threshold) and its mean
    executed depth on evaluation; nothing for other models."""
    e = r.exits
    if e is None:
        return {}
    return {EXIT_THRESHOLD: e.frontier.own_threshold if e.frontier is not None else None,
            EXIT_MEAN_DEPTH: e.evaluation_mean_depth}


def _execution_metrics(r: AuditResult) -> dict[str, float | None]:
    ex, out = r.execution, {}
    if not ex.measured:
        return out
    out["blocks_executed_fraction"] = ex.blocks_executed / ex.blocks_present
    out["flops_ratio"] = ex.flops_ratio
    out["speed_ratio"] = ex.speed_ratio_vs_dense
    if ex.positions_per_block and ex.dense_positions_per_block \
            and None not in (*ex.positions_per_block, *ex.dense_positions_per_block):
        out["tokens_executed_fraction"] = sum(ex.positions_per_block) / \
            sum(ex.dense_positions_per_block)
    if ex.experts is not None:
        out["experts_executed_fraction"] = ex.experts.experts_per_token_summed_over_layers / \
            ex.experts.experts_present_summed_over_layers
    return out


def _gap_25(r: AuditResult) -> Estimate | None:
    """The main family's frontier gap at 25% of FLOPs saved (an Estimate), or None without
    a frontier (MUDD's mixing weights have none: no value of them switches a block off)."""
    fam = (r.frontier or {}).get(r.families[0])
    return fam.gap_at_25 if fam is not None else None


def _frontier_metrics(r: AuditResult) -> dict[str, float | None]:
    """The main family's gap at 25% saved; a model that skips on its own (SkipGate): its
    own point too."""
    gap = _gap_25(r)
    out: dict[str, float | None] = {"frontier_gap_25": None if gap is None else gap.value}
    front = (r.frontier or {}).get(r.families[0])
    if (check := front.check if front is not None else None) is not None:
        out["frontier_own_delta"] = check.delta
        out["frontier_own_flops_saved"] = check.accounted_flops_saved_fraction
        out["frontier_measured_flops_saved"] = check.measured_flops_saved_fraction
        out["frontier_on_curve"] = float(check.on_curve)
    return out


def _rerouted(r: AuditResult) -> dict[str, float | None]:
    """The main family's share of re-routed choices under the re-routing conditions."""
    routing = (r.routing or {}).get(r.families[0])
    if routing is None:
        return {}
    return {rerouted_key(name): routing.changed.get(name)
            for name in REROUTED}


def _accuracy(r: AuditResult, c: ConditionResult) -> dict[str, Any]:
    """The accuracy column of a classification audit (none for other objectives)."""
    scored = any(x.accuracy is not None for x in r.conditions.values())
    return {"accuracy": c.accuracy} if scored else {}


def condition_rows(r: AuditResult, custom: bool = True) -> list[dict[str, Any]]:
    """The one row builder of the conditions table (the report, the notebook view, the
    CLI summary): the main conditions, then the custom ones as given (``custom``)."""
    items = [*r.conditions.items(), *((r.custom_conditions or {}).items() if custom else ())]
    return [{"condition": name, "custom": name not in r.conditions, "meaning": meaning(name),
             "nll": c.nll, "delta": c.delta, "ci_low": c.ci95[0], "ci_high": c.ci95[1],
             "repeats": len(c.repeats), **_accuracy(r, c)} for name, c in items]


def meaning(name: str) -> str:
    """What a condition feeds, in one line (a custom one: a user-defined intervention)."""
    condition = CONDITIONS.get(name)
    return condition.meaning if condition is not None else "user-defined intervention"


def _per_layer_rows(r: AuditResult) -> list[dict[str, Any]]:
    return [{"condition": name, "site": c.site, "family": c.family, "layer": c.layer,
             "nll": c.nll, "delta": c.delta, "ci_low": c.ci95[0], "ci_high": c.ci95[1],
             **_accuracy(r, c)}
            for name, layers in r.per_layer.items() for c in layers]


def _bounds(ci95: Sequence[float] | None, prefix: str = "") -> dict[str, float | None]:
    """A row's interval columns (``ci_low``, ``ci_high``), None without an interval."""
    low, high = ci95 or (None, None)
    return {f"{prefix}ci_low": low, f"{prefix}ci_high": high}


def _retention_rows(r: AuditResult) -> list[dict[str, Any]]:
    """Each profile's retention; its accuracy columns for objectives with accuracy."""
    return [{"profile": name, "retention_pct": ret.value, **_bounds(ret.ci95), "gap": ret.gap,
             "defined": ret.defined, **({} if (acc := ret.accuracy) is None else {
                 "accuracy_retention_pct": acc.value, **_bounds(acc.ci95, "accuracy_"),
                 "accuracy_gap": acc.gap})}
            for name, ret in r.retention.items()]


def _routing_rows(r: AuditResult) -> list[dict[str, Any]]:
    return [{"family": family, "site": layer.site, "layer": layer.layer, "expert": e,
             "load": share, "entropy_normalized": layer.entropy_normalized}
            for family, summary in (r.routing or {}).items() for layer in summary.per_layer
            for e, share in enumerate(layer.load)]


def _expert_rows(r: AuditResult) -> list[dict[str, Any]]:
    return [{"family": family, "site": layer.site, "layer": layer.layer, "expert": x.expert,
             "delta": x.delta, **_bounds(x.ci95), "load": x.load,
             "selected_after": x.selected_after}
            for family, summary in (r.expert_importance or {}).items()
            for layer in summary.per_layer for x in layer.experts]


def _frontier_rows(r: AuditResult) -> list[dict[str, Any]]:
    return [{"family": family, "kind": f.kind, "rule": p.rule, "level": p.level,
             "threshold": p.threshold, "skipped_fraction": p.skipped_fraction,
             "flops_saved_per_token": p.flops_saved_per_token,
             "flops_saved_fraction": p.flops_saved_fraction, "nll": p.nll, "delta": p.delta,
             "ci_low": p.ci95[0], "ci_high": p.ci95[1]}
            for family, f in (r.frontier or {}).items() for p in f.points]


def _metric_rows(r: AuditResult) -> list[dict[str, Any]]:
    intervals = metric_intervals(r)
    return [{"metric": key, "value": value, **_bounds(intervals.get(key))}
            for key, value in metrics(r).items()]


def condition_table_html(r: AuditResult, esc: Callable[[str], str]) -> str:
    """The conditions as HTML table rows (the notebook view)."""
    return "".join(
        f"<tr><td>{esc(row['condition'])}</td><td>{row['nll']:.4f}</td>"
        f"<td>{row['delta']:+.4f}</td><td>[{row['ci_low']:+.4f}, {row['ci_high']:+.4f}]</td></tr>"
        for row in condition_rows(r))


TABLES = {"conditions": condition_rows, "per_layer": _per_layer_rows,
          "retention": _retention_rows, "routing": _routing_rows, "experts": _expert_rows,
          FRONTIER: _frontier_rows, "metrics": _metric_rows}


EXECUTION_COLUMNS = ("blocks_executed", "blocks_present", "executed_fraction", "flops_per_token",
                     "dense_flops_per_token", "flops_ratio", "speed_ratio_vs_dense",
                     "speed_ratio_ci95", "conditional_execution", "degenerate_rule",
                     "experts_per_token")


def execution_row(label: str, ex: ExecutionSection) -> dict[str, Any]:
    """A model's execution as one row, the same columns whether measured or not (then
    empty): ``fcaudit compare``'s execution table."""
    if not ex.measured:
        return {"model": label, "measured": False, "reason": ex.reason, "unit": "token",
                **dict.fromkeys(EXECUTION_COLUMNS)}
    ratio = ex.timing.speed_ratio_vs_dense if ex.timing is not None else None
    return {"model": label, "measured": True, "reason": None, "unit": ex.unit or "token",
            **dict(zip(EXECUTION_COLUMNS, (
                ex.blocks_executed, ex.blocks_present, ex.executed_fraction, ex.flops_per_token,
                ex.dense_flops_per_token, ex.flops_ratio, ratio and ratio.value,
                ratio and ratio.ci95, ex.conditional_execution, ex.degenerate_rule,
                ex.experts and ex.experts.experts_per_token_mean_over_layers), strict=True))}
