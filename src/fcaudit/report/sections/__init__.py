"""The report's sections of registered analyses (:mod:`fcaudit.engine.analyses`): each
analysis's renderer is one entry here, keyed by the analysis's name; a section whose
analysis has no renderer is still shown, as its JSON, so nothing measured goes unsaid."""

from __future__ import annotations

import json

from fcaudit.core.registry import Registry
from fcaudit.engine.result import AuditResult, dump
from fcaudit.report.markdown import md_fenced, md_text
from fcaudit.report.sections import (
    exits,
    expert_importance,
    frontier,
    routing,
    selection_parts,
    tasks,
    token_profile,
)
from fcaudit.report.sections.base import Renderer

__all__ = ["RENDERERS", "Renderer", "analysis_sections"]

# one renderer per analysis that has one, in any order (the report follows the analyses')
RENDERERS: Registry[Renderer] = Registry("section renderer", (
    frontier.RENDERER, routing.RENDERER, expert_importance.RENDERER, token_profile.RENDERER,
    selection_parts.RENDERER, tasks.RENDERER, exits.RENDERER))


def analysis_sections(r: AuditResult, leading: bool = False) -> list[list[str]]:
    """Each analysis section of ``r`` as report blocks, in the result's order: those whose
    renderer :attr:`~Renderer.leads` (``leading``), else the others."""
    out = []
    for name, section in (r.analyses or {}).items():
        if (name in RENDERERS and RENDERERS[name].leads) != leading:
            continue
        if name in RENDERERS:
            out.append(RENDERERS[name].render(r, section))
        else:
            out.append([f"## {md_text(name)}",
                        md_fenced(json.dumps(dump(section), indent=1, sort_keys=True))])
    return out
