"""Prepare: every check that needs no pass of the audit itself, once, into a frozen
:class:`~fcaudit.engine.options.Prepared`.

Arguments and options, the model and its sites, the user's interventions, the data, the
dense counterpart, the output folder, the process group, then the layout of every site
no one declared (read off the first batch); nothing is written before this passes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fcaudit.core.adapters import FLAT, AutoAdapter, infer_adapter
from fcaudit.core.arrays import blamed_on_inputs
from fcaudit.core.candidates import Scaling, ScalingWatch
from fcaudit.core.contract import Site, SiteCall, TensorAdapter
from fcaudit.core.discovery import declared_experts
from fcaudit.core.errors import FcauditError, ModelError, UsageError, arg
from fcaudit.core.hooks import hooks
from fcaudit.core.interventions import Intervention
from fcaudit.core.kinds import (
    HIDDEN,
    KINDS,
    Evidence,
    Kind,
    classify,
    declared_kind,
    in_unit_range,
    read_shape,
    trailing_axes,
    twin_note,
)
from fcaudit.core.layout import (
    TOKEN_AXES,
    TOKEN_LAYOUT,
    SiteAxes,
    canonical_sites,
    decide_layout,
    declare_axes,
)
from fcaudit.core.nll import device_of, model_limits
from fcaudit.core.sites import SiteSpec, find_sites
from fcaudit.engine.analyses import before_model
from fcaudit.engine.analyses.routing import routing_sites
from fcaudit.engine.exits import check_twin, with_exit_conditions
from fcaudit.engine.inputs import (
    as_loaded,
    check_arguments,
    check_dense,
    custom_interventions,
    resolve_block_paths,
    resolve_inputs,
    window_line,
)
from fcaudit.engine.objectives import output_tensors
from fcaudit.engine.options import AuditOptions, Prepared, SeedPlan, asked, check_needs
from fcaudit.engine.passes import Ranks, batch_shape, current
from fcaudit.engine.probe import first_batch
from fcaudit.engine.result import ExecutionSection, NotMeasured
from fcaudit.io.data import AuditData, DataSpec
from fcaudit.io.examples import OTHER_INPUTS, ExampleBatch, Examples, call_model
from fcaudit.io.hf_exit import HEADS_NOTE, KIND, with_early_exit
from fcaudit.io.loading import LoadedModel, release
from fcaudit.io.runtime import untested_versions


@dataclass(frozen=True)
class AuditRequest:
    """What one audit is asked for: :func:`fcaudit.audit`'s arguments as its caller gave
    them (that function says what each means), so the engine takes one value instead of
    spelling the signature again; :func:`prepare` checks every one."""

    model: Any
    out: str | Path | None = None
    sites: SiteSpec = None
    data: DataSpec | AuditData = field(default_factory=DataSpec)
    dense: Any = None
    blocks: str | None = None
    options: AuditOptions = field(default_factory=AuditOptions)
    interventions: Mapping[str, Any] | Sequence[Intervention] | None = None
    command: str | None = None  # the command line that asked (None: a Python call)
    site_axes: SiteAxes = None


def prepare(request: AuditRequest, ranks: Ranks | None = None) -> Prepared:
    """Every check that does not need a forward pass of the audit itself; the notes say
    how long the scored windows are and how undeclared layouts were found."""
    dense, blocks, options = request.dense, request.blocks, request.options
    sites = check_arguments(request.sites, request.data, blocks, options)
    options.validate()
    check_dense(dense, options)
    before = before_model(options)  # e.g. benchmark tasks: refused before the model loads
    loaded = as_loaded(request.model, placement=options.placement(), serving=options.serving())
    try:
        return dataclasses.replace(_prepared(request, loaded, sites, ranks), before=before)
    except BaseException:
        if isinstance(request.model, (str, Path)):  # loaded here: released here
            release(loaded.model)
        raise


def _prepared(request: AuditRequest, loaded: LoadedModel, sites: SiteSpec,
              ranks: Ranks | None) -> Prepared:
    """:func:`prepare` once the model is loaded."""
    dense, blocks, options = request.dense, request.blocks, request.options
    if options.early_exit:
        loaded = with_early_exit(loaded, options.exit_threshold)
    net = loaded.model.eval()
    site_list = declare_axes(find_sites(net, sites), request.site_axes)
    check_needs(options, sites=site_list)  # the needs a model may meet (exit models' sweep)
    conditions = with_exit_conditions(options.conditions, site_list, net)
    # before the first forward pass
    custom = custom_interventions(request.interventions, site_list, conditions)
    block_paths = resolve_block_paths(net, blocks)  # for execution and prefix reuse
    audit_data, objective = resolve_inputs(loaded, request.data, options, site_list)
    twin, twin_source = dense_counterpart(net, audit_data, SeedPlan(options.seed), dense,
                                          blocks) if options.execution else (None, "")
    if twin is None and options.execution and asked(options, "timing_pairs") and \
            _elsewhere(net) is None:  # a served model's timing is of its controllers
        raise UsageError(f"{arg('timing_pairs', options.timing_pairs, owner='AuditOptions')}"
                         " times the model against its dense counterpart, and it has none: "
                         f"give one ({arg('dense')}) or drop {arg('timing_pairs')}",
                         option="timing_pairs")
    setup = Prepared(loaded, site_list, block_paths, blocks, audit_data, options, custom,
                     conditions, objective, audit_data.checked().summary(), twin, twin_source,
                     out=Path(request.out) if request.out is not None else None)
    if setup.out is not None:
        from fcaudit.io.outdir import check_output
        check_output(setup.out, "audit")
    _check_ranks(setup, ranks or current())
    check_twin(setup)
    layouts = resolve_layouts(setup, first_batch(setup))
    return dataclasses.replace(setup, sites=layouts.sites, layouts=layouts.notes,
                               kinds=layouts.kinds,
                               notes=(window_line(setup.data_summary), *layouts.lines,
                                      *(f"note: {line}" for line in loaded.notes),
                                      *([f"note: {HEADS_NOTE}"] if loaded.kind == KIND else []),
                                      *(f"warning: {line}" for line in untested_versions())))


def _check_ranks(setup: Prepared, ranks: Ranks) -> None:
    """An audit over several processes shares its cache through a folder, and a
    ``target_ci`` audit runs in one process."""
    if setup.out is None and ranks.world > 1:
        raise UsageError(f"an audit over several processes needs {arg('out')}, a folder "
                         "every process sees")
    if setup.options.target_ci is not None and ranks.world > 1:
        raise UsageError(f"{arg('target_ci', owner='AuditOptions')} runs in one process: "
                         "start it without torchrun, or give a fixed number of sequences")


# ---------------------------------------------------------------------- twin
# The dense counterpart: loaded and checked before any recording, and the execution
# audit that prices the model against it.
#
# A twin is either given (``--dense``) or built from the model's declared architecture
# with fresh seeded weights; a given one must take the model's inputs and give outputs of
# its shape (and, on token ids, cover their vocabulary).

def dense_counterpart(net: nn.Module, data: AuditData, seeds: SeedPlan, dense: Any,
                      blocks: str | None) -> tuple[nn.Module | None, str]:
    """The dense counterpart and where it came from, loaded and probed now (a bad --dense,
    or an ``execution_mode`` that is no string, fails before recording)."""
    from fcaudit.core.contract import dense_twin, execution_mode
    execution_mode(net)
    if dense is None:
        twin = dense_twin(net, seeds.dense_twin)
        execution_mode(twin)
        if twin is None:
            return None, ""
        resolve_block_paths(twin, blocks, f"the dense counterpart that {type(net).__name__}"
                                          ".dense_counterpart() built")
        return twin, "built from the model's architecture (dense_counterpart, fresh weights)"
    twin = as_loaded(dense).model
    param = next(net.parameters(), None)
    if param is not None:
        twin = twin.to(dtype=param.dtype, device=device_of(net))
    twin.eval()
    inputs = data.checked()
    if not inputs.next_token:  # token windows are checked against its vocabulary too
        _comparable_examples(net, inputs.eval_source, twin, str(dense))
    else:
        _comparable_tokens(net, inputs.eval_source[:1], twin, dense)
    resolve_block_paths(twin, blocks, f"the dense counterpart {arg('dense', str(dense))}")
    execution_mode(twin)
    return twin, str(dense)


def _comparable_tokens(net: nn.Module, first: np.ndarray, twin: nn.Module, dense: Any) -> None:
    """A dense counterpart must know every id of the first sequence and give logits of
    the model's shape on it."""
    ids = torch.from_numpy(first).to(device_of(net))
    vocab, _ = model_limits(twin)
    if vocab is not None and int(ids.max()) >= vocab:
        raise ModelError(f"{arg('dense', dense)}: its vocabulary has {vocab} entries but the "
                         f"evaluation token ids reach {int(ids.max())}; give a dense model "
                         "with the same tokenizer")
    from fcaudit.engine.execution import check_comparable
    check_comparable(net, twin, ids, str(dense))


