"""Interventions: what replay feeds each site under each condition (SPEC section 4).

All randomness is drawn from numpy generators seeded per condition and repeat, so a
given seed always yields the same derangement and the same position permutations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .contract import Site

MAIN_CONDITIONS = ("original", "correct", "reassign", "shuffle", "reassign+shuffle",
                   "static-layer", "static-layer-position", "global-mean")
RANDOM_CONDITIONS = ("reassign", "shuffle", "reassign+shuffle")
STATIC_CONDITIONS = ("static-layer", "static-layer-position", "global-mean")


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


class StaticProfiles:
    """Static coefficient profiles estimated from calibration sequences only.

    ``layer[s]`` is the mean of site ``s`` over positions and sequences (trailing
    shape kept); ``layer_position[s]`` the mean over sequences at each position;
    ``global_mean[f]`` one scalar per family over every coefficient of the family.
    Sums are kept in float64 and streamed batch by batch.
    """

    def __init__(self, sites: Sequence[Site]) -> None:
        self.sites = list(sites)
        self._sum_pos: dict[str, torch.Tensor] = {}
        self._count = 0

    def add(self, coefficients: dict[str, torch.Tensor]) -> None:
        for site in self.sites:
            x = coefficients[site.name].to(torch.float64).sum(0)
            acc = self._sum_pos.get(site.name)
            self._sum_pos[site.name] = x if acc is None else acc + x
        self._count += next(iter(coefficients.values())).shape[0]

    def state(self) -> dict[str, torch.Tensor]:
        """Tensors to persist (float64 sums by position, plus the sequence count)."""
        out = {f"sum_pos::{k}": v for k, v in self._sum_pos.items()}
        out["count"] = torch.tensor([self._count], dtype=torch.int64)
        return out

    @classmethod
    def from_state(cls, sites: Sequence[Site], state: dict[str, torch.Tensor]) -> StaticProfiles:
        prof = cls(sites)
        prof._sum_pos = {s.name: state[f"sum_pos::{s.name}"] for s in prof.sites}
        prof._count = int(state["count"][0])
        return prof

    @property
    def count(self) -> int:
        return self._count

    def layer_position(self, site: Site) -> torch.Tensor:
        return self._sum_pos[site.name] / self._count  # [T, *trailing]

    def layer(self, site: Site) -> torch.Tensor:
        return self.layer_position(site).mean(0)  # [*trailing]

    def global_mean(self, family: str) -> float:
        total, n = 0.0, 0
        for site in self.sites:
            if site.family == family:
                s = self._sum_pos[site.name]
                total += float(s.sum())
                n += s.numel()
        return total / (n * self._count)


def static_tensor(condition: str, site: Site, profiles: StaticProfiles, batch: int,
                  like: torch.Tensor) -> torch.Tensor:
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
        raise ValueError(f"not a static condition: {condition}")
    assert prof.shape[0] == batch
    return prof.to(like.dtype).contiguous()


def shuffle_positions(x: torch.Tensor, perms: np.ndarray) -> torch.Tensor:
    """``x[n, sigma_n(t)]`` for a batch ``x [B, T, ...]`` and permutations ``[B, T]``."""
    idx = torch.from_numpy(perms).to(x.device)
    idx = idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand_as(x)
    return torch.gather(x, 1, idx)
