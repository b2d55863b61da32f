"""Reused replays are proven by recomputation: on a rerun into the same output folder, a
sample of the cached replay runs, drawn afresh at every resume and covering every run of
the plan, is replayed again and must equal the cache bit for bit (``verify_reuse="all"``:
every run of every cached batch).

The models here change only under intervention: their unperturbed pass never reads the
knob, so every record batch is recomputed equal and every fed tensor digests equal, and
only a replay recomputed now can see that the cached results are stale. Expected values
come from a fresh audit into a new folder (the numbers the stale cache would hide)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import toys
from conftest import FAST_ARGS, run_inprocess

import fcaudit
from fcaudit import AuditData, AuditOptions
from fcaudit.core.conditions import CORRECT, STATIC_LAYER
from fcaudit.core.contract import Site
from fcaudit.core.errors import CacheError
from fcaudit.engine.plan import Run, choose, first_difference, sub_plan

KNOB = "FCAUDIT_TEST_KNOB"


def _knob() -> float:
    return float(os.environ.get(KNOB, "1"))


class StaticBranch(toys.ToyModel):
    """``content`` gates (one-hot of the token: they differ across examples in every
    unperturbed pass), scaled by the knob only where a gate is the same for every example
    and position of the batch: the branch that static profiles (and only they) take."""

    def __init__(self, mark: int | None = None) -> None:
        super().__init__("content")
        self.mark = mark  # the knob only for batches whose every row starts with it

    def controller_sites(self) -> list[Site]:
        return [Site(f"gates.{i}", f"gates.{i}", "gate", i) for i in range(len(self.gates))]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        even = (torch.arange(ids.shape[1]) % 2 == 0).float().view(1, -1, 1)
        g = [gate(ids) for gate in self.gates]
        knob = _knob() if self.mark is None or bool((ids[:, 0] == self.mark).all()) else 1.0
        g = [x * knob if bool((x == x[:1, :1]).all()) else x for x in g]
        return self.scale * torch.roll(sum(g) / len(g), shifts=1, dims=-1) * even


class CapacityRouter(toys.ToyRouterModel):
    """The token router (top-1 of 64 experts, expert = token id) with an expert capacity
    read from the environment: past ``capacity`` tokens of a batch, an expert drops the
    rest. Unperturbed routing spreads the tokens (no expert overflows); a static profile
    sends every token to one expert, which overflows at either capacity."""

    def __init__(self) -> None:
        super().__init__(context=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        capacity = int(_knob())
        even = (torch.arange(ids.shape[1]) % 2 == 0).float().view(1, -1, 1)
        votes = []
        for router in self.routers:
            expert = router(ids).topk(1, dim=-1).indices[..., 0]
            onehot = F.one_hot(expert.reshape(-1), toys.V)
            kept = (onehot.cumsum(0) * onehot).sum(-1) <= capacity  # tokens in order
            vote = F.one_hot((expert + 1) % toys.V, toys.V).float()
            votes.append(vote * kept.view(expert.shape).unsqueeze(-1))
        return self.scale * (sum(votes) / len(votes)) * even


def _data(n: int = 12) -> AuditData:
    return AuditData(toys.pair_sequences(n, 16, 1), toys.pair_sequences(8, 16, 2))


def _options(**kw: object) -> AuditOptions:
    return AuditOptions(**{"repeats": 2, "bootstrap": 20, "execution": False,
                           "progress": False, "batch_size": 4, "expert_ablation": False,
                           **kw})


def _rows(result: fcaudit.AuditResult) -> dict[str, float]:
    return {name: c.nll for name, c in result.conditions.items()}


@pytest.mark.parametrize(("model", "before", "after"), [(StaticBranch, 1, 3),
                                                        (CapacityRouter, 16, 8)])
def test_a_model_that_changes_only_under_intervention_never_gets_its_old_numbers(
        model: type, before: int, after: int, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    out, data, options = tmp_path / "audit", _data(), _options()
    monkeypatch.setenv(KNOB, str(before))
    first = fcaudit.audit(model(), out, data=data, options=options)
    unchanged = fcaudit.audit(model(), out, data=data, options=options)  # proven, reused
    assert _rows(unchanged) == _rows(first)
    reuse = unchanged.runtime.reuse
    runs = reuse["runs_reused"] // reuse["batches_reused"]
    assert (reuse["batches_reused"], reuse["batches_recomputed"]) == (3, 0)
    assert reuse["verify_reuse"] == "sample" and reuse["replay_runs_verified"] == runs

    monkeypatch.setenv(KNOB, str(after))
    stale = r"holds replay results this model no longer gives: run (static\S*|global-mean) on"
    with pytest.raises(CacheError, match=stale + r" evaluation batch \d") as caught:
        fcaudit.audit(model(), out, data=data, options=options)
    assert caught.value.batch in (0, 1, 2)
    fresh = fcaudit.audit(model(), tmp_path / "fresh", data=data, options=options)
    assert fresh.conditions[CORRECT].nll == first.conditions[CORRECT].nll  # records equal
    assert fresh.conditions[STATIC_LAYER].nll != first.conditions[STATIC_LAYER].nll


def test_the_unperturbed_routing_never_overflows_the_smaller_capacity() -> None:
    """The premise of the router case: with capacity 8 no expert of the unperturbed pass
    drops a token (each batch of 4 x 16 tokens), so the records cannot tell 16 from 8."""
    ids = torch.from_numpy(toys.pair_sequences(12, 16, 1))
    for batch in ids.split(4):
        counts = torch.bincount(batch.reshape(-1), minlength=toys.V)
        assert int(counts.max()) <= 8


def test_a_change_in_one_batch_is_caught_by_verify_reuse_all(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A knob read only for the rows of batch 2 (its first token marked): a sample may
    prove each run on another batch; ``all`` replays every run of every batch."""
    out, data = tmp_path / "audit", _data()
    mark = toys.V - 1
    data.eval_ids[:, 0] = np.where(data.eval_ids[:, 0] == mark, 0, data.eval_ids[:, 0])
    data.eval_ids[8:, 0] = mark

    monkeypatch.setenv(KNOB, "1")
    fcaudit.audit(StaticBranch(mark), out, data=data, options=_options())
    monkeypatch.setenv(KNOB, "2")
    with pytest.raises(CacheError, match=r"on evaluation batch 2 \(rows 9-12\)"):
        fcaudit.audit(StaticBranch(mark), out, data=data,
                      options=_options(verify_reuse="all"))


