"""Accuracy retention: for objectives with an accuracy, each static profile's share of
the correct-to-global-mean gap on accuracy, ``(acc(P) - acc(G)) / (acc(C) - acc(G))``,
beside its loss retention (audit.json ``retention[P].accuracy``, metrics
``accuracy_retention_<profile>``, report.md's retention table).

The toy (tests/token_gate_toys.py) predicts a class from its two token gates; every
condition's feed is computed here with numpy from the calibration set, so each example's
hit under each condition is known without the model, and the targets are chosen to set
the accuracies. The interval is the percentile bootstrap of the same resample stream,
drawn here with numpy."""

from __future__ import annotations

import json

import numpy as np
import pytest
import token_gate_toys as tg
import toys
from conftest import run_inprocess

import fcaudit
from fcaudit import AuditData, AuditOptions
from fcaudit.engine.metrics import Bootstrap, accuracy_retention
from fcaudit.engine.options import SeedPlan

# 160 examples resolve the static profiles' shares (intervals under 100 points wide); 48
# do not (tested below: such a share has no value)
N, RESAMPLES, SEED = 160, 400, 0
FAST = dict(objective="classification", bootstrap=RESAMPLES, repeats=1, execution=False,
            progress=False, batch_size=16, per_layer=False, seed=SEED)
STATIC = ("static-layer", "static-layer-position", "static-layer-token")


def predictions(ev: np.ndarray) -> dict[str, np.ndarray]:
    """Each condition's predicted class per example, from its feed computed by hand."""
    g = tg.gates(ev)
    calib = tg.gates(tg.CALIBRATION)
    layer = [np.full_like(x, c.mean()) for x, c in zip(g, calib, strict=True)]
    position = [np.broadcast_to(c.mean(0), x.shape) for x, c in zip(g, calib, strict=True)]
    grand = np.mean([c.mean() for c in calib])  # both sites hold as many values
    # calibration sees every id and gate values are functions of the id: its profile is g
    assert set(np.unique(tg.CALIBRATION)) == set(range(tg.V))
    return {"correct": tg.classes(*g), "static-layer": tg.classes(*layer),
            "static-layer-position": tg.classes(*position),
            "static-layer-token": tg.classes(*g),
            "global-mean": tg.classes(np.full_like(g[0], grand), np.full_like(g[1], grand))}


def by_hand(hits: dict[str, np.ndarray], profile: str) -> tuple[float, list[float], float]:
    """(retention %, its percentile interval, the accuracy gap) from per-example hits."""
    c, g, p = hits["correct"], hits["global-mean"], hits[profile]
    rng = np.random.default_rng(SeedPlan(SEED).bootstrap)
    idx = rng.integers(0, len(c), size=(RESAMPLES, len(c)))  # the paired resamples
    samples = 100.0 * (p - g)[idx].mean(1) / (c - g)[idx].mean(1)
    lo, hi = np.percentile(samples, [2.5, 97.5])
    return 100.0 * (p.mean() - g.mean()) / (c.mean() - g.mean()), [lo, hi], \
        c.mean() - g.mean()


def flipped_targets(ev: np.ndarray) -> np.ndarray:
    """The correct prediction, except every 4th example it calls 1 is called 0."""
    targets = predictions(ev)["correct"].copy()
    targets[np.flatnonzero(targets == 1)[::4]] = 0
    return targets


def audit(targets: np.ndarray, out=None, n: int = N):
    ev = tg.evaluation(n, 3)
    return fcaudit.audit(tg.classifier(), out, sites=["gates.*"],
                         data=AuditData(inputs=ev, targets=targets,
                                        calib_inputs=tg.CALIBRATION),
                         options=AuditOptions(**FAST))


