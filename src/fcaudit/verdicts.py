"""Verdicts: one sentence per question, backed by the numbers, with thresholds defined once.

Dependence is *strong* when the lower 95% bound of the reassign or shuffle penalty
exceeds ``STRONG_PENALTY`` nats or a static per-layer profile keeps less than
``STRONG_RETENTION`` percent of the Correct-to-GlobalMean gap; *weak* when it keeps at
least ``WEAK_RETENTION`` percent and both penalties stay below ``WEAK_PENALTY``;
*none measurable* when no penalty's interval excludes zero and retention is
undefined; *partial* otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping

from .result import ConditionResult, Identity, Retention, VarianceShares, Variation

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


def _excludes_zero(c: ConditionResult) -> bool:
    lo, hi = c.ci95
    return lo > 0 or hi < 0


def dependence(conditions: Mapping[str, ConditionResult],
               retention: Mapping[str, Retention]) -> str:
    r, s = conditions["reassign"], conditions["shuffle"]
    sl = retention["static-layer"]
    kept = sl.value
    penalties = [conditions[k] for k in ("reassign", "shuffle", "reassign+shuffle",
                                         "static-layer", "static-layer-position")]
    if max(r.ci95[0], s.ci95[0]) > STRONG_PENALTY or (kept is not None
                                                      and kept < STRONG_RETENTION):
        label = "Strong dependence on the coefficient assignment"
    elif kept is not None and kept >= WEAK_RETENTION and max(r.delta, s.delta) < WEAK_PENALTY:
        label = "Weak dependence on the coefficient assignment"
    elif kept is None and not any(_excludes_zero(c) for c in penalties):
        label = ("No measurable dependence on the coefficient assignment (no penalty's 95% "
                 "interval excludes 0: none found, or too few sequences to resolve one)")
    else:
        label = "Partial dependence on the coefficient assignment"
    kept_txt = (f"a static per-layer profile keeps {kept:.2f}% [{sl.ci95[0]:.2f}, "
                f"{sl.ci95[1]:.2f}] of the Correct-to-GlobalMean gap" if kept is not None
                else "static-profile retention is undefined (no clear Correct-to-GlobalMean gap)")
    return (f"{label}: reassigning coefficients across inputs costs {r.delta:+.4f} nats "
            f"[{r.ci95[0]:+.4f}, {r.ci95[1]:+.4f}], shuffling them across tokens "
            f"{s.delta:+.4f} [{s.ci95[0]:+.4f}, {s.ci95[1]:+.4f}]; {kept_txt}.")


def qualified(sentence: str, identity: Identity | None) -> str:
    """A verdict prefixed with the identity warning when replay was not exact."""
    if identity is None or identity.exact:
        return sentence
    return (f"[NOT EXACT: identity replay differs from the original pass by up to "
            f"{identity.max_abs_diff:.3g} nats per token; read with care] {sentence}")
