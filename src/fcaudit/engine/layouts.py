"""Each undeclared site's coefficient layout, and every site's kind, decided on the first
batch before any pass of the audit reads them.

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

The same pass watches what each coefficient scales (:class:`~fcaudit.core.candidates.
ScalingWatch`), so every site gets its :mod:`kind <fcaudit.core.kinds>` (a gate, an
activation, mixing weights, ...) as ``fcaudit sites`` judges it, said once per family
before the work. A site whose coefficients are the hidden states it read (values outside
[0, 1], scaling nothing as an activation does) is refused when it is one of the execution
blocks (it is the block, its output the hidden state), and otherwise audited under the
kind that says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fcaudit.core.adapters import FLAT, AutoAdapter, infer_adapter
from fcaudit.core.arrays import blamed_on_inputs
from fcaudit.core.candidates import Scaling, ScalingWatch
from fcaudit.core.contract import Site, SiteCall, TensorAdapter
from fcaudit.core.errors import FcauditError, UsageError
from fcaudit.core.hooks import hooks
from fcaudit.core.kinds import (
    HIDDEN,
    Evidence,
    Kind,
    classify,
    declared_kind,
    in_unit_range,
    read_shape,
    trailing_axes,
)
from fcaudit.core.layout import TOKEN_AXES, TOKEN_LAYOUT, canonical_sites, decide_layout
from fcaudit.engine.options import Prepared
from fcaudit.engine.passes import batch_shape
from fcaudit.io.examples import OTHER_INPUTS, ExampleBatch, call_model

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Seen:
    """One site on one pass: its coefficients' shape (``flat``: rows ``[B*P, ...]``
    viewed as ``[B, P, ...]``), the shape of the tensor it reads and of its output,
    whether every coefficient lies in [0, 1], and what of them scales another branch."""

    shape: Shape
    read: Shape | None
    output: Shape | None
    flat: bool
    unit_range: bool
    scaling: Scaling | None = None

    def evidence(self, positions: Sequence[int] | None) -> Evidence:
        """What :func:`~fcaudit.core.kinds.classify` judges the site's kind from."""
        return Evidence(self.shape, trailing_axes(self.shape, positions),
                        None if self.flat else self.read, self.unit_range, self.scaling)


class _Misfit(Exception):
    """A site's adapter did not fit its output on a look: stops that pass at once (the
    model would go on with an output it cannot use)."""

    def __init__(self, site: Site, module: nn.Module, output: Shape | None,
                 error: FcauditError) -> None:
        super().__init__(f"{error}")
        self.site, self.module, self.output, self.error = site, module, output, error


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
def look(model: nn.Module, sites: Sequence[Site], x: Any,
         lenient: frozenset[str] = frozenset()) -> dict[str, Seen]:
    """One forward pass on ``x`` that only looks at ``sites`` (each site's first call);
    a site in ``lenient`` whose adapter does not fit is left out (its record pass says
    why), any other stops the pass."""
    batch, tokens = batch_shape(x)
    seen: dict[str, Seen] = {}
    watch = ScalingWatch()

    def hook_for(site: Site) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 output: Any) -> None:
            if site.name in seen:
                return  # a second call: recording refuses it with its own message
            read = read_shape(args, kwargs, batch)
            raw = tuple(output.shape) if isinstance(output, Tensor) else None
            positions = tokens if tokens is not None else \
                (read[1] if read is not None and len(read) == 3 else None)
            try:
                coef, flat = _coefficients(site, SiteCall(module, args, kwargs, batch,
                                                          positions), output, tokens is not None)
            except FcauditError as exc:
                if site.name in lenient:
                    return
                raise _Misfit(site, module, raw, exc) from exc
            watch.output(site.name, module, output)
            seen[site.name] = Seen(tuple(coef.shape), read, raw, flat, in_unit_range(coef))
        return hook

    with blamed_on_inputs(lambda: call_model(model, x), x, "the first evaluation batch"), \
            hooks(model, {s.path: hook_for(s) for s in sites}, with_kwargs=True), watch:
        call_model(model, x)
    scales = {} if watch.broken else watch.scales
    return {name: dataclasses.replace(s, scaling=scales.get(name)) for name, s in seen.items()}


def _look_first(model: nn.Module, sites: Sequence[Site], x: Any,
                lenient: frozenset[str] = frozenset()) -> dict[str, Seen]:
    """:func:`look` on the first batch; a site whose output no adapter fits stops the
    audit, naming it (as the record pass would), unless it is ``lenient``."""
    try:
        return look(model, sites, x, lenient)
    except _Misfit as bad:
        adapter = getattr(bad.site.adapter, "name", type(bad.site.adapter).__name__)
        raise UsageError(f"site {bad.site.name} ({type(bad.module).__name__}, adapter "
                         f"{adapter}): {bad.error:}") from bad.error


