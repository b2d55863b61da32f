"""Interventions: what replay feeds each site under each condition (docs/method.md,
Conditions).

The built-in conditions are compositions of three coefficient-preserving
transformations, usable on any recorded dict ``{site name: [B, T, ...]}`` or
Recording (each returns the same kind): :func:`reassign` (another sequence's
coefficients), :func:`shuffle` (positions permuted per sequence) and :func:`static`
(calibration means from :class:`StaticProfiles`); the engine's conditions call these
same functions. All randomness comes from numpy generators seeded per
condition and repeat, so a seed always yields the same derangement and permutations.

User-defined interventions (:class:`Intervention`) are functions from a batch's
recorded coefficients and an :class:`InterventionContext` to the coefficients to
feed; the engine replays, bootstraps and reports them like the built-in ones.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fcaudit.core.arrays import id_tensor
from fcaudit.core.conditions import CONDITIONS, STATIC_LAYER, Condition, by_kind
from fcaudit.core.contract import Site
from fcaudit.core.errors import UsageError, arg
from fcaudit.core.exits import ExitPlan, exit_scores
from fcaudit.core.registry import refusal


def derangement(n: int, rng: np.random.Generator) -> np.ndarray:
    """A uniformly random permutation with no fixed point (rejection sampling)."""
    if n < 2:
        raise ValueError("a derangement needs at least 2 elements")
    while True:
        perm = rng.permutation(n)
        if not np.any(perm == np.arange(n)):
            return perm


def position_permutations(n_seq: int, seq_len: int, rng: np.random.Generator) -> np.ndarray:
    """One independent random permutation of positions per sequence: ``[n_seq, seq_len]``."""
    return np.stack([rng.permutation(seq_len) for _ in range(n_seq)]) if n_seq else \
        np.zeros((0, seq_len), dtype=np.int64)


@dataclass(frozen=True)
class RandomDraw:
    """The random assignment of one repeat, shared by every site (and by reassign,
    shuffle and reassign+shuffle of that repeat, so the factorial contrast is paired)."""

    seed: int
    donor: np.ndarray  # [N] donor sequence for each evaluation sequence
    positions: np.ndarray  # [N, T] position permutation per sequence
    # sites with other position counts (patch tokens after pruning, spatial maps): length ->
    # [N, length] permutations, drawn after the main ones
    extra: dict[int, np.ndarray] = field(default_factory=dict)

    def positions_for(self, length: int) -> np.ndarray:
        """The ``[N, length]`` permutations for sites with ``length`` positions."""
        return self.positions if self.positions.shape[1] == length else self.extra[length]


def draw(seed: int, n_seq: int, seq_len: int, others: Sequence[int] = ()) -> RandomDraw:
    """One repeat's derangement and permutations (``others``: further position counts)."""
    rng = np.random.default_rng(seed)
    donor = derangement(n_seq, rng)
    main = position_permutations(n_seq, seq_len, rng)
    extra = {length: position_permutations(n_seq, length, rng)
             for length in dict.fromkeys(others) if length != seq_len}
    return RandomDraw(seed, donor, main, extra)


