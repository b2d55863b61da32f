"""static-layer-token: a profile per (layer, token id) from the calibration set,
its fallback for ids calibration never saw, and the token-id share of the within-layer
variance; every expected value is derived by hand or by numpy, not by the code under test."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import toys

import fcaudit
from fcaudit.core.errors import FcauditError
from fcaudit.core.interventions import StaticProfiles, static
from fcaudit.engine.cache import CoefficientCache
from fcaudit.engine.metrics import TokenShare
from fcaudit.engine.options import silent
from fcaudit.engine.result import ConditionResult, Retention, TokenProfile
from fcaudit.engine.run import AuditOptions, AuditRequest, cache_identity, prepare
from fcaudit.engine.stages import calibration_profiles, record_calibration
from fcaudit.engine.verdicts import dependence_part
from fcaudit.io.data import AuditData
from fcaudit.report.audit_report import build_markdown

V = toys.V
FAST = AuditOptions(repeats=2, bootstrap=200, batch_size=4, execution=False, progress=False)


def covering_calibration(seed: int = 3) -> np.ndarray:
    """8 pair sequences of 16 tokens whose even positions hold every id 0..V-1 once."""
    x = np.zeros((8, 16), dtype=np.int64)
    x[:, 0::2] = np.random.default_rng(seed).permutation(V).reshape(8, 8)
    x[:, 1::2] = (x[:, 0::2] + 1) % V
    return x


def router_audit(model, calib: np.ndarray, **kw):
    data = AuditData(toys.pair_sequences(12, 16, 1), calib, {"source": "tokens"})
    return fcaudit.audit(model, data=data, options=FAST, **kw), data


def my_token_profile(coefficients, context):
    """static-layer-token rebuilt by a user from the public function and the context."""
    return static(coefficients, context.profiles, "static-layer-token", ids=context.ids)


def test_token_router_keeps_the_whole_gap_and_its_id_explains_everything():
    """Logits 4 * one_hot(x_t): the mean over calibration tokens of one id is that id's own
    logits exactly (sums of 4.0 in float64), so static-layer-token feeds the correct
    logits bit for bit: Δ 0, retention 100%, nothing re-routed, token-id share 1."""
    result, data = router_audit(toys.token_router_model(), covering_calibration())
    c, ret = result.conditions["static-layer-token"], result.retention["static-layer-token"]
    assert c.delta == 0.0 and c.ci95 == [0.0, 0.0]
    assert ret.defined and ret.value == pytest.approx(100.0, abs=1e-9)
    assert ret.ci95 == pytest.approx([100.0, 100.0], abs=1e-9)
    assert result.variance["router"].eta2_token_id == pytest.approx(1.0, abs=1e-12)
    routing = result.routing["router"]
    assert routing.changed["static-layer-token"] == 0.0
    assert [layer.changed["static-layer-token"] for layer in routing.per_layer] == [0.0, 0.0]
    # static-layer feeds one expert to every token: at most the tokens of one id keep theirs
    _, counts = np.unique(data.eval_ids, return_counts=True)
    assert routing.changed["static-layer"] >= 1 - counts.max() / data.eval_ids.size
    assert result.retention["static-layer"].value < 20.0
    assert result.token_profile == TokenProfile(V, data.eval_ids.size, 0, 0)


def _eta2_reference(values: np.ndarray, ids: np.ndarray) -> float:
    """One-way ANOVA on token id per (layer, component) cell, pooled: numpy group means.
    ``values [L, N, T, K]``, ``ids [N, T]``."""
    flat_ids = ids.reshape(-1)
    groups = np.unique(flat_ids)
    between = total = 0.0
    for layer in values:
        x = layer.reshape(len(flat_ids), -1)
        mean = x.mean(0)
        total += ((x - mean) ** 2).sum()
        for g in groups:
            member = x[flat_ids == g]
            between += len(member) * ((member.mean(0) - mean) ** 2).sum()
    return between / total


def test_context_router_keeps_little_and_its_id_explains_part():
    """Logits 4 * one_hot((x_t + x_{t-1}) % V): at even positions the expert depends on
    the previous token, which the id's calibration mean cannot know."""
    result, data = router_audit(toys.context_router_model(), covering_calibration(),
                                interventions={"mine": my_token_profile})
    mine, builtin = result.custom_conditions["mine"], result.conditions["static-layer-token"]
    assert (mine.nll, mine.ci95) == (builtin.nll, builtin.ci95)  # the one implementation
    ret = result.retention["static-layer-token"]
    assert ret.defined and ret.value < 50.0 and ret.ci95[1] < 70.0
    assert result.conditions["static-layer-token"].ci95[0] > 0.5
    assert result.routing["router"].changed["static-layer-token"] > 0.3
    ids = data.eval_ids
    prev = np.concatenate([np.zeros_like(ids[:, :1]), ids[:, :-1]], axis=1)
    logits = 4.0 * np.eye(V)[(ids + prev) % V]
    expected = _eta2_reference(np.stack([logits, logits]), ids)
    assert 0.2 < expected < 0.9  # the odd positions' key is a function of x_t, the even not
    assert result.variance["router"].eta2_token_id == pytest.approx(expected, rel=1e-9)


