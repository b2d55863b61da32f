"""AuditResult in a notebook: its HTML view and its tables as pandas DataFrames."""

from __future__ import annotations

import html
import json

import pytest
import toys
from conftest import FAST, optional_extra, toy_data

import fcaudit

pd = optional_extra("pandas")


@pytest.fixture(scope="module")
def result() -> fcaudit.AuditResult:
    def open_last(coefficients, context):
        return {"gates.1": coefficients["gates.1"] * 0 + 1}
    return fcaudit.audit(toys.content_model(), sites=["gates.*"], data=toy_data(),
                         options=FAST, interventions={"open-last": open_last})


def test_the_html_view_shows_the_three_answers_and_every_condition(result) -> None:
    page = result._repr_html_()
    raw = json.loads(json.dumps(result.to_json()))  # the audit.json a reader would see
    for answer in raw["verdict"].values():
        assert html.escape(answer) in page
    for name, c in [*raw["conditions"].items(), *raw["custom_conditions"].items()]:
        row = f"<td>{html.escape(name)}</td><td>{c['nll']:.4f}</td><td>{c['delta']:+.4f}</td>"
        assert row in page


def test_every_table_has_one_row_per_item_of_audit_json(result) -> None:
    raw = result.to_json()
    conditions = result.to_frame("conditions").set_index("condition")
    every = {**raw["conditions"], **raw["custom_conditions"]}
    assert sorted(conditions.index) == sorted(every)
    for name, c in every.items():
        assert conditions.loc[name, "delta"] == c["delta"]
        assert [conditions.loc[name, "ci_low"], conditions.loc[name, "ci_high"]] == c["ci95"]
    assert conditions.loc["open-last", "custom"] and not conditions.loc["reassign", "custom"]
    layers = result.to_frame("per_layer")
    want = [(name, c["site"], c["delta"]) for name, rows in raw["per_layer"].items()
            for c in rows]
    assert list(zip(layers["condition"], layers["site"], layers["delta"], strict=True)) == want
    retention = result.to_frame("retention").set_index("profile")
    for name, r in raw["retention"].items():
        assert retention.loc[name, "gap"] == r["gap"]
        assert retention.loc[name, "defined"] == r["defined"]


def test_an_unknown_table_is_refused_naming_the_choices(result) -> None:
    with pytest.raises(fcaudit.FcauditError, match="conditions, per_layer, retention, routing"):
        result.to_frame("everything")


def test_the_routing_table_has_every_router_and_expert() -> None:
    import numpy as np
    import torch

    from fcaudit.models.moe import MoEConfig, MoEGPT
    torch.manual_seed(0)
    model = MoEGPT(MoEConfig(vocab_size=97, block_size=16, n_layer=2, n_head=2,
                             n_embd=16)).eval()
    rng = np.random.default_rng(0)
    data = fcaudit.AuditData(rng.integers(0, 97, (8, 16)), rng.integers(0, 97, (8, 16)),
                             {"source": "tokens"})
    moe = fcaudit.audit(model, data=data, options=FAST)
    table = moe.to_frame("routing")
    want = [(layer["site"], e, share) for family in moe.to_json()["routing"].values()
            for layer in family["per_layer"] for e, share in enumerate(layer["load"])]
    assert len(want) == 2 * 8
    assert list(zip(table["site"], table["expert"], table["load"], strict=True)) == want


MAIN = ["original", "correct", "reassign", "shuffle", "reassign+shuffle", "static-layer",
        "static-layer-position", "static-layer-token", "global-mean"]  # docs/method.md order


def test_read_keeps_the_order_the_audit_made(tmp_path) -> None:
    """audit.json is written with sorted keys; read() once returned the conditions (and the
    custom ones) alphabetically. It keeps the report order and the order they were given."""
    def zeta(coefficients, context):
        return {"gates.1": coefficients["gates.1"] * 0 + 1}

    def alpha(coefficients, context):
        return {"gates.0": coefficients["gates.0"] * 0}
    fresh = fcaudit.audit(toys.content_model(), tmp_path / "o", sites=["gates.*"],
                          data=toy_data(), options=FAST,
                          interventions={"zeta": zeta, "alpha": alpha})
    back = fcaudit.AuditResult.read(tmp_path / "o" / "audit.json")
    assert list(back.conditions) == list(fresh.conditions) == MAIN
    assert list(back.custom_conditions) == ["zeta", "alpha"]
    assert list(back.retention) == ["static-layer", "static-layer-position",
                                    "static-layer-token"]
    assert list(back.to_frame("conditions")["condition"]) == [*MAIN, "zeta", "alpha"]


def test_classification_frames_carry_accuracy() -> None:
    """to_frame("conditions") once dropped accuracy: for a classification audit every row
    carries it, the original's equal to numpy's share of argmax hits."""
    import numpy as np
    import torch
    import vision_toys as vt
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 1, 8, 8)).astype(np.float32)
    y = np.arange(16) % vt.CLASSES
    xc = rng.normal(size=(16, 1, 8, 8)).astype(np.float32)
    r = fcaudit.audit(vt.tiny_condconv(), data=fcaudit.AuditData(inputs=x, targets=y,
                                                                 calib_inputs=xc),
                      options=fcaudit.AuditOptions(objective="classification", repeats=1,
                                                   bootstrap=100, execution=False,
                                                   progress=False, batch_size=8))
    with torch.no_grad():
        hits = (vt.tiny_condconv()(torch.from_numpy(x)).argmax(1).numpy() == y).mean()
    table = r.to_frame("conditions").set_index("condition")
    assert table.loc["original", "accuracy"] == table.loc["correct", "accuracy"] == hits
    assert list(table["accuracy"]) == [r.conditions[c].accuracy for c in table.index]
    assert "accuracy" in r.to_frame("per_layer")
    assert "accuracy" not in fcaudit.audit(toys.content_model(), sites=["gates.*"],
                                           data=toy_data(), options=FAST
                                           ).to_frame("conditions")
