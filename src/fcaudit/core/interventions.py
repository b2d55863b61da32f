"""Interventions: what replay feeds each site under each condition (SPEC section 4).

The built-in conditions are compositions of three coefficient-preserving
transformations, usable on any recorded dict ``{site name: [B, T, ...]}``:
:func:`reassign` (another sequence's coefficients), :func:`shuffle` (positions
permuted per sequence) and :func:`static` (calibration means from
:class:`StaticProfiles`). All randomness comes from numpy generators seeded per
condition and repeat, so a seed always yields the same derangement and permutations.

User-defined interventions (:class:`Intervention`) are functions from a batch's
recorded coefficients and an :class:`InterventionContext` to the coefficients to
feed; the engine replays, bootstraps and reports them like the built-in ones.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fcaudit.core.conditions import STATIC_CONDITIONS
from fcaudit.core.contract import Site
from fcaudit.core.errors import FcauditError


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


def draw(seed: int, n_seq: int, seq_len: int) -> RandomDraw:
    rng = np.random.default_rng(seed)
    return RandomDraw(seed, derangement(n_seq, rng), position_permutations(n_seq, seq_len, rng))


def batch_sums(coefficients: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Float64 sums over the batch's sequences, by position: ``{name: [T, *trailing]}``."""
    return {k: v.to(torch.float64).sum(0) for k, v in coefficients.items()}


class StaticProfiles:
    """Static coefficient profiles estimated from calibration sequences only.

    ``layer(s)`` is the mean of site ``s`` over positions and sequences (trailing
    shape kept); ``layer_position(s)`` the mean over sequences at each position;
    ``global_mean(f)`` one scalar per family over every coefficient of the family.
    Float64 sums are added batch by batch, in batch order.
    """

    def __init__(self, sites: Sequence[Site]) -> None:
        self.sites = list(sites)
        self._sum_pos: dict[str, Tensor] = {}
        self.count = 0

    def add_sums(self, sums: Mapping[str, Tensor], count: int) -> None:
        for site in self.sites:
            acc = self._sum_pos.get(site.name)
            self._sum_pos[site.name] = sums[site.name] if acc is None else acc + sums[site.name]
        self.count += count

    def add(self, coefficients: Mapping[str, Tensor]) -> None:
        self.add_sums(batch_sums(coefficients), next(iter(coefficients.values())).shape[0])

    def layer_position(self, site: Site) -> Tensor:
        return self._sum_pos[site.name] / self.count  # [T, *trailing]

    def layer(self, site: Site) -> Tensor:
        return self.layer_position(site).mean(0)  # [*trailing]

    def global_mean(self, family: str) -> float:
        total, n = 0.0, 0
        for site in self.sites:
            if site.family == family:
                s = self._sum_pos[site.name]
                total += float(s.sum())
                n += s.numel()
        return total / (n * self.count)


def static_tensor(condition: str, site: Site, profiles: StaticProfiles,
                  like: Tensor) -> Tensor:
    """The coefficients a static condition feeds ``site``, shaped and typed like ``like``."""
    shape = like.shape
    if condition == "static-layer":
        prof = profiles.layer(site).expand(shape)
    elif condition == "static-layer-position":
        prof = profiles.layer_position(site)
        if prof.shape[0] != shape[1]:
            raise ValueError(f"calibration length {prof.shape[0]} != evaluation length {shape[1]}")
        prof = prof.unsqueeze(0).expand(shape)
    elif condition == "global-mean":
        prof = torch.full(shape, profiles.global_mean(site.family), dtype=torch.float64)
    else:
        raise ValueError(f"not a static condition: {condition}; choose one of "
                         f"{', '.join(STATIC_CONDITIONS)}")
    return prof.to(device=like.device, dtype=like.dtype).contiguous()


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
        raise FcauditError(f"{what} must be integers in [0, {bound}) of shape {list(shape)} "
                           f"(one per sequence of the batch), got {arr.dtype} "
                           f"{list(arr.shape)}")
    return arr


def _batch_shape(coefficients: Coefficients) -> tuple[int, int]:
    shapes = {tuple(v.shape[:2]) for v in coefficients.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise FcauditError("coefficients must map site names to tensors [B, T, ...] of one "
                           f"batch, got shapes {sorted(shapes)}")
    return next(iter(shapes))  # type: ignore[return-value]


def reassign(coefficients: Coefficients, donor: Sequence[int]) -> Mapping[str, Tensor]:
    """Sequence ``n`` gets the coefficients of sequence ``donor[n]`` (every site alike)."""
    batch, _ = _batch_shape(coefficients)
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
           condition: str = "static-layer") -> Mapping[str, Tensor]:
    """Every site's coefficients replaced by a static calibration profile."""
    by_name = {s.name: s for s in profiles.sites}
    return _like(coefficients, {k: static_tensor(condition, by_name[k], profiles, v)
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
