"""Issue 37: the token-id share beside its chance level, and the share beyond chance.

With ``k`` distinct ids among ``n`` tokens the one-way ANOVA share (eta squared) is
``(k - 1) / (n - 1)`` on average when the ids are dealt at random: on 2-token windows
nearly every token has an id of its own and the share is 100% by construction. Every
expected value here comes from numpy: the ANOVA by hand, the chance level as the exact
mean over every way to deal the ids, the corrected share as Kelley's epsilon squared
``(SS_between - (k - 1) MS_within) / SS_total``, a formula the code does not use.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
import toys

import fcaudit
from fcaudit.engine.metrics import TokenShare
from fcaudit.engine.result import AuditResult
from fcaudit.io.data import AuditData

FAST = fcaudit.AuditOptions(repeats=1, bootstrap=50, batch_size=4, execution=False,
                            progress=False, per_layer=False)


def anova(values: np.ndarray, ids: np.ndarray) -> tuple[float, float]:
    """Pooled ``(SS_between, SS_total)`` of ``values [cells, n]`` grouped by ``ids [n]``."""
    between = total = 0.0
    for row in values:
        total += ((row - row.mean()) ** 2).sum()
        between += sum((ids == i).sum() * (row[ids == i].mean() - row.mean()) ** 2
                       for i in np.unique(ids))
    return between, total


def epsilon2(values: np.ndarray, ids: np.ndarray) -> float:
    """Kelley's epsilon squared, pooled: ``(SS_b - (k - 1) SS_w / (n - k)) / SS_t``."""
    between, total = anova(values, ids)
    n, k = ids.size, len(np.unique(ids))
    return (between - (k - 1) * (total - between) / (n - k)) / total


def streamed(values: np.ndarray, ids: np.ndarray, splits: list[int]) -> TokenShare:
    """TokenShare over ``values [L, N, T, K]`` and ``ids [N, T]``, in batches of rows."""
    sites = [fcaudit.Site(f"s{i}", f"s{i}", "f", i) for i in range(len(values))]
    acc = TokenShare(sites)
    for lo, hi in zip([0, *splits], [*splits, values.shape[1]], strict=True):
        acc.add({s.name: torch.from_numpy(values[i, lo:hi]) for i, s in enumerate(sites)},
                torch.from_numpy(ids[lo:hi]))
    return acc


def cells(values: np.ndarray) -> np.ndarray:
    """``[L, N, T, K]`` as ``[L * K, N * T]``: one row per (site, component)."""
    return values.transpose(0, 3, 1, 2).reshape(values.shape[0] * values.shape[3], -1)


