"""The audit engine: replay identity, interventions, known answers, bad input, adapters,
user-defined interventions, the library API."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import toys
from conftest import FAST, replay_inputs, toy_data
from torch import nn

import fcaudit
from fcaudit.api import audit
from fcaudit.core.adapters import FLAT, TupleAdapter
from fcaudit.core.contract import Site
from fcaudit.core.errors import FcauditError
from fcaudit.core.interventions import Intervention, StaticProfiles, draw, static
from fcaudit.core.sites import find_sites
from fcaudit.engine.plan import Run, choose, feed
from fcaudit.engine.result import AuditResult
from fcaudit.engine.run import AuditOptions
from fcaudit.io.data import AuditData


def toy_audit(mode: str, tmp_path, **kw) -> AuditResult:
    model = getattr(toys, f"{mode}_model")()
    return audit(model, tmp_path / mode, sites=["gates.*"], data=toy_data(), options=FAST,
                 report=False, **kw)


# ---- the toys' answers by hand, in numpy, from their definitions in tests/toys.py ----

EVEN = (np.arange(16) % 2 == 0)  # toy_data's windows hold 16 tokens; even positions predict
ONE_HOT = np.eye(toys.V)


def mean_nll(logits: np.ndarray, ids: np.ndarray) -> float:
    """Mean next-token NLL over the T - 1 predicted positions, from logits ``[N, T, V]``."""
    z = logits[:, :-1]
    target = np.take_along_axis(z, ids[:, 1:, None], -1)[..., 0]
    return float((np.log(np.exp(z).sum(-1)) - target).mean())


def content_logits(gate: np.ndarray) -> np.ndarray:
    """The content toy fed ``gate [N, T, V]`` at both sites: 8 times it, rolled by one."""
    return 8.0 * np.roll(gate, 1, axis=-1) * EVEN[None, :, None]


def position_logits(gate0: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The position toy fed ``gate0 [N, T]`` at site 0 (site 1 is 0): 8 times it at x + 1."""
    return 8.0 * ONE_HOT[(ids + 1) % toys.V] * (gate0 * EVEN)[..., None]


def fed_ids(ids: np.ndarray, seed: int, condition: str) -> np.ndarray:
    """The token ids whose coefficients each position receives under ``condition`` in the
    repeat drawn with ``seed`` (the draw the result's seeds name)."""
    drawn = draw(seed, *ids.shape)
    if condition == "reassign":
        return ids[drawn.donor]
    return np.take_along_axis(ids, drawn.positions, 1)


def position_shuffle_by_hand(seeds: list[int]) -> list[float]:
    """The position toy's shuffle penalty per repeat: an even position keeps its logit 8
    only when its gate comes from an even position."""
    ids = toy_data().eval_ids
    even = np.broadcast_to(EVEN.astype(float), ids.shape)
    correct = mean_nll(position_logits(even, ids), ids)
    return [mean_nll(position_logits(np.take_along_axis(even, draw(seed, *ids.shape)
                                                        .positions, 1), ids), ids) - correct
            for seed in seeds]


def sentence_numbers(sentence: str) -> list[float]:
    return [float(x) for x in re.findall(r"[-+]?\d+\.\d+", sentence)]


def test_correct_replay_is_bitwise_identical(tiny_runs, tmp_path):
    result = audit(str(tiny_runs["featuregate"]), tmp_path / "a",
                   data=fcaudit.DataSpec(max_eval=10, max_calib=6), options=FAST, report=False)
    assert result.identity_replay_max_abs_diff == 0.0 and result.identity is None
    assert result.conditions["correct"].nll == result.conditions["original"].nll
    assert set(result.conditions) == {"original", "correct", "reassign", "shuffle",
                                      "reassign+shuffle", "static-layer",
                                      "static-layer-position", "static-layer-token",
                                      "global-mean"}
    assert len(result.per_layer["reassign"]) == 4
    assert result.data["eval_sequences"] == 10 and result.data["calib_sequences"] == 6
    on_disk = AuditResult.read(tmp_path / "a" / "audit.json")
    assert on_disk.to_json() == result.to_json()


