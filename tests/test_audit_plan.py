"""The cost said before the work: the plan is printed after the probe and before any pass
of the audit proper, counts every forward pass the audit then makes (counted here by a
hook on the model), estimates the time from the probe's measured pace, names the largest
stages with the option that cuts each, and sizes the cache as it is then written (blocks
on disk, as ``runtime.cache`` counts them)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import toys
import vision_toys as vt
from conftest import toy_data

from fcaudit import AuditData, AuditOptions
from fcaudit.engine.options import NOTE
from fcaudit.engine.run import AuditRequest
from fcaudit.engine.run import audit as audited  # the engine: its notes reach the callback
from fcaudit.models.featuregate import GPT, PRESETS


def _audit(model, tmp_path, sites=None, data=None, dense=None, blocks=None, **options):
    """The audit, the plan's line, and the forward passes the model made after it."""
    calls, said = [], []
    model.register_forward_hook(lambda *_: calls.append(1))

    def progress(stage: str, done: int, total: int, info: str = "") -> None:
        if stage == NOTE and info.startswith("plan: about"):
            said.append((info, len(calls)))

    opts = AuditOptions(**{"bootstrap": 20, "repeats": 2, "batch_size": 4, **options})
    result = audited(AuditRequest(model, tmp_path / "out", sites=sites, data=data or toy_data(),
                                  dense=dense, blocks=blocks, options=opts), progress)
    assert len(said) == 1, said  # once, before the work
    line, before = said[0]
    return result, line, len(calls) - before


def test_the_plan_counts_every_pass_the_audit_then_makes(tmp_path) -> None:
    result, line, made = _audit(toys.content_model(), tmp_path, ["gates.*"])
    plan = result.runtime.plan
    assert made == plan["passes"], (made, plan)
    assert line.startswith(f"plan: about {made} forward passes, ~")
    stages = plan["stages"]
    # 12 + 12 sequences, batches of 4: 3 evaluation (the probe's recorded already) and 3
    # calibration batches; correct, 3 random x 2 repeats, 4 static main runs and the history
    # check per batch; per-layer: 2 sites x (2 reassign + 1 static-layer) (the toy declares
    # no blocks: no prefix to prove, and no execution to measure)
    assert stages["record"]["passes"] == 2 + 3
    assert stages["replay"]["passes"] == (1 + 3 * 2 + 4 + 1) * 3
    assert stages["per-layer runs"]["passes"] == 2 * 3 * 3
    assert "execution" not in stages
    assert "per-layer runs up to" in line and "(per_layer=" in line


def test_execution_counted_on_the_model_alone_is_planned(tmp_path) -> None:
    """No dense counterpart but blocks named: execution counts the model's own blocks and
    FLOPs once per evaluation batch (3 batches of 4) after one uncounted warm pass, and
    the plan counts those passes."""
    result, _, made = _audit(toys.content_model(), tmp_path, ["gates.*"], blocks="gates.*")
    plan = result.runtime.plan
    assert made == plan["passes"], (made, plan)
    assert plan["stages"]["execution"]["passes"] == 1 + 3
    assert result.execution.measured and result.execution.dense_blocks_executed is None


@pytest.mark.parametrize("schedule", ["prefix", "naive"])
def test_a_model_with_blocks_and_a_twin_counts_its_proofs_and_timing(schedule,
                                                                    tmp_path) -> None:
    """FeatureGate with its Dense twin: the prefix schedule proves each site's prefix once
    per batch, execution counts both models' blocks per batch (after a warm pass each) and
    times 2 warm-up and ``timing_pairs`` passes of each."""
    torch.manual_seed(0)
    model, dense = GPT(PRESETS["tiny"]).eval(), GPT(dataclasses.replace(
        PRESETS["tiny"], gated=False)).eval()
    rng = np.random.default_rng(0)
    data = AuditData(rng.integers(0, 2048, (8, 16)), rng.integers(0, 2048, (8, 16)))
    result, _, made = _audit(model, tmp_path, data=data, dense=dense, timing_pairs=10,
                             schedule=schedule)
    plan = result.runtime.plan
    twin = 1 + 2 + (2 + 10)  # the twin's passes: a warm pass, its blocks counted per
    # batch, then timed
    assert made == plan["passes"] - twin, (made, plan)
    layers = PRESETS["tiny"].n_layer
    proofs = layers - 1 if schedule == "prefix" else 0  # the first gate has no prefix
    assert plan["stages"]["per-layer runs"]["passes"] == (layers * 3 + proofs) * 2
    assert plan["stages"]["execution"]["passes"] == 2 * (1 + 2) + 2 * (2 + 10)


