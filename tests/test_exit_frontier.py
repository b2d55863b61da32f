"""The exit frontier (the learned exit rule's threshold sweep against fixed exit at the same
mean executed depth), the twin check on per-example shapes, and the per-example exits of
a model without a position axis: each number worked out by hand or by a real pass of the
model at the other threshold."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

import fcaudit
from fcaudit import AuditData
from fcaudit.core.errors import FcauditError
from fcaudit.engine.analyses.exits import ExitPoint, sweep_thresholds
from fcaudit.engine.frontier import curve
from fcaudit.models.condconv import CNN, CNNConfig
from fcaudit.report.sections.exits import exits_section
from tests.test_exit_conditions import CALIB, EVAL, OPTS, nll
from tests.test_exit_conditions import audit as lm_audit
from tests.test_exit_conditions import make as lm_make
from tests.test_model_branchy import audit_result as branchy_audit
from tests.test_model_branchy import make as branchy_make


def sigmoid(z: float) -> float:
    return 1 / (1 + math.exp(-z))


def test_sweep_thresholds_step_one_nat_on_the_logit_scale():
    # own 0.5 (logit 0), four points: logits -2, -1, +1, +2
    assert sweep_thresholds(0.5, 4) == pytest.approx(
        [sigmoid(-2), sigmoid(-1), sigmoid(1), sigmoid(2)])
    # own 0.8 (logit ln 4), three points: -1, +1, +2 nats around it
    z = math.log(4)
    assert sweep_thresholds(0.8, 3) == pytest.approx(
        [sigmoid(z - 1), sigmoid(z + 1), sigmoid(z + 2)])


def test_fixed_exit_is_interpolated_between_the_integer_depths():
    """The exit sweep reads fixed exit through the savings frontier's curve engine."""
    fixed = curve([(1, np.array([4.0, 2.0])), (2, np.array([3.0, 1.0]))], 2, origin=False)
    # depth 1.25: three quarters of depth 1, a quarter of depth 2
    assert fixed.at(1.25).tolist() == [3.75, 1.75]
    assert fixed.at(2.0).tolist() == [3.0, 1.0]
    assert fixed.at(2.5) is None and fixed.at(0.5) is None  # outside the depths recorded
    assert ExitPoint(threshold=0.25).key == "frontier:exit:learned:0.25"
    assert ExitPoint(depth=3).key == "frontier:exit:fixed:3"


def _full_nll_at_depth(model: torch.nn.Module, depth: int) -> float:
    """Every token through the first ``depth`` blocks, then the shared head, by hand."""
    x = torch.from_numpy(EVAL)
    with torch.no_grad():
        h = model.wte(x) + model.wpe(torch.arange(x.shape[1]))
        for block in model.blocks[:depth]:
            h = block.full(h)
        logits = model.lm_head(model.ln_f(h))
    return float(torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 61), x[:, 1:].reshape(-1)))


def lm_result(model: torch.nn.Module) -> fcaudit.AuditResult:
    return fcaudit.audit(model, None, data=AuditData(EVAL, CALIB, {"source": "tokens"}),
                     options=OPTS, report=False)


def test_exit_frontier_of_the_early_exit_lm_against_real_passes():
    model = lm_make()  # threshold 0.5
    j = lm_audit(model)
    e, f = j["exits"], j["exits"]["frontier"]
    own_nll = nll(model, EVAL)
    assert f["own_threshold"] == 0.5
    learned = [p for p in f["points"] if p["rule"] == "learned"]
    fixed = {int(p["mean_depth"]): p for p in f["points"] if p["rule"] == "fixed"}
    own = next(p for p in learned if p["threshold"] is None)
    assert own["mean_depth"] == pytest.approx(e["evaluation_mean_depth"])
    assert own["delta"]["value"] == 0.0
    # every sweep point is the model itself at that threshold (a real pass)
    swept = [p for p in learned if p["threshold"] is not None]
    assert swept
    for p in swept:
        other = lm_make(p["threshold"])
        assert p["delta"]["value"] == pytest.approx(nll(other, EVAL) - own_nll, abs=1e-5)
    # fixed exit at depth d: every token through d blocks, by hand
    for d, p in fixed.items():
        assert p["delta"]["value"] == pytest.approx(_full_nll_at_depth(model, d) - own_nll,
                                                    abs=1e-5)
    # matched depth: fixed exit interpolated at the learned rule's own mean depth
    m = f["matched_depth"]
    depth = e["evaluation_mean_depth"]
    lo, hi = math.floor(depth), math.ceil(depth)
    w = depth - lo
    expected = (1 - w) * fixed[lo]["delta"]["value"] + w * fixed[hi]["delta"]["value"]
    assert m["mean_depth"] == pytest.approx(depth) and m["fixed_depths"] == sorted({lo, hi})
    assert m["gap"]["value"] == pytest.approx(expected)
    assert m["gap"]["ci95"][0] <= m["gap"]["value"] <= m["gap"]["ci95"][1]
    assert "At the learned rule's mean executed depth" in f["sentence"]


def test_conv_twin_of_another_channel_width_is_refused():
    # the same input shapes at every block (the old last-axis check: image widths 8, 8, 4
    # both), but the twin's last block returns 64 channels where Branchy's returns 32
    torch.manual_seed(0)
    twin = CNN(CNNConfig(widths=(16, 32, 64), strides=(1, 2, 1), condconv=False)).eval()
    with pytest.raises(FcauditError, match=re.escape(
            "the dense twin is not the model's network at full depth: block 2 maps per-example "
            "shapes [32, 4, 4] -> [32, 4, 4] in the model (layers.2), [32, 4, 4] -> "
            "[64, 4, 4] in the twin (layers.2)")):
        branchy_audit(branchy_make(), dense=twin)


def test_per_example_exits_have_no_depth_per_position_and_say_example():
    result = branchy_audit(branchy_make())
    e = result.to_json()["exits"]
    assert e["fixed_exit_depth_per_position"] == []
    text = "\n".join(exits_section(result))
    assert "Layers executed per example (of 3)" in text
    assert "| `fixed-exit` | one layer for every example |" in text
    assert "per token" not in text and "Matched depth:" in text


def test_rules_without_one_threshold_give_the_own_point_only():
    model = lm_make()
    model.blocks[0].halt.threshold = 0.6  # the others keep 0.5: no one threshold to move
    result = lm_result(model)
    f = result.to_json()["exits"]["frontier"]
    assert f["own_threshold"] is None
    assert [p["rule"] for p in f["points"] if p["rule"] == "learned"] == ["learned"]
    assert "carry no one `threshold` to move" in "\n".join(exits_section(result))
