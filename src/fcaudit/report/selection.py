"""The report's words for selective recurrences and named coefficients.

Sites that declare ``selection`` are a recurrence's selection parameters (Mamba's Δ, B, C;
a decay or an input gate): there ``static-layer`` is the LTI twin (each layer fed the
calibration mean of its selection parameters, a time-invariant recurrence), and the
report says so beside the retentions, naming the space the mean was taken in; the
variation answer quotes each named coefficient's token-id share (its rows are the
selection parts' section, :mod:`fcaudit.report.sections.selection_parts`). An audit
without selection sites reads exactly as before.
"""

from __future__ import annotations

from fcaudit.core.conditions import STATIC_LAYER, STATIC_LAYER_POSITION, STATIC_LAYER_TOKEN
from fcaudit.engine.result import AuditResult
from fcaudit.report.markdown import md_code, md_text

# what each static profile is on selection sites (the retention table's note)
PROFILE_NOTES = {
    STATIC_LAYER: "the LTI twin: a time-invariant recurrence with each layer's mean selection",
    STATIC_LAYER_POSITION: "one mean per layer and position: input-independent, not selective",
    STATIC_LAYER_TOKEN: "is selection a lookup of the current token?",
}


def selection_spaces(r: AuditResult) -> dict[str, list[str]]:
    """Per selection family (site order), the distinct spaces its sites' values are in."""
    out: dict[str, list[str]] = {}
    for site in r.sites:
        if site.selection is not None:
            spaces = out.setdefault(site.family, [])
            if site.selection not in spaces:
                spaces.append(site.selection)
    return out


def _spaces_text(spaces: dict[str, list[str]]) -> str:
    return "; ".join(f"{md_code(fam)}: " + ", ".join(md_text(s) for s in found)
                     for fam, found in spaces.items())


def profile_note(r: AuditResult, profile: str) -> str:
    """The retention table's note on ``profile`` for an audit with selection sites."""
    return PROFILE_NOTES.get(profile, "") if selection_spaces(r) else ""


def lti_statement(r: AuditResult) -> list[str]:
    """The static profiles in words, for an audit whose sites include selection parameters."""
    spaces = selection_spaces(r)
    if not spaces:
        return []
    families = ", ".join(md_code(f) for f in spaces)
    return [f"**Selection parameters** ({families}). `static-layer` feeds each layer the "
            "calibration mean of its selection parameters: a time-invariant (LTI) recurrence "
            "with the layer's average parameters, so its retention is the share of the gap "
            "the model's LTI twin keeps. The means were taken in the space the sites record, "
            f"before any range-keeping activation ({_spaces_text(spaces)}). "
            "`static-layer-position` feeds one mean per layer and position: a recurrence "
            "that varies with position but not with the input. `static-layer-token` feeds "
            "one mean per layer and current token id: is selection a lookup of the current "
            "token?"]


def dependence_fact(r: AuditResult) -> list[str]:
    """One line for the dependence answer: what static-layer is on selection sites."""
    spaces = selection_spaces(r)
    if not spaces:
        return []
    return [f"On the selection parameters, `static-layer` is the LTI twin (each layer's "
            f"calibration mean, taken in {_spaces_text(spaces)}); `static-layer-token` asks "
            "whether selection is a lookup of the current token."]


def variation_facts(r: AuditResult) -> list[str]:
    """Per family with named coefficients: the token id's share of each one's variance
    within layers, beyond chance and beside its chance level (the variation answer quotes
    the pooled figure only)."""
    facts = []
    for fam, named in (r.selection_parts or {}).items():
        shares = [f"{md_code(name)}: {md_text(said)}" for name, p in named.items()
                  if (said := p.token_id_text()) is not None]
        if shares and (len(shares) > 1 or next(iter(named)) != fam):
            facts.append(f"{md_code(fam)} per coefficient, within layers: "
                         f"{'; '.join(shares)}.")
    return facts


def execution_note(r: AuditResult) -> list[str]:
    """For selection families: no conditional execution from selection, the twin it was
    measured against, and the compute modes timed (any audit whose models declare them)."""
    ex, spaces = r.execution, selection_spaces(r)
    if not ex.measured:
        return []
    notes = []
    if spaces:
        own = ("no conditional execution" if not ex.conditional_execution else
               "the conditional execution above comes from the audit's other controllers")
        twin = f"class {md_code(ex.dense_class)}" if ex.dense_class else "none given"
        notes.append(f"Selective recurrences ({', '.join(md_code(f) for f in spaces)}) compute "
                     "the same for every token: selection changes the values the recurrence "
                     f"runs with, not which blocks run or for which tokens ({own}). Twin "
                     f"measured against: the model's dense counterpart, {twin} (for a selective "
                     "recurrence, its LTI twin: the same recurrence with fixed parameters).")
    what = "Compute mode timed" if ex.timing is not None else "Compute mode (latency not timed)"
    if ex.mode or ex.dense_mode:
        notes.append(f"{what}: model " + (md_code(ex.mode) if ex.mode else "not declared") +
                     ", dense counterpart " +
                     (md_code(ex.dense_mode) if ex.dense_mode else "not declared") +
                     " (their `execution_mode`).")
    elif spaces:
        notes.append("Neither the model nor its twin declares which compute mode it runs (an "
                     "`execution_mode` attribute), so the timed mode is not stated.")
    return notes
