"""Issue 37: a dependence label rests on its intervals, end to end.

Two audits whose every number is derived here with numpy, without the code under test:

* the content toy with its logits scaled to 0.01: every sequence gains the same tiny
  amount from its gates, so the Correct-to-GlobalMean gap is clear of 0 yet below 1% of
  perplexity, and a static profile keeps little of it (before: "strong" on a 0.005-nat
  gap, as a random Mamba got on 0.0001 nats; now unresolved, and the sentence says the
  gap is too small); NLLs are float32, so the numbers agree to its rounding;
* the token-gate classifier on 48 examples: the gap is clear of 0 but the static per-layer
  profile's share has a 95% interval over 1,000 percentage points wide (before: a number
  behind the label; now undefined, with the same reason in audit.json, the report, the
  comparison, the command-line summary and metrics()).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import token_gate_toys as tg
import toys
from conftest import toy_data

import fcaudit
from fcaudit import AuditData, AuditOptions
from fcaudit.engine.options import SeedPlan
from fcaudit.engine.verdicts import NEGLIGIBLE

RESAMPLES, SEED = 400, 0
OPTIONS = dict(bootstrap=RESAMPLES, repeats=1, execution=False, progress=False,
               per_layer=False, seed=SEED)


def percentile_share(kept: np.ndarray, gap: np.ndarray) -> list[float]:
    """The 95% percentile interval of ``100 * mean(kept) / mean(gap)`` over the audit's
    paired resamples (its seed, one index matrix), drawn here with numpy."""
    idx = np.random.default_rng(SeedPlan(SEED).bootstrap).integers(
        0, len(gap), size=(RESAMPLES, len(gap)))
    with np.errstate(divide="ignore", invalid="ignore"):
        samples = 100.0 * kept[idx].mean(1) / gap[idx].mean(1)
    return list(np.percentile(samples[~np.isnan(samples)], [2.5, 97.5]))


def log_softmax_nll(logits: np.ndarray, target: np.ndarray) -> np.ndarray:
    top = logits.max(-1, keepdims=True)
    lse = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[..., 0]
    return lse - np.take_along_axis(logits, target[..., None], -1)[..., 0]


# --------------------------------------------------------- a clear but negligible gap

SCALE = 0.01


def content_nll(gates: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The content toy's per-sequence NLL when both gates are fed ``gates [N, T, V]``:
    logits ``SCALE * roll(gates, 1)`` at even positions, 0 at odd ones, next-token targets."""
    logits = SCALE * np.roll(gates, 1, axis=-1)
    logits[:, 1::2] = 0.0
    return log_softmax_nll(logits[:, :-1], ids[:, 1:]).mean(1)


def test_a_clear_gap_below_one_percent_of_perplexity_makes_no_label(tmp_path) -> None:
    model = toys.content_model()
    model.scale.data.fill_(SCALE)
    data = toy_data()
    result = fcaudit.audit(model, tmp_path / "out", sites=["gates.*"], data=data,
                           options=AuditOptions(**OPTIONS))
    ids, calib = data.eval_ids, data.calib_ids
    one_hot = np.eye(toys.V)[ids]
    correct = content_nll(one_hot, ids)
    floor = content_nll(np.full(one_hot.shape, 1 / toys.V), ids)  # one mean: 1 / V
    layer = np.broadcast_to(np.eye(toys.V)[calib].mean((0, 1)), one_hot.shape)
    static = content_nll(layer.copy(), ids)
    sl = result.retention["static-layer"]
    # the tiny gap is the same on every sequence: its interval is clear of 0
    assert sl.gap == pytest.approx((floor - correct).mean(), abs=2e-6)
    assert sl.gap_ci95[0] > 0 and sl.gap_ci95[1] < NEGLIGIBLE
    assert sl.value == pytest.approx(100 * (floor - static).mean() / (floor - correct).mean(),
                                     abs=0.1)
    assert sl.ci95 == pytest.approx(percentile_share(floor - static, floor - correct), abs=0.1)
    assert sl.ci95[1] < 50  # before issue 37 this made "strong"
    assert all(c.ci95[1] < NEGLIGIBLE for c in result.conditions.values())
    assert result.verdict.dependence_label == "unresolved"
    said = result.verdict.dependence
    assert said.startswith("No measurable dependence on the coefficient assignment (no "
                           "penalty's 95% interval lies above 1% of perplexity or below 0")
    assert said.endswith(f"of the Correct-to-GlobalMean gap, but that gap, {sl.gap:.3g} nats "
                         f"[{sl.gap_ci95[0]:.3g}, {sl.gap_ci95[1]:.3g}], does not lie above 1% "
                         "of perplexity (0.00995 nats): too small for its share to make a "
                         "label.")
    numbers = result.verdict_parts()["dependence"].numbers
    assert (numbers["delta_global-mean"], numbers["delta_global-mean_ci_low"]) == \
        (sl.gap, sl.gap_ci95[0])  # the gap the label did not rest on, beside the share