def test_content_gate_gives_large_penalties_and_no_retention(tmp_path):
    """Every penalty, NLL and the retention equal the content toy's by hand: a position fed
    another token's one-hot puts the logit 8 on a wrong token (+8 nats there)."""
    a = toy_audit("content", tmp_path)
    c, ids, calib = a.conditions, toy_data().eval_ids, toy_data().calib_ids
    correct = mean_nll(content_logits(ONE_HOT[ids]), ids)
    assert c["correct"].nll == pytest.approx(correct, abs=1e-6)
    for name, seeds in (("reassign", a.seeds.reassign), ("shuffle", a.seeds.shuffle)):
        by_hand = [mean_nll(content_logits(ONE_HOT[fed_ids(ids, seed, name)]), ids) - correct
                   for seed in seeds]
        assert c[name].repeat_deltas == pytest.approx(by_hand, abs=1e-6), name
        assert c[name].delta == pytest.approx(np.mean(by_hand), abs=1e-6), name
        assert c[name].ci95[0] <= c[name].delta <= c[name].ci95[1]
    # global-mean: one scalar 1/V everywhere, so every logit is equal: NLL log V
    assert c["global-mean"].nll == pytest.approx(np.log(toys.V), abs=1e-6)
    profile = np.broadcast_to(ONE_HOT[calib].mean(axis=(0, 1)), (*ids.shape, toys.V))
    static = mean_nll(content_logits(profile), ids)
    assert c["static-layer"].nll == pytest.approx(static, abs=1e-6)
    kept = 100 * (np.log(toys.V) - static) / (np.log(toys.V) - correct)
    assert a.retention["static-layer"].value == pytest.approx(kept, abs=1e-4)
    r, s, sl = c["reassign"], c["shuffle"], a.retention["static-layer"]
    assert a.verdict.dependence.startswith("Strong dependence")
    said = sentence_numbers(a.verdict.dependence)  # nats to 4 decimals, percent to 2
    assert said[:6] == pytest.approx([r.delta, *r.ci95, s.delta, *s.ci95], abs=5e-5)
    assert said[6:] == pytest.approx([sl.value, *sl.ci95], abs=5e-3)


def test_constant_gates_give_no_penalty_and_full_retention(tmp_path):
    a = toy_audit("constant", tmp_path)
    ids = toy_data().eval_ids
    # gates 0.9 and 0.1: the logit of x + 1 is 8 (0.9 - 0.1) = 6.4 at even positions; the
    # global mean 0.5 at both gates cancels it (NLL log V)
    gap = 0.8 * np.ones(ids.shape)
    assert a.conditions["correct"].nll == pytest.approx(
        mean_nll(position_logits(gap, ids), ids), abs=1e-6)
    assert a.conditions["global-mean"].nll == pytest.approx(np.log(toys.V), abs=1e-6)
    for name in ("reassign", "shuffle", "reassign+shuffle", "static-layer"):
        assert abs(a.conditions[name].delta) < 1e-6, name
    assert a.retention["static-layer"].value == pytest.approx(100.0, abs=1e-3)
    assert a.variance["gates.*"].eta2_layer == pytest.approx(1.0)
    assert a.verdict.dependence.startswith("Weak dependence")


def test_position_gates_shuffle_hurts_reassign_does_not(tmp_path):
    """By hand: gate 0 is 1 at even positions, so the logit of x + 1 there is 8; shuffled,
    a position keeps it only when drawn from an even one; the static layer profile is 0.5
    (half the positions are even): logit 4."""
    a = toy_audit("position", tmp_path)
    ids = toy_data().eval_ids
    correct = mean_nll(position_logits(np.ones(ids.shape), ids), ids)
    shuffled = position_shuffle_by_hand(a.seeds.shuffle)
    assert a.conditions["shuffle"].repeat_deltas == pytest.approx(shuffled, abs=1e-6)
    assert a.conditions["shuffle"].delta == pytest.approx(np.mean(shuffled), abs=1e-6)
    assert abs(a.conditions["reassign"].delta) < 1e-6
    assert a.retention["static-layer-position"].value == pytest.approx(100.0, abs=1e-3)
    static = mean_nll(position_logits(0.5 * np.ones(ids.shape), ids), ids)
    kept = 100 * (np.log(toys.V) - static) / (np.log(toys.V) - correct)  # 81.96%
    assert a.retention["static-layer"].value == pytest.approx(kept, abs=1e-4)