def test_routers_with_ablation_and_the_frontier_are_counted(tmp_path) -> None:
    """A routed toy: expert ablation (one run per router and expert) is counted exactly;
    the frontier's points at most (levels that coincide are dropped)."""
    result, line, made = _audit(toys.token_router_model(), tmp_path, execution=False)
    plan = result.runtime.plan
    ablation = plan["stages"]["expert ablation"]["passes"]
    assert ablation == 2 * toys.V * 3  # 2 routers x 64 experts x 3 batches
    assert made == plan["passes"]
    assert "expert ablation up to" in line


def test_an_exit_model_s_references_and_exit_frontier_are_counted(tmp_path) -> None:
    """The early-exit LM: the exit frontier's threshold sweep (a pass per evaluation batch
    and threshold) is counted exactly, its points at most (thresholds whose exits repeat
    another's are dropped), and every other pass the audit makes is counted."""
    from tests.test_exit_conditions import CALIB, EVAL, make
    data = AuditData(EVAL, CALIB, {"source": "tokens"})
    result, line, made = _audit(make(), tmp_path, data=data, execution=False,
                                frontier_points=2)
    plan, n_eval = result.runtime.plan, -(-len(EVAL) // 4)
    stages = plan["stages"]
    assert stages["exit frontier references"]["passes"] == 2 * n_eval
    assert stages["exit references"]["passes"] > 0
    assert result.exits is not None and result.exits.frontier is not None
    replayed = (len(result.exits.frontier.points) - 1) * n_eval  # own point: its pass
    planned = stages["exit frontier points"]["passes"]
    assert 0 < replayed <= planned
    assert made == plan["passes"] - (planned - replayed), (made, plan)
    assert "(frontier_points=" in line


def test_the_planned_cache_is_the_cache_written(tmp_path) -> None:
    for name, (model, sites, data) in {
            "gates": (toys.content_model(), ["gates.*"], toy_data()),
            "classifier": (vt.class_mixer(), None, AuditData(
                inputs=vt.mixer_data(16, 0)[0], targets=vt.mixer_data(16, 0)[1],
                calib_inputs=vt.mixer_data(16, 1)[0]))}.items():
        result, _, _ = _audit(model, tmp_path / name, sites, data, execution=False)
        planned, written = result.runtime.plan["cache_bytes"], result.runtime.cache["bytes"]
        assert abs(planned - written) <= 0.05 * written, (name, planned, written)
        rows = result.data.get("eval_sequences") or result.data["eval_examples"]
        assert result.runtime.plan["bytes_per_eval_sequence"] == round(planned / rows)


def test_the_estimate_is_the_probe_s_pace_times_the_passes(tmp_path) -> None:
    result, _, _ = _audit(toys.content_model(), tmp_path, ["gates.*"], execution=False)
    plan = result.runtime.plan
    record, replay = plan["probe_record_s"], plan["probe_replay_s"]
    record = min(record, replay)  # the record pass was the first: its cold start not counted
    stages = plan["stages"]
    expected = stages["record"]["passes"] * record + (
        stages["replay"]["passes"] + stages["per-layer runs"]["passes"]) * replay
    assert plan["estimated_s"] == pytest.approx(expected, abs=1e-3)
    assert np.isfinite(plan["estimated_s"]) and plan["estimated_s"] > 0


def test_the_record_progress_counts_the_plan_s_evaluation_batches(tmp_path) -> None:
    """The plan's evaluation batches are what the record stage counts: 12 sequences in
    batches of 4 are 3 batches, the first recorded by the probe and said so, so the count
    runs from 1/3 to 3/3 (before: 1/2 to 2/2 beside a plan of 3)."""
    seen = []

    def progress(stage: str, done: int, total: int, info: str = "") -> None:
        if stage == "record evaluation":
            seen.append((done, total, info))

    opts = AuditOptions(bootstrap=20, repeats=1, batch_size=4, per_layer=False)
    audited(AuditRequest(toys.content_model(), tmp_path / "out", sites=["gates.*"],
                         data=toy_data(12, 12), options=opts), progress)
    batches = -(-12 // 4)
    probe = "(batch 1 recorded by the probe)"
    assert seen == [(1, batches, probe), (2, batches, probe), (3, batches, probe)]
