"""The reproduction study: aggregation, findings, resumption, the rendered report."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess

import pytest
import torch
from conftest import chromium, make_mudd_folder

from fcaudit.io.loading import get_arch
from fcaudit.io.outdir import output_kind
from fcaudit.study import paper
from fcaudit.study.presets import STUDY_PRESETS, study
from fcaudit.study.reproduce import StudySettings, aggregate, reproduce, study_options


def test_aggregate_mean_sd_range_skips_nulls():
    agg = aggregate([{"a": 1.0, "b": None}, {"a": 3.0, "b": 2.0}, {"a": 2.0, "b": None}])
    assert agg["a"] == {"n": 3, "mean": 2.0, "sd": 1.0, "min": 1.0, "max": 3.0}
    assert agg["b"] == {"n": 1, "mean": 2.0, "sd": None, "min": 2.0, "max": 2.0}


@pytest.mark.parametrize("preset", STUDY_PRESETS)
def test_study_presets_name_groups_the_model_registry_can_build(preset: str):
    """Every group (and its dense twin) is an architecture and size the model registry
    knows, group names (run folders) are distinct, and ``--seeds`` sets every group's seed
    count but a single-seed control's (SkipGate in ``tiny``)."""
    groups = study(preset, None)
    assert groups and len({g.name for g in groups}) == len(groups)
    for group in groups:
        assert group.seeds >= 1
        for arch in filter(None, (group.arch, group.dense_arch)):
            get_arch(arch).config(group.preset)  # refuses an unknown arch or size
    assert [g.seeds for g in study(preset, 5)] == [1 if g.seeds == 1 else 5 for g in groups]


def test_paper_study_trains_the_papers_sizes_with_its_seeds():
    """The paper preset is FeatureGate at the sizes and seed counts the paper reports
    (fcaudit.study.paper): parameter counts within 3% of the paper's."""
    groups = study("paper", None)
    assert {g.arch for g in groups} == {"featuregate"}
    assert {g.preset.upper(): g.seeds for g in groups} == paper.RETENTION_SEEDS
    for group in groups:
        arch = get_arch(group.arch)
        with torch.device("meta"):
            model = arch.build(arch.config(group.preset))
        n_params = sum(p.numel() for p in model.parameters())
        assert n_params == pytest.approx(paper.PARAMS[group.preset.upper()], rel=0.03)


@pytest.fixture(scope="module")
def small_study(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("study")
    settings = StudySettings(study_options(repeats=1, bootstrap=50, batch_size=4, per_layer=False,
                                           timing_pairs=0, progress=False),
                             steps=3, max_eval=6, max_calib=4)
    checkpoint = str(make_mudd_folder(tmp_path_factory.mktemp("checkpoint")))
    result = reproduce("tiny", out, seeds=1, settings=settings, mudd_checkpoint=checkpoint)
    return out, settings, result, checkpoint


def test_study_writes_tables_and_resumes(small_study):
    out, settings, result, checkpoint = small_study
    assert set(result["groups"]) == {"featuregate-tiny", "mudd-tiny", "moe-tiny",
                                     "skipgate-tiny", "mudd-checkpoint"}
    moe = result["groups"]["moe-tiny"]["aggregate"]
    assert moe["experts_executed_fraction"]["mean"] == 0.25  # 2 of 8 experts per token
    text = (out / "reproduction.md").read_text()
    assert "Findings at this scale" in text and "98.70%" in text
    assert "[[" not in text and "]]" not in text  # each interval in its own brackets only
    assert json.loads((out / "reproduction.json").read_text())["schema"] == \
        "fcaudit.reproduction/1"
    assert any((out / "figures").glob("study_penalties.svg"))
    stamps = {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("model.safetensors")}
    again = reproduce("tiny", out, seeds=1, settings=settings, mudd_checkpoint=checkpoint)
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps  # nothing retrained
    assert output_kind(out) == "study" and not (out / ".previous").exists()  # replaced whole
    assert again["groups"]["featuregate-tiny"]["aggregate"] == \
        result["groups"]["featuregate-tiny"]["aggregate"]


def test_reproduction_html_renders_in_chromium(small_study, tmp_path):
    browser = chromium()
    if browser is None:
        pytest.skip("chromium not installed (apt-get install -y chromium); render check skipped")
    out = small_study[0]
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                          "--disable-background-networking", "--disable-component-update",
                          "--no-first-run", f"--user-data-dir={tmp_path}", "--dump-dom",
                          (out / "report.html").resolve().as_uri()],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "Findings at this scale" in dom and dom.count("<img") >= 4