class Silent(nn.Module):
    """Gates whose content the output ignores entirely: no dependence to find, and no gap
    between correct and global-mean replay either."""

    def __init__(self) -> None:
        super().__init__()
        self.gates = nn.ModuleList(toys.ToyGate("content", i) for i in range(2))
        self.scale = nn.Parameter(torch.tensor(8.0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        g = [gate(ids) for gate in self.gates]
        return self.scale * toys.F.one_hot((ids + 1) % toys.V, toys.V).float() \
            + 0 * sum(x.sum() for x in g)


def test_no_measurable_dependence_is_said_plainly(tmp_path):
    """The output ignores the gates: every condition's NLL is the correct one exactly, no
    gap, no retention; the sentence quotes those zero penalties and says so."""
    a = audit(Silent(), tmp_path, sites=["gates.*"], data=toy_data(), options=FAST,
              report=False)
    assert {c.delta for c in a.conditions.values()} == {0.0}
    assert a.retention["static-layer"].value is None
    assert a.retention["static-layer"].gap == 0.0
    r, s = a.conditions["reassign"], a.conditions["shuffle"]
    assert sentence_numbers(a.verdict.dependence) == [r.delta, *r.ci95, s.delta, *s.ci95]
    assert a.verdict.dependence.startswith("No measurable dependence")
    assert "retention is undefined" in a.verdict.dependence


# ------------------------------------------------------------------ interventions


def test_reassign_is_a_derangement_shared_by_all_sites(tmp_path):
    data = toy_data()
    inputs = replay_inputs(toys.content_model(), data, tmp_path)
    rand = inputs.draws[0]
    assert not np.any(rand.donor == np.arange(len(data.eval_ids)))
    for b in range(inputs.cache.n_batches):
        fed = feed(Run("reassign"), b, inputs, torch.device("cpu"))
        for i, n in enumerate(inputs.cache.batch_range(b)):
            donor = toys.F.one_hot(torch.from_numpy(data.eval_ids[rand.donor[n]]), toys.V)
            for site in inputs.sites:  # every site receives the same donor's coefficients
                assert torch.equal(fed[site][i], donor.float())


def test_shuffle_is_one_permutation_per_sequence_shared_by_sites(tmp_path):
    data = toy_data()
    inputs = replay_inputs(toys.content_model(), data, tmp_path)
    rand = inputs.draws[0]
    assert len({tuple(p) for p in rand.positions}) == len(data.eval_ids)
    fed = feed(Run("shuffle"), 0, inputs, torch.device("cpu"))
    for i, n in enumerate(inputs.cache.batch_range(0)):
        expected = toys.F.one_hot(torch.from_numpy(data.eval_ids[n][rand.positions[n]]), toys.V)
        for site in inputs.sites:
            assert torch.equal(fed[site][i], expected.float())


def test_static_profiles_come_from_calibration_data_only(tmp_path):
    calib = toys.pair_sequences(8, 16, 2)
    for seed in (10, 11):
        data = AuditData(toys.pair_sequences(8, 16, seed), calib, {})
        audit(toys.content_model(), tmp_path / str(seed), sites=["gates.*"], data=data,
              options=FAST, report=False)
    shards = [sorted((tmp_path / str(seed) / "cache").glob("calib-*.safetensors"))
              for seed in (10, 11)]
    assert [p.read_bytes() for p in shards[0]] == [p.read_bytes() for p in shards[1]]
    sites = find_sites(toys.content_model(), ["gates.*"])
    profiles = StaticProfiles(sites)
    profiles.add({s.name: toys.F.one_hot(torch.from_numpy(calib), toys.V).float()
                  for s in sites})
    expected = torch.from_numpy(np.eye(toys.V)[calib].mean(axis=(0, 1)))
    assert torch.allclose(profiles.layer(sites[0]), expected)


def test_user_defined_interventions_are_replayed_and_reported(tmp_path):
    """A user's condition is replayed, bootstrapped and reported like a built-in one: here
    one that rebuilds static-layer from the public helpers reproduces it exactly, one that
    changes nothing costs exactly 0, and a random one runs once per repeat."""
    def my_static(coefficients, context):
        return static(coefficients, context.profiles, "static-layer")

    def scrambled(coefficients, context):
        perm = context.rng.permutation(len(context.rows))
        return {k: v[torch.from_numpy(perm)] for k, v in coefficients.items()}

    a = toy_audit("content", tmp_path, interventions=[
        Intervention("my-static", my_static), Intervention("nothing", lambda c, ctx: {}),
        Intervention("scrambled", scrambled, repeats=2)])
    custom = a.custom_conditions
    assert custom["my-static"].nll == a.conditions["static-layer"].nll
    assert custom["my-static"].ci95 == a.conditions["static-layer"].ci95
    assert custom["nothing"].delta == 0.0 and custom["nothing"].ci95 == [0.0, 0.0]
    assert len(custom["scrambled"].repeats) == 2 and custom["scrambled"].delta > 0.5
    with pytest.raises(FcauditError, match="intervention 'bad'"):
        toy_audit("content", tmp_path / "x", interventions={"bad": lambda c, ctx: {"x": 1}})


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize("case, message", [
    ("one_eval", "at least 2 evaluation sequences"),
    ("shared_window", "share 1 identical window"),
    ("oov", "vocabulary"),
])
def test_bad_data_is_refused(case, message, tiny_runs, tmp_path):
    from fcaudit.io.loading import load
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
        audit(loaded, tmp_path / "out", data=AuditData(ev, ca, {}), options=FAST)
    assert not (tmp_path / "out").exists()


def test_site_output_must_be_per_token(tmp_path):
    model = toys.content_model()
    model.gates[0].forward = lambda ids: torch.zeros(ids.shape[0])
    with pytest.raises(FcauditError, match="neither \\[batch"):
        audit(model, tmp_path, sites=["gates.*"], data=toy_data(), options=FAST)


def test_site_that_never_runs(tmp_path):
    with pytest.raises(FcauditError, match="never ran"):
        audit(toys.content_model(), tmp_path, sites=["gates"], data=toy_data(), options=FAST)


def test_nan_coefficients_are_reported(tmp_path):
    model = toys.constant_model()
    model.gates[1].forward = lambda ids: torch.full((*ids.shape, 1), float("nan"))
    with pytest.raises(FcauditError, match="non-finite .* gates.1"):
        audit(model, tmp_path / "out", sites=["gates.*"], data=toy_data(), options=FAST)
    assert not (tmp_path / "out" / "audit.json").exists()


# ------------------------------------------------- identity: a check, not a statistic


class Twice(toys.ToyModel):
    """Calls its first gate twice per forward: only one call could be replayed."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.gates[0](ids)
        return super().forward(ids)


class InPlace(toys.ToyModel):
    """Edits the controller's output in place after using it (as some models scale a gate)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        g = [gate(ids) for gate in self.gates]
        out = self.scale * torch.roll(sum(g) / len(g), shifts=1, dims=-1)
        for x in g:
            x.mul_(0.0)  # what was cached must not change, and replay must not corrupt it
        return out * (torch.arange(ids.shape[1]) % 2 == 0).float().view(1, -1, 1)


class Noisy(toys.ToyModel):
    """Randomness in the forward pass (like dropout left on)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) + 0.1 * torch.randn(*ids.shape, toys.V)


def test_site_called_twice_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(FcauditError, match="gates.0 .*ran twice in one forward pass"):
        audit(Twice("content"), tmp_path / "out", sites=["gates.*"], data=toy_data(),
              options=FAST)
    assert not (tmp_path / "out").exists()


def test_in_place_edits_of_the_controller_output_keep_replay_exact(tmp_path):
    a = audit(InPlace("content"), tmp_path, sites=["gates.*"], data=toy_data(), options=FAST,
              report=False)
    b = toy_audit("content", tmp_path)
    assert a.identity_replay_max_abs_diff == 0.0
    assert a.conditions["reassign"].delta == pytest.approx(b.conditions["reassign"].delta)


def test_randomness_stops_the_audit_unless_allowed(tmp_path):
    with pytest.raises(FcauditError, match="identity replay is not exact.*not deterministic"):
        audit(Noisy("content"), tmp_path / "out", sites=["gates.*"], data=toy_data(),
              options=FAST)
    assert not (tmp_path / "out").exists()
    allowed = AuditOptions(**{**FAST.__dict__, "allow_nonexact_identity": True})
    a = audit(Noisy("content"), tmp_path / "ok", sites=["gates.*"], data=toy_data(),
              options=allowed, report=False)
    assert a.identity is not None and not a.identity.exact and a.identity.max_abs_diff > 0
    assert all(v.startswith("[NOT EXACT") for v in (a.verdict.variation,
                                                    a.verdict.dependence, a.verdict.execution))


@pytest.mark.parametrize("sites, message", [
    (["gates.*", "gates.*"], "given more than once"),
    (["gates.*", "gates.0"], "named twice"),
    ([Site("g", "gates.0", "f", 0), Site("h", "gates", "f", 1)], "lies inside site gates"),
])
def test_ambiguous_site_lists_are_refused(sites, message, tmp_path):
    with pytest.raises(FcauditError, match=message):
        audit(toys.content_model(), tmp_path, sites=sites, data=toy_data(), options=FAST)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64])
def test_non_floating_coefficients_are_refused(dtype, tmp_path):
    model = toys.content_model()
    for gate in model.gates:
        gate.forward = lambda ids: toys.F.one_hot(ids, toys.V).to(dtype)
    with pytest.raises(FcauditError, match="not floating point"):
        audit(model, tmp_path, sites=["gates.*"], data=toy_data(), options=FAST)


# --------------------------------------------------------------------- adapters


class FlatGates(toys.ToyModel):
    """Gates run on flattened tokens ``[B*T]`` and return ``[B*T, V]``."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        B, T = ids.shape
        g = [gate(ids.reshape(B * T, 1))[:, 0].view(B, T, -1) for gate in self.gates]
        even = (torch.arange(T) % 2 == 0).float().view(1, -1, 1)
        return self.scale * torch.roll(sum(g) / len(g), shifts=1, dims=-1) * even


class Routed(toys.ToyModel):
    """Gates return ``(scores, top-1 index)`` tuples, as a router does."""

    def __init__(self) -> None:
        super().__init__("content")
        for gate in self.gates:
            gate.forward = lambda ids: self.route(toys.F.one_hot(ids, toys.V).float())

    @staticmethod
    def route(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return scores, scores.argmax(-1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        g = [gate(ids)[0] for gate in self.gates]
        even = (torch.arange(ids.shape[1]) % 2 == 0).float().view(1, -1, 1)
        return self.scale * torch.roll(sum(g) / len(g), shifts=1, dims=-1) * even


def test_flattened_outputs_are_audited_through_the_flat_adapter(tmp_path):
    a = audit(FlatGates("content"), tmp_path, sites=["gates.*"], data=toy_data(),
              options=FAST, report=False)
    b = toy_audit("content", tmp_path)
    assert a.identity_replay_max_abs_diff == 0.0
    assert a.conditions["reassign"].delta == pytest.approx(b.conditions["reassign"].delta)
    assert a.sites[0].adapter == "flat"


def test_tuple_outputs_need_an_adapter_and_work_with_one(tmp_path):
    with pytest.raises(FcauditError, match="TupleAdapter"):
        audit(Routed(), tmp_path / "no", sites=["gates.*"], data=toy_data(), options=FAST)
    adapter = TupleAdapter(0, lambda scores, call: Routed.route(scores))
    sites = [Site(f"gates.{i}", f"gates.{i}", "router", i, adapter) for i in range(2)]
    a = audit(Routed(), tmp_path / "yes", sites=sites, data=toy_data(), options=FAST,
              report=False)
    assert a.identity_replay_max_abs_diff == 0.0
    ids = toy_data().eval_ids  # the scores are the content toy's one-hot: its reassign cost
    correct = mean_nll(content_logits(ONE_HOT[ids]), ids)
    by_hand = [mean_nll(content_logits(ONE_HOT[fed_ids(ids, seed, "reassign")]), ids) - correct
               for seed in a.seeds.reassign]
    assert a.conditions["reassign"].repeat_deltas == pytest.approx(by_hand, abs=1e-6)


def test_an_adapter_that_does_not_rebuild_the_output_is_refused(tmp_path):
    wrong = TupleAdapter(0, lambda scores, call: (scores, scores.argmin(-1)))
    sites = [Site(f"gates.{i}", f"gates.{i}", "router", i, wrong) for i in range(2)]
    with pytest.raises(FcauditError, match="site gates.0 .*does not reproduce it bit for bit"):
        audit(Routed(), tmp_path, sites=sites, data=toy_data(), options=FAST)


def test_flat_adapter_round_trip():
    from fcaudit.core.contract import SiteCall
    call = SiteCall(nn.Identity(), (), {}, 2, 3)
    x = torch.randn(6, 4)
    assert torch.equal(FLAT.rebuild(FLAT.extract(x, call), call), x)


# ------------------------------------------------------------- library surface


def test_rerun_reuses_the_cache_and_replays_only_its_proof(tmp_path):
    """A rerun reads coefficients and replay results from the cache once proven: it runs
    the probe passes (with the two looks that prove the glob sites' token axis), one pass
    per other cached record batch and the replay proof (every run of the plan once, on the
    cached batch its sample drew, with the correct replay before and after the batch's
    other sampled runs), and gives the same result."""
    model = toys.content_model()
    passes = []
    model.register_forward_hook(lambda *_: passes.append(1))
    run = lambda: audit(model, tmp_path, sites=["gates.*"], data=toy_data(),  # noqa: E731
                        options=FAST, report=False)
    first = run()
    first_passes, passes[:] = len(passes), []
    second = run()
    assert FAST.batch_size == 4  # 12 + 12 sequences: 3 evaluation and 3 calibration batches
    reuse = second.runtime.reuse
    runs = reuse["runs_reused"] // 3
    sample = choose("sample", runs, [0, 1, 2], reuse["verify_seed"])
    assert sorted(i for picked in sample.by_batch.values() for i in picked) == \
        list(range(runs))  # every run proven once
    proof = sum(len([i for i in picked if i]) + 2 for picked in sample.by_batch.values())
    # vocabulary probe, layout look, the look one token shorter, probe record, probe replay;
    # evaluation batches 1, 2 and calibration batches 0, 1, 2 recomputed to prove their
    # cached records; then the proof, at most one replay of every run and 2 per batch
    assert first_passes > 40 and len(passes) == 5 + 2 + 3 + proof
    assert proof <= runs + 2 * 3 and reuse["replay_runs_verified"] == runs
    assert reuse["batches_reused"] == 3
    assert first.to_json()["conditions"] == second.to_json()["conditions"]


def test_in_memory_audit_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = audit(toys.position_model(), sites=["gates.*"], data=toy_data(), options=FAST)
    assert result.conditions["shuffle"].repeat_deltas == pytest.approx(
        position_shuffle_by_hand(result.seeds.shuffle), abs=1e-6)
    assert list(tmp_path.iterdir()) == []


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
          "report": False}
    a = audit(UserModel(True), tmp_path / "a", dense=UserModel(False), blocks="net.blocks.*",
              **kw)
    ex = a.execution
    assert ex.measured and ex.blocks_executed == ex.blocks_present == 2
    assert not ex.conditional_execution and ex.flops_ratio > 1.0
    b = audit(UserModel(True), tmp_path / "b", **kw)
    assert not b.execution.measured and "--dense" in b.execution.reason


def test_controllers_never_run_during_replay(tmp_path):
    """Only live passes call the gates (the probe's record, calibration and the remaining
    evaluation batches, one vocabulary probe for a model that states no vocabulary size,
    and the two looks that prove the glob sites' token axis): every replay feeds stubs
    instead."""
    model = toys.content_model()
    calls = []
    for gate in model.gates:
        gate.register_forward_hook(lambda *_: calls.append(1))
    data = toy_data(n_eval=12, n_calib=8)
    audit(model, tmp_path, sites=["gates.*"], data=data, options=FAST, report=False)
    live_passes = -(-12 // FAST.batch_size) + -(-8 // FAST.batch_size) + 1 + 2
    assert len(calls) == live_passes * len(model.gates)


# ------------------------------------------------------------------- prefix reuse


def _deep_models() -> list[nn.Module]:
    from fcaudit.models.featuregate import GPT, GPTConfig
    from fcaudit.models.mudd import PRESETS, MuddModel
    torch.manual_seed(0)
    models = [GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32)),
              MuddModel(dataclasses.replace(PRESETS["tiny"], vocab_size=64, n_layer=4))]
    for model in models:  # weights large enough that every coefficient matters
        for p in model.parameters():
            nn.init.normal_(p, std=0.2)
    return models


@pytest.mark.parametrize("index", [0, 1], ids=["featuregate", "mudd"])
def test_prefix_reuse_gives_the_naive_schedules_audit_json(index: int, tmp_path):
    model = _deep_models()[index]
    data = AuditData(np.random.default_rng(0).integers(0, 64, (12, 16)),
                     np.random.default_rng(1).integers(0, 64, (8, 16)), {})
    results = {schedule: audit(model, tmp_path / schedule, data=data, report=False,
                               options=dataclasses.replace(FAST, schedule=schedule))
               for schedule in ("naive", "prefix")}
    texts = [(tmp_path / s / "audit.json").read_text() for s in ("naive", "prefix")]
    naive, prefix = (json.loads(t) for t in texts)
    for key in ("runtime", "command"):
        naive.pop(key), prefix.pop(key)
    assert naive == prefix
    assert results["prefix"].runtime.schedule["batches_prefix_reused"] == 3
    assert results["naive"].runtime.schedule["batches_prefix_reused"] == 0


def test_prefix_reuse_falls_back_when_it_cannot_prove_exactness(tmp_path, monkeypatch):
    """Stubs that return something else than the block computed: the proof fails on every
    batch, the per-layer runs fall back to full passes, and the numbers stay right."""
    from fcaudit.core import replaying as replay_mod
    model = _deep_models()[0]
    data = AuditData(np.random.default_rng(0).integers(0, 64, (8, 16)),
                     np.random.default_rng(1).integers(0, 64, (8, 16)), {})
    naive = audit(model, data=data, options=dataclasses.replace(FAST, schedule="naive"))
    real = replay_mod.clone_tree
    monkeypatch.setattr(replay_mod.OutputStub, "forward",
                        lambda self, *a, **k: real(self._output[0]) * 1.5)
    prefix = audit(model, data=data, options=FAST)
    assert prefix.runtime.schedule["batches_fell_back_to_full_passes"] == 2
    assert [c.nll for c in prefix.per_layer["reassign"]] == \
        [c.nll for c in naive.per_layer["reassign"]]


# ------------------------------------------------ replay results reused only when the same

GAIN = 0.0  # read by `scale_last` at call time: a module-level constant the user edits


def scale_last(coefficients, context):
    return {"gates.1": coefficients["gates.1"] * GAIN}


def _closure(k: float):
    return lambda c, ctx: {"gates.1": c["gates.1"] * k}


def _default(k: float):
    def scaled(c, ctx, k=k):
        return {"gates.1": c["gates.1"] * k}
    return scaled


def _open(site: str):
    def last_gate_open(c, ctx):  # the README's pattern, retargeted by editing one string
        return {site: torch.ones_like(c[site])}
    return last_gate_open


EDITS = {  # (first version, edited version) of one intervention, same bytecode each time
    "closure": (_closure(0.0), _closure(1.0)),
    "default": (_default(0.0), _default(1.0)),
    "site": (_open("gates.1"), _open("gates.0")),
    "constant": (lambda c, ctx: {"gates.1": c["gates.1"] * 2},
                 lambda c, ctx: {"gates.1": c["gates.1"] * 3}),
}


def _without_runtime(path) -> dict:
    result = json.loads(path.read_text())
    result.pop("runtime"), result.pop("command")
    return result


@pytest.mark.parametrize("edit", ["global", *EDITS])
def test_an_edited_intervention_is_replayed_again_not_reused(edit: str, tmp_path, monkeypatch):
    """The same `out`, an intervention edited in what its bytecode does not show (a global,
    a closure cell, a default, a site name, a constant): every batch is replayed again and
    the audit equals a fresh one into a new folder; a rerun with nothing edited reuses."""
    model = toys.position_model() if edit == "site" else toys.content_model()
    out = tmp_path / "out"
    if edit == "global":
        first, second = scale_last, scale_last
    else:
        first, second = EDITS[edit]
    run = lambda fn, where: audit(model, where, sites=["gates.*"], data=toy_data(),  # noqa: E731
                                  options=FAST, report=False, interventions={"edited": fn})
    before = run(first, out)
    monkeypatch.setitem(globals(), "GAIN", 1.0)
    after = run(second, out)
    fresh = run(second, tmp_path / "fresh")
    assert after.runtime.reuse["batches_recomputed"] == 3
    assert after.runtime.reuse["batches_reused"] == 0 and after.runtime.reuse["runs_reused"] == 0
    assert _without_runtime(out / "audit.json") == _without_runtime(tmp_path / "fresh" /
                                                                    "audit.json")
    assert before.custom_conditions["edited"].delta != after.custom_conditions["edited"].delta
    # by hand: the next token's logit s at the 8 even of the 15 predicted positions has NLL
    # log(1 + 63 e^-s) among 64; correct is s = 8
    nll = lambda s: np.log1p(63 * np.exp(-s))  # noqa: E731
    if edit in ("global", "closure", "default"):  # x 0 then x 1: the edit is the identity
        # content: gate 1 zeroed halves the logit
        by_hand = 8 / 15 * (nll(4.0) - nll(8.0))
        assert before.custom_conditions["edited"].delta == pytest.approx(by_hand, abs=1e-6)
        assert after.custom_conditions["edited"].delta == 0.0
    if edit == "site":  # position: gate 1 open zeroes the logit; gate 0 is open already
        by_hand = 8 / 15 * (nll(0.0) - nll(8.0))
        assert before.custom_conditions["edited"].delta == pytest.approx(by_hand, abs=1e-6)
        assert after.custom_conditions["edited"].delta == 0.0
    again = run(second, out)
    proof = ("verify_seed", "replay_runs_verified", "replay_batches_verified",
             "replay_share_verified")
    kept = lambda reuse: {k: v for k, v in reuse.items() if k not in proof}  # noqa: E731
    assert kept(again.runtime.reuse) == {**kept(after.runtime.reuse), "batches_reused": 3,
                                         "batches_recomputed": 0, "runs_reused": 3 * 18,
                                         "runs_recomputed": 0}
    assert after.runtime.reuse["replay_runs_verified"] == 0  # nothing reused: nothing proven
    assert again.runtime.reuse["replay_runs_verified"] == 18  # every run on one batch
    assert again.to_json()["custom_conditions"] == fresh.to_json()["custom_conditions"]
    from fcaudit.report.audit_report import build_markdown
    assert "Replay results: 3 of 3 batches (54 runs) reused" in build_markdown(again, [])[1]


def test_another_schedule_into_the_same_out_is_replayed_again(tmp_path):
    """`--schedule naive` after the prefix schedule into the same folder: every batch is
    replayed in full passes (none reused) and the numbers equal the prefix audit's."""
    model = _deep_models()[0]
    data = AuditData(np.random.default_rng(0).integers(0, 64, (12, 16)),
                     np.random.default_rng(1).integers(0, 64, (8, 16)), {})
    results = [audit(model, tmp_path, data=data, report=False,
                     options=dataclasses.replace(FAST, schedule=schedule))
               for schedule in ("prefix", "naive")]
    prefix, naive = (r.runtime for r in results)
    assert prefix.schedule["batches_prefix_reused"] == 3
    assert naive.schedule["batches_prefix_reused"] == 0
    assert naive.reuse["batches_recomputed"] == 3 and naive.reuse["batches_reused"] == 0
    texts = [r.to_json() for r in results]
    for text in texts:
        text.pop("runtime"), text.pop("command")
    assert texts[0] == texts[1]


@pytest.mark.parametrize("given, message", [
    ([Intervention("twin", lambda c, ctx: {}), Intervention("twin", lambda c, ctx: {})],
     "two interventions are named 'twin'"),
    ({"a": Intervention("twin", lambda c, ctx: {}), "b": Intervention("twin", lambda c, ctx: {})},
     "two interventions are named 'twin'"),
    ({"reassign@gates.0": lambda c, ctx: {}}, "not a built-in condition or per-layer run"),
    ([Intervention("", lambda c, ctx: {})], "give a new name"),
])
def test_interventions_sharing_a_name_are_refused_before_any_work(given, message, tmp_path):
    """Results are keyed by name: two interventions under one name (or one named like a
    per-layer run) would be merged into one condition whose delta is their mean."""
    model = toys.content_model()
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    with pytest.raises(FcauditError, match=message):
        audit(model, tmp_path / "out", sites=["gates.*"], data=toy_data(), options=FAST,
              interventions=given)
    assert calls == [] and not (tmp_path / "out").exists()


class StateBlock(nn.Module):
    """A gated residual block that passes state to later blocks outside its output."""

    def __init__(self, index: int, shared: dict) -> None:
        super().__init__()
        self.gate, self.mix = nn.Linear(16, 1), nn.Linear(16, 16)
        self.index, self._shared = index, shared  # a plain dict: no module, no buffer

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate = self.gate(h)
        out = h + torch.sigmoid(gate) * torch.tanh(self.mix(h))
        mode, shared = self._shared["mode"], self._shared
        if mode == "history":  # fed a gate its live copy would not give: marked for good
            live = shared["copies"][self.index](h)
            shared["dirty"] = shared.get("dirty", False) or not torch.equal(live, gate)
            return out + 0.01 * shared["dirty"]
        if self.index == 0:
            if mode == "self":
                self.last = out  # the case: block 0 leaves its output on itself
            shared["h"] = out
            return out
        if mode == "clobber" and self.index > 1:
            return out
        source = shared["first"].last if mode == "self" else shared["h"]
        out = out + torch.tanh(source)
        if mode == "clobber":  # only block 1 reads what block 0 left, then overwrites it
            shared["h"] = out
        return out


class Stateful(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = {"mode": mode}
        self.emb, self.head = nn.Embedding(64, 16), nn.Linear(16, 64)
        self.blocks = nn.ModuleList(StateBlock(i, self.shared) for i in range(4))
        for p in self.parameters():
            nn.init.normal_(p, std=0.5)
        self.shared["first"] = self.blocks[0]
        self.shared["copies"] = [_frozen_copy(b.gate) for b in self.blocks]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _frozen_copy(module: nn.Module) -> nn.Module:
    import copy
    return copy.deepcopy(module)


def _stateful_audit(mode: str, schedule: str, out, n_eval: int = 12) -> AuditResult:
    data = AuditData(np.random.default_rng(0).integers(0, 64, (n_eval, 16)),
                     np.random.default_rng(1).integers(0, 64, (8, 16)), {})
    return audit(Stateful(mode), out, sites=["blocks.*.gate"], blocks="blocks.*", data=data,
                 report=False, options=dataclasses.replace(FAST, schedule=schedule))


@pytest.mark.parametrize("mode, reused", [("self", 3), ("module", 3), ("clobber", 0)])
def test_blocks_sharing_state_give_the_naive_schedules_numbers(mode: str, reused: int,
                                                               tmp_path):
    """Block 0 leaves its output on itself or in shared state and later blocks read it
    (the issue's case: before, reassign at layer 1 was -0.0356 under prefix and -0.0111
    naive). Per-layer runs go from the last site to the first right after the correct
    replay, so the blocks a run stubs have not run since: prefix reuse is exact. When block
    1 overwrites that state (before: reused, as the longest prefix's proof never reads it),
    site 1's proof fails: full passes."""
    results = {s: _stateful_audit(mode, s, tmp_path / s) for s in ("naive", "prefix")}
    naive, prefix = (_without_runtime(tmp_path / s / "audit.json") for s in ("naive", "prefix"))
    assert naive == prefix
    schedule = results["prefix"].runtime.schedule
    assert schedule["batches_prefix_reused"] == reused
    assert schedule["batches_fell_back_to_full_passes"] == 3 - reused
    deltas = [e.delta for e in results["prefix"].per_layer["reassign"]]
    assert all(d != 0 for d in deltas)  # every layer's gate matters


@pytest.mark.parametrize("schedule", ["naive", "prefix"])
def test_a_model_whose_output_depends_on_earlier_passes_stops_the_audit(schedule, tmp_path):
    """Once fed a gate its live copy would not give, the model shifts every later output:
    the correct replay repeated at the end of the batch differs from the first (one batch:
    before, no later batch's identity check could see it, and the audit went through)."""
    with pytest.raises(FcauditError, match="the model's output depends on earlier forward "
                                           "passes"):
        _stateful_audit("history", schedule, tmp_path, n_eval=4)
    assert not (tmp_path / "audit.json").exists()


def test_non_finite_nll_is_refused(tmp_path: Path) -> None:
    model = toys.content_model()
    with torch.no_grad():
        model.scale.fill_(float("nan"))
    data = AuditData(toys.pair_sequences(8, 16, 1), toys.pair_sequences(8, 16, 2), {})
    with pytest.raises(FcauditError, match="NLL is not finite .* record pass"):
        audit(model, tmp_path / "out", sites=["gates.*"], data=data, report=False,
              options=AuditOptions(bootstrap=10, repeats=1, execution=False, progress=False))
    assert not (tmp_path / "out" / "audit.json").exists()
