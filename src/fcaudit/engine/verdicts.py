"""Verdicts: one sentence per question, backed by the numbers, with thresholds defined once.

Dependence is *strong* when the lower 95% bound of the reassign or shuffle penalty
exceeds ``STRONG_PENALTY`` nats or a static per-layer profile keeps less than
``STRONG_RETENTION`` percent of the Correct-to-GlobalMean gap; *weak* when it keeps at
least ``WEAK_RETENTION`` percent and both penalties stay below ``WEAK_PENALTY``;
*none* when retention is undefined, no penalty's interval lies above zero and some lies
below (an intervention that lowers the NLL is no dependence: the sentence says which, by
how much); *none measurable* when retention is undefined and no penalty's interval
excludes zero; *partial* otherwise (some interval above zero, or a defined retention).
"""

from __future__ import annotations

from collections.abc import Mapping

from fcaudit.engine.result import ConditionResult, Identity, Retention, VarianceShares, Variation

STRONG_PENALTY = 0.1  # nats, lower CI bound of reassign or shuffle
STRONG_RETENTION = 50.0  # percent
WEAK_RETENTION = 90.0  # percent
WEAK_PENALTY = 0.05  # nats
VARIES_SD = 1e-6  # spread below which coefficients "do not vary"


def variation(variance: Mapping[str, VarianceShares], spread: Mapping[str, Variation]) -> str:
    parts = []
    for family, v in spread.items():
        eta = variance[family]
        varies = v.mean_sd_across_inputs > VARIES_SD or v.mean_sd_across_positions > VARIES_SD
        parts.append(
            f"{family}: coefficients {'vary' if varies else 'do not vary'} (sd across inputs "
            f"{v.mean_sd_across_inputs:.3g}, across positions {v.mean_sd_across_positions:.3g}, "
            f"across layers {v.across_layer_sd:.3g}); {eta.sentence()}")
    return "; ".join(parts) + "."


PENALTIES = {"reassign": "reassigning coefficients across inputs",
             "shuffle": "shuffling them across tokens",
             "reassign+shuffle": "reassigning and shuffling them",
             "static-layer": "a static per-layer profile",
             "static-layer-position": "a static per-layer-and-position profile",
             "static-layer-token": "a static per-layer-and-token-id profile"}


def _label(conditions: Mapping[str, ConditionResult], kept: float | None) -> str:
    """The verdict's label; dependence rests on intervals above 0 only."""
    r, s = conditions["reassign"], conditions["shuffle"]
    above = [n for n in PENALTIES if conditions[n].ci95[0] > 0]
    below = [n for n in PENALTIES if conditions[n].ci95[1] < 0]
    if max(r.ci95[0], s.ci95[0]) > STRONG_PENALTY or (kept is not None
                                                      and kept < STRONG_RETENTION):
        return "Strong dependence on the coefficient assignment"
    if kept is not None and kept >= WEAK_RETENTION and max(r.delta, s.delta) < WEAK_PENALTY:
        return "Weak dependence on the coefficient assignment"
    if kept is None and not above and below:
        helps = "; ".join(f"{PENALTIES[n]} lowers the NLL by {-conditions[n].delta:.4f} nats "
                          f"[{-conditions[n].ci95[1]:.4f}, {-conditions[n].ci95[0]:.4f}]"
                          for n in below)
        return (f"No dependence on the coefficient assignment (no penalty's 95% interval lies "
                f"above 0, and {helps}: the model does not need its coefficients matched to "
                "their input and token)")
    if kept is None and not above:
        return ("No measurable dependence on the coefficient assignment (no penalty's 95% "
                "interval excludes 0: none found, or too few sequences to resolve one)")
    return "Partial dependence on the coefficient assignment"


def dependence(conditions: Mapping[str, ConditionResult],
               retention: Mapping[str, Retention]) -> str:
    r, s = conditions["reassign"], conditions["shuffle"]
    sl = retention["static-layer"]
    kept = sl.value
    kept_txt = (f"a static per-layer profile keeps {kept:.2f}% [{sl.ci95[0]:.2f}, "
                f"{sl.ci95[1]:.2f}] of the Correct-to-GlobalMean gap" if kept is not None
                else "static-profile retention is undefined (no clear Correct-to-GlobalMean gap)")
    return (f"{_label(conditions, kept)}: reassigning coefficients across inputs costs "
            f"{r.delta:+.4f} nats [{r.ci95[0]:+.4f}, {r.ci95[1]:+.4f}], shuffling them across "
            f"tokens {s.delta:+.4f} [{s.ci95[0]:+.4f}, {s.ci95[1]:+.4f}]; {kept_txt}.")


def qualified(sentence: str, identity: Identity | None) -> str:
    """A verdict prefixed with the identity warning when replay was not exact."""
    if identity is None or identity.exact:
        return sentence
    return (f"[NOT EXACT: identity replay differs from the original pass by up to "
            f"{identity.max_abs_diff:.3g} nats per token; read with care] {sentence}")