@torch.no_grad()
def _comparable_examples(model: nn.Module, examples: Examples, twin: nn.Module,
                         source: str) -> None:
    """A dense counterpart must give outputs of the model's shape on the same example."""
    x = examples.rows(0, 1).to(device_of(model))
    shapes = []
    for net, what in ((model, "the first evaluation example"),
                      (twin, f"the first evaluation example, as {arg('dense', source)}")):
        with blamed_on_inputs(lambda net=net: call_model(net, x), x, what):
            out = output_tensors(call_model(net, x))
        shapes.append(list(out.shape) if isinstance(out, Tensor) else type(out).__name__)
    if shapes[0] != shapes[1]:
        raise ModelError(f"{arg('dense', source)} is not comparable with the model: on the "
                         f"same example it gives {shapes[1]}, the model {shapes[0]}; give "
                         "a dense model with the model's inputs and outputs")


def missing_twin(setup: Prepared) -> str:
    """What a dense counterpart would be for this model's sites (by their kinds), or why
    none exists (:func:`fcaudit.core.kinds.twin_note`)."""
    return twin_note(KINDS[setup.kinds[s.name]] for s in setup.sites if s.name in setup.kinds)


def _elsewhere(model: nn.Module) -> str | None:
    """Why a model that runs elsewhere (an engine serving it) cannot have its execution
    counted here (its ``execution_note``); None for a model that runs here."""
    note = getattr(model, "execution_note", None)
    return note if isinstance(note, str) else None