def batch_sums(coefficients: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Float64 sums over the batch's sequences, by position: ``{name: [T, *trailing]}``."""
    return {k: v.to(torch.float64).sum(0) for k, v in coefficients.items()}


@dataclass(frozen=True)
class TokenSums:
    """Float64 sums of every site's coefficients per token id, for the ids present only
    (sparse: memory is bounded by the tokens seen, not by the vocabulary)."""

    ids: Tensor  # [U] int64, sorted, distinct
    counts: Tensor  # [U] int64, tokens with that id
    sums: dict[str, Tensor]  # site name -> [U, *trailing] float64


def token_sums(coefficients: Mapping[str, Tensor], ids: Tensor) -> TokenSums:
    """The batch's :class:`TokenSums`: ``ids [B, T]`` are the token ids the coefficients
    ``[B, T, ...]`` were recorded at."""
    flat = torch.as_tensor(ids).to("cpu", torch.int64).reshape(-1)
    unique, inverse, counts = torch.unique(flat, return_inverse=True, return_counts=True)
    sums = {}
    for name, v in coefficients.items():
        x = v.detach().to("cpu", torch.float64).reshape(flat.numel(), *v.shape[2:])
        sums[name] = torch.zeros((len(unique), *v.shape[2:]), dtype=torch.float64).index_add_(
            0, inverse, x)
    return TokenSums(unique, counts, sums)


def merge_token_sums(acc: TokenSums | None, more: TokenSums) -> TokenSums:
    """``acc`` plus ``more`` (ids united): each id's sums are added in call order."""
    if acc is None:
        return more
    ids, inverse = torch.unique(torch.cat([acc.ids, more.ids]), return_inverse=True)
    old, new = inverse[:len(acc.ids)], inverse[len(acc.ids):]

    def merged(a: Tensor, b: Tensor) -> Tensor:
        out = torch.zeros((len(ids), *a.shape[1:]), dtype=a.dtype)
        return out.index_add_(0, old, a).index_add_(0, new, b)
    return TokenSums(ids, merged(acc.counts, more.counts),
                     {k: merged(v, more.sums[k]) for k, v in acc.sums.items()})


def cell_keys(ids: Tensor) -> Tensor:
    """One key per (token id, position) of ``ids [B, T]``: ``id * T + position``."""
    length = ids.shape[-1]
    return ids.to(torch.int64) * length + torch.arange(length, device=ids.device)


# the calibration sums only the conditions that read them collect (their registry entry's
# ``collects``), by name (a keyword of StaticProfiles.add_sums): (coefficients, ids) -> sums
COLLECTIONS: dict[str, Callable[[Mapping[str, Tensor], Tensor], TokenSums]] = {
    "cells": lambda coefficients, ids: token_sums(coefficients, cell_keys(ids)),
}


def _token_ids(ids: Any, shape: tuple[int, ...], what: str) -> Tensor:
    """Token ids ``[B, T]`` for coefficients of leading shape ``shape``, or one clear line."""
    if ids is None:
        raise UsageError(f"{what} needs the token ids the coefficients were recorded at: "
                         "pass ids=[B, T] (a Recording from fcaudit.record carries them)")
    return id_tensor(ids, shape, what)


class StaticProfiles:
    """Static coefficient profiles estimated from calibration sequences only.

    ``layer(s)`` is the mean of site ``s`` over positions and sequences (trailing
    shape kept); ``layer_position(s)`` the mean over sequences at each position;
    ``layer_token(s, ids)`` the mean over every calibration token with the same id
    (ids unseen in calibration get ``layer(s)``); ``layer_token_position(s, ids)`` the
    mean over every calibration token with the same id at the same position (pairs unseen
    get ``layer(s)``; collected by :meth:`add` only); ``global_mean(f)`` one scalar per
    family over every coefficient of the family. Float64 sums are added batch by
    batch, in batch order.
    """

    def __init__(self, sites: Sequence[Site]) -> None:
        self.sites = list(sites)
        self._sum_pos: dict[str, Tensor] = {}
        self.count = 0
        self.tokens: TokenSums | None = None  # per token id; None without token ids
        self._token_means: dict[str, Tensor] = {}
        # per (token id, position), keyed id * T + position (cell_keys); None: not collected
        self.cells: TokenSums | None = None
        self._cell_means: dict[str, Tensor] = {}

    def add_sums(self, sums: Mapping[str, Tensor], count: int,
                 tokens: TokenSums | None = None, cells: TokenSums | None = None) -> None:
        """A calibration batch's sums (by position; by token id; by token id and position:
        :data:`COLLECTIONS`' ``cells``, given only where an opted-in condition reads them)."""
        for site in self.sites:
            acc = self._sum_pos.get(site.name)
            if site.name not in sums:
                raise UsageError(f"StaticProfiles.add: no coefficients for site {site.name}; "
                                 "give every site's coefficients of the batch")
            if acc is not None and acc.shape != sums[site.name].shape:
                raise UsageError(
                    f"StaticProfiles.add: site {site.name} has [positions, ...] "
                    f"{list(sums[site.name].shape)} in this batch, {list(acc.shape)} in earlier "
                    "ones; every calibration batch must have the same length and shape")
            self._sum_pos[site.name] = sums[site.name] if acc is None else acc + sums[site.name]
        self.count += count
        if tokens is not None:
            self.tokens = merge_token_sums(self.tokens, tokens)
            self._token_means.clear()
        if cells is not None:
            self.cells = merge_token_sums(self.cells, cells)
            self._cell_means.clear()

    def add(self, coefficients: Mapping[str, Tensor], ids: Any = None) -> None:
        """A calibration batch; with its token ids (``ids``, or a Recording's own) the
        per-token-id profile too."""
        ids = getattr(coefficients, "input_ids", None) if ids is None else ids
        shape = tuple(next(iter(coefficients.values())).shape[:2])
        if ids is None:
            self.add_sums(batch_sums(coefficients), shape[0])
            return
        ids = _token_ids(ids, shape, "StaticProfiles.add")
        self.add_sums(batch_sums(coefficients), shape[0], token_sums(coefficients, ids),
                      **{name: collect(coefficients, ids) for name, collect in COLLECTIONS.items()})

    def shape(self, site: Site) -> torch.Size:
        """The per-position profile's shape ``[T, *trailing]``, once a batch was added."""
        if not self.count:
            raise UsageError("StaticProfiles holds no calibration batch yet; add one with "
                             "profiles.add(recording) before asking for a profile")
        return self._sum_pos[site.name].shape

    def layer_position(self, site: Site) -> Tensor:
        self.shape(site)
        return self._sum_pos[site.name] / self.count  # [T, *trailing]

    def layer(self, site: Site) -> Tensor:
        return self.layer_position(site).mean(0)  # [*trailing]

    def layer_token(self, site: Site, ids: Tensor) -> Tensor:
        """The per-token-id means at ``ids`` (any shape): ``[*ids.shape, *trailing]``;
        an id no calibration token had gets the static-layer profile."""
        if self.tokens is None:
            raise UsageError("static-layer-token needs per-token-id calibration sums: add "
                             "calibration batches with their token ids (StaticProfiles.add"
                             "(coefficients, ids))")
        return self._keyed(self.tokens, self._token_means, site, ids)

    def layer_token_position(self, site: Site, ids: Tensor, what: str = "this profile") -> Tensor:
        """The per-(token id, position) means at ``ids [B, T]``: ``[B, T, *trailing]``;
        a pair no calibration token had gets the static-layer profile."""
        if self.cells is None:
            asked = arg("conditions", py="AuditOptions(conditions=(...,))", cli="--condition")
            raise UsageError(f"{what} needs per-token-id-and-position calibration sums, which "
                             f"an audit collects only when asked (it is opt-in): run it with "
                             f"{asked}, or add calibration batches with their token ids "
                             "through StaticProfiles.add(coefficients, ids) and call "
                             "fcaudit.static")
        return self._keyed(self.cells, self._cell_means, site, cell_keys(ids))

    def _keyed(self, sums: TokenSums, cache: dict[str, Tensor], site: Site,
               keys: Tensor) -> Tensor:
        """The means of ``sums`` at ``keys``; a key calibration never had gets ``layer``."""
        means = cache.get(site.name)
        if means is None:
            total = sums.sums[site.name]
            means = total / sums.counts.view(-1, *[1] * (total.dim() - 1))
            cache[site.name] = means
        seen, where = self._lookup(keys, sums)
        out = means[where]
        out[~seen] = self.layer(site)
        return out

    def _lookup(self, ids: Tensor, sums: TokenSums | None = None) -> tuple[Tensor, Tensor]:
        """For each id: whether calibration saw it, and its row in ``sums`` (default
        :attr:`tokens`, which holds at least one id: a calibration batch has tokens)."""
        sums = self.tokens if sums is None else sums
        assert sums is not None
        known = sums.ids
        where = torch.searchsorted(known, ids).clamp(max=len(known) - 1)
        return known[where] == ids, where

    def unseen(self, ids: Any) -> tuple[int, int]:
        """How many of ``ids`` (tokens, then distinct ids) no calibration token had."""
        flat = id_tensor(ids, None, "StaticProfiles.unseen").reshape(-1)
        seen = self._lookup(flat)[0] if self.tokens is not None else torch.zeros_like(
            flat, dtype=torch.bool)
        return int((~seen).sum()), len(torch.unique(flat[~seen]))

    def global_mean(self, family: str) -> float:
        total, n = 0.0, 0
        for site in self.sites:
            if site.family == family:
                s = self._sum_pos[site.name]
                total += float(s.sum())
                n += s.numel()
        return total / (n * self.count)


def static_tensor(condition: str, site: Site, profiles: StaticProfiles,
                  like: Tensor, ids: Tensor | None = None) -> Tensor:
    """The coefficients a static condition feeds ``site``, shaped and typed like ``like``
    (``ids [B, T]``: the token ids fed, for the profiles keyed by token id)."""
    cond = _check_profile(condition, site, profiles, like)
    assert cond.profile is not None
    prof = _PROFILES[cond.profile](profiles, site, like.shape, ids, cond.name)
    return prof.to(device=like.device, dtype=like.dtype).contiguous()


def static_any_length(condition: str, site: Site, profiles: StaticProfiles, like: Tensor,
                      ids: Tensor | None = None) -> Tensor:
    """:func:`static_tensor` at any number of positions: a per-position profile's rows past
    the calibration windows are static-layer's, as ids no calibration token had take it
    under static-layer-token (what a task request longer than the windows is fed, and what
    a fold writes for the model's whole context)."""
    if CONDITIONS[condition].profile != "layer_position":
        return static_tensor(condition, site, profiles, like, ids)
    covered = profiles.shape(site)[0]
    rows = static_tensor(condition, site, profiles,
                         like.new_zeros(like.shape[0], covered, *like.shape[2:]))
    if like.shape[1] <= covered:
        return rows[:, :like.shape[1]]
    return torch.cat([rows, static_tensor(STATIC_LAYER, site, profiles, like[:, covered:],
                                          None if ids is None else ids[:, covered:])], dim=1)


def shuffle_by_length(coefficients: Coefficients,
                      permutations: Callable[[int], np.ndarray]) -> dict[str, Tensor]:
    """Each site's positions permuted per sequence by ``permutations(length)``
    (``[sequences, length]``); sites with the same number of positions share one
    permutation per sequence (token sites all have ``T``)."""
    groups: dict[int, dict[str, Tensor]] = {}
    for name, tensor in coefficients.items():
        groups.setdefault(int(tensor.shape[1]), {})[name] = tensor
    out: dict[str, Tensor] = {}
    for length, part in groups.items():
        out.update(shuffle(part, permutations(length)))
    return {name: out[name] for name in coefficients}


ProfileFn = Callable[[StaticProfiles, Site, torch.Size, "Tensor | None", str], Tensor]
# a static condition's profile (its registry entry's ``profile``), as the fed tensor
_PROFILES: dict[str, ProfileFn] = {
    "layer": lambda p, site, shape, ids, what: p.layer(site).expand(shape),
    "layer_position": lambda p, site, shape, ids, what:
        p.layer_position(site).unsqueeze(0).expand(shape),
    "layer_token": lambda p, site, shape, ids, what:
        p.layer_token(site, _token_ids(ids, tuple(shape[:2]), what)),
    "layer_token_position": lambda p, site, shape, ids, what:
        p.layer_token_position(site, _token_ids(ids, tuple(shape[:2]), what), what),
    "global_mean": lambda p, site, shape, ids, what:
        torch.full(shape, p.global_mean(site.family), dtype=torch.float64),
}
# the profiles of shape [positions, *trailing]
_PER_POSITION = ("layer_position", "layer_token_position")


def _check_profile(condition: str, site: Site, profiles: StaticProfiles,
                   like: Tensor) -> Condition:
    """Refuse in one line a condition that is not static, and coefficients whose shape the
    site's calibration profile does not have: [positions, *trailing] for the per-position
    profile, the trailing shape for the others."""
    static_names = by_kind("static", default=None)
    if condition not in static_names:
        raise refusal(f"static(condition={condition!r})", condition, static_names)
    cond = CONDITIONS[condition]
    profile = profiles.shape(site)  # [T, *trailing]
    per_position = cond.profile in _PER_POSITION
    given, kept = (like.shape[1:], profile) if per_position else (like.shape[2:], profile[1:])
    if like.dim() < 2 or given != kept:
        part = "[positions, *trailing]" if per_position else "trailing"
        raise UsageError(f"static(..., {condition!r}): site {site.name}'s coefficients "
                         f"{list(like.shape)} have {part} shape {list(given)}, its calibration "
                         f"profile {list(kept)}; record calibration and these coefficients at "
                         "the same sites and length")
    return cond


def shuffle_positions(x: Tensor, positions: np.ndarray) -> Tensor:
    """``x[n, sigma_n(t)]`` for a batch ``x [B, T, ...]`` and permutations ``[B, T]``."""
    idx = torch.from_numpy(np.asarray(positions)).to(x.device)
    idx = idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand_as(x)
    return torch.gather(x, 1, idx)


Coefficients = Mapping[str, Tensor]


def _like(given: Coefficients, derived: dict[str, Tensor]) -> Mapping[str, Tensor]:
    """``derived`` as the same kind as ``given``: from a Recording, a Recording of the same
    sites (so replay needs no globs), else a plain dict."""
    from fcaudit.core.recording import Recording
    return given.with_coefficients(derived) if isinstance(given, Recording) else derived


def _indices(value: Any, shape: tuple[int, ...], bound: int, what: str) -> np.ndarray:
    """Integer indices of exactly ``shape``, each in [0, bound), or a one-line error: a
    short donor list would otherwise return fewer sequences without a word."""
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu" or arr.shape != shape or (
            arr.size and (int(arr.min()) < 0 or int(arr.max()) >= bound)):
        raise UsageError(f"{what} must be integers in [0, {bound}) of shape {list(shape)} "
                         f"(one per sequence of the batch), got {arr.dtype} "
                         f"{list(arr.shape)}")
    return arr


