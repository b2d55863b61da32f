"""Analyses as plugins: a measurement beyond the main conditions in one module.

An :class:`Analysis` plans its extra replay runs from the prepared audit and its probe
(each a named function of the recorded coefficients, fed as a user intervention is),
turns their per-sequence losses into its section of the result (JSON types, written to
``audit.json`` at the top level under the analysis's name and read back by that name),
and names the numbers of its section that :meth:`AuditResult.metrics` carries (as
``<name>_<key>``). Its renderer, an entry of :data:`fcaudit.report.sections.RENDERERS`,
puts the section in the report. Registering it in :data:`ANALYSES` is all the wiring:
the plan counts its runs, the replay stage replays and proves them as any other run,
and the result, the report and ``metrics()`` carry what it returns. This module imports
nothing of the engine's passes, so the result and the report may read it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fcaudit.core.interventions import Intervention
from fcaudit.core.registry import Registry

Section = dict[str, Any]  # plain JSON types


def _no_metrics(section: Section) -> Mapping[str, float | None]:
    return {}


@dataclass(frozen=True)
class Analysis:
    """One analysis: ``plan`` (the :class:`~fcaudit.engine.options.Prepared` audit and its
    :class:`~fcaudit.engine.probe.Probe` -> the functions to replay, each
    ``(coefficients, context) -> tensors to feed``, as user interventions are),
    ``summarise`` (the :class:`~fcaudit.engine.analyses.runs.Measured` runs, found by
    :meth:`run_key`, and the analysis itself -> its section, or None to leave none) and
    ``metrics`` (its section -> named numbers). Typed loosely here so that the result and
    the report can read this module without the engine's passes."""

    name: str
    plan: Callable[[Any, Any], Sequence[Intervention]]
    summarise: Callable[[Any, Analysis], Section | None]
    metrics: Callable[[Section], Mapping[str, float | None]] = field(default=_no_metrics)

    def run_key(self, intervention: str) -> str:
        """The run key of this analysis's intervention named ``intervention``."""
        return f"{self.name}:{intervention}"


# every analysis an audit runs, in report order; today's built-in ones (routing, expert
# ablation, token profile, frontier, exits, selection parts) are still wired by hand and
# move here one at a time (docs/architecture.md)
ANALYSES: Registry[Analysis] = Registry("analysis")


def analysis_metrics(sections: Mapping[str, Section]) -> dict[str, float | None]:
    """The numbers each section's analysis names, as ``<analysis>_<key>``; a section whose
    analysis this fcaudit does not know contributes none."""
    return {f"{name}_{key}": value for name, section in sections.items() if name in ANALYSES
            for key, value in ANALYSES[name].metrics(section).items()}
