"""Reused replay results, proven by recomputation.

A rerun into the same output folder recomputes every cached *record* batch and uses it
only when bitwise equal. A cached *replay* batch is a different matter: its runs were
computed under intervention, on branches the unperturbed pass never takes (every example
fed one static profile, every token routed to one expert), so state the model reads only
there (a file, an environment variable, an attribute) can change while every record
stays equal. The feed digests prove what each run was *fed*, not what the model *does*
with it.

So at every resume a sample of the reused runs is replayed again and must equal its
cached rows bit for bit: every run of the plan (each condition and repeat, per-layer run,
expert ablation, frontier or exit point, user intervention) on one reused batch drawn at
random, with a seed drawn afresh from the operating system, so that which batch proves a
run cannot be predicted from the folder. ``verify_reuse="all"`` replays every run of
every reused batch. What a sample proves, and what it cannot, is in docs/method.md
("Reuse").
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fcaudit.core.adapters import same_bits
from fcaudit.core.errors import arg
from fcaudit.engine.cache import ReplayShard
from fcaudit.engine.plan import ExpertAblation, Run

Tensors = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class ReuseSample:
    """The reused replay runs this audit recomputes: batch -> run indices (plan order; the
    correct replay, index 0, is recomputed with every batch of the sample)."""

    mode: str
    seed: int
    by_batch: Mapping[int, tuple[int, ...]]

    def runs_in(self, b: int) -> tuple[int, ...]:
        return self.by_batch.get(b, ())

    def summary(self, n_runs: int, reused_batches: int) -> dict[str, object]:
        """What ``runtime.reuse`` says of the proof (counts, not the sample itself: the
        seed and the reused batches give it back)."""
        verified = sum(len(v) for v in self.by_batch.values())
        reused = n_runs * reused_batches
        return {"verify_reuse": self.mode, "verify_seed": self.seed,
                "replay_runs_verified": verified,
                "replay_batches_verified": len(self.by_batch),
                "replay_share_verified": round(verified / reused, 6) if reused else None}


def fresh_seed() -> int:
    """A seed no folder predicts: drawn from the operating system at every resume."""
    return secrets.randbits(63)


def choose(mode: str, n_runs: int, reused: Sequence[int], seed: int) -> ReuseSample:
    """Which reused runs to recompute: ``all`` every run of every reused batch; ``sample``
    each run on one reused batch drawn uniformly (so every run is proven somewhere, and
    every batch can be the one that proves it)."""
    if not reused or n_runs == 0:
        return ReuseSample(mode, seed, {})
    if mode == "all":
        return ReuseSample(mode, seed, {b: tuple(range(n_runs)) for b in sorted(reused)})
    picks = np.random.default_rng(seed).choice(np.asarray(sorted(reused)), size=n_runs)
    by_batch: dict[int, list[int]] = {}
    for i, b in enumerate(picks.tolist()):
        by_batch.setdefault(int(b), []).append(i)
    return ReuseSample(mode, seed, {b: tuple(v) for b, v in sorted(by_batch.items())})


def sub_plan(runs: Sequence[Run], picked: Sequence[int]) -> tuple[list[int], list[Run]]:
    """The runs to replay for ``picked``: the correct replay first (the identity check and
    every other run rest on it), then the picked ones in plan order."""
    index = [0, *sorted(i for i in set(picked) if i)]
    return index, [runs[i] for i in index]


def first_difference(runs: Sequence[Run], index: Sequence[int], cached: Tensors,
                     fresh: Tensors) -> tuple[int, str] | None:
    """The first recomputed run whose rows differ from the cached shard's, as (plan index,
    what differs), or None when every row the sub-plan holds is bitwise the cached one.
    ``fresh`` is the shard of the sub-plan ``[runs[i] for i in index]``."""
    R = ReplayShard
    for j, i in enumerate(index):
        for key, what in ((R.FEED_DIGEST, "fed tensors"), (R.NLL, "per-sequence losses"),
                          (R.HITS, "correct classifications")):
            if key in cached and not same_bits(cached[key][i], fresh[key][j]):
                return i, _what(what, cached[key][i], fresh[key][j])
    loads = R.route_loads(cached)
    if not same_bits(loads, R.route_loads(fresh)):
        return 0, "expert loads of the correct replay"
    for key, rows in ((R.ROUTE_CHANGED, rerouting_rows(runs)),
                      (R.STILL_SELECTED, ablation_rows(runs))):
        if key not in cached:
            continue
        sub_rows = {i: j for j, i in enumerate(r for r in rows if r in index)}
        for k, i in enumerate(rows):
            if i in sub_rows and not same_bits(cached[key][k], fresh[key][sub_rows[i]]):
                return i, "tokens re-routed" if key == R.ROUTE_CHANGED else \
                    "picks of the ablated expert"
    return None


def _what(what: str, cached: torch.Tensor, fresh: torch.Tensor) -> str:
    if not cached.is_floating_point() or cached.shape != fresh.shape:
        return what
    return f"{what} (by up to {float((cached - fresh).abs().max()):.3g})"


def rerouting_rows(runs: Sequence[Run]) -> list[int]:
    """Plan indices of the runs whose re-routing rows a replay shard holds, in row order."""
    return [i for i, r in enumerate(runs) if i and r.target.counts_rerouting]


def ablation_rows(runs: Sequence[Run]) -> list[int]:
    """Plan indices of the expert-ablation runs, in the shard's row order."""
    return [i for i, r in enumerate(runs) if isinstance(r.target, ExpertAblation)]


def run_name(run: Run) -> str:
    """A run as the report names it: its key, and its repeat where it has several."""
    return f"{run.key} (repeat {run.repeat})" if run.repeat else run.key


def replay_line(n_runs: int, n_batches: int, reused: int = 0,
                sample: ReuseSample | None = None) -> str | None:
    """What proves the cached replay batches, when a rerun finds some (None: none; the
    plan said the replay's passes before the work)."""
    if not reused or sample is None:
        return None
    verified = sum(len(v) for v in sample.by_batch.values())
    passes = verified + sum(2 - (0 in v) for v in sample.by_batch.values())
    how = ("every run of every cached batch" if sample.mode == "all" else
           f"a fresh random sample of {verified} runs, every run of the plan on one cached "
           f"batch (seed {sample.seed}; {arg('verify_reuse', 'all')} proves every run)")
    return (f"replay: {reused} of {n_batches} evaluation batches cached: reused only once "
            f"{how} replays bit for bit as cached (about {passes} passes), the other "
            f"{n_batches - reused} replayed ({(n_batches - reused) * n_runs} passes)")
