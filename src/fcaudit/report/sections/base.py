"""What a section renderer is (:mod:`fcaudit.report.sections` registers them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fcaudit.engine.result import AuditResult


@dataclass(frozen=True)
class Renderer:
    """``render(result, section)``: the section's Markdown blocks, the first its
    ``## Title`` (figures titled alike are placed at its end)."""

    name: str
    render: Callable[[AuditResult, Any], list[str]]
    # its section details an answer the verdict gives first (an exit model's exits): the
    # report places it right after the conditions table, before the other answers' detail
    leads: bool = False
