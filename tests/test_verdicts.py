"""The dependence verdict follows its rules (docs/method.md): each label from penalties
and retention built by hand, and the sentence quotes those numbers.
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


def _kept(value: float, lo: float, hi: float) -> Retention:
    return Retention(gap=0.5, gap_ci95=(0.4, 0.6), value=value, ci95=(lo, hi), defined=True)


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
]


@pytest.mark.parametrize("case, r, s, rs, sl, slp, kept, label", VERDICTS,
                         ids=[v[0] for v in VERDICTS])
def test_each_dependence_verdict_follows_its_rule(case: str, r: tuple, s: tuple, rs: tuple,
                                                  sl: tuple, slp: tuple, kept: Retention,
                                                  label: str) -> None:
    from fcaudit.engine.verdicts import dependence
    conditions = {name: _cond(*c) for name, c in (
        ("reassign", r), ("shuffle", s), ("reassign+shuffle", rs), ("static-layer", sl),
        ("static-layer-position", slp), ("static-layer-token", ZERO))}
    sentence = dependence(conditions, {"static-layer": kept})
    assert sentence.startswith(label + " on the coefficient assignment"), sentence
    numbers = (f"reassigning coefficients across inputs costs {r[0]:+.4f} nats [{r[1]:+.4f}, "
               f"{r[2]:+.4f}], shuffling them across tokens {s[0]:+.4f} [{s[1]:+.4f}, "
               f"{s[2]:+.4f}]")
    assert numbers in sentence
    if case == "only below":  # what was seen, said as it is: an intervention that helps
        assert sentence.startswith(
            "No dependence on the coefficient assignment (no penalty's 95% interval lies above "
            "0, and reassigning coefficients across inputs lowers the NLL by 0.0004 nats "
            "[0.0001, 0.0007]; a static per-layer-and-position profile lowers the NLL by "
            "0.0020 nats [0.0010, 0.0030]: the model does not need its coefficients matched to "
            "their input and token)"), sentence
    assert (case in ("only below", "none excluding 0")) == sentence.startswith("No ")
