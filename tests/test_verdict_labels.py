"""Typed verdicts and the one flattening: each answer carries a label and the numbers it
rests on (audit.json gains them as new keys, the sentences stay); AuditResult.metrics()
is what the study, the trend, compare and the notebook read."""

from __future__ import annotations

import json

import pytest
import toys
from conftest import FAST, optional_extra, toy_data

import fcaudit
from fcaudit.engine.result import ConditionResult, Retention
from fcaudit.engine.verdicts import dependence_part


def _c(delta: float, lo: float, hi: float) -> ConditionResult:
    return ConditionResult(nll=3.0 + delta, delta=delta, ci95=[lo, hi], repeats=[3.0 + delta],
                           repeat_deltas=[delta])


def _kept(value: float | None) -> dict[str, Retention]:
    return {"static-layer": Retention(1.0, [0.9, 1.1], value,
                                      None if value is None else [value - 1, value + 1],
                                      value is not None)}


# (reassign, shuffle, static-layer retention) -> the label the documented rule gives
CASES = [
    ((0.30, 0.20, 0.40), (0.01, -0.01, 0.03), 95.0, "strong"),  # reassign lower bound > 0.1
    ((0.01, 0.005, 0.02), (0.01, -0.01, 0.03), 40.0, "strong"),  # keeps < 50%
    ((0.01, 0.005, 0.02), (0.02, 0.01, 0.03), 95.0, "weak"),  # keeps >= 90%, both < 0.05
    ((-0.02, -0.03, -0.01), (0.0, -0.01, 0.01), None, "none"),  # only intervals below 0
    ((0.0, -0.01, 0.01), (0.0, -0.01, 0.01), None, "unresolved"),  # no interval excludes 0
    ((0.03, 0.01, 0.05), (0.0, -0.01, 0.01), None, "partial"),  # one interval above 0
]


@pytest.mark.parametrize(("reassign", "shuffle", "kept", "label"), CASES)
def test_the_dependence_label_follows_the_rule(reassign, shuffle, kept, label):
    conditions = {"reassign": _c(*reassign), "shuffle": _c(*shuffle)}
    part = dependence_part(conditions, _kept(kept))
    assert part.label == label
    assert f"reassigning coefficients across inputs costs {reassign[0]:+.4f} nats" in part.sentence
    assert part.numbers["delta_reassign"] == reassign[0]
    assert [part.numbers["delta_shuffle_ci_low"], part.numbers["delta_shuffle_ci_high"]] == \
        [shuffle[1], shuffle[2]]
    assert part.numbers["retention_static_layer"] == kept


@pytest.fixture(scope="module")
def result() -> fcaudit.AuditResult:
    return fcaudit.audit(toys.content_model(), sites=["gates.*"], data=toy_data(),
                         options=FAST)


def test_audit_json_keeps_the_sentences_and_adds_labels_and_numbers(result):
    raw = json.loads(json.dumps(result.to_json()))
    assert set(raw["verdict"]) == {"variation", "dependence", "execution", "variation_label",
                                   "dependence_label", "execution_label"}
    parts = result.verdict_parts()
    # the content toy's gates are one_hot(token id): they vary, and the model needs them
    assert (parts["variation"].label, parts["dependence"].label) == ("varies", "strong")
    assert raw["verdict"]["dependence_label"] == "strong"
    reassign = raw["conditions"]["reassign"]
    assert raw["verdict_numbers"]["dependence"]["delta_reassign"] == reassign["delta"]
    assert raw["verdict_numbers"]["dependence"]["delta_reassign_ci_low"] == reassign["ci95"][0]
    assert result.verdict.dependence.startswith("Strong")  # still a str for old callers


def test_a_result_written_before_labels_reads_with_no_label(result):
    raw = json.loads(json.dumps(result.to_json()))
    for key in ("variation_label", "dependence_label", "execution_label"):
        del raw["verdict"][key]
    del raw["verdict_numbers"]
    old = fcaudit.AuditResult.from_json(raw)
    assert old.verdict.label("dependence") is None
    assert old.verdict_parts()["dependence"].sentence == result.verdict.dependence


def test_metrics_are_the_results_numbers_under_one_naming(result):
    raw = json.loads(json.dumps(result.to_json()))
    m, ci = result.metrics(), result.metric_intervals()
    assert m["nll_correct"] == raw["conditions"]["correct"]["nll"]
    for name in ("original", "reassign", "shuffle", "reassign+shuffle", "static-layer",
                 "global-mean"):
        assert m[f"delta_{name}"] == raw["conditions"][name]["delta"]
        assert ci[f"delta_{name}"] == raw["conditions"][name]["ci95"]
    for name in ("static-layer", "static-layer-position", "static-layer-token"):
        key = "retention_" + name.replace("-", "_")
        assert m[key] == raw["retention"][name]["value"]
    assert m["interaction"] == raw["interaction"]["value"]
    assert "delta_correct" not in m  # the reference of every penalty


def test_the_metrics_table_is_the_metrics(result):
    optional_extra("pandas")
    table = result.to_frame("metrics").set_index("metric")
    m = result.metrics()
    assert list(table.index) == list(m)
    assert table.loc["delta_reassign", "value"] == m["delta_reassign"]
    assert table.loc["delta_reassign", "ci_low"] == result.conditions["reassign"].ci95[0]
