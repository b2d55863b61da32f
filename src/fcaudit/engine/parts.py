"""Selection parameters and their named coefficients (:class:`~fcaudit.core.contract.Selection`).

A Mamba-2 ``in_proj`` slice holds ``dt``, ``B`` and ``C`` side by side: pooled, their
variance shares mix three coefficients with different roles, so each is also decomposed
alone. The declarations are checked on the first batch (one line naming the site, never an
index error after the whole audit), and they reach ``audit.json`` through the sites listing
and ``variance[family].parts``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from torch import Tensor

from fcaudit.core.contract import Site
from fcaudit.core.errors import ModelError
from fcaudit.engine.metrics import TokenShare, VarianceAccumulator
from fcaudit.engine.result import SitePart, VarianceShares

PARTS_FIX = ("declare Selection(space, parts=((name, width), ...)) with distinct names and "
             "positive widths that add up to the coefficient's last axis")


def _describe(parts: Sequence[tuple[str, int]]) -> str:
    return ", ".join(f"{name}({width})" for name, width in parts)


def declared(site: Site) -> tuple[tuple[str, int], ...]:
    """A site's parts as a tuple of ``(name, width)`` pairs (lists accepted), checked:
    distinct non-empty names, positive integer widths."""
    parts = site.selection.parts if site.selection is not None else ()
    pairs = tuple(tuple(p) for p in parts if isinstance(p, (tuple, list))) \
        if isinstance(parts, (tuple, list)) else None
    well_formed = pairs is not None and len(pairs) == len(parts) and all(
        len(p) == 2 and isinstance(p[0], str) and p[0] and isinstance(p[1], int)
        and not isinstance(p[1], bool) and p[1] > 0 for p in pairs)
    if not well_formed or len({p[0] for p in pairs}) != len(pairs):
        raise ModelError(f"site {site.name}: parts={parts!r} is not a tuple of distinct "
                         f"(name, width) pairs; {PARTS_FIX}", site=site.name)
    return tuple((str(name), int(width)) for name, width in pairs)


def space(site: Site) -> str | None:
    """The space a selection parameter's values are in; None for any other site."""
    return site.selection.space if site.selection is not None else None


def _check_declared(site: Site) -> tuple[tuple[str, int], ...]:
    """The site's parts (:func:`declared`); a selection's space must be named."""
    parts, named = declared(site), space(site)
    if site.selection is not None and not (isinstance(named, str) and named.strip()):
        raise ModelError(f"site {site.name}: Selection.space={named!r} must name the "
                         "space the selection parameter's values are in (e.g. \"dt before "
                         "softplus\")", site=site.name)
    return parts


def check_parts(sites: Sequence[Site], coefficients: Mapping[str, Tensor]) -> None:
    """Every site's declared parts fit its first batch's coefficients, and the sites of a
    family agree on them and on being selection parameters (each coefficient is compared
    across layers, so every layer must hold the same ones)."""
    first: dict[str, tuple[Site, tuple[tuple[str, int], ...]]] = {}
    for site in sites:
        parts = _check_declared(site)
        head, head_parts = first.setdefault(site.family, (site, parts))
        if (parts, site.selection is None) != (head_parts, head.selection is None):
            raise ModelError(
                f"sites {head.name} and {site.name} of family {site.family} declare other "
                f"coefficients (parts {_describe(head_parts) or 'none'} vs "
                f"{_describe(parts) or 'none'}; selection {space(head)!r} vs "
                f"{space(site)!r}); give every site of a family the same parts and "
                "selection, or put them in families of their own", site=site.name)
        if not parts or site.name not in coefficients:
            continue
        shape = list(coefficients[site.name].shape)
        total = sum(width for _, width in parts)
        if len(shape) < 3 or shape[-1] != total:
            raise ModelError(
                f"site {site.name} declares parts {_describe(parts)} ({total} channels) "
                f"but its coefficients have shape {shape}, {shape[-1] if len(shape) >= 3 else 'no'}"
                f" channels on the last trailing axis; {PARTS_FIX}", site=site.name)


def channels(parts: Sequence[tuple[str, int]]) -> dict[str, slice]:
    """Each part's channels on the last axis, in declared order."""
    out, start = {}, 0
    for name, width in parts:
        out[name] = slice(start, start + width)
        start += width
    return out


def coefficients_of(members: Sequence[Site]) -> dict[str, slice] | None:
    """A family's named coefficients and their channels: its declared parts; a selection
    family without parts, one coefficient named by its family; None for any other."""
    head = members[0]
    if declared(head):
        return channels(declared(head))
    return {head.family: slice(None)} if head.selection is not None else None


def part_variance(members: Sequence[Site], variance: VarianceAccumulator,
                  tokens: TokenShare | None) -> dict[str, VarianceShares] | None:
    """Each named coefficient's variance decomposition with its token-id share (None
    without token ids), or None for a family that names none."""
    named = coefficients_of(members)
    if named is None:
        return None
    return {name: dataclasses.replace(variance.part(cut),
                                      **(tokens.shares(cut) if tokens is not None else {}))
            for name, cut in named.items()}


def site_parts(site: Site) -> list[SitePart] | None:
    """A site's parts as ``audit.json`` lists them (None: one coefficient)."""
    return [SitePart(name, width) for name, width in declared(site)] or None