def runs_elsewhere(setup: Prepared) -> bool:
    """The execution audit is on and the model runs elsewhere: it is timed against its
    controllers supplied instead, when timing is on."""
    return setup.options.execution and _elsewhere(setup.model) is not None


def not_measured(setup: Prepared) -> str | None:
    """Why this audit measures no execution (None: it does): disabled, or blocks nobody
    declared. Without a dense counterpart the model's own blocks and FLOPs are counted.
    The plan counts the execution passes by it too."""
    if not setup.options.execution:
        return "disabled (--no-execution)"
    if runs_elsewhere(setup):
        return _elsewhere(setup.model)
    dense_blocks = resolve_block_paths(setup.dense, setup.blocks_glob) \
        if setup.dense is not None else []
    if setup.blocks is not None and dense_blocks is not None:
        return None
    if setup.dense is None and not declared_experts(setup.model):
        return (f"{missing_twin(setup)}; and the model's blocks are not known, so none can be "
                "counted on the model itself: pass --blocks GLOB (e.g. 'layers.*')")
    return "the model does not declare its blocks: pass --blocks GLOB (e.g. 'layers.*')"


def execute(setup: Prepared, degenerate: str | None = None) -> ExecutionSection:
    """The execution section: counts, FLOPs and (with timing pairs) latency vs dense, or
    without a dense counterpart counts and FLOPs on the model alone, with what a twin
    would be; for a routed model, the experts that ran. ``degenerate``: the exit rule's
    note when it stops every unit at one layer, so that no saving and no conditional
    execution is counted for it."""
    from fcaudit.engine.execution import controller_cost, measure_execution
    opts = setup.options
    reason = not_measured(setup)
    if reason is not None:
        if not runs_elsewhere(setup) or not opts.timing_pairs:
            return NotMeasured(reason)
        x = setup.inputs.execution_inputs(device_of(setup.model))[:opts.batch_size]
        return NotMeasured(reason, controller_cost=controller_cost(
            setup.model, setup.sites, x, opts.timing_pairs, seed=setup.seeds.timing))
    experts = declared_experts(setup.model) or []
    dense_blocks = resolve_block_paths(setup.dense, setup.blocks_glob) \
        if setup.dense is not None else []
    x = setup.inputs.execution_inputs(device_of(setup.model))
    routers = {s.name: s for s in routing_sites(setup.sites)}
    measured = measure_execution(
        setup.model, setup.dense, x, batch_size=opts.batch_size, block_paths=setup.blocks,
        dense_block_paths=dense_blocks or None, pairs=opts.timing_pairs, seed=setup.seeds.timing,
        timing=opts.timing_pairs > 0, dense_source=setup.dense_source or None,
        experts=[e for e in experts if e.name in routers], routers=routers,
        gated=[s.gate.gated for s in setup.sites if s.gate.gated], degenerate=degenerate)
    return dataclasses.replace(measured, unit=setup.inputs.execution_unit,
                               twin_note=missing_twin(setup) if setup.dense is None else None)


# ---------------------------------------------------------------------- layouts
# Each undeclared site's coefficient layout, and every site's kind, decided on the first
# batch before any pass of the audit reads them.
#
# A site named by a glob (or a ``Site`` without ``axes``) says nothing about which axis of
# its coefficients holds positions, and guessing axis 1 reads a squeeze-and-excitation
# gate ``[B, C]`` as ``C`` positions: shuffle would permute channels and call it tokens.
# So one pass that only looks (the hooks return nothing) records every such site's
# coefficient shape and the shape of what the module reads, and
# :func:`~fcaudit.core.layout.decide_layout` accepts a position axis only where it is
# proven. On token ids the coefficients must be ``[B, T, ...]`` (or ``[B*T, ...]``), and
# the proof is a second look at the batch cut one token short: a token axis follows the
# length, a width ``d`` that happens to equal ``T`` does not (a model that refuses the
# shorter batch keeps the equality as its proof).
#
# The same pass watches what each coefficient scales (:class:`~fcaudit.core.candidates.
# ScalingWatch`), so every site gets its :mod:`kind <fcaudit.core.kinds>` (a gate, an
# activation, mixing weights, ...) as ``fcaudit sites`` judges it, said once per family
# before the work. A site whose coefficients are the hidden states it read (values outside
# [0, 1], scaling nothing as an activation does) is refused when it is one of the execution
# blocks (it is the block, its output the hidden state), and otherwise audited under the
# kind that says so.

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
