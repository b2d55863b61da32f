"""The public entry points that span layers: an audit that also writes its report.

The engine (``fcaudit.engine``) computes and writes ``audit.json``; the report layer
(``fcaudit.report``) renders an :class:`~fcaudit.engine.result.AuditResult`. This module
joins the two, so neither imports the other (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fcaudit.core.interventions import Intervention
from fcaudit.core.layout import SiteAxes
from fcaudit.core.sites import SiteSpec
from fcaudit.engine import run as engine
from fcaudit.engine.options import AuditOptions, Progress
from fcaudit.engine.result import AuditResult
from fcaudit.io.data import AuditData, DataSpec
from fcaudit.report.audit_report import write_report
from fcaudit.report.progress import with_notes

__all__ = ["AuditOptions", "audit"]


def audit(model: Any, out: str | Path | None = None, *, sites: SiteSpec = None,
          data: DataSpec | AuditData | None = None, dense: Any = None,
          blocks: str | None = None, options: AuditOptions | None = None,
          interventions: Mapping[str, Any] | Sequence[Intervention] | None = None,
          progress: Progress | None = None, command: str | None = None,
          report: bool = True, site_axes: SiteAxes = None) -> AuditResult | None:
    """Run the whole Frozen Controller Audit (:func:`fcaudit.engine.run.audit` explains
    every argument); with ``out`` and ``report``, also write report.md, report.html and
    the figures before audit.json."""
    return engine.audit(model, out, sites=sites, data=data, dense=dense, blocks=blocks,
                        options=options, interventions=interventions, progress=with_notes(progress),
                        command=command, render=write_report if report else None,
                        site_axes=site_axes)
