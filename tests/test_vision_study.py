"""The vision families through the audit (classification on digits) and the
``reproduce --preset vision`` study, on a tiny setting (3 training steps, 1 seed)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import FAST_ARGS, observed_outputs, run_inprocess

import fcaudit
from fcaudit import AuditData, AuditOptions
from fcaudit.io.digits import digits
from fcaudit.models.condconv import CNN, CNNConfig
from fcaudit.models.tokenprune import TokenPruneConfig, TokenPruneViT
from fcaudit.models.vit_moe import ViTMoE, ViTMoEConfig
from fcaudit.study.reproduce import StudySettings, reproduce, study, study_options

NO_POSITION = {"shuffle", "reassign+shuffle", "static-layer-position"}
VIT = dict(n_layer=4, n_head=2, n_embd=16)


def _data(n: int = 24) -> AuditData:
    x, y = digits("eval")
    xc, _ = digits("calib")
    return AuditData(inputs=x[:n], targets=y[:n], calib_inputs=xc[:16])


@pytest.mark.parametrize("make", [lambda: ViTMoE(ViTMoEConfig(**VIT)),
                                  lambda: TokenPruneViT(TokenPruneConfig(**VIT)),
                                  lambda: CNN(CNNConfig(widths=(4, 8), strides=(1, 2)))],
                         ids=["vit-moe", "tokenprune", "condconv"])
def test_each_family_audits_end_to_end_with_exact_identity(make):
    model = make()
    r = fcaudit.audit(model, data=_data(), options=AuditOptions(
        objective="classification", repeats=1, bootstrap=50, batch_size=8, per_layer=False,
        timing_pairs=0, progress=False))
    assert r.identity_replay_max_abs_diff == 0.0 and r.identity is None
    assert r.conditions["correct"].nll == r.conditions["original"].nll
    assert 0.0 <= r.conditions["correct"].accuracy <= 1.0
    sites = model.controller_sites()
    assert [s.name for s in r.sites] == [s.name for s in sites]
    for got, site in zip(r.sites, sites, strict=True):
        assert (tuple(got.axes), tuple(got.positions)) == (site.axes, site.positions)
    ex = r.execution
    if isinstance(model, CNN):  # per-example weights: no position axis, and dense execution
        assert set(r.not_applicable) >= NO_POSITION and not NO_POSITION & set(r.conditions)
        assert ex.flops_ratio > 1.0 and ex.blocks_executed == ex.blocks_present
    elif isinstance(model, ViTMoE):  # 2 of 8 experts run per patch token and layer
        assert ex.experts.experts_per_token_summed_over_layers == 2 * 4
        assert ex.experts.experts_present_summed_over_layers == 8 * 4
    else:  # blocks 0, 1 on 16 patches, blocks 2, 3 on the 8 kept ones
        assert ex.positions_per_block == [16.0, 16.0, 8.0, 8.0]
        assert ex.dense_positions_per_block == [16.0] * 4
        assert ex.flops_ratio < 1.0


@pytest.fixture(scope="module")
def vision_study(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("vision-study")
    settings = StudySettings(study_options(repeats=1, bootstrap=50, batch_size=16,
                                           per_layer=False, timing_pairs=0, progress=False),
                             steps=3, max_eval=24, max_calib=16)
    return out, reproduce("vision", out, seeds=1, settings=settings)


def test_vision_preset_groups():
    groups = {g.name: (g.seeds, g.dense_arch) for g in study("vision", None)}
    assert groups == {"vit-moe-tiny": (3, "dense-vit"), "tokenprune-tiny": (3, "dense-vit"),
                      "condconv-tiny": (3, "dense-cnn")}


def test_vision_study_trains_twins_once_and_tabulates(vision_study):
    out, result = vision_study
    runs = {p.name for p in (out / "runs").iterdir() if not p.name.startswith(".")}
    assert runs == {"vit-moe-tiny-s0", "tokenprune-tiny-s0", "condconv-tiny-s0",
                    "dense-vit-tiny-s0", "dense-cnn-tiny-s0"}  # one ViT twin serves two
    groups = result["groups"]
    assert set(groups) == {"vit-moe-tiny", "tokenprune-tiny", "condconv-tiny"}
    for name, group in groups.items():
        (seed,) = group["per_seed"]
        config = json.loads((out / "runs" / f"{name}-s0" / "config.json").read_text())
        audit = json.loads((out / "audits" / f"{name}-s0" / "audit.json").read_text())
        assert audit["identity_replay_max_abs_diff"] == 0.0
        assert seed["accuracy_correct"] == audit["conditions"]["correct"]["accuracy"]
        twin = "dense-cnn" if name.startswith("condconv") else "dense-vit"
        twin_config = json.loads((out / "runs" / f"{twin}-tiny-s0" / "config.json").read_text())
        assert seed["twin_accuracy"] == twin_config["results"]["eval_accuracy"]
        assert config["train"]["steps"] == 3
    assert groups["condconv-tiny"]["per_seed"][0]["delta_shuffle"] is None
    assert groups["tokenprune-tiny"]["per_seed"][0]["tokens_executed_fraction"] == \
        (16 + 16 + 8 + 8) / (4 * 16)
    assert groups["vit-moe-tiny"]["per_seed"][0]["experts_executed_fraction"] == 2 / 8
    rows = {r["family"]: r for r in result["vision"]}
    assert set(rows) == {"ViT-MoE", "TokenPrune", "CondConv"}
    assert rows["CondConv"]["shuffle"].startswith("not applicable")
    assert rows["CondConv"]["static-layer-position retention"] == "not applicable"
    assert rows["CondConv"]["executed"].startswith("every block")
    assert rows["TokenPrune"]["executed"] == "75.0% of the patch tokens"
    assert rows["ViT-MoE"]["executed"] == "25.0% of the experts"
    assert all(not r["shuffle"].startswith("not") for f, r in rows.items() if f != "CondConv")
    text = (out / "reproduction.md").read_text()
    assert "Vision families on digits" in text and "ViT-MoE" in text
    assert len(result["findings"]) == 6  # dependence and execution, per family


def test_cli_audits_a_vision_run_on_its_own_digits(vision_study, tmp_path, capsys):
    """`fcaudit audit --model RUN`: a run knows its task, so neither data options nor
    --objective are needed (the run's own digits, classification); a token option is
    refused in one line before any file."""
    out, _ = vision_study
    run = out / "runs" / "condconv-tiny-s0"
    audit_dir = tmp_path / "audit"
    base = ["audit", "--model", run, "--out", audit_dir, "--max-eval", "12", "--max-calib",
            "8", *FAST_ARGS]
    res = run_inprocess([*base, "--tokens", run / "config.json", "--calib-tokens",
                         run / "config.json"], capsys)
    assert res.returncode == 2 and "vision run" in res.stderr and not audit_dir.exists()
    res = run_inprocess(base, capsys)
    assert res.returncode == 0, res.stderr
    audit = json.loads((audit_dir / "audit.json").read_text())
    assert audit["settings"]["objective"] == "classification"
    named = tmp_path / "named"
    res = run_inprocess([*base[:3], "--out", named, *base[5:], "--objective",
                         "classification"], capsys)
    assert res.returncode == 0, res.stderr
    assert json.loads((named / "audit.json").read_text())["conditions"] == audit["conditions"]
    assert audit["data"]["source"] == "sklearn.datasets.load_digits"
    assert audit["data"]["eval_examples"] == 12 and audit["data"]["calib_examples"] == 8
    x, y = digits("eval")
    with torch.no_grad():
        logits = fcaudit.load_model(str(run))(torch.from_numpy(x[:12]))
    assert audit["conditions"]["original"]["accuracy"] == \
        float((logits.argmax(1).numpy() == y[:12]).mean())
    assert audit["identity_replay_max_abs_diff"] == 0.0


def test_sites_all_probes_every_vision_run_with_its_own_digits(vision_study, capsys):
    """`fcaudit sites --model RUN --all` on an image model: every module of every run
    (families and twins) is called by the probe, its output as a hook sees it on two
    digits images; only containers are never called themselves."""
    from fcaudit.core.sites import NOT_CALLED
    out, _ = vision_study
    runs = sorted((out / "runs").iterdir())
    assert len(runs) >= 4  # three families and their twins
    x = torch.from_numpy(digits("eval")[0][:2])
    for run in runs:
        res = run_inprocess(["sites", "--model", run, "--all"], capsys)
        assert res.returncode == 0, res.stderr
        lines = dict(ln.strip().split("\t", 1) for ln in res.stdout.splitlines()
                     if ln.startswith("  "))
        model = fcaudit.load_model(str(run))
        seen = observed_outputs(model, x)
        assert list(lines) == [n for n, _ in model.named_modules() if n], run.name
        for name, line in lines.items():
            if name in seen and isinstance(seen[name], torch.Tensor):
                assert f"Tensor{list(seen[name].shape)}" in line, (run.name, name, line)
            elif name not in seen:
                assert line.endswith(NOT_CALLED), (run.name, name, line)


def test_cli_trains_a_vision_family(tmp_path, capsys):
    res = run_inprocess(["train", "--arch", "dense-cnn", "--steps", "2", "--out",
                         tmp_path / "run", "--quiet"], capsys)
    assert res.returncode == 0, res.stderr
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    accuracy = config["results"]["eval_accuracy"]
    assert f"eval accuracy {accuracy:.4f}" in res.stdout
    assert config["data"]["source"] == "sklearn.datasets.load_digits"
    assert config["train"]["steps"] == 2 and config["arch"] == "dense-cnn"
