"""The replay plan: which runs the audit replays, and what each feeds every site.

The conditions of docs/method.md (Conditions), their per-layer variants (one site
intervened, the others correct), expert ablations (one router's logits with one expert
never picked), savings-frontier points and user-defined interventions, all as
:class:`Run`, whose :class:`Target` (a sum type) says its key, its digest identity and
what it feeds; :func:`feed` turns a run and a batch into the coefficient tensor each site
receives.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fcaudit.core.conditions import (
    CONDITIONS,
    CORRECT,
    EXPERT_ABLATION,
    FRONTIER,
    RANDOM_CONDITIONS,
    audited,
    by_kind,
    by_role,
)
from fcaudit.core.contract import RoutingAdapter, Site
from fcaudit.core.digest import digest_tensors
from fcaudit.core.errors import FcauditError
from fcaudit.core.exits import ExitPlan
from fcaudit.core.interventions import (
    Intervention,
    InterventionContext,
    RandomDraw,
    StaticProfiles,
)
from fcaudit.core.routers import ablate_expert
from fcaudit.engine.cache import CoefficientCache
from fcaudit.engine.exit_sweep import ExitPoint, exit_feed
from fcaudit.engine.frontier import FrontierPoint, point_feed
from fcaudit.engine.options import AUTO_ABLATION_MAX_EXPERTS, AuditOptions

# the main conditions of each kind, the opt-in ones too (run where asked)
RANDOM_ALL, STATIC_ALL = by_kind("random", default=None), by_kind("static", default=None)
EXIT_ALL = by_kind("exit", default=None)  # run once each, on exit models


class Target:
    """What a run intervenes on: every site (:class:`AllSites`), one site
    (:class:`OneSite`), one router's expert (:class:`ExpertAblation`), a savings-frontier
    point (:class:`FrontierRun`) or the user's function (:class:`UserIntervention`). Each
    says its run's key, its part of the run's digest identity and what it feeds."""

    counts_rerouting = False  # its re-routing rows are kept in the replay shard

    @property
    def only_site(self) -> Site | None:
        """The one site the run changes (per-layer and ablation runs), else None."""
        return None

    def key(self, condition: str) -> str:
        return condition

    def identity(self) -> tuple[str | None, bool, int | None, str | None]:
        """(the one site's name, a user intervention, the ablated expert, the frontier
        point's key): what, besides the condition and repeat, names the run in digests."""
        return (None, False, None, None)

    def feed(self, run: Run, b: int, inputs: ReplayInputs,
             correct: dict[Site, Tensor]) -> Mapping[Site, Tensor]:
        """The tensors fed where they differ from the recorded (``correct``) ones."""
        raise NotImplementedError


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
class ExpertAblation(Target):
    """``expert`` of the router ``site`` never picked (its logit pushed below the rest)."""

    site: Site
    expert: int

    @property
    def only_site(self) -> Site | None:
        return self.site

    def key(self, condition: str) -> str:
        return ablation_key(self.site, self.expert)

    def identity(self) -> tuple[str | None, bool, int | None, str | None]:
        return (self.site.name, False, self.expert, None)

    def feed(self, run: Run, b: int, inputs: ReplayInputs,
             correct: dict[Site, Tensor]) -> Mapping[Site, Tensor]:
        return {self.site: ablate_expert(correct[self.site], self.expert)}


@dataclass(frozen=True)
class FrontierRun(Target):
    """A savings-frontier point: its rule's gates switched off where it skips."""

    point: FrontierPoint
    counts_rerouting = True

    def key(self, condition: str) -> str:
        return self.point.key

    def identity(self) -> tuple[str | None, bool, int | None, str | None]:
        return (None, False, None, self.point.key)

    def feed(self, run: Run, b: int, inputs: ReplayInputs,
             correct: dict[Site, Tensor]) -> Mapping[Site, Tensor]:
        return point_feed(self.point, correct)


@dataclass(frozen=True)
class ExitRun(Target):
    """An exit-frontier point: the learned exit rule at another threshold, or fixed exit at
    one depth, fed as the exit scores that carry its exits out."""

    point: ExitPoint

    def key(self, condition: str) -> str:
        return self.point.key

    def identity(self) -> tuple[str | None, bool, int | None, str | None]:
        return (None, False, None, self.point.key)

    def feed(self, run: Run, b: int, inputs: ReplayInputs,
             correct: dict[Site, Tensor]) -> Mapping[Site, Tensor]:
        return exit_feed(self.point, inputs.exits, inputs.cache.batch_range(b), correct)


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


def ablation_key(site: Site | None, expert: int) -> str:
    """The run key of ablating ``expert`` at ``site`` (custom interventions may not take it)."""
    return f"{EXPERT_ABLATION}:{expert}@{site.name if site else ''}"


def ablation_experts(sites: Sequence[Site], options: AuditOptions,
                     experts: Mapping[str, int]) -> dict[Site, int]:
    """The routing sites whose experts are ablated, with their number of experts
    (``experts``: site name -> the last axis of its recorded logits, for sites whose
    coefficients are ``[B, T, ..., E]``). Auto (``expert_ablation`` None): every such site
    when none has more than ``AUTO_ABLATION_MAX_EXPERTS`` experts, else none."""
    routed = {s: experts[s.name] for s in routing_sites(sites) if s.name in experts}
    if options.expert_ablation is None:
        return routed if max(routed.values(), default=0) <= AUTO_ABLATION_MAX_EXPERTS else {}
    return routed if options.expert_ablation else {}


def plan_runs(sites: Sequence[Site], options: AuditOptions, conditions: Sequence[str],
              interventions: Sequence[Intervention] = (),
              ablated: Mapping[Site, int] | None = None,
              points: Sequence[FrontierPoint] = (),
              skipped: Collection[str] = (),
              exit_points: Sequence[ExitPoint] = ()) -> list[Run]:
    """Every run, in order: correct first, then the conditions (the opt-in ones asked for
    after the default ones of their kind; the exit references after the static ones),
    per-layer variants, expert ablations (``ablated``: site -> its number of experts),
    frontier points (the exit frontier's after the others) and user interventions;
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
    runs += [Run(EXPERT_ABLATION, target=ExpertAblation(site, e))
             for site, n in (ablated or {}).items() for e in range(n)]
    runs += [Run(FRONTIER, target=FrontierRun(p)) for p in points]
    runs += [Run(FRONTIER, target=ExitRun(p)) for p in exit_points]
    runs += [Run(iv.name, k, UserIntervention(iv)) for iv in interventions
             for k in range(iv.repeats)]
    return runs


def frontier_runs(runs: Sequence[Run]) -> list[Run]:
    """The savings-frontier runs, in plan order."""
    return [r for r in runs if isinstance(r.target, FrontierRun)]


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
    context = InterventionContext(
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


def ablation_runs(runs: Sequence[Run]) -> list[Run]:
    """The expert-ablation runs, in plan order."""
    return [r for r in runs if isinstance(r.target, ExpertAblation)]


def tracked_runs(runs: Sequence[Run]) -> list[Run]:
    """The runs whose re-routing is counted: main conditions other than correct."""
    return [r for r in runs if isinstance(r.target, AllSites) and r.condition != CORRECT]


def routing_sites(sites: Sequence[Site]) -> list[Site]:
    """Sites whose adapter can say which experts a router selects."""
    return [s for s in sites if isinstance(s.adapter, RoutingAdapter)]
