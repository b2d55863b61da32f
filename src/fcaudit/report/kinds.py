"""What kind of coefficient each family is (:mod:`fcaudit.core.kinds`), said beside the
answers: the judgement ``fcaudit sites`` and the audit's console gave before the work,
so that a dependence on an activation is not read as a controller's."""

from __future__ import annotations

from fcaudit.core.kinds import KINDS
from fcaudit.engine.result import AuditResult
from fcaudit.report.markdown import md_code, md_text


def kind_facts(r: AuditResult) -> list[str]:
    """One fact per family: its kind and what that kind is (none for an audit written
    before kinds were judged)."""
    facts = []
    for family in r.families:
        kinds = [s.kind for s in r.sites if s.family == family and s.kind]
        if not kinds:
            continue
        distinct = list(dict.fromkeys(kinds))
        if len(distinct) == 1 and distinct[0] in KINDS:
            said = f"**{md_text(distinct[0])}**: {md_text(KINDS[distinct[0]].meaning)}"
        else:
            said = "kinds " + ", ".join(f"**{md_text(k)}** ({kinds.count(k)} sites)"
                                        for k in distinct)
        facts.append(f"{md_code(family)} is of kind {said}.")
    return facts


def twin_facts(r: AuditResult) -> list[str]:
    """Without a dense counterpart: what one would be for these sites, or why none
    exists, and that the counts are the model's own."""
    if not r.execution.measured or not (note := r.execution.twin_note):
        return []
    return [f"Blocks and FLOPs counted on the model alone: {md_text(note)}."]
