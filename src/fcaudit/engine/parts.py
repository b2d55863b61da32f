"""Named coefficients and selection parameters (:attr:`Site.parts`, :attr:`Site.selection`).

A Mamba-2 ``in_proj`` slice holds ``dt``, ``B`` and ``C`` side by side: pooled, their
variance shares mix three coefficients with different roles, so each is also decomposed
alone. The declarations are checked on the first batch (one line naming the site, never an
index error after the whole audit), and they reach ``audit.json`` through the sites listing
and ``variance[family].parts``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import Tensor

from fcaudit.core.contract import Site
from fcaudit.core.errors import ModelError
from fcaudit.engine.metrics import TokenShare, VarianceAccumulator
from fcaudit.engine.result import SitePart, VarianceShares

PARTS_FIX = ("declare Site(parts=((name, width), ...)) with distinct names and positive "
             "widths that add up to the coefficient's last axis")


def _describe(parts: Sequence[tuple[str, int]]) -> str:
    return ", ".join(f"{name}({width})" for name, width in parts)


def _check_declared(site: Site) -> None:
    """``parts`` is a tuple of distinct ``(name, width)``; ``selection`` a non-empty string."""
    parts = site.parts
    well_formed = isinstance(parts, tuple) and all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and p[0]
        and isinstance(p[1], int) and not isinstance(p[1], bool) and p[1] > 0 for p in parts)
    if not well_formed or len({p[0] for p in parts}) != len(parts):
        raise ModelError(f"site {site.name}: parts={parts!r} is not a tuple of distinct "
                         f"(name, width) pairs; {PARTS_FIX}", site=site.name)
    if site.selection is not None and not (isinstance(site.selection, str)
                                           and site.selection.strip()):
        raise ModelError(f"site {site.name}: selection={site.selection!r} must name the space "
                         "the selection parameter's values are in (e.g. \"dt before softplus\"),"
                         " or be None for a controller that is no selection parameter",
                         site=site.name)


def check_parts(sites: Sequence[Site], coefficients: Mapping[str, Tensor]) -> None:
    """Every site's declared parts fit its first batch's coefficients, and the sites of a
    family agree on them and on being selection parameters (each coefficient is compared
    across layers, so every layer must hold the same ones)."""
    first: dict[str, Site] = {}
    for site in sites:
        _check_declared(site)
        head = first.setdefault(site.family, site)
        if (site.parts, site.selection is None) != (head.parts, head.selection is None):
            raise ModelError(
                f"sites {head.name} and {site.name} of family {site.family} declare other "
                f"coefficients (parts {_describe(head.parts) or 'none'} vs "
                f"{_describe(site.parts) or 'none'}; selection {head.selection!r} vs "
                f"{site.selection!r}); give every site of a family the same parts and "
                "selection, or put them in families of their own", site=site.name)
        if not site.parts or site.name not in coefficients:
            continue
        shape = list(coefficients[site.name].shape)
        total = sum(width for _, width in site.parts)
        if len(shape) < 3 or shape[-1] != total:
            raise ModelError(
                f"site {site.name} declares parts {_describe(site.parts)} ({total} channels) "
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
    if head.parts:
        return channels(head.parts)
    return {head.family: slice(None)} if head.selection is not None else None


def part_variance(members: Sequence[Site], variance: VarianceAccumulator,
                  tokens: TokenShare | None) -> dict[str, VarianceShares] | None:
    """Each named coefficient's variance decomposition with its token-id share (None
    without token ids), or None for a family that names none."""
    named = coefficients_of(members)
    if named is None:
        return None
    out = {}
    for name, cut in named.items():
        shares = variance.part(cut)
        shares.eta2_token_id = tokens.share(cut) if tokens is not None else None
        out[name] = shares
    return out


def site_parts(site: Site) -> list[SitePart] | None:
    """A site's parts as ``audit.json`` lists them (None: one coefficient)."""
    return [SitePart(name, width) for name, width in site.parts] or None
