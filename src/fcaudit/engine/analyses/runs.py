"""The analyses' runs and sections: planned beside the audit's own runs, summarised from
their replays (see :mod:`fcaudit.engine.analyses`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import get_origin

import numpy as np
from torch import Tensor

from fcaudit.core.conditions import CORRECT
from fcaudit.core.contract import Site
from fcaudit.core.interventions import Intervention, StaticProfiles
from fcaudit.engine.analyses import ANALYSES, Analysis, Section
from fcaudit.engine.analyses.base import Target
from fcaudit.engine.options import Prepared
from fcaudit.engine.plan import AllSites, ReplayInputs, Run, custom_feed
from fcaudit.engine.probe import Probe
from fcaudit.engine.result import dump
from fcaudit.engine.result_parts import ConditionResult
from fcaudit.engine.stages import Replays
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
class Measured:
    """What an analysis summarises from: the prepared audit, every run in plan order with
    its per-sequence losses by run key (repeats in order), the replays' routing counts,
    the calibration profiles and the probe's coefficient shapes."""

    setup: Prepared
    repeats: Mapping[str, list[np.ndarray]]
    profiles: StaticProfiles  # the calibration set's static profiles
    runs: Sequence[Run]
    replays: Replays
    shapes: Mapping[str, tuple[int, ...]]  # each site's coefficients on the probe's batch

    def tracked_runs(self) -> list[Run]:
        """The runs whose re-routing the replays count (main conditions other than
        correct), in the rows' order."""
        return [r for r in self.runs if isinstance(r.target, AllSites) and r.condition != CORRECT]

    def condition(self, key: str) -> ConditionResult:
        """Run ``key`` against correct, as the conditions table states a condition: mean
        loss, paired penalty with its 95% interval, and each repeat's."""
        per_seq = {k: np.mean(v, axis=0) for k, v in self.repeats.items()}
        boot = paired_bootstrap(self.setup.inputs.n_eval, self.setup.options)
        return condition_result(per_seq, self.repeats, key, boot)


def analysis_runs(setup: Prepared, first: Probe) -> tuple[Run, ...]:
    """Every registered analysis's runs, in registry order: its own targets once each
    (named by their condition), its interventions once per repeat."""
    return tuple(run for a in ANALYSES.values() for planned in a.plan(setup, first)
                 for run in ([Run(planned.condition, 0, planned)] if isinstance(planned, Target)
                             else [Run(a.name, k, AnalysisRun(a, planned))
                                   for k in range(planned.repeats)]))


def analysis_sections(setup: Prepared, runs: Sequence[Run], replays: Replays,
                      profiles: StaticProfiles, shapes: Mapping[str, tuple[int, ...]]
                      ) -> dict[str, Section]:
    """Each analysis's section from the measured runs, leaving out those that return None:
    an instance of its ``section_type``, else plain JSON types (as audit.json reads back)."""
    repeats: dict[str, list[np.ndarray]] = {}
    for run, values in zip(runs, replays.per_run, strict=True):
        repeats.setdefault(run.key, []).append(values)
    measured, out = Measured(setup, repeats, profiles, runs, replays, shapes), {}
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


