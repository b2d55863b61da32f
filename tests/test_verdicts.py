"""The dependence verdict follows its rules (docs/method.md): each label from penalties
and retention built by hand, and the sentence quotes those numbers. Since issue 37 each
label rests on intervals that support it: a change counts above 1% of perplexity, a
retention only when measurable on a gap above that.
"""

from __future__ import annotations

import pytest

from fcaudit.engine.result import ConditionResult, Retention

# ------------------------------------------------------------------------ verdicts

def _cond(delta: float, lo: float, hi: float) -> ConditionResult:
    return ConditionResult(nll=3.0 + delta, delta=delta, ci95=(lo, hi), repeats=[3.0 + delta],
                           repeat_deltas=[delta])


ZERO = (0.0, -0.01, 0.01)  # an interval that holds 0
KEPT_UNDEFINED = Retention(gap=0.0, gap_ci95=(-0.1, 0.1), value=None, ci95=None, defined=False)


def _kept(value: float, lo: float, hi: float, gap: tuple = (0.5, 0.4, 0.6)) -> Retention:
    return Retention(gap=gap[0], gap_ci95=gap[1:], value=value, ci95=(lo, hi), defined=True)


# a share the data do not resolve (the Jamba of issue 37: 11.25% [-166.64, 177.67] of a gap
# clear of 0): metrics.retention gives it no value, and the reason says why
WIDE = ("no measurable share: its 95% interval [-166.64, 177.67]% is wider than the whole "
        "0-100% scale (the Correct-to-GlobalMean gap +0.0010 nats [+0.0002, +0.0018] is too "
        "small against its noise to resolve a share of it)")
KEPT_WIDE = Retention(gap=0.001, gap_ci95=(0.0002, 0.0018), value=None, ci95=None,
                      defined=False, reason=WIDE)
TINY = (0.0001, 0.00005, 0.00015)  # clear of 0, far below 1% of perplexity (0.00995 nats)


# (case, reassign, shuffle, reassign+shuffle, static-layer, static-layer-position, retention,
#  the verdict's label, by hand from the rules in docs/method.md)
VERDICTS = [
    ("all above", (0.3, 0.2, 0.4), (0.25, 0.15, 0.3), (0.5, 0.4, 0.6), (0.2, 0.1, 0.3),
     (0.1, 0.05, 0.2), _kept(30.0, 20.0, 40.0), "Strong dependence"),
    ("some above", (0.02, 0.01, 0.03), ZERO, ZERO, ZERO, ZERO, KEPT_UNDEFINED,
     "Partial dependence"),
    ("above and below", (0.02, 0.01, 0.03), (-0.02, -0.03, -0.01), ZERO, ZERO, ZERO,
     KEPT_UNDEFINED, "Partial dependence"),
    ("weak", (0.01, 0.005, 0.02), (0.01, 0.002, 0.02), ZERO, ZERO, ZERO,
     _kept(95.0, 92.0, 98.0), "Weak dependence"),
    ("only below", (-0.0004, -0.0007, -0.0001), (0.0001, -0.0002, 0.0003), ZERO, ZERO,
     (-0.002, -0.003, -0.001), KEPT_UNDEFINED, "No dependence"),
    ("none excluding 0", ZERO, ZERO, ZERO, ZERO, ZERO, KEPT_UNDEFINED,
     "No measurable dependence"),
    # issue 37: every label rests on intervals that support it
    ("strong by retention alone", (0.02, 0.011, 0.03), ZERO, ZERO, ZERO, ZERO,
     _kept(30.0, 20.0, 40.0), "Strong dependence"),  # its interval below 50%
    ("retention interval reaches 50%", ZERO, ZERO, ZERO, ZERO, ZERO, _kept(45.0, 30.0, 60.0),
     "Partial dependence"),  # before: strong on the point 45% < 50%
    ("retention interval reaches below 90%", (0.01, 0.005, 0.02), (0.01, 0.002, 0.02), ZERO,
     ZERO, ZERO, _kept(92.0, 85.0, 99.0), "Partial dependence"),  # before: weak
    ("a penalty interval reaches 0.05", (0.03, 0.01, 0.06), (0.01, 0.002, 0.02), ZERO, ZERO,
     ZERO, _kept(95.0, 92.0, 98.0), "Partial dependence"),  # before: weak on the point 0.03
    ("a share wider than its scale", (0.0001, -0.0002, 0.0004), ZERO, ZERO, ZERO, ZERO,
     KEPT_WIDE, "No measurable dependence"),  # before: strong on 11.25%
    ("a share of a negligible gap", TINY, TINY, TINY, TINY, TINY,
     _kept(20.0, 10.0, 30.0, TINY), "No measurable dependence"),  # before: strong
    ("a negligible penalty above 0", (0.005, 0.002, 0.008), ZERO, ZERO, ZERO, ZERO,
     KEPT_UNDEFINED, "No measurable dependence"),  # before: partial
    ("a penalty above 1% of perplexity", (0.015, 0.011, 0.02), ZERO, ZERO, ZERO, ZERO,
     KEPT_UNDEFINED, "Partial dependence"),
]


@pytest.mark.parametrize("case, r, s, rs, sl, slp, kept, label", VERDICTS,
                         ids=[v[0] for v in VERDICTS])
def test_each_dependence_verdict_follows_its_rule(case: str, r: tuple, s: tuple, rs: tuple,
                                                  sl: tuple, slp: tuple, kept: Retention,
                                                  label: str) -> None:
    from fcaudit.engine.verdicts import dependence_part
    conditions = {name: _cond(*c) for name, c in (
        ("reassign", r), ("shuffle", s), ("reassign+shuffle", rs), ("static-layer", sl),
        ("static-layer-position", slp), ("static-layer-token", ZERO))}
    sentence = dependence_part(conditions, {"static-layer": kept}).sentence
    assert sentence.startswith(label + " on the coefficient assignment"), sentence
    numbers = (f"reassigning coefficients across inputs costs {r[0]:+.4f} nats [{r[1]:+.4f}, "
               f"{r[2]:+.4f}], shuffling them across tokens {s[0]:+.4f} [{s[1]:+.4f}, "
               f"{s[2]:+.4f}]")
    assert numbers in sentence
    if case == "only below":  # what was seen, said as it is: an intervention that helps
        assert sentence.startswith(
            "No dependence on the coefficient assignment (no penalty's 95% interval lies above "
            "1% of perplexity, and reassigning coefficients across inputs lowers the NLL by "
            "0.0004 nats "
            "[0.0001, 0.0007]; a static per-layer-and-position profile lowers the NLL by "
            "0.0020 nats [0.0010, 0.0030]: the model does not need its coefficients matched to "
            "their input and token)"), sentence
    assert (label.startswith("No")) == sentence.startswith("No ")
    if label == "No measurable dependence":  # why, in the sentence
        assert "(no penalty's 95% interval lies above 1% of perplexity or below 0, and no " \
               "retention of a measurable gap: none found, or too few sequences to resolve " \
               "one)" in sentence
    if case == "a share wider than its scale":
        assert sentence.endswith(f"; static-profile retention is undefined ({WIDE}).")
    if case == "a share of a negligible gap":
        assert sentence.endswith(
            "; a static per-layer profile keeps 20.00% [10.00, 30.00] of the Correct-to-"
            "GlobalMean gap, but that gap, 0.0001 nats [5e-05, 0.00015], does not lie above 1% "
            "of perplexity (0.00995 nats): too small for its share to make a label.")
