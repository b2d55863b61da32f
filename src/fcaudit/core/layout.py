"""Coefficient layouts other than ``[B, T, ...]``: the engine's canonical view.

Every condition of the audit acts on a tensor ``[examples, positions, *trailing]``. A
:class:`~fcaudit.core.contract.Site` names its own axes (``axes``) and which of them are
positions (``positions``); :func:`canonical_sites` gives each site whose positions are not
axis 1 alone a :class:`LayoutAdapter`, which presents the coefficients in that view:

* ``[B, P, ...]`` patch tokens (``positions=(1,)``): unchanged;
* ``[B, K]`` per-example coefficients (``positions=()``): ``[B, 1, K]``, one position;
* ``[B, C, H, W]`` spatial maps (``positions=(2, 3)``): ``[B, H*W, C]``, the position
  axes moved forward and flattened (row-major), the other axes trailing in order.

Rebuilding inverts the move exactly (a permutation and reshape: no arithmetic), so the
recorder's bitwise round-trip check and the identity replay hold as for any adapter.

A site that does not declare its layout (named by a ``--sites`` glob, or a ``Site``
without ``axes``) gets one from :func:`decide_layout`, and only a *proven* position
axis: one as long as the positions of what the module reads (the tokens of a token
batch; the patches of a ``[B, P, D]`` input, the cells of a ``[B, C, H, W]`` input).
A coefficient with no such axis is per-example (``positions=()``: shuffle and
per-position profiles do not apply); one whose position axis could as well be a width
(``[B, 16]`` from patches ``[B, 16, 16]``) is refused in one line naming the way to
declare it, ``Site(axes=...)`` or ``--site-axes GLOB=AXES`` (:func:`parse_axes`).
Reading a width as positions is the silent fault this rules out: ``shuffle`` would
permute channels and report it as tokens.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import shlex
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from fcaudit.core.conditions import CONDITIONS, audited
from fcaudit.core.contract import ControllerAdapter, RoutingAdapter, Site, SiteCall, describe
from fcaudit.core.errors import UsageError, arg

TOKEN_LAYOUT = (1,)  # positions on axis 1: the layout every condition reads directly
TOKEN_AXES = ("example", "token")
POSITION_MARK = "*"  # an axis name ending in it is a position axis (as the report marks)
SiteAxes = Mapping[str, str | Sequence[str]] | Sequence[str] | None


def parse_axes(spec: str | Sequence[str], where: str) -> tuple[tuple[str, ...],
                                                               tuple[int, ...]]:
    """``"example,channel,row*,column*"`` (or the names as a sequence) -> axes and
    positions: the first axis is the examples axis, a trailing ``*`` marks a position axis
    (the report's notation); no ``*`` at all is one value set per example."""
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    if not names or not all(isinstance(n, str) and n.strip().rstrip(POSITION_MARK).strip()
                            for n in names):
        raise UsageError(f"{where}: axes must be comma-separated names, the examples axis "
                         f"first and a * after each position axis, e.g. "
                         f"'example,channel' or 'example,patch*'; got {spec!r}")
    names = [n.strip() for n in names]
    axes = tuple(n.rstrip(POSITION_MARK).strip() for n in names)
    positions = tuple(i for i, n in enumerate(names) if n.endswith(POSITION_MARK))
    if 0 in positions or len(set(axes)) != len(axes):
        raise UsageError(f"{where}: the first axis is the examples axis (never a position "
                         f"axis) and each axis is named once; got {spec!r}")
    return axes, positions


def spell_axes(axes: Sequence[str], positions: Sequence[int]) -> str:
    """The inverse of :func:`parse_axes`: ``example,channel,row*,column*``."""
    return ",".join(f"{a}{POSITION_MARK if i in positions else ''}"
                    for i, a in enumerate(axes))


SITE_AXES = "site_axes"


def declare_hint(site: Site, spec: str) -> str:
    """How to declare ``spec`` for this site, in the reader's words: ``--site-axes`` on the
    site's glob (its family), or ``Site(axes=...)`` in Python."""
    axes, positions = parse_axes(spec, "hint")
    python = (f"Site(..., axes={axes!r}, positions={positions!r}) or "
              f"{SITE_AXES}={{{site.family!r}: {spec!r}}}")
    return arg(SITE_AXES, py=python, cli=f"--site-axes '{site.family}={spec}'")


def _declared(site: Site) -> Site:
    """``axes`` given without ``positions``: positions on axis 1 (the documented default),
    or none for a lone examples axis; ``positions`` without ``axes`` is refused."""
    if site.axes is None:
        if site.positions is not None:
            raise UsageError(f"site {site.name}: positions={site.positions!r} needs axes=(...) "
                             "naming every leading axis, the examples axis first")
        return site
    if site.positions is None:
        positions = TOKEN_LAYOUT if isinstance(site.axes, tuple) and len(site.axes) > 1 else ()
        site = dataclasses.replace(site, positions=positions)
    check_layout(site)
    return site


def declare_axes(sites: Sequence[Site], site_axes: SiteAxes) -> list[Site]:
    """Each site's declared layout: its own ``axes``, else the ``site_axes`` entry whose
    glob matches its path (``{GLOB: AXES}`` or ``["GLOB=AXES", ...]``), else None (decided
    from the first batch). A glob matching no site, two entries disagreeing on one site,
    or an entry contradicting a layout the model declares is refused."""
    entries = _entries(site_axes)
    out = []
    for site in (_declared(s) for s in sites):
        given = {(g, parse_axes(spec, _entry(g, spec))) for g, spec in entries
                 if fnmatch.fnmatchcase(site.path, g) or g == site.family}
        own = set() if site.axes is None else {(site.axes, site.positions)}
        layouts = _one_layout({layout for _, layout in given} | own)
        if len(layouts) > 1:
            said = "; ".join(sorted(f"{g}={spell_axes(*lay)}" for g, lay in given))
            own = "" if site.axes is None else \
                f", and it declares {spell_axes(site.axes, site.positions or ())}"
            raise UsageError(f"site {site.name}: {arg(SITE_AXES)} gives it more than one "
                             f"layout ({said}{own}); give each site one")
        if layouts and site.axes is None:
            axes, positions = layouts.pop()
            site = dataclasses.replace(site, axes=axes, positions=positions)
            check_layout(site)
        out.append(site)
    unused = [_entry(g, spec) for g, spec in entries if not any(
        fnmatch.fnmatchcase(s.path, g) or g == s.family for s in sites)]
    if unused:
        raise UsageError(f"{unused[0]} matches none of the audited sites "
                         f"({', '.join(s.path for s in sites[:4])}"
                         f"{', ...' if len(sites) > 4 else ''}); give a glob of their paths")
    return out


def _one_layout(layouts: set[tuple[tuple[str, ...], tuple[int, ...]]]
                ) -> set[tuple[tuple[str, ...], tuple[int, ...]]]:
    """Layouts with the same positions whose axes each extend a shorter one's (a router's
    declared ``example,token*`` and a user's ``example,token*,expert``: trailing axes
    named or not) are one layout, the longest; any other difference stays two."""
    longest = max(layouts, key=lambda lay: len(lay[0]), default=None)
    if longest is not None and all(lay[1] == longest[1] and longest[0][:len(lay[0])] == lay[0]
                                   for lay in layouts):
        return {longest}
    return layouts


def _entry(glob: str, spec: str | Sequence[str]) -> str:
    """One ``site_axes`` entry as its reader wrote it."""
    cli = shlex.quote(f"{glob}={spec if isinstance(spec, str) else ','.join(spec)}")
    return arg(SITE_AXES, py=f"{SITE_AXES}[{glob!r}]={spec!r}", cli=f"--site-axes {cli}")


def _entries(site_axes: SiteAxes) -> list[tuple[str, str | Sequence[str]]]:
    """``site_axes`` as (glob, axes) pairs: a mapping, or ``GLOB=AXES`` strings (the CLI)."""
    if site_axes is None:
        return []
    if isinstance(site_axes, str):
        site_axes = [site_axes]
    if isinstance(site_axes, Mapping):
        pairs = list(site_axes.items())
    elif isinstance(site_axes, (list, tuple)) and all(isinstance(e, str) for e in site_axes):
        pairs = [tuple(e.rsplit("=", 1)) if "=" in e else (e, "") for e in site_axes]
    else:
        pairs = [("", site_axes)]
    for glob, spec in pairs:
        names = [spec] if isinstance(spec, str) else spec
        if not isinstance(glob, str) or not glob or not spec or not isinstance(
                spec, (str, list, tuple)) or not all(isinstance(n, str) for n in names):
            got = f"{glob!r}: {spec!r}" if isinstance(site_axes, Mapping) else \
                repr(glob or site_axes)
            option = arg(SITE_AXES, py='site_axes={GLOB: AXES}', cli='--site-axes GLOB=AXES')
            raise UsageError(
                f"give {option} for each glob of sites (AXES: comma-separated axis names), e.g. "
                "'blocks.*.gate=example,channel' (one value set per example) or "
                f"'blocks.*.mask=example,channel,row*,column*'; got {got}")
    return pairs  # type: ignore[return-value]


def check_family_positions(sites: Sequence[Site], coefficients: Mapping[str, Tensor]
                           ) -> None:
    """The sites of one family must have as many positions each (``[B, P, ...]`` as the
    engine reads them): the per-position conditions and the variance split compare one
    position across layers. Declared layouts of unequal lengths (a channel axis of 4 in
    one block and 6 in the next, marked as positions) are refused here, on the first
    batch, not by an arithmetic error after the whole audit."""
    for family in dict.fromkeys(s.family for s in sites):
        counts = {s.name: int(coefficients[s.name].shape[1]) for s in sites
                  if s.family == family and s.name in coefficients
                  and coefficients[s.name].dim() >= 2}
        if len(set(counts.values())) > 1:
            (a, pa) = next(iter(counts.items()))
            (b, pb) = next(item for item in counts.items() if item[1] != pa)
            option = arg(SITE_AXES, py=f"site_axes={{{family!r}: ...}}", cli="--site-axes")
            raise UsageError(
                f"sites of family {family} have different numbers of positions ({a}: {pa}, "
                f"{b}: {pb}), so no position can be compared across them; give the axis "
                f"that differs without a * (one value set per example), e.g. {option}, "
                "or name each site with its own glob")


def check_layout(site: Site) -> None:
    """A site's ``axes`` and ``positions`` must describe a tensor the engine can read."""
    axes, positions = site.axes, site.positions
    if not isinstance(axes, tuple) or not axes or not all(isinstance(a, str) for a in axes):
        raise UsageError(f"site {site.name}: axes must be a tuple of axis names, the first "
                         f"the examples axis, got {axes!r}")
    if not isinstance(positions, tuple) or any(
            isinstance(p, bool) or not isinstance(p, int) or not 0 < p < len(axes)
            for p in positions) or list(positions) != sorted(set(positions)):
        raise UsageError(f"site {site.name}: positions must be increasing indices of "
                         f"axes {list(axes)} other than the examples axis 0 (() for "
                         f"per-example coefficients), got {positions!r}")


Shape = tuple[int, ...]


def decide_layout(site: Site, shape: Shape, read: Shape | None) -> tuple[Site, str]:
    """The layout of an undeclared site on inputs other than token ids, from the shape
    ``[B, *S]`` of its coefficients and ``read``, the shape of the tensor the module reads
    (its first tensor input): a position axis only where ``S`` has the patches ``P`` of a
    ``[B, P, D]`` input or the rows and columns ``H, W`` of a ``[B, C, H, W]`` input, and
    ``S`` can be read that way alone; else per-example. Returns the site and how its
    layout was found."""
    candidates = _position_readings(shape[1:], read)
    if not candidates:
        where = f"its input {_shape(read)}" if read is not None else "its inputs"
        seen = f"{where} has no patches [B, P, D] or cells [B, C, H, W]" \
            if _positions(read) is None else f"no axis has the positions of {where}"
        return (dataclasses.replace(site, axes=_per_example_axes(shape, read), positions=()),
                f"one value set per example: {seen}")
    if len(candidates) > 1 or candidates[0][2]:
        spec = spell_axes(*candidates[0][:2])
        raise UsageError(
            f"site {site.name}: cannot tell which axes of its coefficients {_shape(shape)} are "
            f"positions: its input {_shape(read)} has {_positions(read)} positions, and an "
            "axis of that length can as well be a width; declare the layout with "
            f"{declare_hint(site, spec)} (a * marks each position axis; none at all for one "
            "value set per example)")
    axes, positions, _ = candidates[0]
    return (dataclasses.replace(site, axes=axes, positions=positions),
            f"positions proven: axes {spell_axes(axes, positions)} match the "
            f"{_positions(read)} positions of its input {_shape(read)}")


def _per_example_axes(shape: Shape, read: Shape | None) -> tuple[str, ...]:
    """``example``, then ``channel`` (``feature``) when axis 1 is as long as the channels
    of a ``[B, C, H, W]`` input (the features of a ``[B, P, D]`` one): an SE gate's."""
    width = {4: (1, "channel"), 3: (2, "feature")}.get(len(read) if read else 0)
    if read is not None and width is not None and shape[1:2] == (read[width[0]],):
        return "example", width[1]
    return ("example",)


def _shape(shape: Shape | None) -> str:
    return "[B, " + ", ".join(str(n) for n in shape[1:]) + "]" if shape else "?"


def _positions(read: Shape | None) -> str | None:
    """The positions of what a module reads, in words, or None (it has none)."""
    if read is not None and len(read) == 3:
        return f"{read[1]} patch"
    if read is not None and len(read) == 4:
        return f"{read[2]}x{read[3]} cell"
    return None


def _position_readings(rest: Shape, read: Shape | None
                       ) -> list[tuple[tuple[str, ...], tuple[int, ...], bool]]:
    """Every reading of ``[B, *rest]`` with the input's positions: (axes, positions,
    ambiguous), ambiguous when the position axis is as long as the input's width too."""
    if read is None or len(read) not in (3, 4) or math.prod(read[1:-1] if len(read) == 3
                                                            else read[2:]) < 2:
        return []  # no positions, or a single one (a pooled [B, C, 1, 1]): nothing to permute
    if len(read) == 3:  # patches [B, P, D]
        _, count, width = read
        return [(("example", "patch"), (1,), count == width)] if rest[:1] == (count,) else []
    # a map [B, C, H, W]. A flattened [B, H*W] is not read as cells: a squeeze-and-excitation
    # gate [B, C] on 64 channels of an 8x8 map has that shape too (declare cells with *)
    _, width, rows, cols = read
    out = []
    if rest[:2] == (rows, cols):
        out.append((("example", "row", "column"), (1, 2), rows == width))
    if rest[1:3] == (rows, cols):
        out.append((("example", "channel", "row", "column"), (2, 3), False))
    return out


@dataclass(frozen=True, eq=False)
class LayoutAdapter:
    """Wraps a site's adapter: extract gives ``[B, P, *rest]``, rebuild takes it back.

    The per-example shape is learned when the site is first recorded (every pass of an
    audit records the first batch before it replays anything) and checked on every call.
    """

    inner: ControllerAdapter
    axes: tuple[str, ...]
    positions: tuple[int, ...]
    _shape: list[tuple[int, ...]] = field(default_factory=list, repr=False)

    @property
    def name(self) -> str:
        return getattr(self.inner, "name", type(self.inner).__name__)

    def _order(self, dim: int) -> list[int]:
        return [0, *self.positions, *(i for i in range(1, dim) if i not in self.positions)]

    def extract(self, output: Any, call: SiteCall) -> Tensor:
        x = self.inner.extract(output, dataclasses.replace(call, seq_len=None))
        if not isinstance(x, Tensor) or x.dim() < len(self.axes) or x.shape[0] != call.batch:
            named = ", ".join(self.axes)
            raise UsageError(f"coefficients are {describe(x)}, expected [{named}, ...] "
                             f"with {call.batch} examples (the site's axes)")
        shape = tuple(x.shape[1:])
        if self._shape and self._shape[0] != shape:
            raise UsageError(f"coefficients have per-example shape {list(shape)}, recorded "
                             f"earlier as {list(self._shape[0])}; a site's shape must be "
                             "the same for every example")
        if not self._shape:
            self._shape.append(shape)
        order = self._order(x.dim())
        moved = x.permute(order)
        count = math.prod(x.shape[i] for i in self.positions)
        return moved.reshape(x.shape[0], count, *moved.shape[1 + len(self.positions):])

    def rebuild(self, coefficients: Tensor, call: SiteCall) -> Any:
        if not self._shape:
            raise UsageError("this site's layout is not known yet: record it first "
                             "(fcaudit.record, or the audit's first batch)")
        shape = (coefficients.shape[0], *self._shape[0])
        order = self._order(len(shape))
        moved = coefficients.reshape(coefficients.shape[0],
                                     *(shape[i] for i in order[1:]))
        inverse = sorted(range(len(order)), key=order.__getitem__)
        return self.inner.rebuild(moved.permute(inverse).contiguous(),
                                  dataclasses.replace(call, seq_len=None))


def canonical_sites(sites: Sequence[Site]) -> list[Site]:
    """The sites as the engine reads them: each whose positions are not axis 1 alone gets a
    :class:`LayoutAdapter` (a router's must keep its positions on axis 1)."""
    out = []
    for site in sites:
        if site.axes is None:  # the audit decides it from the first batch before this
            raise UsageError(f"site {site.name}: its layout is not known yet; record it "
                             "first (the audit's first batch decides it)")
        check_layout(site)
        if site.positions == TOKEN_LAYOUT:
            out.append(site)
            continue
        if isinstance(site.adapter, RoutingAdapter):
            raise UsageError(f"site {site.name}: a router's logits must be [examples, "
                             "positions, experts] (positions=(1,)); got positions "
                             f"{site.positions!r}")
        out.append(dataclasses.replace(site, adapter=LayoutAdapter(site.adapter, site.axes,
                                                                   site.positions)))
    return out


def shuffled_axes(sites: Sequence[Site]) -> str:
    """What shuffle permutes, in the sites' words: "tokens", else the position axes'
    names ("positions (patch)", "positions (row, column)")."""
    names = list(dict.fromkeys(
        (site.axes or TOKEN_AXES)[i] for site in sites for i in site.positions or ()))
    return "tokens" if names in ([], ["token"]) else f"positions ({', '.join(names)})"


def keyed_by_token(sites: Sequence[Site]) -> bool:
    """True when every site has one coefficient set per token (positions on axis 1 of
    ``[B, T, ...]``): only then does each coefficient have a token id to be keyed by."""
    return all(s.positions in (None, TOKEN_LAYOUT) for s in sites)


def not_applicable(sites: Sequence[Site], token_ids: bool,
                   opted: Collection[str] = ()) -> dict[str, str]:
    """The conditions (default ones, and the opt-in ones in ``opted``) that cannot act on
    these sites and inputs (``token_ids``: the inputs are token ids), each with the reason
    in the sites' own axis names (reported as not applicable, never as a number)."""
    positions = any(s.positions for s in sites)  # sites without one all have their axes named
    shapes = "" if positions else "; ".join(dict.fromkeys(f"[{', '.join(s.axes)}]"
                                                          for s in sites))
    exits = any(s.exit is not None for s in sites)
    keyed = token_ids and keyed_by_token(sites)
    unkeyed = next((s for s in sites if not keyed_by_token([s])), None)
    no_ids = None if keyed or not token_ids or unkeyed is None else (
        f"site {unkeyed.name}'s coefficients [{', '.join(unkeyed.axes or ())}] have no token "
        "axis: no token id keys them")
    why = {name: CONDITIONS[name].why_not(positions, keyed, shapes, exits, no_ids)
           for name in audited(opted)}
    return {name: reason for name, reason in why.items() if reason is not None}
