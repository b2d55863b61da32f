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

from collections.abc import Mapping
from typing import Any

from fcaudit.core.registry import Registry
from fcaudit.engine.analyses import (
    exits,
    expert_importance,
    frontier,
    routing,
    selection_parts,
    tasks,
    token_profile,
)
from fcaudit.engine.analyses.base import Analysis, Section

__all__ = ["ANALYSES", "Analysis", "Section", "analysis_intervals", "analysis_metrics",
           "before_model"]

# every analysis an audit runs, in report order (the exit frontier's points are replayed
# after the savings frontier's, as in the caches of earlier versions)
ANALYSES: Registry[Analysis] = Registry("analysis", (
    frontier.ANALYSIS, routing.ANALYSIS, expert_importance.ANALYSIS, token_profile.ANALYSIS,
    selection_parts.ANALYSIS, tasks.ANALYSIS, exits.ANALYSIS))


def analysis_metrics(sections: Mapping[str, Section]) -> dict[str, float | None]:
    """The numbers each section's analysis names, as ``<analysis>_<key>``; a section whose
    analysis this fcaudit does not know contributes none."""
    return {f"{name}_{key}": value for name, section in sections.items() if name in ANALYSES
            for key, value in ANALYSES[name].metrics(section).items()}


def analysis_intervals(sections: Mapping[str, Section]) -> dict[str, list[float] | None]:
    """The 95% intervals of :func:`analysis_metrics` that have one, by the same names."""
    return {f"{name}_{key}": value for name, section in sections.items() if name in ANALYSES
            for key, value in ANALYSES[name].intervals(section).items()}


def before_model(options: Any) -> dict[str, Any]:
    """What each analysis loads and checks from the options before the model loads (its
    refusals first), by name; those that need nothing are left out."""
    return {a.name: state for a in ANALYSES.values() if a.before is not None
            and (state := a.before(options)) is not None}