# ------------------------------------------------------- a share wider than its scale

N_WIDE = 48


def classifier_losses(ev: np.ndarray, targets: np.ndarray) -> dict[str, np.ndarray]:
    """Each example's cross-entropy under correct, static-layer and global-mean, from the
    gates each feeds (computed from the calibration set): logits ``[sum(g0 - g1), BIAS]``."""
    g = tg.gates(ev)
    calib = tg.gates(tg.CALIBRATION)
    grand = np.mean([c.mean() for c in calib])  # both sites hold as many values
    feeds = {"correct": g, "static-layer": [np.full_like(x, c.mean()) for x, c in
                                            zip(g, calib, strict=True)],
             "global-mean": [np.full_like(x, grand) for x in g]}
    out = {}
    for name, (g0, g1) in feeds.items():
        score = (g0 - g1).sum(1)
        logits = np.stack([score, np.full_like(score, tg.BIAS)], 1)
        out[name] = log_softmax_nll(logits, targets)
    return out


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory):
    ev = tg.evaluation(N_WIDE, 3)
    g = tg.gates(ev)
    targets = tg.classes(*g)
    targets[np.flatnonzero(targets == 1)[::4]] = 0  # every 4th class 1 called 0
    out = tmp_path_factory.mktemp("wide") / "out"
    result = fcaudit.audit(tg.classifier(), out, sites=["gates.*"],
                           data=AuditData(inputs=ev, targets=targets,
                                          calib_inputs=tg.CALIBRATION),
                           options=AuditOptions(objective="classification", **OPTIONS))
    loss = classifier_losses(ev, targets)
    floor = loss["global-mean"]
    share = percentile_share(floor - loss["static-layer"], floor - loss["correct"])
    return result, out, share, (floor - loss["correct"]).mean()


def test_a_share_wider_than_its_scale_has_no_value(wide) -> None:
    result, out, share, gap = wide
    sl = result.retention["static-layer"]
    assert sl.gap == pytest.approx(gap, rel=1e-5) and sl.gap_ci95[0] > 0  # a clear gap
    assert share[1] - share[0] > 1000  # by hand: far wider than the 0-100% scale
    assert (sl.value, sl.ci95, sl.defined) == (None, None, False)
    assert sl.reason.startswith(f"no measurable share: its 95% interval [{share[0]:.2f}, "
                                f"{share[1]:.2f}]% is wider than the whole 0-100% scale (the "
                                f"Correct-to-GlobalMean gap {gap:+.4f} nats ["), sl.reason
    written = json.loads((out / "audit.json").read_text())["retention"]["static-layer"]
    assert written["value"] is None and written["ci95"] is None
    assert written["reason"] == sl.reason
    assert result.metrics()["retention_static_layer"] is None
    assert result.metric_intervals()["retention_static_layer"] is None


def test_every_consumer_shows_it_undefined_with_its_reason(wide, capsys) -> None:
    from fcaudit.cli.commands import print_summary
    from fcaudit.report.markdown import md_text
    result, out, _, _ = wide
    reason = result.retention["static-layer"].reason
    report = (out / "report.md").read_text().split("## Gap retention")[1]
    row = next(line for line in report.splitlines() if line.startswith("| `static-layer` |"))
    assert row.startswith("| `static-layer` | undefined | n/a |") and md_text(reason) in row
    capsys.readouterr()
    print_summary(result, out)
    printed = capsys.readouterr().out.splitlines()
    assert f"retention static-layer: undefined ({reason}); on accuracy" in \
        next(line for line in printed if line.startswith("retention static-layer:"))
    comparison = fcaudit.compare([result, result], labels=["a", "b"]).to_markdown()
    assert "| retention `static-layer` |  | undefined | undefined |" in comparison
    # the label rests on the reassign penalty's interval, the sentence says why no share
    assert result.conditions["reassign"].ci95[0] > 0.1
    assert result.verdict.dependence_label == "strong"
    assert result.verdict.dependence.endswith(f"static-profile retention is undefined "
                                              f"({reason}).")
