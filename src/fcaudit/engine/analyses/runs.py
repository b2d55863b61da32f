"""The analyses' runs and sections: planned beside the audit's own runs, summarised from
their replays (see :mod:`fcaudit.engine.analyses`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, get_origin

import numpy as np
from torch import Tensor

from fcaudit.core.conditions import CORRECT
from fcaudit.core.contract import Site
from fcaudit.core.exits import ExitPlan
from fcaudit.core.interventions import Intervention, StaticProfiles
from fcaudit.core.nll import device_of
from fcaudit.engine.analyses import ANALYSES, Analysis, Section
from fcaudit.engine.analyses.base import Later, Target
from fcaudit.engine.cache import CoefficientCache
from fcaudit.engine.execution import execution_pass
from fcaudit.engine.exits import sweep
from fcaudit.engine.metrics import Bootstrap
from fcaudit.engine.options import Prepared, Progress
from fcaudit.engine.passes import Ranks, batches
from fcaudit.engine.plan import AllSites, ReplayInputs, Run, custom_feed
from fcaudit.engine.probe import Probe, first_batch
from fcaudit.engine.result import dump
from fcaudit.engine.result_parts import ConditionResult, ExecutionSection, VarianceShares
from fcaudit.engine.stages import (
    Replays,
    frontier_calibration,
    record_frontier_calibration,
)
from fcaudit.engine.summary import condition_result, paired_bootstrap


@dataclass(frozen=True)
class AnalysisRun(Target):
    """One run an analysis planned: its function of the recorded coefficients, keyed
    ``<analysis>:<name>`` (never a condition's key)."""

    analysis: Analysis
    intervention: Intervention

    def key(self, condition: str) -> str:
        return self.analysis.run_key(self.intervention.name)

    def identity(self) -> tuple[str | None, bool, int | None, str | None]:
        return (None, True, None, self.key(""))

    def feed(self, run: Run, b: int, inputs: ReplayInputs,
             correct: dict[Site, Tensor]) -> Mapping[Site, Tensor]:
        return custom_feed(self.intervention, run.repeat, b, inputs, correct)


@dataclass(frozen=True)
class Recorded:
    """The audit once calibration and evaluation are recorded: what a
    :class:`~fcaudit.engine.analyses.base.Later` places its runs from, and the passes it
    may ask for (every rank resolves it alike); ``exits``: the exit conditions'
    references, read in real passes (None: no exit condition runs)."""

    setup: Prepared
    cache: CoefficientCache
    progress: Progress
    ranks: Ranks
    exits: ExitPlan | None = None

    def whole_calibration(self, sites: Sequence[Site]) -> dict[str, Tensor]:
        """The calibration coefficients of ``sites``, whole (recorded once, into the
        cache, by the ranks together)."""
        record_frontier_calibration(self.setup, self.cache, sites, self.progress, self.ranks)
        self.ranks.barrier("recorded the whole calibration coefficients")
        return frontier_calibration(self.setup, self.cache, sites)

    def executed_per_layer(self) -> list[float] | None:
        """Each declared block's executed fraction on the evaluation set (a counting pass,
        no FLOPs): below 1 where the model skips tokens on its own; None without blocks."""
        setup = self.setup
        if setup.blocks is None:
            return None
        net = setup.model
        counted = execution_pass(net, setup.blocks, (x for _, x in batches(
            setup.eval_source, setup.options.batch_size, device_of(net))),
            flops=False)
        return counted["blocks_executed_per_layer"]

    def exit_sweep(self, own: Tensor) -> tuple[tuple[float, Tensor], ...]:
        """The exit frontier's threshold sweep: each moved threshold with the exits it
        gives the evaluation units (``own``: the model's own), one pass a batch
        (:func:`~fcaudit.engine.exits.sweep`)."""
        return sweep(self.setup, own, self.progress)

    def first_batch(self) -> Any:
        """The first evaluation batch, on the model's device."""
        return first_batch(self.setup)


def resolve_later(recorded: Recorded, later: Sequence[tuple[str, Later]]
                  ) -> tuple[dict[str, Any], tuple[Run, ...]]:
    """Each :class:`Later`'s state by its analysis's name, and its runs (named by their
    targets' condition), in registry order."""
    states, runs = {}, []
    for name, plan in later:
        states[name], targets = plan.resolve(recorded)
        runs += [Run(t.condition, 0, t) for t in targets]
    return states, tuple(runs)


@dataclass(frozen=True)
class Measured:
    """What an analysis summarises from: the prepared audit, every run in plan order with
    its per-sequence losses by run key (repeats in order), the replays' routing counts,
    the calibration profiles, the description pass's named coefficients, the probe's
    coefficient shapes, what each analysis's :class:`Later` resolved (by name), the cache
    and the execution section."""

    setup: Prepared
    repeats: Mapping[str, list[np.ndarray]]
    profiles: StaticProfiles  # the calibration set's static profiles
    # per family that names its coefficients: each one's variance decomposed alone
    parts: Mapping[str, dict[str, VarianceShares]]
    runs: Sequence[Run]
    replays: Replays
    shapes: Mapping[str, tuple[int, ...]]  # each site's coefficients on the probe's batch
    states: Mapping[str, Any]
    cache: CoefficientCache
    execution: ExecutionSection
    progress: Progress

    def say(self, stage: str, done: int, total: int) -> None:
        """Report an analysis's own work (the audit's progress callback)."""
        self.progress(stage, done, total, "")

    def tracked_runs(self) -> list[Run]:
        """The runs whose re-routing the replays count (main conditions other than
        correct), in the rows' order."""
        return [r for r in self.runs if isinstance(r.target, AllSites) and r.condition != CORRECT]

    @property
    def boot(self) -> Bootstrap:
        """The audit's one resample stream (paired contrasts over sequences)."""
        return paired_bootstrap(self.setup.inputs.n_eval, self.setup.options)

    def condition(self, key: str) -> ConditionResult:
        """Run ``key`` against correct, as the conditions table states a condition: mean
        loss, paired penalty with its 95% interval, and each repeat's."""
        per_seq = {k: np.mean(v, axis=0) for k, v in self.repeats.items()}
        return condition_result(per_seq, self.repeats, key, self.boot)


def analysis_runs(setup: Prepared, first: Probe
                  ) -> tuple[tuple[Run, ...], tuple[tuple[str, Later], ...]]:
    """Every registered analysis's runs, in registry order: its own targets once each
    (named by their condition), its interventions once per repeat; and the plans of those
    it can place only once the audit is recorded, by analysis name."""
    runs, later = [], []
    for a in ANALYSES.values():
        for planned in a.plan(setup, first):
            if isinstance(planned, Later):
                later.append((a.name, planned))
            elif isinstance(planned, Target):
                runs.append(Run(planned.condition, 0, planned))
            else:
                runs += [Run(a.name, k, AnalysisRun(a, planned)) for k in range(planned.repeats)]
    return tuple(runs), tuple(later)


def analysis_sections(setup: Prepared, runs: Sequence[Run], replays: Replays,
                      profiles: StaticProfiles, parts: Mapping[str, dict[str, VarianceShares]],
                      shapes: Mapping[str, tuple[int, ...]],
                      states: Mapping[str, Any], cache: CoefficientCache,
                      execution: ExecutionSection, progress: Progress) -> dict[str, Section]:
    """Each analysis's section from the measured runs, leaving out those that return None:
    an instance of its ``section_type``, else plain JSON types (as audit.json reads back)."""
    repeats: dict[str, list[np.ndarray]] = {}
    for run, values in zip(runs, replays.per_run, strict=True):
        repeats.setdefault(run.key, []).append(values)
    measured = Measured(setup, repeats, profiles, parts, runs, replays, shapes, states,
                        cache, execution, progress)
    out = {}
    for analysis in ANALYSES.values():
        section = analysis.summarise(measured, analysis)
        if section is None:
            continue
        if analysis.section_type is not None:
            assert isinstance(section, get_origin(analysis.section_type) or
                              analysis.section_type), (analysis.name, section)
            out[analysis.name] = section
        else:
            out[analysis.name] = json.loads(json.dumps(dump(section)))
    return out


