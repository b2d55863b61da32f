"""``fcaudit reproduce --preset exit``: the early-exit LM, the ponder model and the digits
early-exit classifier with their full-depth twins, on a tiny setting (3 training steps, 2
seeds): the runs, the twins' scores, each table cell against the mean over the seeds'
audit.json and the span of their intervals (computed here), the findings."""

from __future__ import annotations

import json
import math

import pytest

from fcaudit.study.reproduce import StudySettings, reproduce, study, study_options

SEEDS = 2
TWINS = {"earlyexit": "dense", "ponder": "dense-ponder", "branchy": "dense-cnn"}
RUNS = {f"{family}-tiny-s{seed}": f"{twin}-tiny-s{seed}"
        for family, twin in TWINS.items() for seed in range(SEEDS)}
LABELS = {"earlyexit": "early-exit LM", "ponder": "ponder (PonderNet)",
          "branchy": "digits (BranchyNet)"}


@pytest.fixture(scope="module")
def exit_study(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("exit-study")
    settings = StudySettings(study_options(repeats=1, bootstrap=50, batch_size=8,
                                           per_layer=False, timing_pairs=0, progress=False),
                             steps=3, max_eval=8, max_calib=8)
    return out, reproduce("exit", out, seeds=SEEDS, settings=settings)


def test_exit_preset_groups():
    groups = {g.name: (g.seeds, g.dense_arch) for g in study("exit", None)}
    assert groups == {"earlyexit-tiny": (3, "dense"), "ponder-tiny": (3, "dense-ponder"),
                      "branchy-tiny": (3, "dense-cnn")}


def _read(path):
    return json.loads(path.read_text())


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _spanned(estimates: list[dict], spec: str, unit: str = "") -> str:
    """The mean of the seeds' values and the span of their intervals (lowest low to
    highest high), as the table writes them."""
    lo = min(e["ci95"][0] for e in estimates)
    hi = max(e["ci95"][1] for e in estimates)
    return f"{_mean([e['value'] for e in estimates]):{spec}}{unit} [{lo:{spec}}, {hi:{spec}}]"


def _shares(estimates: list[dict], undefined: str) -> str:
    """Shares in percent over the seeds where defined, with how many are not."""
    defined = [e for e in estimates if e["value"] is not None]
    if not defined:
        return undefined
    missing = len(estimates) - len(defined)
    return _spanned(defined, ".1f", "%") + \
        (f" ({missing} of {len(estimates)} seeds undefined)" if missing else "")


def _check_row(row: dict, audits: list[dict], twins: list[dict]) -> None:
    """Every cell of a family's row from its seeds' audit.json and twin configs."""
    assert row["seeds"] == str(SEEDS) == str(len(audits))
    # the seeds trained different models: a mean over them is not one seed's number
    assert len({a["conditions"]["correct"]["nll"] for a in audits}) == SEEDS
    e = [a["exits"] for a in audits]
    assert len({x["depth"] for x in e}) == 1
    assert row["mean executed depth"] == (
        f"{_mean([x['evaluation_mean_depth'] for x in e]):.2f} of {e[0]['depth']} "
        f"(oracle {_mean([x['oracle_mean_depth'] for x in e]):.2f})")
    for condition in ("fixed-exit", "oracle-exit"):
        found = [a["conditions"][condition] for a in audits]
        assert row[condition] == _spanned([{"value": c["delta"], "ci95": c["ci95"]}
                                           for c in found], "+.3f")
    assert row["share of fixed-to-oracle gap closed"] == _shares(
        [x["gap_closed"] for x in e], "undefined (no clear fixed-to-oracle gap)")
    assert row["static-layer retention"] == _shares(
        [a["retention"]["static-layer"] for a in audits], "undefined (no clear gap)")
    assert row["fixed − learned at matched depth"] == _spanned(
        [x["frontier"]["matched_depth"]["gap"] for x in e], "+.3f")
    results = [t["results"] for t in twins]
    if "eval_accuracy" in results[0]:
        accuracy = _mean([a["conditions"]["correct"]["accuracy"] for a in audits])
        twin = _mean([r["eval_accuracy"] for r in results])
        assert row["score (twin)"] == f"accuracy {accuracy:.3f} (twin {twin:.3f})"
    else:
        nll = _mean([a["conditions"]["correct"]["nll"] for a in audits])
        assert row["score (twin)"] == \
            f"NLL {nll:.3f} (twin {_mean([r['eval_nll'] for r in results]):.3f})"
    flops = _mean([a["execution"]["flops_per_token"] / a["execution"]["dense_flops_per_token"]
                   for a in audits])
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
    for family, twin in TWINS.items():
        seeds = range(SEEDS)
        _check_row(rows[LABELS[family]],
                   [_read(out / "audits" / f"{family}-tiny-s{s}" / "audit.json") for s in seeds],
                   [_read(out / "runs" / f"{twin}-tiny-s{s}" / "config.json") for s in seeds])
    for run in RUNS:
        audit = _read(out / "audits" / run / "audit.json")
        assert audit["identity_replay_max_abs_diff"] == 0.0
        m = audit["exits"]["frontier"]["matched_depth"]
        depth = audit["exits"]["evaluation_mean_depth"]
        assert m["mean_depth"] == pytest.approx(depth)
        assert m["fixed_depths"] == sorted({math.floor(depth), math.ceil(depth)})
    findings = dict(result["findings"])
    assert len(findings) == 6  # per family: matched depth, computing less than the twin
    assert all(v.startswith(("holds", "does not hold")) for v in findings.values())
    text = (out / "reproduction.md").read_text()
    assert "Early exit and adaptive depth against their full-depth twins" in text