def _engine_profiles(model, data: AuditData, tmp_path, batch_size: int) -> StaticProfiles:
    options = dataclasses.replace(FAST, batch_size=batch_size)
    setup = prepare(AuditRequest(model, data=data, options=options))
    cache = CoefficientCache(tmp_path / f"cache-{batch_size}", cache_identity(setup),
                             batch_size, len(data.eval_ids))
    record_calibration(setup, cache, silent)
    return calibration_profiles(setup, cache)


def test_profiles_per_token_id_come_from_cached_calibration_and_fall_back(tmp_path):
    """The engine's profiles (calibration shards, any batch size) equal numpy's mean logits
    per id; ids missing from calibration get the mean over every calibration token, and
    are counted."""
    calib = toys.pair_sequences(10, 16, 4)
    calib[np.isin(calib, [5, 6, 7])] = 9  # three ids calibration never sees
    eval_ids = toys.pair_sequences(12, 16, 1)
    eval_ids[0, :3] = [5, 6, 5]  # and the evaluation set surely has
    data = AuditData(eval_ids, calib, {})
    model = toys.token_router_model()
    onehot = 4.0 * np.eye(V)[calib]  # [N, T, V]: the router's logits on calibration
    layer_mean = onehot.mean(axis=(0, 1))
    expected = np.stack([onehot[calib == i].mean(0) if (calib == i).any() else layer_mean
                         for i in range(V)])
    unseen = ~np.isin(eval_ids, calib)
    for batch_size in (3, 4):
        profiles = _engine_profiles(model, data, tmp_path, batch_size)
        for site in profiles.sites:  # every site, every token of the evaluation set
            got = profiles.layer_token(site, torch.from_numpy(eval_ids)).numpy()
            np.testing.assert_allclose(got, expected[eval_ids], rtol=0, atol=1e-12)
            np.testing.assert_allclose(profiles.layer(site).numpy(), layer_mean, atol=1e-12)
        assert profiles.unseen(eval_ids) == (int(unseen.sum()), len(np.unique(eval_ids[unseen])))
    result = fcaudit.audit(model, data=data, options=FAST)
    assert result.token_profile.eval_tokens_unseen == int(unseen.sum()) >= 3
    assert result.token_profile.eval_token_ids_unseen == len(np.unique(eval_ids[unseen])) >= 2
    assert result.token_profile.calibration_token_ids == len(np.unique(calib))
    _, md = build_markdown(result, [])
    retention = md[md.index("\n## Gap retention\n"):md.index("\n## Interaction\n")]
    assert "| `static-layer-token` |" in retention
    profiles = md[md.index("\n## Token-id profiles\n"):md.index("\n## Reproducibility\n")]
    assert (f"`static-layer-token` has a profile for each of the {len(np.unique(calib))} "
            f"token ids of the calibration set; {int(unseen.sum())} of the {eval_ids.size} "
            f"evaluation tokens ({len(np.unique(eval_ids[unseen]))} distinct ids) have an id "
            "it lacks and were fed the static-layer profile.") in profiles
    assert "| `static-layer-token` | per-site, per-token-id calibration mean |" in md


