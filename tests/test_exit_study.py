"""``fcaudit reproduce --preset exit``: the early-exit LM, the ponder model and the digits
early-exit classifier with their full-depth twins, on a tiny setting (3 training steps, 1
seed): the runs, the twins' scores, the table cells against each audit.json, the
findings."""

from __future__ import annotations

import json
import math

import pytest

from fcaudit.study.reproduce import StudySettings, reproduce, study, study_options

RUNS = {"earlyexit-tiny-s0": "dense-tiny-s0", "ponder-tiny-s0": "dense-ponder-tiny-s0",
        "branchy-tiny-s0": "dense-cnn-tiny-s0"}
LABELS = {"earlyexit": "early-exit LM", "ponder": "ponder (PonderNet)",
          "branchy": "digits (BranchyNet)"}


@pytest.fixture(scope="module")
def exit_study(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("exit-study")
    settings = StudySettings(study_options(repeats=1, bootstrap=50, batch_size=8,
                                           per_layer=False, timing_pairs=0, progress=False),
                             steps=3, max_eval=8, max_calib=8)
    return out, reproduce("exit", out, seeds=1, settings=settings)


def test_exit_preset_groups():
    groups = {g.name: (g.seeds, g.dense_arch) for g in study("exit", None)}
    assert groups == {"earlyexit-tiny": (3, "dense"), "ponder-tiny": (3, "dense-ponder"),
                      "branchy-tiny": (3, "dense-cnn")}


def _read(path):
    return json.loads(path.read_text())


def _spanned(value: float, ci: list[float], spec: str, unit: str = "") -> str:
    return f"{value:{spec}}{unit} [{ci[0]:{spec}}, {ci[1]:{spec}}]"


def _check_row(row: dict, audit: dict, twin: dict) -> None:
    e = audit["exits"]
    assert row["mean executed depth"] == (f"{e['evaluation_mean_depth']:.2f} of {e['depth']} "
                                          f"(oracle {e['oracle_mean_depth']:.2f})")
    for condition in ("fixed-exit", "oracle-exit"):
        c = audit["conditions"][condition]
        assert row[condition] == _spanned(c["delta"], c["ci95"], "+.3f")
    share = e["gap_closed"]
    assert row["share of fixed-to-oracle gap closed"] == (
        "undefined (no clear fixed-to-oracle gap)" if share["value"] is None
        else _spanned(share["value"], share["ci95"], ".1f", "%"))
    ret = audit["retention"]["static-layer"]
    assert row["static-layer retention"] == (
        "undefined (no clear gap)" if ret["value"] is None
        else _spanned(ret["value"], ret["ci95"], ".1f", "%"))
    gap = e["frontier"]["matched_depth"]["gap"]
    assert row["fixed − learned at matched depth"] == _spanned(gap["value"], gap["ci95"],
                                                                 "+.3f")
    results = twin["results"]
    if "eval_accuracy" in results:
        assert row["score (twin)"].endswith(f"(twin {results['eval_accuracy']:.3f})")
    else:
        assert row["score (twin)"] == (f"NLL {audit['conditions']['correct']['nll']:.3f} "
                                       f"(twin {results['eval_nll']:.3f})")
    flops = audit["execution"]["flops_per_token"] / audit["execution"]["dense_flops_per_token"]
    assert row["vs twin"].startswith(f"FLOPs {flops:.3f}x")


def test_exit_study_trains_each_twin_and_tabulates(exit_study):
    out, result = exit_study
    runs = {p.name for p in (out / "runs").iterdir() if not p.name.startswith(".")}
    assert runs == set(RUNS) | set(RUNS.values())
    assert _read(out / "runs/dense-ponder-tiny-s0/config.json")["model_config"]["halting"] is False
    rows = {r["family"]: r for r in result["exit"]}
    assert set(rows) == set(LABELS.values())
    for page in ("reproduction.md", "report.html"):  # each interval in its own brackets only
        text = (out / page).read_text(encoding="utf-8")
        assert "[[" not in text and "]]" not in text, page
    for run, twin in RUNS.items():
        audit = _read(out / "audits" / run / "audit.json")
        assert audit["identity_replay_max_abs_diff"] == 0.0
        _check_row(rows[LABELS[run.split("-")[0]]], audit, _read(out / "runs" / twin /
                                                                 "config.json"))
        m = audit["exits"]["frontier"]["matched_depth"]
        depth = audit["exits"]["evaluation_mean_depth"]
        assert m["mean_depth"] == pytest.approx(depth)
        assert m["fixed_depths"] == sorted({math.floor(depth), math.ceil(depth)})
    findings = dict(result["findings"])
    assert len(findings) == 6  # per family: matched depth, computing less than the twin
    assert all(v.startswith(("holds", "does not hold")) for v in findings.values())
    text = (out / "reproduction.md").read_text()
    assert "Early exit and adaptive depth against their full-depth twins" in text