@dataclass(frozen=True)
class Resolved:
    """The engine's canonical sites, each undeclared one with its layout, how each layout
    was found (site -> note), every site's kind (site -> kind name) and the lines to tell
    the user."""

    sites: list[Site]
    notes: dict[str, str]
    kinds: dict[str, str]
    lines: list[str]


def resolve_layouts(setup: Prepared, x: Any) -> Resolved:
    """Give every undeclared site of ``setup`` its layout and every site its kind, and say
    once per family what kind it is and how its layout was found on inputs other than
    token ids."""
    tokens = batch_shape(x)[1] is not None
    open_sites = [s for s in setup.sites if s.axes is None]
    named = [s for s in setup.sites if tokens and _unproven_token_axis(s)]
    if named:  # declared, but not as the token axis: it must follow the length too
        _prove_token_axis(setup.model, named, x, _look_first(setup.model, named, x))
    looked = [s for s in setup.sites if s.axes is None or declared_kind(s) is None]
    seen = _look_first(setup.model, looked, x, frozenset(
        s.name for s in looked if s.axes is not None)) if looked else {}
    decided = {s.name: _decide(s, seen.get(s.name), tokens) for s in open_sites}
    laid = [decided[s.name][0] if s.name in decided else s for s in setup.sites]
    kinds = {s.name: classify(seen[s.name].evidence(s.positions) if s.name in seen else None,
                              s) for s in laid}
    _refuse_blocks(setup, laid, kinds, seen)
    if tokens and open_sites:
        _prove_token_axis(setup.model, open_sites, x, seen)
    notes = {name: note for name, (_, note) in decided.items() if note}
    return Resolved(canonical_sites(laid), notes, {n: k.name for n, k in kinds.items()},
                    _lines(laid, notes, kinds))


def site_kinds(model: nn.Module, sites: Sequence[Site], x: Any) -> dict[str, Kind]:
    """The kinds of ``sites`` as the audit judges them (one look at the sites whose
    declaration does not say it, on ``x``), for ``fcaudit sites`` to show; a site the look
    could not see (a probe the model refuses) is left out."""
    tokens = batch_shape(x)[1] is not None
    looked = [s for s in sites if declared_kind(s) is None]
    try:
        seen = look(model, looked, x, frozenset(s.name for s in looked)) if looked else {}
    except Exception:  # noqa: BLE001 - a probe the model cannot take: kinds declared only
        seen = {}
    kinds = {}
    for site in sites:
        if site.name not in seen:
            declared = declared_kind(site)
            if declared is not None:
                kinds[site.name] = declared
            continue
        try:  # a site without axes gets the layout the audit would give it
            laid = site if site.axes is not None else _decide(site, seen[site.name], tokens)[0]
        except FcauditError:  # one the audit would ask to declare: its kind waits for it
            continue
        kinds[site.name] = classify(seen[site.name].evidence(laid.positions), laid)
    return kinds


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


def _refuse_blocks(setup: Prepared, sites: Sequence[Site], kinds: dict[str, Kind],
                   seen: dict[str, Seen]) -> None:
    """A site that is one of the execution blocks and whose coefficients are the hidden
    states it reads (:data:`~fcaudit.core.kinds.HIDDEN`) is that block, not a controller
    (a block that outputs a gate, as a toy's may, is audited)."""
    blocks = set(setup.blocks or [])
    inside = next((s for s in sites if s.path in blocks and kinds[s.name] is HIDDEN), None)
    if inside is not None:
        raise UsageError(
            f"site {inside.name} is one of the model's execution blocks and outputs the hidden "
            f"states it reads {list(seen[inside.name].shape)}, not a controller's "
            "coefficients; name the controller inside the block (`fcaudit sites --model SPEC "
            "--all` lists the modules and marks likely controllers)")


def _lines(sites: Sequence[Site], notes: dict[str, str], kinds: dict[str, Kind]) -> list[str]:
    """One line per family: its kind (the judgement ``fcaudit sites`` gives) and, on
    inputs other than token ids, how its layout was found."""
    lines = []
    for family in dict.fromkeys(s.family for s in sites):
        members = [s for s in sites if s.family == family]
        said = next((s for s in members if s.name in notes), members[0])
        lines.append(f"sites {family} ({len(members)}, e.g. {said.name}): "
                     f"{kind_words([kinds[s.name] for s in members])}"
                     + (f"; {notes[said.name]}" if said.name in notes else ""))
    return lines


def kind_words(kinds: Sequence[Kind]) -> str:
    """The kind of a family's sites in words: one kind with its meaning, else each with
    its count."""
    distinct = list(dict.fromkeys(kinds))
    if len(distinct) == 1:
        return f"kind {distinct[0].line()}"
    return "kinds " + ", ".join(f"{k.name} ({kinds.count(k)} sites)" for k in distinct)
