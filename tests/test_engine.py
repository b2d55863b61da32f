"""The audit engine: replay identity, interventions, known answers, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import toys

from fcaudit.audit_run import AuditOptions, Run, feed, run_audit
from fcaudit.cache import CoefficientCache
from fcaudit.data import AuditData
from fcaudit.errors import FcauditError
from fcaudit.interventions import StaticProfiles, draw
from fcaudit.sites import find_sites as resolve_sites

FAST = AuditOptions(repeats=2, bootstrap=200, batch_size=4, execution=False, progress=False)


def toy_data(n_eval: int = 12, n_calib: int = 12, seq_len: int = 16) -> AuditData:
    return AuditData(toys.pair_sequences(n_eval, seq_len, 1),
                     toys.pair_sequences(n_calib, seq_len, 2), {"source": "tokens"})


def toy_audit(mode: str, tmp_path, **kw):
    model = getattr(toys, f"{mode}_model")()
    return run_audit(model, tmp_path / mode, sites=["gates.*"], data=toy_data(),
                     options=FAST, write_report=False, **kw)


def test_correct_replay_is_bitwise_identical(tiny_runs, tmp_path):
    audit = run_audit(str(tiny_runs["featuregate"]), tmp_path / "a", max_eval=10, max_calib=6,
                      options=FAST, write_report=False)
    assert audit["identity_replay_max_abs_diff"] == 0.0
    assert audit["conditions"]["correct"]["nll"] == audit["conditions"]["original"]["nll"]
    assert set(audit["conditions"]) == {"original", "correct", "reassign", "shuffle",
                                        "reassign+shuffle", "static-layer",
                                        "static-layer-position", "global-mean"}
    assert len(audit["per_layer"]["reassign"]) == 4
    assert audit["data"]["eval_sequences"] == 10 and audit["data"]["calib_sequences"] == 6


def test_content_gate_gives_large_penalties_and_no_retention(tmp_path):
    a = toy_audit("content", tmp_path)
    c = a["conditions"]
    assert c["reassign"]["delta"] > 1.0 and c["reassign"]["ci95"][0] > 0.5
    assert c["shuffle"]["delta"] > 1.0
    assert abs(a["retention"]["static-layer"]["value"]) < 5.0
    assert a["verdict"]["dependence"].startswith("Strong dependence")


def test_constant_gates_give_no_penalty_and_full_retention(tmp_path):
    a = toy_audit("constant", tmp_path)
    c = a["conditions"]
    for name in ("reassign", "shuffle", "reassign+shuffle", "static-layer"):
        assert abs(c[name]["delta"]) < 1e-6, name
    assert a["retention"]["static-layer"]["value"] == pytest.approx(100.0, abs=1e-3)
    assert a["variance"]["gates.*"]["eta2_layer"] == pytest.approx(1.0)
    assert a["verdict"]["dependence"].startswith("Weak dependence")


def test_position_gates_shuffle_hurts_reassign_does_not(tmp_path):
    a = toy_audit("position", tmp_path)
    c = a["conditions"]
    assert c["shuffle"]["delta"] > 0.5
    assert abs(c["reassign"]["delta"]) < 1e-6
    assert a["retention"]["static-layer-position"]["value"] == pytest.approx(100.0, abs=1e-3)
    assert a["retention"]["static-layer"]["value"] < 90.0


def _cache_for(model, data, tmp_path):
    sites = resolve_sites(model, ["gates.*"])
    a = run_audit(model, tmp_path, sites=["gates.*"], data=data, options=FAST,
                  write_report=False)
    cache = CoefficientCache(tmp_path / "cache", __import__("json").loads(
        (tmp_path / "cache" / "manifest.json").read_text())["identity"], FAST.batch_size,
        len(data.eval_ids))
    return a, sites, cache


def test_reassign_is_a_derangement_shared_by_all_sites(tmp_path):
    data = toy_data()
    model = toys.content_model()
    _, sites, cache = _cache_for(model, data, tmp_path)
    rand = draw(5, len(data.eval_ids), data.eval_ids.shape[1])
    assert not np.any(rand.donor == np.arange(len(data.eval_ids)))
    for b in range(cache.n_batches):
        rows = cache.batch_range(b)
        fed = feed(Run("reassign"), b, rows, cache, sites, None, rand)
        for i, n in enumerate(rows):
            donor = toys.F.one_hot(torch.from_numpy(data.eval_ids[rand.donor[n]]), toys.V)
            for site in sites:  # every site receives the same donor's coefficients
                assert torch.equal(fed[site][i], donor.float())


def test_shuffle_is_one_permutation_per_sequence_shared_by_sites(tmp_path):
    data = toy_data()
    _, sites, cache = _cache_for(toys.content_model(), data, tmp_path)
    rand = draw(3, len(data.eval_ids), data.eval_ids.shape[1])
    assert len({tuple(p) for p in rand.positions}) == len(data.eval_ids)
    rows = cache.batch_range(0)
    fed = feed(Run("shuffle"), 0, rows, cache, sites, None, rand)
    for i, n in enumerate(rows):
        expected = toys.F.one_hot(torch.from_numpy(data.eval_ids[n][rand.positions[n]]), toys.V)
        for site in sites:
            assert torch.equal(fed[site][i], expected.float())


def test_static_profiles_ignore_evaluation_data(tmp_path):
    calib = toys.pair_sequences(8, 16, 2)
    profiles = []
    for seed in (10, 11):
        data = AuditData(toys.pair_sequences(8, 16, seed), calib, {})
        a = run_audit(toys.content_model(), tmp_path / str(seed), sites=["gates.*"], data=data,
                      options=FAST, write_report=False)
        profiles.append(a["conditions"]["static-layer"]["nll"])
        state = CoefficientCache(tmp_path / str(seed) / "cache", __import__("json").loads(
            (tmp_path / str(seed) / "cache" / "manifest.json").read_text())["identity"], 4,
            8).read_extra("static.safetensors")
        profiles.append(state)
    s1, s2 = profiles[1], profiles[3]
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    prof = StaticProfiles.from_state(resolve_sites(toys.content_model(), ["gates.*"]), s1)
    expected = torch.from_numpy(np.eye(toys.V)[calib].mean(axis=(0, 1)))
    assert torch.allclose(prof.layer(prof.sites[0]), expected)


@pytest.mark.parametrize("case, message", [
    ("one_eval", "at least 2 evaluation sequences"),
    ("shared_window", "share 1 identical window"),
    ("oov", "vocabulary"),
])
def test_bad_data_is_refused(case, message, tiny_runs, tmp_path):
    from fcaudit.loading import load
    loaded = load(str(tiny_runs["featuregate"]))
    ev = np.random.default_rng(0).integers(0, 100, size=(4, 16))
    ca = np.random.default_rng(1).integers(0, 100, size=(4, 16))
    if case == "one_eval":
        ev = ev[:1]
    elif case == "shared_window":
        ca[2] = ev[1]
    else:
        ev[0, 3] = 5000
    with pytest.raises(FcauditError, match=message):
        run_audit(loaded, tmp_path, data=AuditData(ev, ca, {}), options=FAST)
    assert not (tmp_path / "audit.json").exists()


def test_sites_glob_matching_nothing(tmp_path):
    with pytest.raises(FcauditError, match="matched no module"):
        run_audit(toys.content_model(), tmp_path, sites=["blocks.*.gate"], data=toy_data(),
                  options=FAST)


def test_site_output_must_be_per_token(tmp_path):
    model = toys.content_model()
    model.gates[0].forward = lambda ids: torch.zeros(ids.shape[0])
    with pytest.raises(FcauditError, match="expected \\[batch"):
        run_audit(model, tmp_path, sites=["gates.*"], data=toy_data(), options=FAST)


def test_site_that_never_runs(tmp_path):
    with pytest.raises(FcauditError, match="never ran"):
        run_audit(toys.content_model(), tmp_path, sites=["gates"], data=toy_data(),
                  options=FAST)


def test_nan_coefficients_are_reported(tmp_path):
    model = toys.constant_model()
    model.gates[1].forward = lambda ids: torch.full((*ids.shape, 1), float("nan"))
    with pytest.raises(FcauditError, match="non-finite .* gates.1"):
        run_audit(model, tmp_path, sites=["gates.*"], data=toy_data(), options=FAST)
    assert not (tmp_path / "audit.json").exists()


def test_cache_from_other_data_is_refused(tmp_path):
    toy_audit("constant", tmp_path)
    other = AuditData(toys.pair_sequences(12, 16, 7), toys.pair_sequences(12, 16, 2), {})
    with pytest.raises(FcauditError, match="different eval_data"):
        run_audit(toys.constant_model(), tmp_path / "constant", sites=["gates.*"], data=other,
                  options=FAST, write_report=False)


def test_rerun_reuses_cache_and_gives_identical_json(tmp_path):
    first = toy_audit("content", tmp_path)
    second = toy_audit("content", tmp_path)
    for key in ("conditions", "retention", "interaction", "variance", "per_layer"):
        assert first[key] == second[key]


def test_user_model_execution_with_blocks_glob(tmp_path):
    from fcaudit.models.featuregate import GPT, GPTConfig

    class UserModel(torch.nn.Module):  # declares nothing: sites and blocks come from globs
        def __init__(self, gated: bool) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2,
                                     n_embd=16, gated=gated))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.net(ids)

    opts = AuditOptions(repeats=1, bootstrap=50, batch_size=4, timing_pairs=0, progress=False)
    kw = {"sites": ["net.blocks.*.gate"], "data": toy_data(), "options": opts,
          "write_report": False}
    a = run_audit(UserModel(True), tmp_path / "a", dense=UserModel(False),
                  blocks="net.blocks.*", **kw)
    ex = a["execution"]
    assert ex["measured"] and ex["blocks_executed"] == ex["blocks_present"] == 2
    assert not ex["conditional_execution"] and ex["flops_ratio"] > 1.0
    b = run_audit(UserModel(True), tmp_path / "b", **kw)
    assert not b["execution"]["measured"] and "--dense" in b["execution"]["reason"]


def test_controllers_never_run_during_replay(tmp_path):
    """Only live passes call the gates (record, and one vocabulary probe for a model that
    states no vocabulary size): every replay feeds stubs instead."""
    model = toys.content_model()
    calls = []
    for gate in model.gates:
        gate.register_forward_hook(lambda *_: calls.append(1))
    data = toy_data(n_eval=12, n_calib=8)
    run_audit(model, tmp_path, sites=["gates.*"], data=data, options=FAST, write_report=False)
    live_passes = -(-12 // FAST.batch_size) + -(-8 // FAST.batch_size) + 1
    assert len(calls) == live_passes * len(model.gates)
