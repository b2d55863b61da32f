"""The public entry points that span layers: an audit that also writes its report.

The engine (``fcaudit.engine``) measures and holds the output folder; the report layer
(``fcaudit.report``) renders an :class:`~fcaudit.engine.result.AuditResult`. This module
joins the two and writes the results through the folder's writer, so neither imports
the other (docs/architecture.md).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fcaudit.core.errors import render
from fcaudit.core.interventions import Intervention
from fcaudit.core.layout import SiteAxes
from fcaudit.core.sites import SiteSpec
from fcaudit.engine import run as engine
from fcaudit.engine.options import NOTE, AuditOptions, Progress
from fcaudit.engine.result import AuditResult
from fcaudit.io.data import AuditData, DataSpec
from fcaudit.report.audit_report import identity_words, write_report

# what the layers above (study, cli) use of the report: only this module imports
# ``fcaudit.report`` (.importlinter), so these are their way in
from fcaudit.report.compare import Comparison, compare
from fcaudit.report.figures import (
    FigureSpec,
    RenderedFigure,
    Span,
    penalty_figure,
    profile_figure,
    ratio_figure,
    retention_figure,
    variance_figure,
    write_figures,
)
from fcaudit.report.markdown import md_code, md_fenced, md_figures, md_table, md_text, to_html
from fcaudit.report.progress import ProgressReporter
from fcaudit.report.trend_figures import Anchor, TrendPanel, TrendPoint, trend_figure

__all__ = ["AuditOptions", "audit", "Comparison", "compare", "ProgressReporter",
           "identity_words",
           "Anchor", "FigureSpec", "RenderedFigure", "Span", "TrendPanel", "TrendPoint",
           "penalty_figure", "profile_figure", "ratio_figure", "retention_figure",
           "trend_figure", "variance_figure", "write_figures",
           "md_code", "md_fenced", "md_figures", "md_table", "md_text", "to_html"]


def audit(model: Any, out: str | Path | None = None, *, sites: SiteSpec = None,
          data: DataSpec | AuditData | None = None, dense: Any = None,
          blocks: str | None = None, options: AuditOptions | None = None,
          interventions: Mapping[str, Any] | Sequence[Intervention] | None = None,
          progress: Progress | None = None, command: str | None = None,
          report: bool = True, site_axes: SiteAxes = None) -> AuditResult | None:
    """Run the whole Frozen Controller Audit and return its :class:`AuditResult`; with
    ``out``, write its results through the folder's writer: with ``report``, report.md,
    report.html and the figures, then audit.json (last: its presence means the audit
    finished). The engine's notes go to stderr (:func:`with_notes`), its stages to
    ``progress``.

    ``model``: a spec (run folder, checkpoint folder, ``pkg.module:factory``), an
    ``nn.Module`` or a :class:`~fcaudit.io.loading.LoadedModel`. ``out``: the output
    folder (cache, ``audit.json``, report); None runs in a temporary cache and writes
    nothing. ``sites``: module-path globs or :class:`~fcaudit.Site` objects (default:
    the model's declaration). ``site_axes``: the coefficient layout of sites no one
    declared, ``{glob: "example,channel"}`` (a ``*`` after each position axis, e.g.
    ``"example,channel,row*,column*"``); without it such a layout is read off the first
    batch, a position axis only where proven. ``data``: a :class:`DataSpec` (text, token
    arrays or the built-in corpus) or ready :class:`AuditData`. ``interventions``: user-defined
    conditions, ``{name: fn}`` or :class:`~fcaudit.core.interventions.Intervention` objects.
    ``command``: the command line that asked (recorded in ``audit.json``; the notes then
    name options by their flags).

    In a ``torchrun`` process group every rank calls this; rank 0 validates and claims
    ``out`` first, the batches are shared out, and rank 0 alone returns the result
    (the other ranks return None).
    """
    request = engine.AuditRequest(
        model, out, sites=sites, data=DataSpec() if data is None else data, dense=dense,
        blocks=blocks, options=AuditOptions() if options is None else options,
        interventions=interventions, command=command, site_axes=site_axes)
    with engine.audited(request, with_notes(progress, cli=command is not None)) as done:
        if done.files is not None:
            if report:
                write_report(done.result, done.out, done.files)
            done.finish()
        return done.result


def with_notes(progress: Progress | None, cli: bool = False) -> Progress:
    """``progress`` with the engine's notes (stage :data:`~fcaudit.engine.options.NOTE`: the
    window, layouts, the cache's size, the replay plan, each ``--target-ci`` round) printed
    on stderr as ``fcaudit: LINE``, as they always were, whatever callback is given; an
    option a note names reads as its reader spells it (``cli``: the command line's flag)."""
    def shown(stage: str, done: int, total: int, info: str = "") -> None:
        if stage == NOTE:
            print(f"fcaudit: {render(info, cli=cli)}", file=sys.stderr, flush=True)
        elif progress is not None:
            progress(stage, done, total, info)
    return shown
