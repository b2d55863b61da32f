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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from fcaudit.core.contract import ControllerAdapter, RoutingAdapter, Site, SiteCall, describe
from fcaudit.core.errors import FcauditError

TOKEN_LAYOUT = (1,)  # positions on axis 1: the layout every condition reads directly


def check_layout(site: Site) -> None:
    """A site's ``axes`` and ``positions`` must describe a tensor the engine can read."""
    axes, positions = site.axes, site.positions
    if not isinstance(axes, tuple) or not axes or not all(isinstance(a, str) for a in axes):
        raise FcauditError(f"site {site.name}: axes must be a tuple of axis names, the first "
                           f"the examples axis, got {axes!r}")
    if not isinstance(positions, tuple) or any(
            isinstance(p, bool) or not isinstance(p, int) or not 0 < p < len(axes)
            for p in positions) or list(positions) != sorted(set(positions)):
        raise FcauditError(f"site {site.name}: positions must be increasing indices of "
                           f"axes {list(axes)} other than the examples axis 0 (() for "
                           f"per-example coefficients), got {positions!r}")


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
            raise FcauditError(f"coefficients are {describe(x)}, expected [{named}, ...] "
                               f"with {call.batch} examples (the site's axes)")
        shape = tuple(x.shape[1:])
        if self._shape and self._shape[0] != shape:
            raise FcauditError(f"coefficients have per-example shape {list(shape)}, recorded "
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
            raise FcauditError("this site's layout is not known yet: record it first "
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
        check_layout(site)
        if site.positions == TOKEN_LAYOUT:
            out.append(site)
            continue
        if isinstance(site.adapter, RoutingAdapter):
            raise FcauditError(f"site {site.name}: a router's logits must be [examples, "
                               "positions, experts] (positions=(1,)); got positions "
                               f"{site.positions!r}")
        out.append(dataclasses.replace(site, adapter=LayoutAdapter(site.adapter, site.axes,
                                                                   site.positions)))
    return out


def has_positions(sites: Sequence[Site]) -> bool:
    """True when some site has a position axis (shuffle and per-position profiles apply)."""
    return any(s.positions for s in sites)


def not_applicable(sites: Sequence[Site], token_ids: bool) -> dict[str, str]:
    """The conditions that cannot act on these sites and inputs, each with the reason in
    the sites' own axis names (reported as not applicable, never as a number)."""
    out = {}
    if not has_positions(sites):
        shapes = "; ".join(dict.fromkeys(f"[{', '.join(s.axes)}]" for s in sites))
        why = (f"the coefficients ({shapes}) have no position axis, one value set per "
               "example")
        out["shuffle"] = f"{why}: there are no positions to permute"
        out["reassign+shuffle"] = f"{why}: shuffle does not apply, so neither does the pair"
        out["static-layer-position"] = f"{why}: a per-position profile is the per-layer one"
    if not token_ids:
        out["static-layer-token"] = ("the inputs are not token ids: there is no token id "
                                     "to key a profile by")
    return out