def test_accuracy_retention_matches_the_hits_by_hand(tmp_path) -> None:
    """Targets: the correct prediction, except every 4th example it calls 1 (which gets
    0): correct is right on all but those, global-mean (class 1 for all) on the rest of
    class 1, the static per-layer and per-position profiles (class 0 for all) on every
    target 0, and the per-token profile on what correct is."""
    ev = tg.evaluation(N, 3)
    pred = predictions(ev)
    targets = flipped_targets(ev)
    flipped = np.flatnonzero(targets != pred["correct"])
    hits = {k: (v == targets).astype(np.float64) for k, v in pred.items()}
    assert hits["correct"].sum() == N - len(flipped)
    assert hits["correct"].sum() - hits["global-mean"].sum() == (pred["correct"] == 0).sum()
    assert set(pred["static-layer"]) == {0} and set(pred["global-mean"]) == {1}
    r = audit(targets, tmp_path / "a")
    for name in ("correct", "global-mean", *STATIC):
        assert r.conditions[name].accuracy == pytest.approx(hits[name].mean(), abs=1e-12)
    metrics, intervals = r.metrics(), r.metric_intervals()
    for profile in STATIC:
        value, ci, gap = by_hand(hits, profile)
        assert ci[1] - ci[0] <= 100  # measurable: the share is resolved on its scale
        acc = r.retention[profile].accuracy
        assert acc is not None and acc.defined
        assert acc.value == pytest.approx(value, rel=1e-12)
        assert acc.ci95 == pytest.approx(ci, rel=1e-12)
        assert acc.gap == pytest.approx(gap, rel=1e-12)
        key = "accuracy_retention_" + profile.replace("-", "_")
        assert metrics[key] == acc.value and intervals[key] == acc.ci95
    assert r.retention["static-layer-token"].accuracy.value == pytest.approx(100.0)
    written = json.loads((tmp_path / "a" / "audit.json").read_text())["retention"]
    assert written["static-layer"]["accuracy"]["value"] == pytest.approx(
        by_hand(hits, "static-layer")[0], rel=1e-12)
    report = (tmp_path / "a" / "report.md").read_text()
    assert "| profile | retention | 95% CI | gap (nats) [95% CI] | accuracy retention |" \
        in report


def test_a_share_wider_than_its_scale_has_no_value() -> None:
    """The same targets on 48 examples: the accuracy gap is clear (its interval above 0),
    but the static per-layer profile's share, by hand, has a 95% interval over 100
    percentage points wide (from keeping less than nothing to most of the gap): not
    measurable, so no value, and the reason quotes that interval. The per-token profile
    keeps exactly 100% in every resample, and keeps its value."""
    n = 48
    ev = tg.evaluation(n, 3)
    targets = flipped_targets(ev)
    hits = {k: (v == targets).astype(np.float64) for k, v in predictions(ev).items()}
    r = audit(targets, n=n)
    for profile in STATIC:
        value, ci, gap = by_hand(hits, profile)
        acc = r.retention[profile].accuracy
        assert acc.gap == pytest.approx(gap, rel=1e-12) and acc.gap_ci95[0] > 0
        if ci[1] - ci[0] > 100:
            assert profile != "static-layer-token"
            assert (acc.value, acc.ci95, acc.defined) == (None, None, False)
            assert acc.reason.startswith(f"no measurable share: its 95% interval "
                                         f"[{ci[0]:.2f}, {ci[1]:.2f}]% is wider than the whole "
                                         "0-100% scale"), acc.reason
            assert r.metrics()["accuracy_retention_" + profile.replace("-", "_")] is None
        else:
            assert profile == "static-layer-token" and acc.value == pytest.approx(100.0)


def test_undefined_when_the_accuracy_gap_interval_includes_zero() -> None:
    """Targets 1 (what global-mean predicts) except on the examples correct calls 0:
    there k+1 of them have target 0 and k target 1, so correct beats global-mean on one
    example net, a gap of 1/N whose bootstrap interval reaches 0: no number."""
    ev = tg.evaluation(N, 3)
    pred = predictions(ev)
    zeros = np.flatnonzero(pred["correct"] == 0)
    k = (len(zeros) - 1) // 2
    targets = np.ones(N, np.int64)
    targets[zeros[:k + 1]] = 0
    hits = {k_: (v == targets).astype(np.float64) for k_, v in pred.items()}
    assert hits["correct"].sum() - hits["global-mean"].sum() == 1
    r = audit(targets)
    metrics = r.metrics()
    for profile in STATIC:
        acc = r.retention[profile].accuracy
        assert acc is not None and not acc.defined
        assert acc.value is None and acc.ci95 is None
        assert acc.gap == pytest.approx(1 / N, rel=1e-12) and acc.gap_ci95[0] <= 0
        assert acc.reason.startswith(f"the Correct-to-GlobalMean accuracy gap {1 / N:+.4f} "
                                     "has a 95% interval [")
        assert metrics["accuracy_retention_" + profile.replace("-", "_")] is None


