"""Summarize: results from per-sequence NLLs and the cached coefficients.

Penalties, retention and interaction (paired bootstrap over sequences) for every
condition, per-layer variant and user intervention; the variance decomposition,
variation and profiles of each family's coefficients.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fcaudit.core.conditions import (
    CORRECT,
    GLOBAL_MEAN,
    ORIGINAL,
    PER_LAYER_CONDITIONS,
    REASSIGN,
    REASSIGN_SHUFFLE,
    REPORTED_RETENTION,
    SHUFFLE,
    STATIC_LAYER,
    audited,
)
from fcaudit.core.contract import Site
from fcaudit.core.errors import ModelError
from fcaudit.core.sites import families
from fcaudit.engine.cache import CoefficientCache, EvaluationShard
from fcaudit.engine.metrics import (
    Bootstrap,
    TokenShare,
    VarianceAccumulator,
    accuracy_retention,
    interaction,
    penalty,
    retention,
)
from fcaudit.engine.options import AuditOptions, SeedPlan
from fcaudit.engine.plan import Run, UserIntervention
from fcaudit.engine.result import (
    ConditionResult,
    LayerConditionResult,
    Profile,
    Retention,
    SitePart,
    VarianceShares,
    Variation,
)


def condition_result(per_seq: Mapping[str, np.ndarray], repeats: Mapping[str, list[np.ndarray]],
               key: str, boot: Bootstrap,
               hits: Mapping[str, float] | None = None) -> ConditionResult:
    correct = per_seq[CORRECT]
    delta, ci = penalty(per_seq[key], correct, boot)
    reps = repeats[key]
    return ConditionResult(float(per_seq[key].mean()), delta, ci,
                           [float(r.mean()) for r in reps],
                           [float((r - correct).mean()) for r in reps],
                           None if hits is None else hits[key])


def accuracies(runs: Sequence[Run], hits: Sequence[np.ndarray] | None,
               original: np.ndarray | None) -> dict[str, float] | None:
    """Run key -> share of examples classified correctly, repeats averaged (None where the
    objective defines no accuracy)."""
    if hits is None or original is None:
        return None
    by_key: dict[str, list[np.ndarray]] = {}
    for run, values in zip(runs, hits, strict=True):
        by_key.setdefault(run.key, []).append(values)
    out = {k: float(np.mean([v.mean() for v in vs])) for k, vs in by_key.items()}
    return {**out, ORIGINAL: float(original.mean())}


def example_hits(runs: Sequence[Run], hits: Sequence[np.ndarray] | None,
                 original: np.ndarray | None) -> dict[str, np.ndarray] | None:
    """Run key -> each example's hit (1: scored right), repeats averaged, as the losses
    are (None where the objective defines no accuracy): what accuracy retention reads."""
    if hits is None or original is None:
        return None
    by_key: dict[str, list[np.ndarray]] = {}
    for run, values in zip(runs, hits, strict=True):
        by_key.setdefault(run.key, []).append(np.asarray(values, dtype=np.float64))
    return {**{k: np.mean(v, axis=0) for k, v in by_key.items()},
            ORIGINAL: np.asarray(original, dtype=np.float64)}


def paired_bootstrap(n: int, options: AuditOptions) -> Bootstrap:
    """The one resample stream every interval of an audit uses (paired contrasts)."""
    return Bootstrap(n, options.bootstrap, SeedPlan(options.seed).bootstrap)


@dataclass
class Summary:
    conditions: dict[str, ConditionResult]
    per_layer: dict[str, list[LayerConditionResult]]
    retention: dict[str, Any]
    interaction: Any
    custom: dict[str, ConditionResult]


def summarize(runs: Sequence[Run], replayed: Sequence[np.ndarray], original: np.ndarray,
              sites: Sequence[Site], options: AuditOptions, opted: Sequence[str],
              skipped: Mapping[str, str] | None = None,
              hits: Mapping[str, float] | None = None,
              per_example_hits: Mapping[str, np.ndarray] | None = None) -> Summary:
    """Penalties, retention and interaction from per-sequence NLLs (paired bootstrap);
    ``replayed`` holds one array per run, in run order. ``skipped``: conditions not
    applicable (not run) with the reason; ``hits``: accuracy per run key;
    ``per_example_hits`` (:func:`example_hits`): each retention's share on accuracy too."""
    skipped = skipped or {}
    repeats: dict[str, list[np.ndarray]] = {}
    for run, values in zip(runs, replayed, strict=True):  # repeats of a key come in order
        repeats.setdefault(run.key, []).append(values)
    repeats[ORIGINAL] = [original]
    per_seq = {k: np.mean(v, axis=0) for k, v in repeats.items()}
    boot = paired_bootstrap(len(original), options)
    conditions = {c: condition_result(per_seq, repeats, c, boot, hits) for c in audited(opted)
                  if c not in skipped}
    per_layer = {c: [LayerConditionResult(**dataclasses.asdict(condition_result(
        per_seq, repeats, f"{c}@{s.name}", boot, hits)), layer=s.layer, site=s.name,
        family=s.family) for s in sites] for c in PER_LAYER_CONDITIONS} \
        if options.per_layer else {}
    correct = per_seq[CORRECT]
    ret = {p: _retention(per_seq, p, boot, skipped, per_example_hits)
           for p in audited(opted, REPORTED_RETENTION)}
    inter = interaction(per_seq[REASSIGN_SHUFFLE], per_seq[REASSIGN], per_seq[SHUFFLE],
                        correct, boot) if SHUFFLE not in skipped else None
    custom = {r.target.intervention.name: condition_result(per_seq, repeats, r.key, boot, hits)
              for r in runs if isinstance(r.target, UserIntervention)}
    return Summary(conditions, per_layer, ret, inter, custom)


