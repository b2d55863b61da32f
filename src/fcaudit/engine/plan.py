"""The replay plan: which runs the audit replays, and what each feeds every site.

The conditions of docs/method.md (Conditions), their per-layer variants (one site
intervened, the others correct), the analyses' runs (:mod:`fcaudit.engine.analyses`:
expert ablations, savings- and exit-frontier points, ...) and user-defined interventions,
all as :class:`Run`, whose
:class:`~fcaudit.engine.analyses.base.Target` says its key, its digest identity and
what it feeds; :func:`feed` turns a run and a batch into the coefficient tensor each site
receives.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fcaudit.core.adapters import same_bits
from fcaudit.core.conditions import (
    CONDITIONS,
    CORRECT,
    RANDOM_CONDITIONS,
    audited,
    by_kind,
    by_role,
)
from fcaudit.core.contract import Site
from fcaudit.core.digest import digest_tensors
from fcaudit.core.errors import FcauditError, arg
from fcaudit.core.exits import ExitPlan
from fcaudit.core.interventions import (
    ConditionContext,
    Intervention,
    InterventionContext,
    RandomDraw,
    StaticProfiles,
)
from fcaudit.engine.analyses.base import Target, picking_rows
from fcaudit.engine.cache import CoefficientCache, ReplayShard
from fcaudit.engine.options import AuditOptions

# the main conditions of each kind, the opt-in ones too (run where asked)
RANDOM_ALL, STATIC_ALL = by_kind("random", default=None), by_kind("static", default=None)
EXIT_ALL = by_kind("exit", default=None)  # run once each, on exit models


@dataclass(frozen=True)
class AllSites(Target):
    """A main condition on every site (also ``correct``, which changes nothing)."""

    counts_rerouting = True

    def feed(self, run: Run, b: int, inputs: ReplayInputs,
             correct: dict[Site, Tensor]) -> Mapping[Site, Tensor]:
        return _intervened(run, inputs.cache.batch_range(b), inputs, dict(correct))


@dataclass(frozen=True)
class OneSite(Target):
    """A per-layer variant: the condition on ``site`` alone, every other site correct."""

    site: Site

    @property
    def only_site(self) -> Site | None:
        return self.site

    def key(self, condition: str) -> str:
        return f"{condition}@{self.site.name}"

    def identity(self) -> tuple[str | None, bool, int | None, str | None]:
        return (self.site.name, False, None, None)

    def feed(self, run: Run, b: int, inputs: ReplayInputs,
             correct: dict[Site, Tensor]) -> Mapping[Site, Tensor]:
        return _intervened(run, inputs.cache.batch_range(b), inputs,
                           {self.site: correct[self.site]})


@dataclass(frozen=True)
class UserIntervention(Target):
    """The user's function of the recorded coefficients (:class:`Intervention`)."""

    intervention: Intervention

    def identity(self) -> tuple[str | None, bool, int | None, str | None]:
        return (None, True, None, None)

    def feed(self, run: Run, b: int, inputs: ReplayInputs,
             correct: dict[Site, Tensor]) -> Mapping[Site, Tensor]:
        return custom_feed(self.intervention, run.repeat, b, inputs, correct)


ALL_SITES = AllSites()


@dataclass(frozen=True)
class Run:
    """One replay pass over the evaluation set: a condition (a main condition, or a user
    intervention's name), its repeat, and what it intervenes on."""

    condition: str
    repeat: int = 0
    target: Target = ALL_SITES

    @property
    def key(self) -> str:
        return self.target.key(self.condition)


def plan_runs(sites: Sequence[Site], options: AuditOptions, conditions: Sequence[str],
              interventions: Sequence[Intervention] = (),
              analysis: Sequence[Run] = (),
              later: Sequence[Run] = (),
              skipped: Collection[str] = ()) -> list[Run]:
    """Every run, in order: correct first, then the conditions (the opt-in ones asked for
    after the default ones of their kind; the exit references after the static ones),
    per-layer variants, the analyses' runs (``analysis``: expert ablations, ...), those
    placed once the audit is recorded (``later``: savings- and exit-frontier points) and
    user interventions;
    conditions in ``skipped`` (not applicable to these sites) are not run."""
    runs = [Run(CORRECT)]
    runs += [Run(c, k) for k in range(options.repeats)
             for c in audited(conditions, RANDOM_ALL) if c not in skipped]
    runs += [Run(c) for c in audited(conditions, STATIC_ALL + EXIT_ALL)
             if c not in skipped]
    if options.per_layer:
        for site in sites:
            for name in by_role("per-layer"):  # random ones repeated, static ones once
                repeats = options.repeats if name in RANDOM_CONDITIONS else 1
                runs += [Run(name, k, OneSite(site)) for k in range(repeats)]
    runs += analysis
    runs += later
    runs += [Run(iv.name, k, UserIntervention(iv)) for iv in interventions
             for k in range(iv.repeats)]
    return runs


def run_digest(run: Run, fed: Mapping[Site, Tensor], context: bytes) -> bytes:
    """What one run's NLL on a batch is computed from: ``context`` (the batch's token ids
    and the schedule), the run's identity, and every fed tensor in site order."""
    # earlier runs' digests unchanged; a frontier point's key names its rule and level
    site, user, *named = run.target.identity()
    identity = repr((run.condition, run.repeat, site, user,
                     *(x for x in named if x is not None))).encode()
    return digest_tensors(((s.name, t) for s, t in fed.items()), context + identity)