def _batch_shape(coefficients: Coefficients) -> tuple[int, int]:
    shapes = {tuple(v.shape[:2]) for v in coefficients.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise UsageError("coefficients must map site names to tensors [B, T, ...] of one "
                         f"batch, got shapes {sorted(shapes)}")
    return next(iter(shapes))  # type: ignore[return-value]


def _examples(coefficients: Coefficients) -> int:
    """The examples every site's coefficients ``[B, P, ...]`` share; their position counts
    may differ (patch sites beside per-example ones, ``P = 1``)."""
    counts = {int(v.shape[0]) for v in coefficients.values() if v.dim() >= 2}
    if len(counts) != 1 or any(v.dim() < 2 for v in coefficients.values()):
        raise UsageError("coefficients must map site names to tensors [B, P, ...] with "
                         "the same examples B, got shapes "
                         f"{sorted(tuple(v.shape[:2]) for v in coefficients.values())}")
    return counts.pop()


def reassign(coefficients: Coefficients, donor: Sequence[int]) -> Mapping[str, Tensor]:
    """Sequence ``n`` gets the coefficients of sequence ``donor[n]`` (every site alike)."""
    batch = _examples(coefficients)
    idx = torch.as_tensor(_indices(donor, (batch,), batch, "reassign(donor=...)"),
                          dtype=torch.long)
    return _like(coefficients, {k: v[idx.to(v.device)] for k, v in coefficients.items()})


def shuffle(coefficients: Coefficients, positions: np.ndarray) -> Mapping[str, Tensor]:
    """Sequence ``n`` gets its own coefficients at positions ``positions[n]`` (every site
    alike)."""
    batch, length = _batch_shape(coefficients)
    order = _indices(positions, (batch, length), length, "shuffle(positions=...)")
    return _like(coefficients, {k: shuffle_positions(v, order) for k, v in coefficients.items()})


def static(coefficients: Coefficients, profiles: StaticProfiles,
           condition: str = STATIC_LAYER, ids: Any = None) -> Mapping[str, Tensor]:
    """Every site's coefficients replaced by a static calibration profile; for
    ``static-layer-token``, the profile of each token's id (``ids [B, T]``, or the
    Recording's own input ids)."""
    by_name = {s.name: s for s in profiles.sites}
    unknown = [k for k in coefficients if k not in by_name]
    if unknown:
        raise UsageError(f"static: the profiles have no site {unknown[0]!r}; they were added "
                         f"for {', '.join(by_name) or 'no site'}")
    ids = getattr(coefficients, "input_ids", None) if ids is None else ids
    return _like(coefficients, {k: static_tensor(condition, by_name[k], profiles, v, ids)
                                for k, v in coefficients.items()})


@dataclass(frozen=True)
class InterventionContext:
    """What a user-defined intervention may use besides the batch's own coefficients."""

    sites: tuple[Site, ...]
    rows: range  # global indices of this batch's evaluation sequences
    profiles: StaticProfiles  # calibration profiles (see :func:`static`)
    repeat: int
    rng: np.random.Generator  # seeded by (master seed, name, repeat, batch)
    donors: Callable[[str, Sequence[int]], Tensor]  # any sequences' coefficients of a site
    ids: Tensor | None = None  # the batch's token ids [B, T] (static(..., ids=context.ids))
    # the repeat's random assignment over the whole evaluation set (the engine's built-in
    # random conditions; None for user interventions, which draw from ``rng``)
    draw: RandomDraw | None = None


@dataclass(frozen=True)
class ConditionContext(InterventionContext):
    """A built-in condition's context: the public one plus the exit references' layers
    (core/exits.py ExitPlan), which travel with the exit conditions' runs only; a user
    intervention never sees them."""

    exits: ExitPlan | None = None


InterventionFn = Callable[[dict[str, Tensor], InterventionContext], Mapping[str, Tensor]]


@dataclass(frozen=True)
class Intervention:
    """A named user-defined condition: ``fn(coefficients, context)`` returns the tensors to
    feed the sites it changes (the others stay correct); run ``repeats`` times with
    independent seeds when it is random."""

    name: str
    fn: InterventionFn
    repeats: int = 1

    def rng(self, master: int, repeat: int, batch: int) -> np.random.Generator:
        key = zlib.crc32(self.name.encode())
        return np.random.default_rng([master, key, repeat, batch])


# The built-in conditions' feeds (core/conditions.py names them): the engine feeds its
# conditions through the same InterventionContext as user interventions.

def feed_own(condition: Condition, coefficients: Coefficients,
             context: InterventionContext) -> Mapping[str, Tensor]:
    """The reference: each site's own recorded coefficients."""
    return coefficients


def _drawn(condition: Condition, context: InterventionContext) -> RandomDraw:
    if context.draw is None:
        raise UsageError(f"condition {condition.name!r} needs the audit's random draw of the "
                         "repeat (InterventionContext.draw): the engine gives it")
    return context.draw


def feed_reassign(condition: Condition, coefficients: Coefficients,
                  context: InterventionContext) -> Mapping[str, Tensor]:
    """Sequence ``n`` of the batch gets evaluation sequence ``donor[n]``'s coefficients,
    from any batch: the donor rows are read through ``context.donors`` (each once, in
    increasing order) and :func:`reassign` pairs them with their receivers. The donors
    are a slice of a derangement, so the pool has one distinct row per receiver."""
    rows = context.rows
    pool_rows, donor = np.unique(_drawn(condition, context).donor[rows.start:rows.stop],
                                 return_inverse=True)
    pool = {k: context.donors(k, pool_rows) for k in coefficients}
    return reassign(pool, donor.reshape(-1))


def feed_shuffle(condition: Condition, coefficients: Coefficients,
                 context: InterventionContext) -> Mapping[str, Tensor]:
    """Each site's positions permuted per sequence (:func:`shuffle_by_length`: the
    repeat's draw for the batch's rows)."""
    rand, rows = _drawn(condition, context), context.rows
    return shuffle_by_length(coefficients,
                             lambda length: rand.positions_for(length)[rows.start:rows.stop])


def feed_reassign_shuffle(condition: Condition, coefficients: Coefficients,
                          context: InterventionContext) -> Mapping[str, Tensor]:
    """Another sequence's coefficients, then positions permuted (the same draws as
    reassign and shuffle of the repeat, so the factorial contrast is paired)."""
    return feed_shuffle(condition, feed_reassign(condition, coefficients, context), context)


def feed_static(condition: Condition, coefficients: Coefficients,
                context: InterventionContext) -> Mapping[str, Tensor]:
    """The condition's calibration profile (:func:`static`)."""
    return static(coefficients, context.profiles, condition.name, context.ids)


def feed_exit(condition: Condition, coefficients: Coefficients,
              context: InterventionContext) -> Mapping[str, Tensor]:
    """The exit scores that stop each token at the layer the condition's reference gives
    it (:meth:`~fcaudit.core.exits.ExitPlan.layers`): the model's own rule carries it out."""
    if not isinstance(context, ConditionContext) or context.exits is None:
        raise UsageError(f"condition {condition.name!r} needs the exit layers of the model "
                         "(ConditionContext.exits, an ExitPlan): the engine gives them")
    layers = context.exits.layers(condition.name, context.rows, _batch_shape(coefficients))
    return exit_scores(context.sites, layers, coefficients)


def builtin(name: str, repeats: int = 1) -> Intervention:
    """A built-in condition as an :class:`Intervention`, to run one that audits do not run
    by default (``fcaudit.audit(..., interventions=[builtin(name)])``)."""
    condition = CONDITIONS.get(name)
    if condition is None or condition.feeder is None or condition.kind == "random":
        choices = [c.name for c in CONDITIONS.values() if c.feeder and c.kind != "random"]
        raise refusal(f"builtin({name!r})", name, choices, option="name")
    return Intervention(name, condition.feed, repeats)
