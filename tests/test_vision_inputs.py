"""Inputs that are not token ids and coefficient layouts other than [B, T, ...]:
planted toys with known answers (tests/vision_toys.py), each condition per
shape, identity replay, the cache and resume on input bits, execution per example."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import vision_toys as vt

import fcaudit
from fcaudit import AuditData, AuditOptions
from fcaudit.core.contract import TENSOR, SiteCall
from fcaudit.core.errors import FcauditError
from fcaudit.core.layout import LayoutAdapter

FAST = dict(objective="classification", bootstrap=200, repeats=2, execution=False,
            progress=False, batch_size=8)
NO_POSITION = {"shuffle", "reassign+shuffle", "static-layer-position"}


def mixer_audit(factory, **kw):
    x, y = vt.mixer_data(16, 0)
    xc, _ = vt.mixer_data(16, 1)
    return fcaudit.audit(factory(), data=AuditData(inputs=x, targets=y, calib_inputs=xc),
                         options=AuditOptions(**{**FAST, **kw}))


def image_audit(factory, out=None, data=None, **kw):
    x, y = vt.image_data(16, 0)
    xc, _ = vt.image_data(16, 1)
    data = data or AuditData(inputs=x, targets=y, calib_inputs=xc)
    return fcaudit.audit(factory(), out, data=data, options=AuditOptions(**{**FAST, **kw}))


def assert_exact_identity(r) -> None:
    assert r.identity_replay_max_abs_diff == 0.0 and r.identity is None
    assert r.conditions["correct"].nll == r.conditions["original"].nll


def test_per_example_coefficient_of_the_class() -> None:
    """[B, K] mixing weights = one-hot class: reassign costs whenever the donor's class
    differs, the uniform static-layer vector (balanced calibration) keeps 0%."""
    r = mixer_audit(vt.class_mixer)
    assert_exact_identity(r)
    assert r.conditions["reassign"].ci95[0] > 1.0
    assert r.retention["static-layer"].value == 0.0
    assert r.conditions["static-layer"].nll == r.conditions["global-mean"].nll
    # shuffle and per-position profiles do not apply; static-layer-token needs token ids
    assert set(r.not_applicable) == NO_POSITION | {"static-layer-token"}
    assert all("no position axis" in r.not_applicable[c] for c in NO_POSITION)
    assert not set(r.not_applicable) & set(r.conditions)
    assert r.interaction is None
    for profile in ("static-layer-position", "static-layer-token"):
        ret = r.retention[profile]
        assert ret.value is None and ret.ci95 is None and not ret.defined
        assert ret.reason.startswith("not applicable")
    # the report names the axes in the model's words
    assert (r.sites[0].axes, r.sites[0].positions, r.sites[0].trailing_shape) == (
        ["example", "kernel"], [], [vt.C])
    assert "shuffling is not applicable" in r.verdict.dependence


def test_constant_per_example_coefficient() -> None:
    r = mixer_audit(vt.constant_mixer)
    assert_exact_identity(r)
    reassign = r.conditions["reassign"]
    assert reassign.delta == 0.0 and reassign.ci95 == [0.0, 0.0]
    assert r.retention["static-layer"].value == 100.0
    assert r.retention["static-layer"].gap_ci95[0] > 0
    assert [c.accuracy for c in r.conditions.values()] == [1.0, 1.0, 1.0, 1.0, 0.25]


def test_patch_coefficient_shuffles_over_patches() -> None:
    """A [B, P] gate that depends on the patch position only: shuffle hurts, reassign is
    exactly 0, the per-position profile keeps 100%."""
    r = image_audit(vt.patch_model)
    assert_exact_identity(r)
    assert r.conditions["shuffle"].ci95[0] > 0.3
    assert r.conditions["reassign"].delta == 0.0
    assert r.retention["static-layer-position"].value == 100.0
    assert r.not_applicable == {"static-layer-token": r.not_applicable["static-layer-token"]}
    assert r.interaction is not None
    assert r.variance["patch-gate"].eta2_position == 1.0
    assert (r.sites[0].axes, r.sites[0].positions) == (["example", "patch"], [1])


def test_spatial_map_shuffles_over_rows_and_columns() -> None:
    r = image_audit(vt.spatial_model)
    assert_exact_identity(r)
    assert r.conditions["shuffle"].ci95[0] > 0.3
    assert r.conditions["reassign"].delta == 0.0
    assert r.retention["static-layer-position"].value == 100.0
    assert r.sites[0].trailing_shape == [2]  # the channel axis trails the 16 positions
    assert r.sites[0].positions == [2, 3]


def test_layout_adapter_moves_positions_first_and_back() -> None:
    """[B, C, H, W] -> [B, H*W, C] row-major, checked element by element with numpy, and
    rebuilt bit for bit; [B, K] -> [B, 1, K]."""
    t = torch.randn(3, 2, 4, 5)
    layout = LayoutAdapter(TENSOR, ("example", "channel", "row", "column"), (2, 3))
    call = SiteCall(torch.nn.Identity(), (), {}, 3, None)
    canon = layout.extract(t, call)
    ref = np.transpose(t.numpy(), (0, 2, 3, 1)).reshape(3, 20, 2)
    assert np.array_equal(canon.numpy(), ref)
    back = layout.rebuild(canon, call)
    assert back.shape == t.shape and torch.equal(back, t)
    flat = LayoutAdapter(TENSOR, ("example", "kernel"), ())
    k = torch.randn(3, 4)
    assert torch.equal(flat.extract(k, call), k.view(3, 1, 4))
    assert torch.equal(flat.rebuild(flat.extract(k, call), call), k)


def test_dataset_and_dict_inputs_give_the_same_audit() -> None:
    x, y = vt.mixer_data(16, 0)
    xc, yc = vt.mixer_data(16, 1)
    arrays = mixer_audit(vt.class_mixer)
    dataset = fcaudit.audit(vt.class_mixer(), data=AuditData(
        dataset=torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y)),
        calib_dataset=torch.utils.data.TensorDataset(torch.from_numpy(xc),
                                                     torch.from_numpy(yc))),
        options=AuditOptions(**FAST))
    offset = np.arange(16, dtype=np.float32)[:, None]
    as_dict = fcaudit.audit(vt.DictMixer().eval(), data=AuditData(
        inputs={"features": x, "offset": offset}, targets=y,
        calib_inputs={"features": xc, "offset": offset + 100}), options=AuditOptions(**FAST))
    for other in (dataset, as_dict):
        assert other.conditions.keys() == arrays.conditions.keys()
        for name, c in arrays.conditions.items():
            assert (other.conditions[name].nll, other.conditions[name].ci95) == (c.nll, c.ci95)


def test_cache_resumes_on_the_same_input_bits_only(tmp_path) -> None:
    """A rerun reuses every replay batch; one flipped input bit is a different data set
    (the cache digests the input tensors), refused rather than reused."""
    x, y = vt.image_data(16, 0)
    xc, _ = vt.image_data(16, 1)
    out = tmp_path / "a"
    first = image_audit(vt.patch_model, out)
    again = image_audit(vt.patch_model, out)
    assert again.runtime.reuse["batches_reused"] == 2
    assert again.runtime.reuse["batches_recomputed"] == 0
    assert again.conditions == first.conditions
    flipped = x.copy()
    flipped.view(np.uint32)[3, 0, 5, 5] ^= 1
    with pytest.raises(FcauditError, match="a different evaluation data"):
        image_audit(vt.patch_model, out,
                    AuditData(inputs=flipped, targets=y, calib_inputs=xc))


def test_execution_per_example_against_the_dense_twin() -> None:
    """CondConv mixes its kernels into one per example: the body runs once per example in
    both, and its FLOPs are counted per example (hand count below)."""
    x, y = vt.image_data(16, 0)
    xc, _ = vt.image_data(16, 1)
    r = fcaudit.audit(vt.tiny_condconv(), data=AuditData(inputs=x, targets=y, calib_inputs=xc),
                      options=AuditOptions(**{**FAST, "execution": True, "timing_pairs": 0}))
    e = r.execution
    assert e.measured and e.unit == "example"
    assert (e.blocks_executed, e.dense_blocks_executed, e.tokens_counted) == (1.0, 1.0, 16)
    mix, apply, route = 2 * vt.K * vt.D * vt.CLASSES, 2 * vt.D * vt.CLASSES, 2 * vt.D * vt.K
    assert e.flops_per_token == mix + apply + route
    assert e.dense_flops_per_token == apply
    assert e.flops_ratio == (mix + apply + route) / apply
    assert e.saves_against_dense is False and e.conditional_execution is False


def test_positions_entering_patch_blocks_are_counted_per_example() -> None:
    """A block fed patch tokens [B, P, C] reports P positions per example (a pruned block
    would report fewer); a block fed anything else reports none (n/a, not a number)."""
    from fcaudit.engine.execution import measure_execution
    from fcaudit.io.examples import Examples
    x, y = vt.image_data(6, 0)
    examples = Examples.of(x, y, "")
    e = measure_execution(vt.patch_model(), None, examples, batch_size=4,
                          block_paths=["gate"], timing=False)
    assert (e.blocks_executed, e.tokens_counted, e.positions_per_block) == (1.0, 6, [16.0])
    m = measure_execution(vt.spatial_model(), None, examples, batch_size=4,
                          block_paths=["mask"], timing=False)
    assert m.positions_per_block == [None] and m.blocks_executed == 1.0


def test_two_processes_give_the_single_process_audit_on_images(tmp_path) -> None:
    """torchrun shares the example batches out; audit.json equals one process's."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from fcaudit.engine.result import NONDETERMINISTIC_KEYS
    x, y = vt.image_data(20, 0)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    np.save(tmp_path / "xc.npy", vt.image_data(12, 1)[0])
    tests = str(Path(__file__).parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [tests, *filter(None, [os.environ.get("PYTHONPATH")])])}

    def audit(out: str, processes: int | None) -> dict:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                    str(processes), "--standalone", "-m", "fcaudit"] if processes else \
            [sys.executable, "-m", "fcaudit"]
        argv = ["audit", "--model", "vision_toys:patch_model", "--inputs", tmp_path / "x.npy",
                "--targets", tmp_path / "y.npy", "--calib-inputs", tmp_path / "xc.npy",
                "--objective", "classification", "--out", tmp_path / out, "--batch-size", "4",
                "--bootstrap", "100",
                "--repeats", "2", "--no-execution", "--quiet"]
        done = subprocess.run([*launcher, *map(str, argv)], capture_output=True, text=True,
                              timeout=300, env=env)
        assert done.returncode == 0, done.stderr
        result = json.loads((tmp_path / out / "audit.json").read_text())
        for key in NONDETERMINISTIC_KEYS:
            head, _, tail = key.partition(".")
            (result.get(head, {}).pop(tail, None) if tail else result.pop(head, None))
        return result

    single, double = audit("single", None), audit("double", 2)
    assert double == single
    assert single["conditions"]["shuffle"]["ci95"][0] > 0



def test_compare_of_audits_on_other_inputs_names_examples_and_a_missing_interaction(
        tmp_path) -> None:
    """Two audits of per-example mixers on the same images: paired, counted in examples,
    and the interaction (no shuffle on [B, K]) is a dash, not a crash or a number."""
    results = [mixer_audit(vt.class_mixer), mixer_audit(vt.constant_mixer)]
    assert all(r.interaction is None for r in results)
    comparison = fcaudit.compare(results, tmp_path / "cmp", labels=["class", "constant"])
    content = comparison.to_json()
    assert content["data"]["identical"] and content["data"]["eval_examples"] == 16
    inter = next(q for q in content["tables"]["quantities"] if q["kind"] == "interaction")
    assert inter["models"] == {"class": None, "constant": None}
    md = (tmp_path / "cmp" / "compare.md").read_text(encoding="utf-8")
    assert "on the same 16 evaluation examples" in md
    assert md.count("| 16 evaluation examples |") == 2
