"""The selection parts' section: per family, one variance row per named coefficient
(each one's channels decomposed alone) beside the pooled row."""

from __future__ import annotations

from fcaudit.engine.result import ETA2_KEYS, TOKEN_ID_KEYS, AuditResult, VarianceShares
from fcaudit.report.figures import SHARE_LABELS
from fcaudit.report.format import fmt_num, fmt_share
from fcaudit.report.markdown import md_code, md_table
from fcaudit.report.sections.base import Renderer


def _channels(r: AuditResult, family: str) -> dict[str, str]:
    """Each named coefficient's channels on the last axis, as shown (declared order)."""
    site = next(s for s in r.sites if s.family == family)
    out, start = {}, 0
    for part in site.parts or ():
        out[part.name] = f"{start}–{start + part.width - 1}" if part.width > 1 else str(start)
        start += part.width
    return out or {family: "all"}


def _table(r: AuditResult, family: str, named: dict[str, VarianceShares]) -> str:
    """One row per named coefficient, in declared order, and the pooled row."""
    shown, pooled = _channels(r, family), r.variance[family]
    order = [*(p for p in shown if p in named), *(p for p in named if p not in shown)]
    keys = (*ETA2_KEYS, *TOKEN_ID_KEYS)
    rows = [[md_code(name), shown.get(name, ""), fmt_num(named[name].n_values),
             *(fmt_share(getattr(named[name], k)) for k in keys)] for name in order]
    rows.append(["pooled", "all", fmt_num(pooled.n_values),
                 *(fmt_share(getattr(pooled, k)) for k in keys)])
    header = ("coefficient", "channels", "values", *(SHARE_LABELS[k] for k in ETA2_KEYS),
              "token id (within layers)", "its chance level", "token id beyond chance")
    return md_table(header, rows, "llr" + "r" * len(keys))


def render(r: AuditResult, section: dict[str, dict[str, VarianceShares]]) -> list[str]:
    blocks = ["## Named coefficients",
              "Per family of selection parameters, each named coefficient's channels "
              "decomposed alone, beside the pooled decomposition: the shares of layer "
              "identity, position and their interaction as in the variance decomposition; "
              "the token-id share is of the variance within layers, beside its chance level "
              "(k − 1) / (n − 1) for k distinct ids among n tokens, and the share beyond "
              "chance, (share − chance) / (1 − chance)."]
    for family, named in section.items():
        blocks += [f"### Family {md_code(family)}", _table(r, family, named)]
    return blocks


RENDERER = Renderer("selection_parts", render)
