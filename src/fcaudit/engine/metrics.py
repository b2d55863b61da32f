"""Metrics (docs/method.md, Metrics): penalties, retention, interaction with paired bootstrap
intervals over sequences, and the variance decomposition of cached coefficients.

:func:`aggregate` summarises a metric over the training seeds of a study.

Every interval uses the same seeded stream of resampled sequence indices
(:class:`Bootstrap`), so all contrasts are paired: the same resample is applied to
every condition.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fcaudit.core.contract import RoutingAdapter, Site
from fcaudit.core.interventions import TokenSums, merge_token_sums, token_sums
from fcaudit.engine.result import (
    ComponentShares,
    Estimate,
    LayerVariation,
    Profile,
    Retention,
    VarianceShares,
    Variation,
)

CHUNK_ELEMENTS = 1 << 18  # resampled indices held at once (2 MB), whatever the data size


class Bootstrap:
    """A seeded paired bootstrap over ``n`` sequences, streamed in chunks of resamples.

    Every statistic regenerates the same index stream from ``seed`` (so all contrasts
    are paired: the same resample applies to every condition), ``CHUNK_ELEMENTS`` at a
    time: memory stays flat in ``n``, and the numbers equal those of one
    ``[resamples, n]`` index matrix (numpy draws the same stream either way; tested).
    """

    def __init__(self, n: int, resamples: int, seed: int) -> None:
        self.n, self.resamples, self.seed = n, resamples, seed

    def _chunks(self) -> Iterator[np.ndarray]:
        """The resamples' indices, ``[rows, n]`` at a time, regenerated from the seed."""
        rng = np.random.default_rng(self.seed)
        rows = max(1, CHUNK_ELEMENTS // max(1, self.n))
        for start in range(0, self.resamples, rows):
            yield rng.integers(0, self.n, size=(min(rows, self.resamples - start), self.n))

    def means(self, values: np.ndarray) -> np.ndarray:
        """The mean of ``values [n]`` under each resample: ``[resamples]``."""
        return np.concatenate([values[idx].mean(axis=1) for idx in self._chunks()])

    def rows(self) -> Iterator[np.ndarray]:
        """Each resample's indices ``[n]``, in the order :meth:`means` uses them (for a
        statistic that is not a mean: a benchmark task's own aggregation)."""
        for idx in self._chunks():
            yield from idx


def interval(samples: np.ndarray, estimate: float) -> list[float]:
    """95% percentile interval of bootstrap samples, widened to hold ``estimate`` where it
    does not: with few resamples a percentile can fall on the estimate's side (the mean of
    10 resamples can sit below it 9 times), and an interval that excludes its own number
    is read as damaged (:mod:`fcaudit.engine.result`). Never narrowed."""
    lo, hi = np.percentile(samples, [2.5, 97.5])
    return [min(float(lo), estimate), max(float(hi), estimate)]


def penalty(cond: np.ndarray, correct: np.ndarray, boot: Bootstrap) -> tuple[float, list[float]]:
    """``Delta = NLL(cond) - NLL(correct)`` with its paired bootstrap interval."""
    diff = cond - correct
    delta = float(diff.mean())
    return delta, interval(boot.means(diff), delta)


# The widest 95% interval a share in percent may have and still be reported: the whole
# scale, from keeping nothing (0%) to keeping everything (100%). A wider interval cannot
# place the share on that scale (it is what a gap barely above its noise gives: the ratio's
# resamples divide by near-zero gaps), so the share is not measurable and has no value.
MAX_SHARE_WIDTH = 100.0  # percentage points


def retention(static: np.ndarray, correct: np.ndarray, global_mean: np.ndarray,
              boot: Bootstrap, what: str = "Correct-to-GlobalMean gap",
              unit: str = " nats") -> Retention:
    """Gap retention ``R(P) = (G - P) / (G - C)`` in percent; undefined (no value, a
    reason) unless it is measurable.

    Measurable: the gap ``G - C`` is clearly positive (its 95% interval above zero),
    else the ratio would divide by noise; and the share's own 95% interval is at most
    :data:`MAX_SHARE_WIDTH` percentage points wide, else it does not resolve the share
    on its 0-100% scale. ``what`` and ``unit`` name the gap in the reason.
    """
    gap = global_mean - correct
    gap_samples = boot.means(gap)
    gap_ci = interval(gap_samples, float(gap.mean()))
    if not gap_ci[0] > 0:
        return Retention(float(gap.mean()), gap_ci, None, None, False,
                         f"the {what} {gap.mean():+.4f}{unit} has a 95% "
                         f"interval [{gap_ci[0]:+.4f}, {gap_ci[1]:+.4f}] that is not above 0")
    kept = global_mean - static
    with np.errstate(divide="ignore", invalid="ignore"):  # a resample's gap can be 0 (hits
        samples = 100.0 * boot.means(kept) / gap_samples  # are discrete): +-inf sit in
    samples = samples[~np.isnan(samples)]  # the tails; 0/0, a resample with no share, goes
    value = float(100.0 * kept.mean() / gap.mean())
    ci = interval(samples, value)
    if not ci[1] - ci[0] <= MAX_SHARE_WIDTH:  # also an infinite bound
        return Retention(float(gap.mean()), gap_ci, None, None, False,
                         f"no measurable share: its 95% interval [{ci[0]:.2f}, {ci[1]:.2f}]% "
                         f"is wider than the whole 0-100% scale (the {what} "
                         f"{gap.mean():+.4f}{unit} [{gap_ci[0]:+.4f}, {gap_ci[1]:+.4f}] is too "
                         "small against its noise to resolve a share of it)")
    return Retention(float(gap.mean()), gap_ci, value, ci, True)


def accuracy_retention(static: np.ndarray, correct: np.ndarray, global_mean: np.ndarray,
                       boot: Bootstrap) -> Retention:
    """The same share on accuracy, from each example's hits (share of its answers right):
    ``(acc(P) - acc(G)) / (acc(C) - acc(G))`` in percent, with the same paired bootstrap
    and the same rule (undefined unless the accuracy gap's interval lies above 0). It is
    :func:`retention` of the negated hits, an error rate: exact, since negation is."""
    return retention(-static, -correct, -global_mean, boot,
                     "Correct-to-GlobalMean accuracy gap", "")


def interaction(both: np.ndarray, reassign: np.ndarray, shuffle: np.ndarray,
                correct: np.ndarray, boot: Bootstrap) -> Estimate:
    """``I = Delta(reassign+shuffle) - Delta(reassign) - Delta(shuffle)``."""
    contrast = both - reassign - shuffle + correct
    value = float(contrast.mean())
    return Estimate(value, interval(boot.means(contrast), value))


class VarianceAccumulator:
    """Streams coefficients of one family and decomposes their variance.

    Per site it keeps float64 sums over sequences by (position, component):
    ``s1 = sum x``, ``s2 = sum x^2``. From these the variance splits exactly into
    layer, position, layer x position, component-within-cell (the trailing index,
    e.g. which source a mixing weight belongs to; zero for scalar gates) and the
    residual: variation across sequences at fixed layer, position and component,
    i.e. what depends on input and token content. The design is proportional
    (every layer has every position), so the shares are orthogonal and sum to 1.
    """

    def __init__(self, sites: Sequence[Site]) -> None:
        self.sites = list(sites)
        self.s1: dict[str, torch.Tensor] = {}
        self.s2: dict[str, torch.Tensor] = {}
        self.sd_pos_sum: dict[str, float] = {s.name: 0.0 for s in self.sites}
        self.n = 0

    def add(self, coefficients: dict[str, torch.Tensor]) -> None:
        for site in self.sites:
            x = coefficients[site.name].to(torch.float64)
            for sums, value in ((self.s1, x.sum(0)), (self.s2, (x * x).sum(0))):
                sums[site.name] = sums[site.name] + value if site.name in sums else value
            # spread across positions within each sequence (and component), averaged
            self.sd_pos_sum[site.name] += float(x.std(dim=1, unbiased=False).mean(
                dim=tuple(range(1, x.dim() - 1))).sum()) if x.dim() > 2 else \
                float(x.std(dim=1, unbiased=False).sum())
        self.n += next(iter(coefficients.values())).shape[0]

    @staticmethod
    def _shares(cells_s1: list[torch.Tensor], cells_s2: list[torch.Tensor],
                n: int) -> dict[str, float]:
        """Decompose per-layer tensors ``[T, K_l]`` of sums over ``n`` sequences."""
        total_s1 = sum(float(c.sum()) for c in cells_s1)
        total_s2 = sum(float(c.sum()) for c in cells_s2)
        count = sum(c.numel() for c in cells_s1) * n
        grand = total_s1 / count
        ss_total = total_s2 - count * grand**2
        ss_layer = ss_pos = ss_cell = ss_comp = 0.0
        T = cells_s1[0].shape[0]
        pos_s1 = torch.zeros(T, dtype=torch.float64)
        pos_count = 0
        for c1 in cells_s1:
            k = c1.shape[1]
            layer_mean = float(c1.sum()) / (T * k * n)
            ss_layer += T * k * n * (layer_mean - grand) ** 2
            lt = c1.sum(1) / (k * n)  # layer x position cell means
            ss_cell += float(((lt - grand) ** 2).sum()) * k * n
            ss_comp += float(((c1 / n - grand) ** 2).sum()) * n
            pos_s1 += c1.sum(1)
            pos_count += k * n
        pos_mean = pos_s1 / pos_count
        ss_pos = float(((pos_mean - grand) ** 2).sum()) * pos_count
        ss_int = ss_cell - ss_layer - ss_pos
        ss_comp_within = ss_comp - ss_cell
        ss_resid = ss_total - ss_comp
        if ss_total <= 0:
            return {"eta2_layer": 0.0, "eta2_position": 0.0, "eta2_layer_position": 0.0,
                    "eta2_component": 0.0, "eta2_residual": 0.0, "ss_total": 0.0}
        return {"eta2_layer": ss_layer / ss_total, "eta2_position": ss_pos / ss_total,
                "eta2_layer_position": ss_int / ss_total,
                "eta2_component": ss_comp_within / ss_total,
                "eta2_residual": ss_resid / ss_total, "ss_total": ss_total}

    def part(self, channels: slice) -> VarianceShares:
        """The decomposition of the channels ``channels`` of the last axis alone (one named
        coefficient of :attr:`Selection.parts`), without per-component rows: the share of each
        axis within that coefficient, not diluted by its neighbours."""
        flat1 = [self.s1[s.name][..., channels].reshape(self.s1[s.name].shape[0], -1)
                 for s in self.sites]
        flat2 = [self.s2[s.name][..., channels].reshape(self.s2[s.name].shape[0], -1)
                 for s in self.sites]
        return VarianceShares(**self._shares(flat1, flat2, self.n),
                              n_values=sum(f.numel() for f in flat1) * self.n,
                              component_axis="component" if flat1[0].shape[1] > 1 else None)

    def decompose(self, max_components: int = 16) -> VarianceShares:
        flat1 = [self.s1[s.name].reshape(self.s1[s.name].shape[0], -1) for s in self.sites]
        flat2 = [self.s2[s.name].reshape(self.s2[s.name].shape[0], -1) for s in self.sites]
        shares = self._shares(flat1, flat2, self.n)
        trailing = [tuple(self.s1[s.name].shape[1:]) for s in self.sites]
        axis: str | None = None
        if any(f.shape[1] > 1 for f in flat1):
            routed = all(isinstance(s.adapter, RoutingAdapter) for s in self.sites)
            axis = "expert" if routed else "component"
        comps: list[ComponentShares] | None = None
        note: str | None = None
        if any(trailing):
            common = tuple(min(dims) for dims in zip(*trailing, strict=True))
            comps = []
            for index in itertools.islice(itertools.product(*(range(d) for d in common)),
                                          max_components):
                c1 = [self.s1[s.name][(slice(None), *index)].unsqueeze(1) for s in self.sites]
                c2 = [self.s2[s.name][(slice(None), *index)].unsqueeze(1) for s in self.sites]
                part = self._shares(c1, c2, self.n)
                part.pop("eta2_component")
                comps.append(ComponentShares(index=list(index), **part))
            note = (
                f"one row per entry of the coefficient vector that every layer's sites have "
                f"(indices below {list(common)} on the last axes)"
                f"{f'; the first {max_components} shown' if len(comps) == max_components else ''}")
        return VarianceShares(**shares, n_values=sum(f.numel() for f in flat1) * self.n,
                              components=comps, components_note=note, component_axis=axis)

    def variation(self) -> Variation:
        """Spread across inputs and positions within each layer vs across layers."""
        per_layer = []
        for site in self.sites:
            s1, s2, n = self.s1[site.name], self.s2[site.name], self.n
            mean = float(s1.sum()) / (s1.numel() * n)
            var_total = float(s2.sum()) / (s2.numel() * n) - mean**2
            var_inputs = (s2 / n - (s1 / n) ** 2).clamp_min(0)
            per_layer.append(LayerVariation(
                layer=site.layer, site=site.name, mean=mean,
                sd_total=max(var_total, 0.0) ** 0.5,
                sd_across_inputs=float(var_inputs.sqrt().mean()),
                sd_across_positions=self.sd_pos_sum[site.name] / n))
        means = np.array([p.mean for p in per_layer])
        across = float(means.std()) if len(means) > 1 else 0.0
        inputs = float(np.mean([p.sd_across_inputs for p in per_layer]))
        positions = float(np.mean([p.sd_across_positions for p in per_layer]))
        return Variation(per_layer, across, inputs, positions,
                         inputs / across if across > 0 else None,
                         positions / across if across > 0 else None)

    def profile(self, max_positions: int = 512) -> Profile:
        """Per-layer mean and spread (:meth:`variation`'s), and the layer x position mean
        map, for figures."""
        pos, stride = [], 1
        for site in self.sites:
            s1 = self.s1[site.name]
            row = (s1.reshape(s1.shape[0], -1).sum(1) / (s1[0].numel() * self.n)).numpy()
            stride = max(1, int(np.ceil(len(row) / max_positions)))
            pos.append([round(float(v), 6) for v in row[::stride]])
        layers = self.variation().per_layer
        return Profile([s.name for s in self.sites], [x.mean for x in layers],
                       [x.sd_total for x in layers], pos, stride)


class TokenShare:
    """Streams one family's coefficients with the token ids they were recorded at: the
    share of within-layer variance the current token id explains, its chance level and
    the share beyond chance.

    Per (site, component) cell it is a one-way ANOVA on token id, ``SS_between /
    SS_total`` with both taken about the cell's mean, pooled over the family's cells
    (sums of squares added, then divided): 1 when every coefficient is a function of
    its token id within its layer. Values are accumulated in float64 minus each cell's
    first value, so coefficients that do not vary within a layer give exactly 0 / 0:
    undefined (None), not a rounding ratio.

    With ``k`` distinct ids among ``n`` tokens the share is large by chance alone: ids
    dealt to the same values at random (a permutation) give ``E[SS_between] = (k - 1) /
    (n - 1) SS_total`` in every cell, so the pooled share's chance level is exactly
    ``(k - 1) / (n - 1)`` (1 when every token has an id of its own). The share beyond
    chance, ``(share - chance) / (1 - chance)``, is Kelley's epsilon squared (the adjusted
    R^2 of a regression on id indicators): 0 on average under no association, 1 for a
    pure function of the id, negative below chance. It is not clipped at 0: a clipped
    estimate is biased upwards, and means over seeds would inherit the bias.
    """

    def __init__(self, sites: Sequence[Site]) -> None:
        self.sites = list(sites)
        self.shift: dict[str, torch.Tensor] = {}
        self.t1: dict[str, torch.Tensor] = {}
        self.t2: dict[str, torch.Tensor] = {}
        self.by_id: TokenSums | None = None
        self.n = 0

    def add(self, coefficients: Mapping[str, torch.Tensor], ids: torch.Tensor) -> None:
        centred = {}
        for site in self.sites:
            x = coefficients[site.name].to(torch.float64)
            d = x - self.shift.setdefault(site.name, x[0, 0].clone())
            flat = d.reshape(-1, *d.shape[2:])
            for sums, value in ((self.t1, flat.sum(0)), (self.t2, (flat * flat).sum(0))):
                sums[site.name] = sums[site.name] + value if site.name in sums else value
            centred[site.name] = d
        self.by_id = merge_token_sums(self.by_id, token_sums(centred, ids))
        self.n += ids.numel()

    def share(self, channels: slice | None = None) -> float | None:
        """The pooled share; with ``channels``, that of those channels of the last axis
        alone (one named coefficient of :attr:`Selection.parts`)."""
        assert self.by_id is not None
        between = total = 0.0
        cut = (Ellipsis, channels) if channels is not None else (Ellipsis,)
        for site in self.sites:
            t1, t2 = self.t1[site.name][cut], self.t2[site.name][cut]
            sums = self.by_id.sums[site.name][cut]
            mean = t1 / self.n  # the cell's mean (minus its shift), [*trailing]
            counts = self.by_id.counts.to(torch.float64).view(-1, *[1] * t1.dim())
            total += float((t2 - t1 * mean).sum())
            between += float((counts * (sums / counts - mean) ** 2).sum())
        return min(between / total, 1.0) if total > 0 else None  # min: rounding only

    def chance(self) -> float | None:
        """The share's chance level ``(k - 1) / (n - 1)`` (None with one token)."""
        assert self.by_id is not None
        return (len(self.by_id.ids) - 1) / (self.n - 1) if self.n > 1 else None

    def shares(self, channels: slice | None = None) -> dict[str, float | None]:
        """The share, its chance level and the share beyond chance (None without a share,
        or when chance is 1: every token has an id of its own), by their
        :class:`VarianceShares` field names."""
        share, chance = self.share(channels), self.chance()
        beyond = None if share is None or chance is None or chance >= 1 else \
            (share - chance) / (1 - chance)
        return {"eta2_token_id": share, "eta2_token_id_chance": chance,
                "epsilon2_token_id": beyond}


def aggregate(per_seed: Sequence[Mapping[str, float | None]]) -> dict[str, dict[str, Any]]:
    """Mean, sd (n-1), min and max of each metric over seeds; null values are left out."""
    keys = list(dict.fromkeys(k for m in per_seed for k in m))
    out = {}
    for key in keys:
        values = np.array([m[key] for m in per_seed if m.get(key) is not None], dtype=float)
        out[key] = {"n": int(len(values)),
                    "mean": float(values.mean()) if len(values) else None,
                    "sd": float(values.std(ddof=1)) if len(values) > 1 else None,
                    "min": float(values.min()) if len(values) else None,
                    "max": float(values.max()) if len(values) else None}
    return out
