"""What an analysis is (:mod:`fcaudit.engine.analyses` registers them)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # reading an audit.json loads no torch
    from fcaudit.core.interventions import Intervention

Section = Any  # an instance of the analysis's section_type, else plain JSON types


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
    # the section's dataclass, read back strictly from audit.json (None: plain JSON types)
    section_type: type | None = None

    def run_key(self, intervention: str) -> str:
        """The run key of this analysis's intervention named ``intervention``."""
        return f"{self.name}:{intervention}"