def test_a_gap_exactly_zero_is_undefined_too() -> None:
    """Equal hits everywhere: gap 0, interval [0, 0], no ratio of noise."""
    same = np.array([1.0, 0.0, 1.0, 1.0])
    acc = accuracy_retention(same, same, same, Bootstrap(4, 50, 1))
    assert (acc.value, acc.ci95, acc.defined, acc.gap, acc.gap_ci95) == \
        (None, None, False, 0.0, [0.0, 0.0])


def test_token_nll_audits_have_no_accuracy_retention() -> None:
    """Next-token NLL has no accuracy: no key in audit.json's retention, none in metrics."""
    ids = toys.pair_sequences(8, 8, 0)
    r = fcaudit.audit(toys.content_model(), sites=["gates.*"],
                      data=AuditData(ids, toys.pair_sequences(6, 8, 1)),
                      options=AuditOptions(bootstrap=50, repeats=1, execution=False,
                                           progress=False, per_layer=False))
    assert all(ret.accuracy is None for ret in r.retention.values())
    assert not [k for k in r.metrics() if k.startswith("accuracy_retention")]
    assert all("accuracy" not in row for row in r.to_json()["retention"].values())


def test_the_command_line_summary_prints_it(tmp_path, capsys) -> None:
    """The summary's retention lines end with the accuracy retention and its interval,
    by hand (the same resamples: the default seed, as many)."""
    ev = tg.evaluation(N, 3)
    targets = flipped_targets(ev)
    hits = {k: (v == targets).astype(np.float64) for k, v in predictions(ev).items()}
    value, ci, _ = by_hand(hits, "static-layer")
    for name, arr in (("x", ev), ("y", targets), ("xc", tg.CALIBRATION)):
        np.save(tmp_path / f"{name}.npy", arr)
    res = run_inprocess(["audit", "--model", "token_gate_toys:classifier", "--sites",
                         "gates.*", "--inputs", tmp_path / "x.npy", "--targets",
                         tmp_path / "y.npy", "--calib-inputs", tmp_path / "xc.npy",
                         "--out", tmp_path / "out", "--no-execution", "--repeats", "1",
                         "--bootstrap", str(RESAMPLES), "--no-per-layer"], capsys)
    assert res.returncode == 0, res.stderr
    line = next(li for li in res.stdout.splitlines() if li.startswith("retention static-layer:"))
    assert line.endswith(f"; on accuracy {value:.2f}% [{ci[0]:.2f}, {ci[1]:.2f}]"), line


def test_compare_shows_accuracy_retention_beside_the_loss_retention(tmp_path) -> None:
    """`fcaudit compare` of a classification audit and a token-NLL audit: a row per
    profile of the accuracy retention, each cell equal to the audit.json's (read as plain
    JSON here), a dash where the audit has none (next-token NLL has no accuracy)."""
    audit(flipped_targets(tg.evaluation(N, 3)), tmp_path / "cls")
    fcaudit.audit(toys.content_model(), tmp_path / "nll", sites=["gates.*"],
                  data=AuditData(toys.pair_sequences(8, 8, 0), toys.pair_sequences(6, 8, 1)),
                  options=AuditOptions(bootstrap=50, repeats=1, execution=False,
                                       progress=False, per_layer=False), report=False)
    fcaudit.compare([tmp_path / "cls", tmp_path / "nll"], tmp_path / "cmp",
                    allow_different_data=True)
    rows = {q["name"]: q["models"] for q in json.loads(
        (tmp_path / "cmp" / "compare.json").read_text())["tables"]["quantities"]
        if q["kind"] == "accuracy retention"}
    written = json.loads((tmp_path / "cls" / "audit.json").read_text())["retention"]
    assert set(rows) == set(STATIC)
    md = (tmp_path / "cmp" / "compare.md").read_text()
    for profile in STATIC:
        acc = written[profile]["accuracy"]
        assert rows[profile]["cls"]["value"] == acc["value"]
        assert rows[profile]["cls"]["ci95"] == acc["ci95"]
        assert rows[profile]["nll"] is None
        line = next(li for li in md.splitlines()
                    if li.startswith(f"| retention `{profile}` on accuracy |"))
        assert f"{acc['value']:.2f}%" in line and line.rstrip(" |").endswith("—")
