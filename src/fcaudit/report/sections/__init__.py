"""The report's sections of registered analyses (:mod:`fcaudit.engine.analyses`): each
analysis's renderer is one entry here, keyed by the analysis's name; a section whose
analysis has no renderer is still shown, as its JSON, so nothing measured goes unsaid."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fcaudit.core.registry import Registry
from fcaudit.engine.result import AuditResult
from fcaudit.report.markdown import md_fenced, md_text


@dataclass(frozen=True)
class Renderer:
    """``render(result, section)``: the section's Markdown blocks, the first its
    ``## Title`` (figures titled alike are placed at its end)."""

    name: str
    render: Callable[[AuditResult, dict[str, Any]], list[str]]


# one renderer per analysis that has one, in any order (the report follows the analyses')
RENDERERS: Registry[Renderer] = Registry("section renderer")


def analysis_sections(r: AuditResult) -> list[list[str]]:
    """Each analysis section of ``r`` as report blocks, in the result's order."""
    out = []
    for name, section in (r.analyses or {}).items():
        if name in RENDERERS:
            out.append(RENDERERS[name].render(r, section))
        else:
            out.append([f"## {md_text(name)}",
                        md_fenced(json.dumps(section, indent=1, sort_keys=True))])
    return out