def _retention(per_seq: Mapping[str, np.ndarray], profile: str, boot: Bootstrap,
               skipped: Mapping[str, str],
               hits: Mapping[str, np.ndarray] | None) -> Retention:
    """``profile``'s gap retention and, with per-example hits, its share on accuracy."""
    out = _measured(retention, per_seq, profile, boot, skipped)
    if hits is None:
        return out
    return dataclasses.replace(out, accuracy=_measured(accuracy_retention, hits, profile,
                                                       boot, skipped))


def _measured(measure: Any, per_key: Mapping[str, np.ndarray], profile: str,
              boot: Bootstrap, skipped: Mapping[str, str]) -> Retention:
    """``measure`` (loss or accuracy retention) of ``profile``, or its not-applicable row."""
    if profile in skipped:
        return _not_applicable(per_key, boot, skipped[profile], measure)
    return measure(per_key[profile], per_key[CORRECT], per_key[GLOBAL_MEAN], boot)


def _not_applicable(per_seq: Mapping[str, np.ndarray], boot: Bootstrap,
                    reason: str, measure: Any = retention) -> Retention:
    """The retention of a profile that does not apply: the gap as measured, no value."""
    gap = measure(per_seq[STATIC_LAYER], per_seq[CORRECT], per_seq[GLOBAL_MEAN], boot)
    return dataclasses.replace(gap, value=None, ci95=None, defined=False,
                               reason=f"not applicable: {reason}")


@dataclass(frozen=True)
class Description:
    """What the cached coefficients say on their own, per family, and the original NLL."""

    variance: dict[str, VarianceShares]
    variation: dict[str, Variation]
    profiles: dict[str, Profile]
    original_nll: np.ndarray  # [N] per-sequence mean NLL of the record pass
    # per family that names its coefficients: each one decomposed alone (the selection
    # parts analysis's section)
    parts: dict[str, dict[str, VarianceShares]]


def describe(cache: CoefficientCache, sites: Sequence[Site],
             ids: np.ndarray | None) -> Description:
    """Variance (with the token-id share, from the evaluation token ids ``ids``; none
    without them), variation and profiles per family, the original per-sequence NLL, and
    each named coefficient's variance (:func:`part_variance`)."""
    members = {f: [s for s in sites if s.family == f] for f in families(sites)}
    accumulators = {f: VarianceAccumulator(m) for f, m in members.items()}
    tokens = {f: TokenShare(m) for f, m in members.items()}
    original = np.empty(cache.n_sequences)
    for b in range(cache.n_batches):
        coefficients = {s.name: cache.coefficients(b, s.name) for s in sites}
        rows = cache.batch_range(b)
        for f, acc in accumulators.items():
            acc.add(coefficients)
            if ids is not None:
                tokens[f].add(coefficients, torch.from_numpy(
                    np.ascontiguousarray(ids[rows.start:rows.stop])))
        nll = cache.batch(b, EvaluationShard.NLL)
        original[rows.start:rows.stop] = nll.double().mean(1).numpy()
    variance = {f: dataclasses.replace(
        a.decompose(), **(tokens[f].shares() if ids is not None else {}))
        for f, a in accumulators.items()}
    parts = {f: named for f, a in accumulators.items() if (named := part_variance(
        members[f], a, tokens[f] if ids is not None else None)) is not None}
    return Description(variance, {f: a.variation() for f, a in accumulators.items()},
                       {f: a.profile() for f, a in accumulators.items()}, original, parts)


# ---------------------------------------------------------------------- parts
# Selection parameters and their named coefficients (:class:`~fcaudit.core.contract.Selection`).
#
# A Mamba-2 ``in_proj`` slice holds ``dt``, ``B`` and ``C`` side by side: pooled, their
# variance shares mix three coefficients with different roles, so each is also decomposed
# alone. The declarations are checked on the first batch (one line naming the site, never an
# index error after the whole audit), and they reach ``audit.json`` through the sites listing
# and the selection parts analysis's section (:mod:`fcaudit.engine.analyses.selection_parts`).