def test_each_resume_draws_its_own_sample_and_says_so(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    np.save(tmp_path / "eval.npy", toys.pair_sequences(12, 16, 1))
    np.save(tmp_path / "calib.npy", toys.pair_sequences(8, 16, 2))
    argv = ["audit", "--model", "toys:content_model", "--sites", "gates.*", "--tokens",
            tmp_path / "eval.npy", "--calib-tokens", tmp_path / "calib.npy",
            "--out", tmp_path / "out",
            *[a for a in FAST_ARGS if a != "--quiet"]]
    assert run_inprocess(argv, capsys).returncode == 0
    seeds = []
    for _ in range(2):
        res = run_inprocess(argv, capsys)
        assert res.returncode == 0, res.stderr
        assert "replay: 3 of 3 evaluation batches cached: reused only once a fresh random " \
            "sample of" in res.stderr
        assert "; --verify-reuse all proves every run)" in res.stderr
        audit = fcaudit.AuditResult.read(tmp_path / "out" / "audit.json")
        seeds.append(audit.runtime.reuse["verify_seed"])
        assert f"seed {seeds[-1]}" in res.stderr
        report = (tmp_path / "out" / "report.md").read_text()
        assert f"a sample drawn afresh at this resume (seed {seeds[-1]})" in report
    assert seeds[0] != seeds[1]  # drawn from the operating system, not from the folder


def test_the_sample_covers_every_run_and_every_batch_can_prove_it() -> None:
    reused = [0, 2, 3, 5]
    counts = np.zeros((7, len(reused)))
    for seed in range(400):
        sample = choose("sample", 7, reused, seed)
        owners = {i: b for b, runs in sample.by_batch.items() for i in runs}
        assert sorted(owners) == list(range(7))  # every run, exactly once
        assert set(owners.values()) <= set(reused)
        for i, b in owners.items():
            counts[i, reused.index(b)] += 1
    share = counts / 400  # each run's batch is uniform over the reused ones
    assert np.all(np.abs(share - 0.25) < 0.1)
    everything = choose("all", 7, reused, 0)
    assert everything.by_batch == {b: tuple(range(7)) for b in reused}
    assert choose("sample", 7, [], 0).by_batch == {}


def test_a_difference_is_named_by_its_run() -> None:
    """The comparison of a cached shard's rows with a recomputed sub-plan's: rows are
    matched by plan index, each differing key named."""
    runs = [Run(CORRECT), Run("reassign"), Run("reassign", 1), Run(STATIC_LAYER)]
    nll = torch.arange(8, dtype=torch.float64).view(4, 2)
    digest = torch.arange(4 * 32, dtype=torch.uint8).view(4, 32)
    cached = {"nll": nll, "feed_digest": digest}
    index, sub = sub_plan(runs, [3, 1, 3])
    assert index == [0, 1, 3] and [r.condition for r in sub] == [CORRECT, "reassign",
                                                                 STATIC_LAYER]
    fresh = {"nll": nll[index].clone(), "feed_digest": digest[index].clone()}
    assert first_difference(runs, index, cached, fresh) is None
    fresh["nll"][2, 1] += 0.25
    assert first_difference(runs, index, cached, fresh) == (3, "per-sequence losses (by up "
                                                               "to 0.25)")
    fresh["feed_digest"][1, 0] ^= 1
    assert first_difference(runs, index, cached, fresh) == (1, "fed tensors")