def test_the_chance_level_is_the_mean_over_every_way_to_deal_the_ids() -> None:
    """Seven tokens, four ids (two, three, one, one of each), two sites of two components:
    the pooled share averaged over all 420 distinct orders of the ids is (4 - 1) / (7 - 1)
    exactly, for these values as for any; the streamed share, chance and corrected share
    equal numpy's."""
    rng = np.random.default_rng(0)
    ids = np.array([[5, 5, 9, 9, 9, 2, 7]])
    values = rng.normal(size=(2, 1, 7, 2)) + np.array([0.0, 3.0]).reshape(2, 1, 1, 1)
    flat = cells(values)
    orders = set(itertools.permutations(ids[0].tolist()))
    assert len(orders) == 420
    dealt = [np.divide(*anova(flat, np.array(order))) for order in orders]
    assert np.mean(dealt) == pytest.approx(3 / 6, abs=1e-12)
    got = streamed(values, ids, []).shares()
    between, total = anova(flat, ids[0])
    assert got["eta2_token_id"] == pytest.approx(between / total, rel=1e-12)
    assert got["eta2_token_id_chance"] == 3 / 6
    assert got["epsilon2_token_id"] == pytest.approx(epsilon2(flat, ids[0]), rel=1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_noise_is_near_zero_beyond_chance_and_a_function_of_the_id_is_one(seed) -> None:
    """40 sequences of 25 tokens, 10 ids, streamed in random batches: noise unrelated to
    the id explains about (10 - 1) / (1000 - 1) and 0 beyond chance; a function of the id
    explains 1 either way; a mix, what numpy's ANOVA says."""
    rng = np.random.default_rng(seed)
    n, t, k = 40, 25, 3
    ids = rng.integers(100, 110, (n, t))
    splits = sorted(rng.choice(np.arange(1, n), 3, replace=False).tolist())
    chance = (len(np.unique(ids)) - 1) / (ids.size - 1)
    noise = rng.normal(size=(2, n, t, k))
    got = streamed(noise, ids, splits).shares()
    assert got["eta2_token_id_chance"] == pytest.approx(chance, rel=1e-15)
    assert got["epsilon2_token_id"] == pytest.approx(epsilon2(cells(noise), ids.ravel()),
                                                     rel=1e-9)
    assert abs(got["epsilon2_token_id"]) < 0.02
    table = rng.normal(size=(2, 110, k))
    pure = np.stack([table[i][ids] for i in range(2)])
    assert streamed(pure, ids, splits).shares()["epsilon2_token_id"] == pytest.approx(1.0)
    mixed = pure + noise
    got = streamed(mixed, ids, splits).shares()
    assert got["epsilon2_token_id"] == pytest.approx(epsilon2(cells(mixed), ids.ravel()),
                                                     rel=1e-9)


def test_two_token_windows_explain_everything_by_chance() -> None:
    """2-token windows with every id its own (k = n): 100% by construction, chance 100%,
    nothing beyond; with a few ids repeated, a large chance level and the share beyond it
    (numpy), said so in the sentence."""
    ids = np.arange(24).reshape(12, 2)
    values = np.random.default_rng(1).normal(size=(2, 12, 2, 1))
    got = streamed(values, ids, [5]).shares()
    assert got == {"eta2_token_id": pytest.approx(1.0), "eta2_token_id_chance": 1.0,
                   "epsilon2_token_id": None}
    shares = fcaudit.engine.result.VarianceShares(0, 0, 0, 0, 1, 1.0, 48, **got)
    assert shares.token_id_text() == (
        "the current token id explains no share beyond chance: every token has an id of its "
        "own, so it explains 100.0% by construction (chance level 100.0%)")
    repeated = ids % 20  # ids 0..3 twice: 20 ids among 24 tokens
    got = streamed(values, repeated, [5]).shares()
    share = np.divide(*anova(cells(values), repeated.ravel()))
    beyond = epsilon2(cells(values), repeated.ravel())
    assert got["eta2_token_id_chance"] == 19 / 23
    assert got["eta2_token_id"] == pytest.approx(share, rel=1e-12)
    assert got["epsilon2_token_id"] == pytest.approx(beyond, rel=1e-9)


def router_logits(ids: np.ndarray, context: bool) -> np.ndarray:
    """The toy routers' logits ``[2, N, T, V]``: ``4 * one_hot(key)``, the key the token id
    (plus the previous one for the context router)."""
    prev = np.concatenate([np.zeros_like(ids[:, :1]), ids[:, :-1]], 1)
    one = 4.0 * np.eye(toys.V)[(ids + prev * context) % toys.V]
    return np.stack([one, one])


@pytest.mark.parametrize("context, seq_len", [(False, 16), (True, 16), (False, 2)])
def test_audits_headline_the_share_beyond_chance(tmp_path, context, seq_len) -> None:
    """The planted token-keyed router (its logits a function of the id: 100% beyond
    chance), the context router (less), and the token router on 2-token windows, where
    the raw share is 100% and the chance level is high: audit.json, metrics(), the
    variation sentence and the report say what numpy says."""
    model = toys.context_router_model() if context else toys.token_router_model()
    ev = toys.pair_sequences(12, seq_len, 1)
    calib = toys.pair_sequences(12, seq_len, 2)
    if seq_len == 2:  # windows [x, x + 1]: calibration from the first ids evaluation lacks
        calib = np.array([[x, (x + 1) % toys.V] for x in range(toys.V) if x not in ev[:, 0]])
    out = tmp_path / "out"
    result = fcaudit.audit(model, out, data=AuditData(ev, calib, {}), options=FAST)
    flat = cells(router_logits(ev, context))
    share = np.divide(*anova(flat, ev.ravel()))
    chance = (len(np.unique(ev)) - 1) / (ev.size - 1)
    beyond = epsilon2(flat, ev.ravel())
    raw = json.loads((out / "audit.json").read_text())["variance"]["router"]
    assert raw["eta2_token_id"] == pytest.approx(share, rel=1e-9)
    assert raw["eta2_token_id_chance"] == pytest.approx(chance, rel=1e-15)
    assert raw["epsilon2_token_id"] == pytest.approx(beyond, rel=1e-9)
    if not context:
        assert beyond == pytest.approx(1.0)  # planted: the id explains all, beyond chance
    else:
        assert 0 < beyond < share
    metrics = result.metrics()
    assert [metrics[k] for k in ("eta2_token_id", "eta2_token_id_chance",
                                 "epsilon2_token_id")] == \
        [raw["eta2_token_id"], raw["eta2_token_id_chance"], raw["epsilon2_token_id"]]
    said = (f"within layers, the current token id explains {100 * beyond:.1f}% beyond chance "
            f"({100 * share:.1f}% against a chance level of {100 * chance:.1f}%)")
    assert said in result.verdict.variation
    assert said in (out / "report.md").read_text()
    table = result.to_frame("metrics") if _pandas() else None
    if table is not None:
        assert list(table["metric"]) == list(metrics)


def _pandas() -> bool:
    try:
        import pandas  # noqa: F401
    except ImportError:
        return False
    return True


def test_an_audit_json_from_before_the_chance_level_reads_and_says_so(tmp_path) -> None:
    out = tmp_path / "out"
    fcaudit.audit(toys.token_router_model(), out, data=AuditData(
        toys.pair_sequences(8, 8, 1), toys.pair_sequences(8, 8, 2), {}), options=FAST,
        report=False)
    raw = json.loads((out / "audit.json").read_text())
    for key in ("eta2_token_id_chance", "epsilon2_token_id"):
        del raw["variance"]["router"][key]
    old = AuditResult.from_json(raw)
    assert old.metrics()["eta2_token_id_chance"] is None
    assert old.metrics()["epsilon2_token_id"] is None
    share = raw["variance"]["router"]["eta2_token_id"]
    assert old.variance["router"].token_id_text() == (
        f"the current token id explains {100 * share:.1f}% (chance level not recorded)")