@dataclass
class ReplayInputs:
    """What feeding a batch needs: the cache, calibration profiles, random draws and the
    evaluation token ids (static-layer-token feeds each token its id's profile)."""

    cache: CoefficientCache
    sites: list[Site]
    profiles: StaticProfiles
    draws: list[RandomDraw]
    seed: int
    ids: np.ndarray | None = None  # [N, T] evaluation token ids
    exits: ExitPlan | None = None  # the exit references' layers, where one runs


def feed(run: Run, b: int, inputs: ReplayInputs, device: torch.device) -> dict[Site, Tensor]:
    """The coefficient tensors every site receives for batch ``b`` under ``run``."""
    correct = {s: inputs.cache.coefficients(b, s.name) for s in inputs.sites}
    fed = {**correct, **run.target.feed(run, b, inputs, correct)}
    return {s: t.to(device) for s, t in fed.items()}


def _intervened(run: Run, rows: range, inputs: ReplayInputs,
                targets: dict[Site, Tensor]) -> dict[Site, Tensor]:
    """A main condition on the targeted sites: its registry feed, through the same
    :class:`InterventionContext` as user interventions, with the repeat's draw over the
    whole evaluation set (donors from any batch)."""
    condition = CONDITIONS[run.condition]
    by_name = {s.name: s for s in targets}
    draw = inputs.draws[run.repeat] if condition.kind == "random" else None
    context = ConditionContext(
        tuple(targets), rows, inputs.profiles, run.repeat,
        np.random.default_rng([inputs.seed, run.repeat, rows.start]), inputs.cache.coefficient_rows,
        _batch_ids(inputs, rows), draw, inputs.exits)
    x = condition.feed({s.name: t for s, t in targets.items()}, context)
    return {by_name[k]: v for k, v in x.items()}


def _batch_ids(inputs: ReplayInputs, rows: range) -> Tensor | None:
    return None if inputs.ids is None else torch.from_numpy(
        np.ascontiguousarray(inputs.ids[rows.start:rows.stop]))


def custom_feed(iv: Intervention, repeat: int, b: int, inputs: ReplayInputs,
                 correct: dict[Site, Tensor]) -> dict[Site, Tensor]:
    """The user's function on a clone of the recorded coefficients, its answer checked:
    site names it was given, each a tensor of its recorded shape."""
    rows, by_name = inputs.cache.batch_range(b), {s.name: s for s in inputs.sites}
    context = InterventionContext(
        tuple(inputs.sites), rows, inputs.profiles, repeat, iv.rng(inputs.seed, repeat, b),
        inputs.cache.coefficient_rows, _batch_ids(inputs, rows))
    given = iv.fn({s.name: t.clone() for s, t in correct.items()}, context)
    fed = {}
    for name, tensor in given.items():
        site = by_name.get(name)
        if site is None or not isinstance(tensor, Tensor) or \
                tensor.shape != correct[site].shape:
            raise FcauditError(f"intervention {iv.name!r} returned {name!r}: it must "
                               "map site names to tensors shaped like their recorded "
                               "coefficients")
        fed[site] = tensor.to(correct[site].dtype)
    return fed


# ---------------------------------------------------------------------- replay_proof
# Reused replay results, proven by recomputation.
#
# A rerun into the same output folder recomputes every cached *record* batch and uses it
# only when bitwise equal. A cached *replay* batch is a different matter: its runs were
# computed under intervention, on branches the unperturbed pass never takes (every example
# fed one static profile, every token routed to one expert), so state the model reads only
# there (a file, an environment variable, an attribute) can change while every record
# stays equal. The feed digests prove what each run was *fed*, not what the model *does*
# with it.
#
# So at every resume a sample of the reused runs is replayed again and must equal its
# cached rows bit for bit: every run of the plan (each condition and repeat, per-layer run,
# expert ablation, frontier or exit point, user intervention) on one reused batch drawn at
# random, with a seed drawn afresh from the operating system, so that which batch proves a
# run cannot be predicted from the folder. ``verify_reuse="all"`` replays every run of
# every reused batch. What a sample proves, and what it cannot, is in docs/method.md
# ("Reuse").

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
                      (R.STILL_SELECTED, picking_rows(runs))):
        if key not in cached:
            continue
        sub_rows = {i: j for j, i in enumerate(r for r in rows if r in index)}
        for k, i in enumerate(rows):
            if i in sub_rows and not same_bits(cached[key][k], fresh[key][sub_rows[i]]):
                return i, "tokens re-routed" if key == R.ROUTE_CHANGED else \
                    "picks of what the run removed"
    return None


def _what(what: str, cached: torch.Tensor, fresh: torch.Tensor) -> str:
    if not cached.is_floating_point() or cached.shape != fresh.shape:
        return what
    return f"{what} (by up to {float((cached - fresh).abs().max()):.3g})"


def rerouting_rows(runs: Sequence[Run]) -> list[int]:
    """Plan indices of the runs whose re-routing rows a replay shard holds, in row order."""
    return [i for i, r in enumerate(runs) if i and r.target.counts_rerouting]


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
