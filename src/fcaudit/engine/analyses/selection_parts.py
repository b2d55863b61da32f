"""Selection parts: each named coefficient of a family decomposed alone, beside the pooled
variance. A Mamba-2 ``in_proj`` slice holds ``dt``, ``B`` and ``C`` side by side; pooled,
their shares mix three coefficients with different roles. Families whose sites declare
:class:`~fcaudit.core.contract.Selection` get one entry per part (a selection without
parts: one, named by its family), with the same shares as the pooled figure and its own
token-id share. No runs of its own: the description pass accumulates them over the cached
coefficients beside the pooled decomposition (:func:`fcaudit.engine.summary.describe`)."""

from __future__ import annotations

from typing import Any

from fcaudit.engine.analyses.base import Analysis
from fcaudit.engine.result_parts import ETA2_KEYS, TOKEN_ID_KEYS, VarianceShares
from fcaudit.io.typedjson import load

Parts = dict[str, dict[str, VarianceShares]]  # family -> coefficient -> its decomposition


def summarise(measured: Any, analysis: Analysis) -> Parts | None:
    return dict(measured.parts) or None


def metrics(section: Parts) -> dict[str, float | None]:
    """Every share of every named coefficient, as ``<share>@<family>.<coefficient>``."""
    return {f"{key}@{family}.{name}": getattr(shares, key)
            for family, named in section.items() for name, shares in named.items()
            for key in (*ETA2_KEYS, *TOKEN_ID_KEYS)}


def from_variance(data: dict[str, Any]) -> tuple[dict[str, Any], Parts | None]:
    """``audit.json`` content written before this analysis, which held each family's parts
    at ``variance[family].parts``: the content without them (a new dict) and the section
    read from there, a wrong value refused at the path the file has. Content that has the
    section already is returned as it is: a file with both is refused by the strict
    reader, as neither is what fcaudit wrote."""
    variance = data.get("variance")
    if ANALYSIS.name in data or not isinstance(variance, dict):
        return data, None
    held = {family: v["parts"] for family, v in variance.items()
            if isinstance(v, dict) and "parts" in v}
    if not held:
        return data, None
    rest = {family: {k: x for k, x in v.items() if k != "parts"} if family in held else v
            for family, v in variance.items()}
    return {**data, "variance": rest}, {
        family: load(dict[str, VarianceShares], parts, f"variance.{family}.parts")
        for family, parts in held.items()}


ANALYSIS = Analysis("selection_parts", plan=lambda setup, probe: [], summarise=summarise,
                    metrics=metrics, section_type=Parts, earlier=from_variance)