def test_static_of_a_recording_reads_its_token_ids():
    """Python API: a Recording carries its input ids; a plain dict needs ids= or one line."""
    model = toys.token_router_model()
    calib = covering_calibration()
    profiles = StaticProfiles(fcaudit.record(model, torch.from_numpy(calib)).sites)
    profiles.add(fcaudit.record(model, torch.from_numpy(calib)))
    ids = torch.from_numpy(toys.pair_sequences(3, 16, 8))
    recording = fcaudit.record(model, ids)
    fed = static(recording, profiles, "static-layer-token")
    assert isinstance(fed, type(recording))
    for name in recording:  # every id was in calibration: its profile is its own logits
        assert torch.equal(fed[name], recording[name])
    as_dict = {k: v for k, v in recording.items()}
    without_ids = StaticProfiles(profiles.sites)  # calibrated on a dict: no token ids
    without_ids.add(as_dict)
    assert torch.equal(static(as_dict, profiles, "static-layer-token", ids=ids)["routers.0"],
                       recording["routers.0"])
    for call, fragment in ((lambda: static(as_dict, profiles, "static-layer-token"),
                            "needs the token ids"),
                           (lambda: static(as_dict, profiles, "static-layer-token",
                                           ids=ids[:, :4]), "ids must be integer token ids"),
                           (lambda: static(recording, without_ids, "static-layer-token"),
                            "per-token-id")):
        with pytest.raises(FcauditError, match=fragment) as caught:
            call()
        assert "\n" not in str(caught.value)


def _share(values: np.ndarray, ids: np.ndarray, splits: list[int]) -> float | None:
    """TokenShare over ``values [L, N, T, K]`` streamed in batches ending at ``splits``."""
    sites = [fcaudit.Site(f"s{i}", f"s{i}", "f", i) for i in range(len(values))]
    acc = TokenShare(sites)
    for lo, hi in zip([0, *splits], [*splits, values.shape[1]], strict=True):
        acc.add({s.name: torch.from_numpy(values[i, lo:hi]) for i, s in enumerate(sites)},
                torch.from_numpy(ids[lo:hi]))
    return acc.share()


@pytest.mark.parametrize("seed", range(4))
def test_token_share_matches_numpy_and_its_known_answers(seed):
    rng = np.random.default_rng(seed)
    n, t, k, groups = 40, 25, 3, 10
    ids = rng.integers(100, 100 + groups, (n, t))
    splits = sorted(rng.choice(np.arange(1, n), 3, replace=False).tolist())
    layer_offset = np.array([0.0, 5.0]).reshape(2, 1, 1, 1)
    # a pure function of the id (plus a layer constant): the id explains everything
    table = rng.normal(size=(2, 100 + groups, k))
    pure = np.stack([table[i][ids] for i in range(2)]) + layer_offset
    assert _share(pure, ids, splits) == pytest.approx(1.0, abs=1e-12)
    # noise independent of the id: E[eta^2] = (groups - 1) / (tokens - 1) per cell
    noise = rng.normal(size=(2, n, t, k)) + layer_offset
    got = _share(noise, ids, splits)
    assert got == pytest.approx(_eta2_reference(noise, ids), rel=1e-9)
    assert got == pytest.approx((groups - 1) / (n * t - 1), rel=0.5)
    # a mix: the id effect plus unit noise -> var(effect) / (var(effect) + 1), pooled
    mixed = pure + rng.normal(size=pure.shape)
    assert _share(mixed, ids, splits) == pytest.approx(_eta2_reference(mixed, ids), rel=1e-9)
    effect = pure.reshape(2, n * t, k).var(axis=1).sum()
    assert _share(mixed, ids, splits) == pytest.approx(effect / (effect + 2 * k), abs=0.05)
    # no variance within layers (the layers differ): nothing to explain, not 0 / rounding
    assert _share(np.zeros_like(noise) + layer_offset + 0.9, ids, splits) is None