def test_study_reports_static_layer_token_and_the_token_id_share(small_study):
    """Every audited controller kind gets the static-layer-token rows, from its audits."""
    out, _, result, _ = small_study
    text = (out / "reproduction.md").read_text()
    for label in ("retention: static-layer-token", "penalty: static-layer-token",
                  "token-id share of within-layer variance"):
        assert label in text
    for name, label in (("featuregate-tiny", "FeatureGate"), ("mudd-tiny", "MUDD"),
                        ("moe-tiny", "MoE")):
        (seed,) = result["groups"][name]["per_seed"]  # one seed: its audit.json's numbers
        written = json.loads((out / "audits" / f"{name}-s0" / "audit.json").read_text())
        family = written["sites"][0]["family"]
        assert seed["retention_static_layer_token"] == \
            written["retention"]["static-layer-token"]["value"]
        assert seed["delta_static-layer-token"] == \
            written["conditions"]["static-layer-token"]["delta"]
        assert seed["eta2_token_id"] == written["variance"][family]["eta2_token_id"]
        assert f"{label}: a static profile per (layer, token id)" in text
    (moe,) = result["groups"]["moe-tiny"]["per_seed"]
    written = json.loads((out / "audits" / "moe-tiny-s0" / "audit.json").read_text())
    assert moe["rerouted_static-layer-token"] == \
        written["routing"]["moe"]["changed"]["static-layer-token"]


def test_the_study_runs_the_frontier_where_a_family_has_one(small_study):
    """The study's audits (as `fcaudit reproduce` sets them) run the savings frontier for
    soft gates and routers, and each seed's frontier gap is its audit.json's."""
    out, _, result, _ = small_study
    for name, covered in (("featuregate-tiny", True), ("moe-tiny", True), ("mudd-tiny", False),
                          ("skipgate-tiny", True)):
        written = json.loads((out / "audits" / f"{name}-s0" / "audit.json").read_text())
        assert written["settings"]["frontier"] is covered, name  # unset: ran where it can
        family = written["sites"][0]["family"]
        frontier = written.get("frontier") or {}
        assert (family in frontier) is covered, name
        (seed,) = result["groups"][name]["per_seed"]
        gap = frontier.get(family, {}).get("gap_at_25")
        assert seed["frontier_gap_25"] == (gap["value"] if gap else None), name


def test_a_resumed_study_reaudits_with_its_own_options(small_study, tmp_path):
    """A finished audit is not taken as it is when the study's options changed (before: a
    study resumed with the frontier on kept audits made without it)."""
    out, settings, _, checkpoint = small_study
    copy = tmp_path / "study"
    shutil.copytree(out, copy)
    off = dataclasses.replace(settings, options=dataclasses.replace(settings.options,
                                                                    frontier=False))
    result = reproduce("tiny", copy, seeds=1, settings=off, mudd_checkpoint=checkpoint)
    for name in ("featuregate-tiny", "moe-tiny"):
        written = json.loads((copy / "audits" / f"{name}-s0" / "audit.json").read_text())
        assert written["settings"]["frontier"] is False and "frontier" not in written, name
        (seed,) = result["groups"][name]["per_seed"]
        assert seed["frontier_gap_25"] is None, name
