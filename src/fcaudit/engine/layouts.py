"""Each undeclared site's coefficient layout, decided on the first batch before any pass
of the audit reads it.

A site named by a glob (or a ``Site`` without ``axes``) says nothing about which axis of
its coefficients holds positions, and guessing axis 1 reads a squeeze-and-excitation
gate ``[B, C]`` as ``C`` positions: shuffle would permute channels and call it tokens.
So one pass that only looks (the hooks return nothing) records every such site's
coefficient shape and the shape of what the module reads, and
:func:`~fcaudit.core.layout.decide_layout` accepts a position axis only where it is
proven. On token ids the coefficients must be ``[B, T, ...]`` (or ``[B*T, ...]``), and
the proof is a second look at the batch cut one token short: a token axis follows the
length, a width ``d`` that happens to equal ``T`` does not (a model that refuses the
shorter batch keeps the equality as its proof).

The same pass catches a glob that names whole blocks: a site whose coefficients have
exactly the shape of the hidden states it reads, with values outside [0, 1] (no gate,
mixing weight or probability), is refused when it is one of the execution blocks (it is
the block, its output the hidden state), and otherwise audited but said to look like
hidden states, since a feature-wise gate can have that shape too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fcaudit.core.adapters import FLAT, AutoAdapter, infer_adapter
from fcaudit.core.contract import Site, SiteCall, TensorAdapter
from fcaudit.core.errors import FcauditError, UsageError
from fcaudit.core.hooks import hooks
from fcaudit.core.layout import TOKEN_AXES, TOKEN_LAYOUT, canonical_sites, decide_layout
from fcaudit.engine.options import Prepared
from fcaudit.engine.passes import batch_shape
from fcaudit.io.examples import OTHER_INPUTS, ExampleBatch, call_model

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Seen:
    """One site on one pass: its coefficients' shape (``flat``: rows ``[B*P, ...]``
    viewed as ``[B, P, ...]``), the shape of the tensor it reads and of its output, and
    whether every coefficient lies in [0, 1]."""

    shape: Shape
    read: Shape | None
    output: Shape | None
    flat: bool
    unit_range: bool


class _Misfit(Exception):
    """A site's adapter did not fit its output on a look: stops that pass at once (the
    model would go on with an output it cannot use)."""

    def __init__(self, site: Site, module: nn.Module, output: Shape | None,
                 error: FcauditError) -> None:
        super().__init__(f"{error}")
        self.site, self.module, self.output, self.error = site, module, output, error


def _read_shape(args: tuple[Any, ...], kwargs: dict[str, Any], batch: int) -> Shape | None:
    """The shape of the module's first tensor input (positional, else keyword), when its
    first axis is the examples axis."""
    first = next((v for v in (*args, *kwargs.values()) if isinstance(v, Tensor)), None)
    if first is None or first.dim() == 0 or first.shape[0] != batch:
        return None
    return tuple(first.shape)


def _coefficients(site: Site, call: SiteCall, output: Any, tokens: bool
                  ) -> tuple[Tensor, bool]:
    """The coefficient tensor as the site's adapter gives it; on inputs other than token
    ids a plain tensor output (a glob's, or a ``Site`` with the default adapter) is
    ``[B, ...]`` as it is, or for a glob rows ``[B*P, ...]`` of the ``P`` patches it
    reads (``True``: viewed as ``[B, P, ...]``)."""
    plain = isinstance(site.adapter, (AutoAdapter, TensorAdapter))
    if tokens or not plain:
        return site.adapter.extract(output, call), False
    if isinstance(output, Tensor) and output.dim() >= 1 and output.shape[0] == call.batch:
        return output, False
    adapter = infer_adapter(output, call) if isinstance(site.adapter, AutoAdapter) \
        else site.adapter  # rows [B*P, ...], or the one-line refusal
    return adapter.extract(output, call), adapter is FLAT


@torch.no_grad()
def look(model: nn.Module, sites: Sequence[Site], x: Any) -> dict[str, Seen]:
    """One forward pass on ``x`` that only looks at ``sites`` (each site's first call)."""
    batch, tokens = batch_shape(x)
    seen: dict[str, Seen] = {}

    def hook_for(site: Site) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 output: Any) -> None:
            if site.name in seen:
                return  # a second call: recording refuses it with its own message
            read = _read_shape(args, kwargs, batch)
            raw = tuple(output.shape) if isinstance(output, Tensor) else None
            positions = tokens if tokens is not None else \
                (read[1] if read is not None and len(read) == 3 else None)
            try:
                coef, flat = _coefficients(site, SiteCall(module, args, kwargs, batch,
                                                          positions), output, tokens is not None)
            except FcauditError as exc:
                raise _Misfit(site, module, raw, exc) from exc
            unit = bool(coef.is_floating_point() and coef.numel() and coef.min() >= 0
                        and coef.max() <= 1)
            seen[site.name] = Seen(tuple(coef.shape), read, raw, flat, unit)
        return hook

    with hooks(model, {s.path: hook_for(s) for s in sites}, with_kwargs=True):
        call_model(model, x)
    return seen


def _look_first(model: nn.Module, sites: Sequence[Site], x: Any) -> dict[str, Seen]:
    """:func:`look` on the first batch; a site whose output no adapter fits stops the
    audit, naming it (as the record pass would)."""
    try:
        return look(model, sites, x)
    except _Misfit as bad:
        adapter = getattr(bad.site.adapter, "name", type(bad.site.adapter).__name__)
        raise UsageError(f"site {bad.site.name} ({type(bad.module).__name__}, adapter "
                         f"{adapter}): {bad.error:}") from bad.error


@dataclass(frozen=True)
class Resolved:
    """The engine's canonical sites, each undeclared one with its layout, how each layout
    was found (site -> note) and the lines to tell the user."""

    sites: list[Site]
    notes: dict[str, str]
    lines: list[str]


def resolve_layouts(setup: Prepared, x: Any) -> Resolved:
    """Give every undeclared site of ``setup`` its layout and say how each family's
    layout was found on inputs other than token ids, and warnings."""
    tokens = batch_shape(x)[1] is not None
    open_sites = [s for s in setup.sites if s.axes is None]
    named = [s for s in setup.sites if tokens and _unproven_token_axis(s)]
    if named:  # declared, but not as the token axis: it must follow the length too
        _prove_token_axis(setup.model, named, x, _look_first(setup.model, named, x))
    if not open_sites:
        return Resolved(canonical_sites(setup.sites), {}, [])
    seen = _look_first(setup.model, open_sites, x)
    _refuse_blocks(setup, open_sites, seen)
    if tokens:
        _prove_token_axis(setup.model, open_sites, x, seen)
    decided = {s.name: _decide(s, seen.get(s.name), tokens) for s in open_sites}
    sites = canonical_sites([decided[s.name][0] if s.name in decided else s
                             for s in setup.sites])
    notes = {s.name: "; ".join(n for n in (decided[s.name][1], _hidden(seen.get(s.name))) if n)
             for s in open_sites}
    return Resolved(sites, {name: note for name, note in notes.items() if note},
                    _lines(open_sites, notes))


def _unproven_token_axis(site: Site) -> bool:
    """A declared position axis 1 on token ids not named as the token axis
    (``--site-axes 'gate=example,channel*'``): a channel width equal to the length would
    pass every shape check, so it gets the proof an undeclared site gets. The sites our
    models and the router discovery declare say ``("example", "token")``: no extra pass."""
    return site.positions == TOKEN_LAYOUT and tuple(site.axes or ())[:2] != TOKEN_AXES


def _decide(site: Site, seen: Seen | None, tokens: bool) -> tuple[Site, str]:
    """The site with its layout, and how it was found ("" on token ids: as ever)."""
    if tokens or seen is None:  # a site that never ran is refused by the record pass
        return dataclasses.replace(site, axes=TOKEN_AXES, positions=TOKEN_LAYOUT), ""
    if seen.flat:
        return (dataclasses.replace(site, axes=("example", "patch"), positions=TOKEN_LAYOUT),
                f"positions proven: rows [B*{seen.shape[1]}, ...] of the "
                f"{seen.shape[1]} patches of its input")
    return decide_layout(site, seen.shape, seen.read)


def _prove_token_axis(model: nn.Module, sites: Sequence[Site], x: Tensor | ExampleBatch,
                      seen: dict[str, Seen]) -> None:
    """Each site's axis 1 (or its rows) must follow the sequence length: the batch cut one
    token short (ids given as such or as inputs) must give one position fewer."""
    batch, length = batch_shape(x)
    if length is None or length < 2:
        return
    try:
        look(model, sites, x.shorter() if isinstance(x, ExampleBatch) else x[:, :-1])
    except _Misfit as bad:
        before = seen[bad.site.name].output if bad.site.name in seen else None
        if before and before[0] == batch and (not bad.output or bad.output[0] != batch):
            return  # axis 0 followed the length ([T, B] with B == T): the probe's check says
        raise UsageError(
            f"site {bad.site.name}: its output {list(before or ())} at {length} tokens is "
            f"{list(bad.output or ())} at {length - 1}: its axis of {length} does not follow "
            "the sequence length, so it is a width, not the token axis; token ids are scored "
            "per token: name a module with one coefficient set per token [B, T, ...], or "
            f"audit per-example coefficients on {OTHER_INPUTS}") from bad.error
    except Exception:  # noqa: BLE001 - a model that needs exactly T tokens: equality stands
        return


def _refuse_blocks(setup: Prepared, sites: Sequence[Site], seen: dict[str, Seen]) -> None:
    """A site that is one of the execution blocks and outputs the hidden states it reads
    (:func:`_hidden`) is that block, not a controller (a block that outputs a gate, as a
    toy's may, is audited)."""
    blocks = set(setup.blocks or [])
    inside = next((s for s in sites if s.path in blocks and _hidden(seen.get(s.name))), None)
    if inside is not None:
        raise UsageError(
            f"site {inside.name} is one of the model's execution blocks and outputs the hidden "
            f"states it reads {list(seen[inside.name].shape)}, not a controller's "
            "coefficients; name the controller inside the block (`fcaudit sites --model SPEC "
            "--all` lists the modules and marks likely controllers)")


def _lines(sites: Sequence[Site], notes: dict[str, str]) -> list[str]:
    """One line per family that has something to say: how its layout was found (inputs
    other than token ids) and whether its coefficients look like hidden states."""
    lines = []
    for family in dict.fromkeys(s.family for s in sites):
        members = [s for s in sites if s.family == family]
        said = next((s for s in members if notes[s.name]), None)
        if said is not None:
            lines.append(f"sites {family} ({len(members)}, e.g. {said.name}): {notes[said.name]}")
    return lines


def _hidden(seen: Seen | None) -> str:
    """A warning when the coefficients have exactly the shape of the hidden states the
    module reads (``[B, T, d]``, ``d`` > 1) and values outside [0, 1]: a block's output."""
    if seen is None or seen.flat or seen.shape != seen.read or len(seen.shape) < 3 or \
            seen.shape[-1] == 1 or seen.unit_range:
        return ""
    return (f"warning: its coefficients {list(seen.shape)} have exactly the shape of the "
            "hidden states it reads and values outside [0, 1]: a glob that matches whole "
            "blocks (an MLP, an attention, a layer) audits their outputs as coefficients; "
            "name the gate or router inside unless this is a feature-wise gate (`fcaudit "
            "sites --model SPEC --all` marks likely controllers)")