PARTS_FIX = ("declare Selection(space, parts=((name, width), ...)) with distinct names and "
             "positive widths that add up to the coefficient's last axis")


def _describe(parts: Sequence[tuple[str, int]]) -> str:
    return ", ".join(f"{name}({width})" for name, width in parts)


def declared(site: Site) -> tuple[tuple[str, int], ...]:
    """A site's parts as a tuple of ``(name, width)`` pairs (lists accepted), checked:
    distinct non-empty names, positive integer widths."""
    parts = site.selection.parts if site.selection is not None else ()
    pairs = tuple(tuple(p) for p in parts if isinstance(p, (tuple, list))) \
        if isinstance(parts, (tuple, list)) else None
    well_formed = pairs is not None and len(pairs) == len(parts) and all(
        len(p) == 2 and isinstance(p[0], str) and p[0] and isinstance(p[1], int)
        and not isinstance(p[1], bool) and p[1] > 0 for p in pairs)
    if not well_formed or len({p[0] for p in pairs}) != len(pairs):
        raise ModelError(f"site {site.name}: parts={parts!r} is not a tuple of distinct "
                         f"(name, width) pairs; {PARTS_FIX}", site=site.name)
    return tuple((str(name), int(width)) for name, width in pairs)


def space(site: Site) -> str | None:
    """The space a selection parameter's values are in; None for any other site."""
    return site.selection.space if site.selection is not None else None


def _check_declared(site: Site) -> tuple[tuple[str, int], ...]:
    """The site's parts (:func:`declared`); a selection's space must be named."""
    parts, named = declared(site), space(site)
    if site.selection is not None and not (isinstance(named, str) and named.strip()):
        raise ModelError(f"site {site.name}: Selection.space={named!r} must name the "
                         "space the selection parameter's values are in (e.g. \"dt before "
                         "softplus\")", site=site.name)
    return parts


def check_parts(sites: Sequence[Site], coefficients: Mapping[str, Tensor]) -> None:
    """Every site's declared parts fit its first batch's coefficients, and the sites of a
    family agree on them and on being selection parameters (each coefficient is compared
    across layers, so every layer must hold the same ones)."""
    first: dict[str, tuple[Site, tuple[tuple[str, int], ...]]] = {}
    for site in sites:
        parts = _check_declared(site)
        head, head_parts = first.setdefault(site.family, (site, parts))
        if (parts, site.selection is None) != (head_parts, head.selection is None):
            raise ModelError(
                f"sites {head.name} and {site.name} of family {site.family} declare other "
                f"coefficients (parts {_describe(head_parts) or 'none'} vs "
                f"{_describe(parts) or 'none'}; selection {space(head)!r} vs "
                f"{space(site)!r}); give every site of a family the same parts and "
                "selection, or put them in families of their own", site=site.name)
        if not parts or site.name not in coefficients:
            continue
        shape = list(coefficients[site.name].shape)
        total = sum(width for _, width in parts)
        if len(shape) < 3 or shape[-1] != total:
            raise ModelError(
                f"site {site.name} declares parts {_describe(parts)} ({total} channels) "
                f"but its coefficients have shape {shape}, {shape[-1] if len(shape) >= 3 else 'no'}"
                f" channels on the last trailing axis; {PARTS_FIX}", site=site.name)


def channels(parts: Sequence[tuple[str, int]]) -> dict[str, slice]:
    """Each part's channels on the last axis, in declared order."""
    out, start = {}, 0
    for name, width in parts:
        out[name] = slice(start, start + width)
        start += width
    return out


def coefficients_of(members: Sequence[Site]) -> dict[str, slice] | None:
    """A family's named coefficients and their channels: its declared parts; a selection
    family without parts, one coefficient named by its family; None for any other."""
    head = members[0]
    if declared(head):
        return channels(declared(head))
    return {head.family: slice(None)} if head.selection is not None else None


def part_variance(members: Sequence[Site], variance: VarianceAccumulator,
                  tokens: TokenShare | None) -> dict[str, VarianceShares] | None:
    """Each named coefficient's variance decomposition with its token-id share (None
    without token ids), or None for a family that names none."""
    named = coefficients_of(members)
    if named is None:
        return None
    return {name: dataclasses.replace(variance.part(cut),
                                      **(tokens.shares(cut) if tokens is not None else {}))
            for name, cut in named.items()}


def site_parts(site: Site) -> list[SitePart] | None:
    """A site's parts as ``audit.json`` lists them (None: one coefficient)."""
    return [SitePart(name, width) for name, width in declared(site)] or None
