"""Routed models audited end to end: routing-aware metrics (expert load, entropy, re-routed
top-k sets per condition), the experts that ran, and a Hugging Face MoE folder audited with
one command."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import md_tables, optional_extra

from fcaudit.api import audit
from fcaudit.engine.run import AuditOptions
from fcaudit.io.data import AuditData
from fcaudit.models.moe import PRESETS, MoEGPT

OPTIONS = AuditOptions(repeats=2, bootstrap=100, batch_size=4, timing_pairs=0, progress=False)


@pytest.fixture(scope="module")
def moe_audit(tmp_path_factory: pytest.TempPathFactory):
    torch.manual_seed(0)
    model = MoEGPT(PRESETS["tiny"]).eval()
    rng = np.random.default_rng(0)
    data = AuditData(rng.integers(0, 2048, (8, 16)), rng.integers(0, 2048, (8, 16)), {})
    out = tmp_path_factory.mktemp("moe")
    return audit(model, out, data=data, options=OPTIONS), out


def test_routing_metrics_of_a_routed_model(moe_audit) -> None:
    result, _ = moe_audit
    routing = result.routing["moe"]
    assert routing.num_experts == 8 and routing.tokens == 8 * 16
    for layer in routing.per_layer:
        assert sum(layer.load) == pytest.approx(1.0) and len(layer.load) == 8
        assert 0 < layer.entropy_normalized <= 1
    changed = routing.changed
    assert set(changed) == {"reassign", "shuffle", "reassign+shuffle", "static-layer",
                            "static-layer-position", "static-layer-token", "global-mean"}
    assert all(0 <= v <= 1 for v in changed.values())
    assert changed["reassign"] > 0.3  # another input's logits pick other experts
    assert result.variance["moe"].eta2_layer >= 0  # the decomposition of router logits


def test_experts_that_ran_are_the_routers_top_k(moe_audit) -> None:
    result, _ = moe_audit
    experts = result.execution.experts
    assert experts.experts_per_token_per_layer == [2.0] * 4 and experts.matches_routing
    assert experts.active_expert_flops_per_token / experts.all_expert_flops_per_token == \
        pytest.approx(2 / 8)
    assert experts.routing_changes_computation and result.execution.conditional_execution
    assert result.verdict.execution.startswith(
        "Conditional execution: routing changes what is computed (experts skipped per token): "
        "each token runs 2.00 of 8 experts")


def _percent(cell: str) -> float:
    return float(cell.removesuffix("%")) / 100


def test_the_report_shows_routing(moe_audit) -> None:
    """The Routing tables quote the result's numbers: per condition the share of top-k sets
    changed and the penalty; per layer the load entropy, every expert's load and the
    random conditions' changed shares (shown to 0.1%, 3 decimals)."""
    result, out = moe_audit
    report = (out / "report.md").read_text()
    routing = result.routing["moe"]
    section = report[report.index("## Routing"):report.index("\n## ", report.index("## Routing"))]
    assert f"### Family `moe` ({routing.num_experts} experts, {routing.tokens} tokens per " \
           "layer)" in section
    by_condition, by_layer = md_tables(section)
    assert [row["condition"].strip("`") for row in by_condition] == list(routing.changed)
    for row in by_condition:
        name = row["condition"].strip("`")
        assert _percent(row["top-k sets changed"]) == pytest.approx(routing.changed[name],
                                                                     abs=5.01e-4)
        c = result.conditions[name]
        shown = [float(x) for x in re.findall(r"[-+]\d+\.\d+", row["Δ NLL [95% CI]"])]
        assert shown == pytest.approx([c.delta, *c.ci95], abs=5.01e-5)
    assert len(by_layer) == len(routing.per_layer)
    for row, layer in zip(by_layer, routing.per_layer, strict=True):
        assert (int(row["layer"]), row["site"].strip("`")) == (layer.layer, layer.site)
        assert float(row["load entropy / log E"]) == pytest.approx(layer.entropy_normalized,
                                                                   abs=5.01e-4)
        assert [float(x) for x in row["expert load"].split(",")] == pytest.approx(layer.load,
                                                                                  abs=5.01e-4)
        for name in ("reassign", "shuffle", "reassign+shuffle"):
            assert _percent(row[f"changed: {name}"]) == pytest.approx(layer.changed[name],
                                                                      abs=5.01e-4)
    experts = result.execution.experts
    rows = {r["measure"]: r["model"] for t in md_tables(report) for r in t if "measure" in r}
    assert rows["experts run per token per routed layer (mean over layers)"] == \
        f"{experts.experts_per_token_mean_over_layers:.2f} of {routing.num_experts}"


def test_a_hugging_face_moe_folder_is_audited_with_one_command(tmp_path: Path) -> None:
    optional_extra("transformers")
    from conftest import FAMILIES, save, token_batches

    from fcaudit.cli import main
    from fcaudit.io.data import folder_tokenizer
    folder = save(FAMILIES["qwen2_moe"][0](), tmp_path / "qwen2-moe")
    x, calib = token_batches(folder_tokenizer(folder))
    np.save(tmp_path / "eval.npy", x.numpy())
    np.save(tmp_path / "calib.npy", calib.numpy())
    out = tmp_path / "out"
    assert main(["audit", "--model", str(folder), "--tokens", str(tmp_path / "eval.npy"),
                 "--calib-tokens", str(tmp_path / "calib.npy"), "--out", str(out),
                 "--batch-size", "2", "--bootstrap", "50", "--repeats", "1",
                 "--timing-pairs", "0", "--quiet"]) == 0
    result = json.loads((out / "audit.json").read_text())
    assert result["identity_replay_max_abs_diff"] == 0.0
    assert {s["family"] for s in result["sites"]} == {"router", "shared_expert_gate"}
    assert set(result["routing"]) == {"router"}
    assert result["execution"]["experts"]["experts_per_token_per_layer"] == [2.0, 2.0]


def test_the_router_map_shows_expert_load_not_mean_logits(moe_audit) -> None:
    """A router family gets the layer x expert load map (what routing picks); the map of
    mean logits by position, averaged over experts, is not drawn for it."""
    from fcaudit.report.figures import expert_load_figure
    result, out = moe_audit
    figures = {p.name for p in (out / "figures").iterdir()}
    assert "expert-load.png" in figures and "heatmap.png" not in figures
    loads = [x.load for x in result.routing["moe"].per_layer]
    fig = expert_load_figure({"moe": loads})
    (ax,) = [a for a in fig.axes if a.images]
    shown = np.asarray(ax.images[0].get_array())
    assert shown.shape == (4, 8)
    assert np.array_equal(shown, np.array(loads))  # every layer, every expert
    assert np.allclose(shown.sum(axis=1), 1.0)
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("expert", "layer")
    assert "expert load by layer" in ax.get_title()
    assert "Expert load by layer" in (out / "report.md").read_text()
