"""The statistics: random draws (derangements, permutations), static profiles, penalties
with paired intervals, retention, interaction and variance decompositions, each against an
independent reference (numpy, scipy, a brute-force ANOVA).

Most are property-based (hypothesis): values come from numpy generators seeded by
hypothesis, so each example is cheap and every failure is reproducible from the printed
seed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fcaudit.core.contract import Site
from fcaudit.core.interventions import (
    StaticProfiles,
    derangement,
    draw,
    position_permutations,
    shuffle_positions,
)
from fcaudit.engine import metrics
from fcaudit.engine.metrics import Bootstrap, VarianceAccumulator, interaction, penalty, retention

FEW = settings(max_examples=25, deadline=None, database=None)
SOME = settings(max_examples=50, deadline=None, database=None)
seeds = st.integers(0, 2**32 - 1)
SHARES = ("eta2_layer", "eta2_position", "eta2_layer_position", "eta2_component",
          "eta2_residual")


def sites_for(n_layers: int, family: str = "f") -> list[Site]:
    return [Site(f"s{i}", f"s{i}", family, i) for i in range(n_layers)]


def batch_splits(n: int, rng: np.random.Generator) -> list[slice]:
    """Random contiguous batches covering 0..n (what streaming shard by shard sees)."""
    cuts = sorted(set(rng.integers(1, n, size=rng.integers(0, n)).tolist())) if n > 1 else []
    edges = [0, *cuts, n]
    return [slice(a, b) for a, b in zip(edges[:-1], edges[1:], strict=True)]


# ---------------------------------------------------------------------- permutations

@SOME
@given(n=st.integers(2, 200), seed=seeds)
def test_derangement_is_a_permutation_without_fixed_points(n: int, seed: int) -> None:
    perm = derangement(n, np.random.default_rng(seed))
    assert sorted(perm.tolist()) == list(range(n))
    assert not np.any(perm == np.arange(n))


def test_derangement_of_fewer_than_two_is_refused() -> None:
    for n in (0, 1):
        with pytest.raises(ValueError):
            derangement(n, np.random.default_rng(0))


@SOME
@given(n_seq=st.integers(0, 40), seq_len=st.integers(1, 64), seed=seeds)
def test_position_permutations_rows_are_permutations(n_seq: int, seq_len: int,
                                                     seed: int) -> None:
    perms = position_permutations(n_seq, seq_len, np.random.default_rng(seed))
    assert perms.shape == (n_seq, seq_len)
    for row in perms:
        assert sorted(row.tolist()) == list(range(seq_len))


@FEW
@given(n_seq=st.integers(2, 30), seq_len=st.integers(1, 32), seed=seeds)
def test_draw_is_reproducible_from_its_seed(n_seq: int, seq_len: int, seed: int) -> None:
    a, b = draw(seed, n_seq, seq_len), draw(seed, n_seq, seq_len)
    assert np.array_equal(a.donor, b.donor) and np.array_equal(a.positions, b.positions)
    assert not np.any(a.donor == np.arange(n_seq))


@FEW
@given(batch=st.integers(1, 6), seq_len=st.integers(1, 20),
       trailing=st.lists(st.integers(1, 4), max_size=2), seed=seeds)
def test_shuffle_positions_is_x_n_sigma_n_t(batch: int, seq_len: int, trailing: list[int],
                                            seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, seq_len, *trailing))
    perms = position_permutations(batch, seq_len, rng)
    got = shuffle_positions(torch.from_numpy(x), perms).numpy()
    expected = np.stack([x[n][perms[n]] for n in range(batch)])
    assert np.array_equal(got, expected)


# ------------------------------------------------------------------ static profiles

@FEW
@given(n=st.integers(1, 20), seq_len=st.integers(1, 12), n_layers=st.integers(1, 4),
       vector=st.booleans(), seed=seeds)
def test_static_profiles_equal_numpy_means(n: int, seq_len: int, n_layers: int, vector: bool,
                                           seed: int) -> None:
    rng = np.random.default_rng(seed)
    sites = sites_for(n_layers)
    shapes = [(n, seq_len, 3, i + 1) if vector else (n, seq_len) for i in range(n_layers)]
    data = {s.name: rng.normal(rng.normal(), rng.uniform(0.1, 3), size=shp).astype(np.float32)
            for s, shp in zip(sites, shapes, strict=True)}
    prof = StaticProfiles(sites)
    for part in batch_splits(n, rng):
        prof.add({k: torch.from_numpy(v[part]) for k, v in data.items()})
    assert prof.count == n
    for s in sites:
        x = data[s.name].astype(np.float64)
        np.testing.assert_allclose(prof.layer_position(s).numpy(), x.mean(0), rtol=1e-9,
                                   atol=1e-12)
        np.testing.assert_allclose(prof.layer(s).numpy(), x.mean((0, 1)), rtol=1e-9,
                                   atol=1e-12)
    pooled = np.concatenate([v.astype(np.float64).ravel() for v in data.values()])
    assert prof.global_mean("f") == pytest.approx(pooled.mean(), rel=1e-9, abs=1e-12)


# ------------------------------------------------------- penalty, retention, interaction

@SOME
@given(n=st.integers(1, 300), resamples=st.integers(1, 700), chunk=st.integers(1, 5000),
       seed=seeds)
def test_streamed_bootstrap_equals_one_index_matrix(n: int, resamples: int, chunk: int,
                                                    seed: int, ) -> None:
    """Memory stays flat because indices are drawn in chunks; the numbers must be those of
    one [resamples, n] matrix drawn from the same seed (what the paired design needs)."""
    values = np.random.default_rng(seed + 1).normal(size=n)
    whole = values[np.random.default_rng(seed).integers(0, n, size=(resamples, n))].mean(1)
    old = metrics.CHUNK_ELEMENTS
    metrics.CHUNK_ELEMENTS = chunk
    try:
        streamed = Bootstrap(n, resamples, seed).means(values)
    finally:
        metrics.CHUNK_ELEMENTS = old
    np.testing.assert_array_equal(streamed, whole)


@st.composite
def nll_sets(draw_: st.DrawFn) -> tuple[np.ndarray, ...]:
    n = draw_(st.integers(20, 60))
    seed = draw_(seeds)
    gap = draw_(st.floats(-1.0, 3.0))  # includes no gap, a negative gap and a clear one
    rng = np.random.default_rng(seed)
    correct = rng.uniform(2, 5, n)
    global_mean = correct + gap + rng.normal(0, 0.5, n)
    static = correct + rng.uniform(0, 1, n) * (global_mean - correct) + rng.normal(0, 0.1, n)
    reassign = correct + rng.uniform(0, 2, n)
    shuffle = correct + rng.uniform(0, 2, n)
    both = reassign + shuffle - correct + rng.normal(0, 0.3, n)
    return correct, global_mean, static, reassign, shuffle, both, int(rng.integers(1000))


def scipy_interval(statistic, *samples: np.ndarray) -> np.ndarray:
    """An independent paired percentile bootstrap (scipy, its own random stream)."""
    from scipy.stats import bootstrap
    res = bootstrap(samples, statistic, paired=True, vectorized=False, n_resamples=4000,
                    method="percentile", random_state=np.random.default_rng(0))
    return np.array([res.confidence_interval.low, res.confidence_interval.high])


def close_interval(ours: list[float], reference: np.ndarray) -> None:
    """Two Monte Carlo estimates of the same interval agree to a fraction of its width."""
    width = max(reference[1] - reference[0], 1e-12)
    assert np.abs(np.array(ours) - reference).max() <= 0.15 * width, (ours, reference)


@FEW
@given(nll_sets())
def test_penalty_is_the_mean_difference_with_a_paired_interval(sets: tuple) -> None:
    correct, _, static, *_, seed = sets
    delta, ci = penalty(static, correct, Bootstrap(len(correct), 4000, seed))
    assert delta == pytest.approx(np.mean([s - c for s, c in zip(static, correct, strict=True)]))
    close_interval(ci, scipy_interval(lambda s, c: np.mean(s - c), static, correct))


@FEW
@given(nll_sets())
def test_retention_formula_and_when_it_is_undefined(sets: tuple) -> None:
    correct, global_mean, static, *_, seed = sets
    out = retention(static, correct, global_mean, Bootstrap(len(correct), 4000, seed))
    gap = float(np.mean(global_mean) - np.mean(correct))
    assert out.gap == pytest.approx(gap, abs=1e-12)
    gap_ci = scipy_interval(lambda g, c: np.mean(g - c), global_mean, correct)
    close_interval(out.gap_ci95, gap_ci)
    if gap_ci[0] > 0.1 * (gap_ci[1] - gap_ci[0]):  # clearly above 0 for both estimates
        share_ci = scipy_interval(lambda g, s, c: 100 * np.mean(g - s) / np.mean(g - c),
                                  global_mean, static, correct)
        if share_ci[1] - share_ci[0] < 90:  # clearly measurable for both estimates
            assert out.defined
            direct = 100 * (np.mean(global_mean) - np.mean(static)) / gap
            assert out.value == pytest.approx(direct, rel=1e-9, abs=1e-9)
            close_interval(out.ci95, share_ci)
        elif share_ci[1] - share_ci[0] > 110:  # clearly wider than the 0-100% scale
            assert not out.defined and out.reason.startswith("no measurable share")
    if not out.gap_ci95[0] > 0:  # never a number divided by noise
        assert out.value is None and out.ci95 is None and "not above 0" in out.reason
    if out.defined:  # never a share its interval does not resolve
        assert out.ci95[1] - out.ci95[0] <= 100
    else:
        assert out.value is None and out.ci95 is None and out.reason


@FEW
@given(nll_sets())
def test_interaction_is_the_factorial_contrast(sets: tuple) -> None:
    correct, _, _, reassign, shuffle, both, seed = sets
    out = interaction(both, reassign, shuffle, correct, Bootstrap(len(correct), 4000, seed))
    deltas = [np.mean(x) - np.mean(correct) for x in (both, reassign, shuffle)]
    assert out.value == pytest.approx(deltas[0] - deltas[1] - deltas[2], abs=1e-9)
    close_interval(out.ci95, scipy_interval(
        lambda b, r, s, c: np.mean(b - r - s + c), both, reassign, shuffle, correct))


# -------------------------------------------------------------- variance decomposition

def _check_shares(shares: object, keys: tuple[str, ...]) -> None:
    assert sum(getattr(shares, k) for k in keys) == pytest.approx(1.0, abs=1e-9)
    for k in keys:
        assert -1e-9 <= getattr(shares, k) <= 1 + 1e-9, (k, getattr(shares, k))


def brute_force_shares(layers: list[np.ndarray]) -> dict[str, float]:
    """The two-way decomposition straight from the data (each layer ``[n, T, K_l]``):
    every group mean computed from the values themselves, no streamed sums."""
    values = np.concatenate([x.ravel() for x in layers])
    grand = values.mean()
    total = ((values - grand) ** 2).sum()
    ss_layer = sum(x.size * (x.mean() - grand) ** 2 for x in layers)
    by_pos = np.concatenate([x.transpose(1, 0, 2).reshape(x.shape[1], -1) for x in layers], 1)
    ss_pos = by_pos.shape[1] * ((by_pos.mean(1) - grand) ** 2).sum()
    ss_cell = sum(x.shape[0] * x.shape[2] * ((x.mean((0, 2)) - grand) ** 2).sum()
                  for x in layers)
    ss_comp = sum(x.shape[0] * ((x.mean(0) - grand) ** 2).sum() for x in layers)
    return {"eta2_layer": ss_layer / total, "eta2_position": ss_pos / total,
            "eta2_layer_position": (ss_cell - ss_layer - ss_pos) / total,
            "eta2_component": (ss_comp - ss_cell) / total,
            "eta2_residual": (total - ss_comp) / total}


@SOME
@given(n=st.integers(2, 12), seq_len=st.integers(2, 10), n_layers=st.integers(1, 5),
       kind=st.sampled_from(["scalar", "one", "vector"]), seed=seeds,
       effects=st.tuples(*[st.floats(0, 3)] * 4))
def test_variance_shares_match_a_brute_force_anova(n: int, seq_len: int, n_layers: int,
                                                   kind: str, seed: int,
                                                   effects: tuple[float, ...]) -> None:
    rng = np.random.default_rng(seed)
    sites = sites_for(n_layers)
    layer_fx, pos_fx, cell_fx, noise = effects
    data = {}
    for s in sites:
        trailing = {"scalar": (), "one": (1,), "vector": (4, s.layer + 2)}[kind]
        x = (layer_fx * rng.normal() + pos_fx * rng.normal(size=(1, seq_len) + (1,) *
                                                           len(trailing))
             + cell_fx * rng.normal(size=(1, seq_len, *trailing))
             + (noise + 1e-3) * rng.normal(size=(n, seq_len, *trailing)))
        data[s.name] = torch.from_numpy(x.astype(np.float32))
    acc = VarianceAccumulator(sites)
    for part in batch_splits(n, rng):
        acc.add({k: v[part] for k, v in data.items()})
    out = acc.decompose()
    _check_shares(out, SHARES)
    reference = brute_force_shares([v.double().numpy().reshape(n, seq_len, -1)
                                    for v in data.values()])
    for key, value in reference.items():
        assert getattr(out, key) == pytest.approx(value, abs=1e-7), key
    if kind != "scalar":  # per-component decompositions over the components every layer has
        common = (1,) if kind == "one" else (4, 2)
        assert [c.index for c in out.components] == [list(i) for i in np.ndindex(*common)]
        for comp in out.components:
            _check_shares(comp, tuple(k for k in SHARES if k != "eta2_component"))
            part = brute_force_shares([v[(slice(None), slice(None), *comp.index)].double()
                                       .numpy()[..., None] for v in data.values()])
            assert comp.eta2_layer == pytest.approx(part["eta2_layer"], abs=1e-7)
            assert comp.eta2_residual == pytest.approx(part["eta2_residual"], abs=1e-7)


def test_variance_of_constant_data_is_all_zero_not_nan() -> None:
    acc = VarianceAccumulator(sites_for(2))
    acc.add({"s0": torch.ones(3, 4), "s1": torch.ones(3, 4)})
    out = acc.decompose()
    assert all(getattr(out, k) == 0.0 for k in SHARES)


@FEW
@given(seed=seeds)
def test_eta2_matches_the_known_population_value(seed: int) -> None:
    """x = a_layer + b_position + noise with known variances: the estimated shares
    approach var(a) / total, var(b) / total and sigma^2 / total (25,600 values: the
    sampling sd of each share is about 0.005, the tolerance 0.025)."""
    rng = np.random.default_rng(seed)
    a = np.array([-1.5, -0.5, 0.5, 1.5])  # population variance 1.25
    b = np.tile([-0.5, 0.5], 8)  # 16 positions, population variance 0.25
    sigma2 = 1.0
    n = 400
    sites = sites_for(len(a))
    acc = VarianceAccumulator(sites)
    acc.add({s.name: torch.from_numpy(a[s.layer] + b[None, :]
                                      + rng.normal(0, np.sqrt(sigma2), size=(n, len(b))))
             for s in sites})
    out = acc.decompose()
    total = 1.25 + 0.25 + sigma2
    assert out.eta2_layer == pytest.approx(1.25 / total, abs=0.025)
    assert out.eta2_position == pytest.approx(0.25 / total, abs=0.025)
    assert out.eta2_residual == pytest.approx(sigma2 / total, abs=0.025)
    assert 0 <= out.eta2_layer_position < 0.01


# --------------------------------------- variance decompositions: every axis named


def numpy_shares(x: np.ndarray) -> dict[str, float]:
    """Reference decomposition of values ``[layers, sequences, positions, components]``."""
    grand = x.mean()
    total = ((x - grand) ** 2).sum()
    n_l, n_s, n_t, n_c = x.shape
    layer = x.mean(axis=(1, 2, 3))
    pos = x.mean(axis=(0, 1, 3))
    cell = x.mean(axis=(1, 3))  # [layers, positions]
    comp = x.mean(axis=1)  # [layers, positions, components]
    ss_layer = n_s * n_t * n_c * ((layer - grand) ** 2).sum()
    ss_pos = n_l * n_s * n_c * ((pos - grand) ** 2).sum()
    ss_cell = n_s * n_c * ((cell - grand) ** 2).sum()
    ss_comp = n_s * ((comp - cell[:, :, None]) ** 2).sum()
    ss_resid = ((x - comp[:, None]) ** 2).sum()
    return {"layer identity": ss_layer / total, "position": ss_pos / total,
            "layer-by-position interaction": (ss_cell - ss_layer - ss_pos) / total,
            "component": ss_comp / total, "input and token content": ss_resid / total}


@pytest.mark.parametrize("kind", ["scalar gate", "vector coefficient", "router"])
def test_every_decomposition_names_all_its_axes_and_sums_to_one(kind: str) -> None:
    from fcaudit.core.contract import Site
    from fcaudit.core.routers import RouterAdapter
    from fcaudit.engine.metrics import VarianceAccumulator
    from fcaudit.engine.result import Variation
    from fcaudit.engine.verdicts import variation_part
    width = {"scalar gate": 1, "vector coefficient": 3, "router": 8}[kind]
    rng = np.random.default_rng(1)
    # layer, position and component effects plus noise: every axis carries variance
    x = (rng.normal(size=(3, 1, 1, 1)) + rng.normal(size=(1, 1, 5, 1))
         + 2 * rng.normal(size=(1, 1, 1, width)) + rng.normal(size=(3, 6, 5, width)))
    adapter = RouterAdapter() if kind == "router" else None
    sites = [Site(f"l{i}", f"l{i}", "fam", i, **({"adapter": adapter} if adapter else {}))
             for i in range(3)]
    acc = VarianceAccumulator(sites)
    acc.add({s.name: torch.from_numpy(x[i]) for i, s in enumerate(sites)})
    shares = acc.decompose()
    axes = dict(shares.axes())
    expected = numpy_shares(x)
    axis = {"scalar gate": None, "vector coefficient": "component", "router": "expert"}[kind]
    assert shares.component_axis == axis
    if axis is None:
        assert abs(expected.pop("component")) < 1e-12
    else:
        expected[axis] = expected.pop("component")
    assert set(axes) == set(expected)
    for name, share in expected.items():
        assert axes[name] == pytest.approx(share, abs=1e-9), name
    assert sum(axes.values()) == pytest.approx(1.0, abs=1e-9)
    spread = {"fam": Variation([], 0.1, 0.2, 0.3, None, None)}
    sentence = variation_part({"fam": shares}, spread).sentence
    for name, share in expected.items():
        assert f"{name} {100 * share:.1f}%" in sentence, (name, sentence)
    # the trailing axis is explained where the sentence names it
    said = {"scalar gate": "(total 100.0%)",
            "vector coefficient": "(total 100.0%; component: which entry of a coefficient "
                                  "vector a value is (its index on the sites' last axes), beyond "
                                  "its layer and position)",
            "router": "(total 100.0%; expert: which expert a router logit scores, beyond its "
                      "layer and position)"}[kind]
    assert said in sentence


def test_an_interval_of_few_resamples_is_widened_to_hold_its_estimate() -> None:
    """With 10 resamples the percentile interval can miss its own mean (9 resample means
    on one side of it, about 1 seed in 50): it is widened to reach the estimate, never
    narrowed, so a result's every estimate lies in its interval (what a reader checks).
    Expected: numpy's percentile of the same resample means, by hand."""
    diff = np.random.default_rng(0).normal(size=8)
    missed = 0
    for seed in range(500):
        boot = Bootstrap(len(diff), 10, seed)
        lo, hi = np.percentile(boot.means(diff), [2.5, 97.5])
        delta, ci = penalty(diff, np.zeros_like(diff), boot)
        assert delta == pytest.approx(diff.mean(), abs=1e-15)
        assert ci == [min(lo, delta), max(hi, delta)]
        missed += not lo <= delta <= hi
    assert missed > 0  # the case this guards was met, and widened above
