"""``fcaudit reproduce --preset fold``: each family's seed folded, timed and healed, on a
tiny setting (3 training steps, 1 seed): every table cell against the fold's own record
in the folded run folder and the seed's audit.json (read here), and the findings."""

from __future__ import annotations

import json

import pytest

from fcaudit.study.reproduce import StudySettings, reproduce, study, study_options

FOLDED = {"featuregate-tiny": "static-layer", "moe-tiny": "static-layer-token",
          "mamba-tiny": "static-layer", "earlyexit-tiny": "fixed-exit",
          "mamba-selective-copy-tiny": "static-layer"}
LABELS = {"featuregate-tiny": "FeatureGate", "moe-tiny": "MoE", "mamba-tiny": "Mamba",
          "earlyexit-tiny": "early-exit LM", "mamba-selective-copy-tiny": "Mamba"}


@pytest.fixture(scope="module")
def fold_study(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("fold-study")
    settings = StudySettings(study_options(repeats=1, bootstrap=50, batch_size=8,
                                           per_layer=False, timing_pairs=10, progress=False),
                             steps=3, max_eval=8, max_calib=8)
    return out, reproduce("fold", out, seeds=1, settings=settings)


def test_fold_preset_groups():
    groups = {g.name: (g.fold, g.heal, g.dense_arch) for g in study("fold", None)}
    assert groups == {name: (condition, 100, None) for name, condition in FOLDED.items()}


def _read(path):
    return json.loads(path.read_text())


def _spanned(value: float, lo: float, hi: float, spec: str, unit: str = "") -> str:
    return f"{value:{spec}}{unit} [{lo:{spec}}, {hi:{spec}}]"


def test_every_cell_is_the_fold_s_own_record(fold_study):
    out, summary = fold_study
    rows = summary["fold"]
    assert len(rows) == len(FOLDED)
    for row, (name, condition) in zip(rows, FOLDED.items(), strict=True):
        assert row["family, condition folded"].startswith(LABELS[name])
        assert condition in row["family, condition folded"]
        audit = _read(out / "audits" / f"{name}-s0" / "audit.json")
        c = audit["conditions"][condition]
        assert row["penalty in the audit"] == _spanned(c["delta"], *c["ci95"], "+.3f")
        fold = _read(out / "runs" / f"{name}-s0-{condition}" / "config.json")["fold"]
        assert row["largest loss difference"] == f"{fold['exactness']['max_abs_diff']:.2g}"
        assert fold["exactness"]["max_abs_diff"] <= 1e-4
        speed = fold["vs_original"]["latency_ratio"]
        assert row["latency / original"] == _spanned(speed["value"], *speed["ci95"], ".3f")
        assert row["FLOPs / original"] == f"{fold['vs_original']['flops_ratio']:.3f}"
        healed = summary["groups"][name]["per_seed"][0]
        assert healed["heal_steps"] == 3
        assert row["penalty before healing"] == _spanned(
            healed["heal_before"], healed["heal_before_lo"], healed["heal_before_hi"], "+.4f")
        # a task run heals on its task: the task's accuracy before and after, its control's
        accuracies = [healed.get(k) for k in ("heal_accuracy_before", "heal_accuracy_after",
                                              "heal_control_accuracy")]
        if "selective" in name:
            assert all(0.0 <= a <= 1.0 for a in accuracies), accuracies
        else:
            assert accuracies == [None, None, None]
    claims = [claim for claim, _ in summary["findings"]]
    assert any("time-invariant fold runs faster" in c for c in claims)
    assert any("planted truth" in c for c in claims)
    assert any("Healing does not make the time-invariant fold pass" in c for c in claims)
    assert (out / "reproduction.md").read_text().count("| ") > 0