def _cond(lo: float, hi: float) -> ConditionResult:
    delta = (lo + hi) / 2
    return ConditionResult(3.0 + delta, delta, [lo, hi], [3.0 + delta], [delta])


@pytest.mark.parametrize("interval, label", [
    ((0.01, 0.03), "Partial dependence"),  # by hand: some penalty's interval lies above 0
    ((-0.03, -0.01), "No dependence"),  # none above, this one below, retention undefined
])
def test_static_layer_token_penalty_counts_in_the_dependence_verdict(interval, label):
    conditions = {name: _cond(-0.01, 0.01) for name in (
        "reassign", "shuffle", "reassign+shuffle", "static-layer", "static-layer-position")}
    conditions["static-layer-token"] = _cond(*interval)
    undefined = Retention(0.0, [-0.1, 0.1], None, None, False)
    sentence = dependence_part(conditions, {"static-layer": undefined}).sentence
    assert sentence.startswith(f"{label} on the coefficient assignment"), sentence
    if label == "No dependence":
        assert "a static per-layer-and-token-id profile lowers the NLL by 0.0200 nats " \
               "[0.0100, 0.0300]" in sentence


def test_a_cache_from_before_token_sums_is_refused(tmp_path):
    """Calibration shards of cache schema 4 hold no per-token-id sums: such a cache is
    refused in one line (delete and rerun), never read with a profile missing."""
    import json
    audit_out = tmp_path / "out"
    data = AuditData(toys.pair_sequences(8, 16, 1), covering_calibration(), {})
    fcaudit.audit(toys.token_router_model(), audit_out, data=data, options=FAST, report=False)
    manifest = audit_out / "cache" / "manifest.json"
    old = {**json.loads(manifest.read_text()), "schema": "fcaudit.cache/4"}
    manifest.write_text(json.dumps(old))
    with pytest.raises(FcauditError, match="written by another fcaudit version") as caught:
        fcaudit.audit(toys.token_router_model(), audit_out, data=data, options=FAST,
                      report=False)
    assert "\n" not in str(caught.value) and "'fcaudit.cache/4'" in str(caught.value)


@pytest.mark.parametrize("seed, trailing", [(0, ()), (1, (3, 2)), (2, (1,)), (3, (4,))])
def test_profile_per_token_id_equals_numpy_group_means(seed, trailing):
    """Random coefficients, ids and batch splits: each id's profile is numpy's mean over
    its calibration tokens; an unseen id gets the mean over all of them."""
    rng = np.random.default_rng(seed)
    n, t = 13, 7
    sites = [fcaudit.Site(f"s{i}", f"s{i}", "f", i) for i in range(2)]
    values = {s.name: rng.normal(size=(n, t, *trailing)) for s in sites}
    ids = rng.integers(0, 30, (n, t))
    profiles = StaticProfiles(sites)
    cuts = sorted(rng.choice(np.arange(1, n), 4, replace=False).tolist())
    for lo, hi in zip([0, *cuts], [*cuts, n], strict=True):
        profiles.add({k: torch.from_numpy(v[lo:hi]) for k, v in values.items()},
                     ids=ids[lo:hi])
    asked = np.arange(-2, 33).reshape(5, 7)  # ids -2..32: some never seen
    for site in sites:
        x = values[site.name]
        expected = np.stack([x[ids == i].mean(0) if (ids == i).any() else x.mean((0, 1))
                             for i in asked.reshape(-1)]).reshape(*asked.shape, *trailing)
        got = profiles.layer_token(site, torch.from_numpy(asked)).numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    missing = ~np.isin(asked, ids)
    assert profiles.unseen(asked) == (int(missing.sum()), int(missing.sum()))
