"""The Frozen Controller Audit, in stages with plain data between them.

    prepare  -> validate every option and input, load models, resolve sites and data,
                check the output folder (nothing is written before this passes)
    probe    -> record and replay the first batch in memory: adapters, call counts and
                the identity replay are checked before any real work
    record   -> calibration sums and evaluation coefficients into the on-disk cache
    plan     -> the replay runs (the conditions of docs/method.md, per-layer variants, yours)
    replay   -> every run on every batch, batch by batch (resumable), identity checked
    summarize-> penalties, retention, interaction with paired bootstrap intervals
    describe -> variance decomposition, variation, profiles of the cached coefficients
    execute  -> blocks, FLOPs and latency against the dense counterpart
    verdicts -> one sentence per question
    assemble -> an :class:`~fcaudit.engine.result.AuditResult` (and, with an output folder, the
                report and audit.json)

Progress is reported through an optional callback ``progress(stage, done, total, info)``.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fcaudit._version import __version__
from fcaudit.core.adapters import adapter_name, same_bits
from fcaudit.core.arrays import blamed_on_inputs
from fcaudit.core.contract import Site
from fcaudit.core.discovery import declared_blocks, declared_experts
from fcaudit.core.errors import FcauditError, arg
from fcaudit.core.errors import render as for_reader
from fcaudit.core.interventions import Intervention, draw
from fcaudit.core.layout import (
    TOKEN_AXES,
    TOKEN_LAYOUT,
    SiteAxes,
    check_family_positions,
    declare_axes,
    not_applicable,
    shuffled_axes,
    spell_axes,
)
from fcaudit.core.nll import device_of, logits_of, model_limits, probe_vocab
from fcaudit.core.sites import SiteSpec, find_sites, match_modules
from fcaudit.engine.cache import CoefficientCache
from fcaudit.engine.cost import check_disk, free_bytes, record_cost, replay_line
from fcaudit.engine.distributed import SINGLE as SINGLE_RANK
from fcaudit.engine.distributed import Ranks, current
from fcaudit.engine.frontier import (
    GATE,
    Covered,
    FrontierPoint,
    frontier_families,
    frontier_summary,
    own_point,
    own_thresholds,
    plan_points,
    skipped_units,
)
from fcaudit.engine.layouts import resolve_layouts
from fcaudit.engine.objectives import UNREADABLE, check_targets, output_tensors, resolve
from fcaudit.engine.options import AuditOptions, Progress, Setup, silent
from fcaudit.engine.passes import (
    batches,
    check_finite,
    check_finite_losses,
    check_units,
    record_batch,
    replay_batch,
)
from fcaudit.engine.plan import (
    EXPERT_ABLATION,
    FRONTIER,
    ReplayInputs,
    ablation_experts,
    ablation_runs,
    digest_tensors,
    frontier_runs,
    plan_runs,
    routing_sites,
    tracked_runs,
)
from fcaudit.engine.result import (
    MAIN_CONDITIONS,
    NONDETERMINISTIC_KEYS,
    PER_LAYER_CONDITIONS,
    SCHEMA,
    TIMED_VERDICT_KEY,
    AuditResult,
    Execution,
    Identity,
    ModelInfo,
    Runtime,
    Seeds,
    SiteInfo,
)
from fcaudit.engine.stages import (
    ALLOW_NONEXACT,
    IDENTITY_CAUSES,
    adopt_probe,
    calibration_profiles,
    calibration_shard,
    eval_shard,
    frontier_calibration,
    record_calibration,
    record_evaluation,
    record_frontier_calibration,
    replay_results,
    replay_stage,
)
from fcaudit.engine.summary import (
    Summary,
    accuracies,
    describe,
    expert_importance,
    paired_bootstrap,
    routing_summary,
    summarize,
    token_profile,
)
from fcaudit.engine.verdicts import judge
from fcaudit.io.data import AuditData, DataSpec, picked_note, resolve_data
from fcaudit.io.digits import run_audit_data
from fcaudit.io.examples import OTHER_INPUTS, ExampleBatch, call_model
from fcaudit.io.loading import LoadedModel, get_arch, input_spec, load, load_module
from fcaudit.io.placement import PLACEMENT, Placement, offload_space
from fcaudit.io.runtime import host, versions

__all__ = ["AuditOptions", "audit"]

Renderer = Callable[[AuditResult, Path], None]  # writes the human-readable report


def as_loaded(model: str | Path | nn.Module | LoadedModel,
              dtype: torch.dtype | None = None,
              placement: Placement | None = None) -> LoadedModel:
    if isinstance(model, LoadedModel):
        return model
    if isinstance(model, nn.Module):
        if placement is not None:
            raise FcauditError(f"{arg('device_map', placement.device_map)} places a model "
                               "fcaudit loads from a folder; give the folder's path, not a "
                               "module already in memory")
        return load_module(model, type(model).__name__)
    return load(str(model), dtype, placement)


def resolve_block_paths(model: nn.Module, pattern: str | None) -> list[str] | None:
    if pattern is not None:
        return match_modules(model, pattern, "blocks", "blocks.*")
    return declared_blocks(model)


def _interventions(given: Mapping[str, Any] | Sequence[Intervention] | None,
                   sites: Sequence[Site]) -> list[Intervention]:
    """The user's interventions, each with a name no other run of the audit has (results
    are keyed by name: two runs under one name would be merged into one condition)."""
    if not given:
        return []
    if isinstance(given, Mapping):
        items = list(given.items())
    elif isinstance(given, (list, tuple)) and all(isinstance(i, Intervention) for i in given):
        items = [(i.name, i) for i in given]
    else:
        raise FcauditError("audit(interventions=...) must be {name: fn} or a list of "
                           f"fcaudit.Intervention objects, not {given!r:.80}")
    builtin = {*MAIN_CONDITIONS, *(f"{c}@{s.name}" for c in PER_LAYER_CONDITIONS for s in sites)}
    out: list[Intervention] = []
    for name, item in items:
        iv = item if isinstance(item, Intervention) else Intervention(str(name), item)
        if isinstance(iv.name, str) and iv.name in {o.name for o in out}:
            raise FcauditError(f"two interventions are named {iv.name!r}: give each its own "
                               "name (results are reported by name, so both would be merged "
                               "into one condition)")
        if not isinstance(iv.name, str) or not iv.name or iv.name in builtin or \
                iv.name.startswith((f"{EXPERT_ABLATION}:", f"{FRONTIER}:")) or \
                not callable(iv.fn) or isinstance(iv.repeats, bool) or \
                not isinstance(iv.repeats, int) or iv.repeats < 1:
            raise FcauditError(f"intervention {iv.name!r}: give a new name (not a built-in "
                               "condition or per-layer run), a callable and repeats >= 1")
        out.append(iv)
    return out


def _check_arguments(sites: Any, data: Any, blocks: Any, options: Any) -> SiteSpec:
    """A Python caller's arguments of the wrong kind, each refused in one line naming the
    argument; a single glob string for ``sites`` is taken as one glob."""
    if not isinstance(options, AuditOptions):
        raise FcauditError(f"audit(options=...) must be fcaudit.AuditOptions(...), not "
                           f"{type(options).__name__}")
    if not isinstance(data, (AuditData, DataSpec)):
        raise FcauditError(f"audit(data=...) must be fcaudit.DataSpec(...) or "
                           f"fcaudit.AuditData(...), not {type(data).__name__}")
    if blocks is not None and not isinstance(blocks, str):
        raise FcauditError(f"audit(blocks=...) must be one module-path glob string, not "
                           f"{type(blocks).__name__}")
    if isinstance(sites, str):
        return [sites]
    if sites is not None and (not isinstance(sites, (list, tuple)) or not sites
                              or not all(isinstance(s, (str, Site)) for s in sites)):
        raise FcauditError(f"audit(sites=...) must be a non-empty list of module-path globs "
                           f"or fcaudit.Site objects, not {sites!r:.80}")
    return sites


def prepare(model: Any, out: str | Path | None, *, sites: SiteSpec, data: DataSpec | AuditData,
            dense: Any, blocks: str | None, options: AuditOptions,
            interventions: Any, site_axes: SiteAxes = None) -> Setup:
    """Every check that does not need a forward pass of the audit itself."""
    sites = _check_arguments(sites, data, blocks, options)
    options.validate()
    if dense is not None and not options.execution:
        no_execution = arg("execution", py="AuditOptions(execution=False)", cli="--no-execution")
        raise FcauditError(f"{arg('dense')} is ignored with {no_execution} (the dense "
                           "counterpart only serves the execution audit): drop one of them")
    loaded = as_loaded(model, placement=options.placement())
    net = loaded.model.eval()
    site_list = declare_axes(find_sites(net, sites), site_axes)
    custom = _interventions(interventions, site_list)  # before the first forward pass
    block_paths = resolve_block_paths(net, blocks)  # for execution and prefix reuse
    default_len, default_why = loaded_seq_len(loaded)
    vision = bool(loaded.run_config) and get_arch(loaded.run_config["arch"]).task == "vision"
    if vision and options.objective == "token-nll":  # the default: a run knows its task
        options = dataclasses.replace(options, objective="classification")
    if isinstance(data, AuditData):
        audit_data = data
    elif vision:  # a vision run: its own digits, in the dtype the model computes in
        audit_data = run_audit_data(data, loaded.spec, next(net.parameters()).dtype)
    else:
        audit_data = resolve_data(loaded.tokenizer, data, default_len)
    audit_data.check_arrays()
    if not audit_data.tokens:
        return _prepare_examples(loaded, out, site_list, audit_data, options, custom, blocks,
                                 block_paths, dense)
    if options.objective == "classification" or any(
            s.positions not in (None, TOKEN_LAYOUT) for s in site_list):
        raise FcauditError(
            "token ids are scored by next-token NLL on sites [batch, tokens, ...]: for "
            f"{arg('objective', 'classification', owner='AuditOptions')} or sites without a "
            f"token axis give {OTHER_INPUTS}")
    if "seq_len_source" not in audit_data.sources:  # a copy: the caller's data stays as given
        audit_data = dataclasses.replace(audit_data, sources={
            **audit_data.sources, "seq_len_source": window_source(data, default_why)})
    vocab, ctx = model_limits(net)
    if vocab is None:
        vocab = probe_vocab(net, audit_data.eval_ids.shape[1])
    audit_data.validate(vocab, ctx)
    if options.target_ci is not None:  # the floor is checked against the pool, then ordered
        from fcaudit.engine.stopping import min_sequences, ordered_pool
        min_sequences(options.min_sequences, len(audit_data.eval_ids))
        audit_data = ordered_pool(audit_data, options.seed)
    setup = Setup(loaded, site_list, block_paths, blocks, audit_data, options,
                  custom, out=Path(out) if out is not None else None)
    if options.execution:
        setup.dense, setup.dense_source = _dense(setup, dense, blocks)
    if setup.out is not None:
        from fcaudit.io.outdir import check_output
        check_output(setup.out, "audit")
    return setup


# inputs that are not token ids, in the caller's words


def _prepare_examples(loaded: LoadedModel, out: str | Path | None, sites: list[Site],
                      data: AuditData, options: AuditOptions, custom: list[Intervention],
                      blocks: str | None, block_paths: list[str] | None, dense: Any) -> Setup:
    """:func:`prepare` for inputs that are not token ids (``AuditData(inputs=...)``)."""
    objective = resolve(options.objective)
    if objective.tokens:
        raise FcauditError(
            f"{arg('objective', 'token-nll', owner='AuditOptions')} scores token ids, but the "
            f"data are other inputs: choose {arg('objective', 'classification')} (integer "
            "targets) or a callable (model_output, batch) -> per-unit losses, or give token "
            "ids as AuditData(eval_ids=..., calib_ids=...)")
    if options.frontier:
        raise FcauditError(f"{arg(FRONTIER, py='AuditOptions(frontier=True)')} is measured "
                           "on token inputs only; drop it for these inputs")
    if options.target_ci is not None:
        raise FcauditError(f"{arg('target_ci', py='AuditOptions(target_ci=...)')} grows a pool "
                           "of token windows; for these inputs give a fixed evaluation set")
    data.check_inputs(input_spec(loaded))
    data.validate(None, None)
    setup = Setup(loaded, sites, block_paths, blocks, data, options, custom,
                  out=Path(out) if out is not None else None)
    if options.execution:
        setup.dense, setup.dense_source = _dense(setup, dense, blocks)
    if setup.out is not None:
        from fcaudit.io.outdir import check_output
        check_output(setup.out, "audit")
    return setup


DEFAULT_WINDOW = 256  # tokens, for a model whose training length fcaudit does not know


def loaded_seq_len(loaded: LoadedModel) -> tuple[int, str]:
    """The default window and where it comes from: the run's training length, or 256
    capped by the model's context."""
    train_cfg = (loaded.run_config or {}).get("train")
    if isinstance(train_cfg, dict) and isinstance(train_cfg.get("seq_len"), int):
        return int(train_cfg["seq_len"]), "the run's training length"
    _, ctx = model_limits(loaded.model)
    what = "a Hugging Face folder" if loaded.kind.startswith("hf") else \
        "a model without a training run"
    if not ctx:
        return DEFAULT_WINDOW, f"default for {what}: {DEFAULT_WINDOW}, the model states no context"
    return min(DEFAULT_WINDOW, ctx), f"default for {what}: min({DEFAULT_WINDOW}, context {ctx})"


GIVEN_DATA = "the AuditData given"
TOKEN_WIDTH = "the width of the --tokens arrays"  # which --seq-len cannot change


def window_source(data: DataSpec | AuditData, default: str) -> str:
    """Where the scoring window's length came from, in words (audit.json data section)."""
    if isinstance(data, AuditData):
        return GIVEN_DATA
    if data.tokens is not None:
        return TOKEN_WIDTH
    return "--seq-len" if data.seq_len is not None else default


def window_line(data: Mapping[str, Any]) -> str:
    """One line saying how long the scored windows are and why, for the start of an audit
    and its summary (a model scored past its training length scores differently); its
    option is rendered for its reader (:func:`fcaudit.core.errors.render`)."""
    picked = picked_note(data, for_api=True)
    picked = f"; {picked}" if picked else ""
    if "eval_examples" in data:
        return (f"scoring {data['eval_examples']} evaluation examples "
                f"({data['calib_examples']} calibrate the static profiles){picked}")
    source = data.get("seq_len_source", "source not recorded")
    change = "" if source == GIVEN_DATA else "; re-cut the arrays to change" \
        if source == TOKEN_WIDTH else f"; {arg('seq_len', owner='DataSpec')} to change"
    return f"scoring windows of {data['seq_len']} tokens ({source}{change}){picked}"


def _dense(setup: Setup, dense: Any, blocks: str | None) -> tuple[nn.Module | None, str]:
    """The dense counterpart, loaded and probed now (a bad --dense fails before recording)."""
    from fcaudit.core.contract import dense_twin
    net = setup.model
    if dense is None:
        twin = dense_twin(net, setup.options.seed)
        return twin, ("built from the model's architecture (dense_counterpart, fresh "
                      "weights)" if twin is not None else "")
    twin = as_loaded(dense).model
    param = next(net.parameters(), None)
    if param is not None:
        twin = twin.to(dtype=param.dtype, device=device_of(net))
    twin.eval()
    if not setup.data.tokens:
        _comparable_examples(setup, twin, str(dense))
        resolve_block_paths(twin, blocks)
        return twin, str(dense)
    ids = torch.from_numpy(setup.data.eval_ids[:1]).to(device_of(net))
    vocab, _ = model_limits(twin)
    if vocab is not None and int(ids.max()) >= vocab:
        raise FcauditError(f"{arg('dense', dense)}: its vocabulary has {vocab} entries but the "
                           f"evaluation token ids reach {int(ids.max())}; give a dense model "
                           "with the same tokenizer")
    from fcaudit.engine.execution import check_comparable
    check_comparable(net, twin, ids, str(dense))
    resolve_block_paths(twin, blocks)
    return twin, str(dense)


@torch.no_grad()
def _comparable_examples(setup: Setup, twin: nn.Module, source: str) -> None:
    """A dense counterpart must give outputs of the model's shape on the same example."""
    assert setup.data.examples is not None
    x = setup.data.examples.rows(0, 1).to(device_of(setup.model))
    shapes = []
    for net, what in ((setup.model, "the first evaluation example"),
                      (twin, f"the first evaluation example, as {arg('dense', source)}")):
        with blamed_on_inputs(lambda net=net: call_model(net, x), x, what):
            out = output_tensors(call_model(net, x))
        shapes.append(list(out.shape) if isinstance(out, Tensor) else type(out).__name__)
    if shapes[0] != shapes[1]:
        raise FcauditError(f"{arg('dense', source)} is not comparable with the model: on the "
                           f"same example it gives {shapes[1]}, the model {shapes[0]}; give "
                           "a dense model with the model's inputs and outputs")


@dataclass
class Probe:
    """The first evaluation batch, recorded and replayed in memory."""

    identity: Identity
    coefficients: dict[str, Tensor]
    nll: Tensor
    hits: Tensor | None = None  # classification: 1 per correctly classified example


def first_batch(setup: Setup) -> Any:
    """The first evaluation batch, on the model's device."""
    return next(batches(setup.eval_source, setup.options.batch_size, device_of(setup.model)))[1]


@torch.no_grad()
def probe(setup: Setup) -> Probe:
    """Record and replay the first evaluation batch in memory, before anything is written.

    Sites that run twice, outputs no adapter fits, non-floating coefficients, targets the
    objective cannot score and a non-exact identity replay all stop the audit here (the
    last one unless ``allow_nonexact_identity``), naming the site and the likely causes.
    """
    net, sites, objective = setup.model, setup.sites, setup.objective
    x = first_batch(setup)
    with blamed_on_inputs(lambda: call_model(net, x), x, "the first evaluation batch"):
        if objective.accuracy:  # every target against the logits' classes, before any score
            _check_targets(setup, record_batch(net, sites, x, None)[0])
        logits, coefficients, nll = record_batch(net, sites, x, objective)
    check_finite(coefficients, "evaluation data")  # before any file is written
    check_finite_losses(nll, objective, "the unperturbed record pass, batch 0")
    check_family_positions(sites, coefficients)
    _check_axes(net, sites, x)
    if setup.blocks_glob is not None and setup.blocks is not None:
        from fcaudit.engine.execution import refuse_idle_blocks
        refuse_idle_blocks(setup.blocks_glob, x, {"the model": (net, setup.blocks), **(
            {"the dense model": (setup.dense, resolve_block_paths(
                setup.dense, setup.blocks_glob) or [])} if setup.dense is not None else {})})
    replayed = replay_batch(net, x, {s: coefficients[s.name] for s in sites},
                            objective=objective)
    hits = objective.hits(logits, x)
    if same_bits(logits, replayed.logits):
        return Probe(Identity(True, 0.0, setup.options.allow_nonexact_identity,
                              "identity replay is bitwise exact"), coefficients, nll, hits)
    units = objective.units(replayed.output, x)
    check_units(units, nll.shape, objective, "the identity replay of batch 0")
    diff = float((units - nll).abs().max())
    again, _, _ = record_batch(net, sites, x, objective)
    if not same_bits(logits, again):
        cause = "two unperturbed passes over the same batch already differ: the forward " \
                "pass is not deterministic (dropout, sampling or training mode?)"
    else:
        culprit = _first_nonexact_site(setup, coefficients, x, logits)
        cause = f"replaying site {culprit} alone already changes the output" if culprit \
            else "replaying all sites together changes the output"
    unit = "per-token NLL" if objective.tokens else f"{objective.name} loss"
    message = (f"identity replay is not exact: replaying the recorded coefficients changes "
               f"the {unit} by up to {diff:.3g} nats ({cause}). Likely causes: "
               f"{IDENTITY_CAUSES}")
    if not setup.options.allow_nonexact_identity:
        raise FcauditError(f"{message}. No verdict can rest on such a replay: fix the model "
                           "(model.eval(), fixed seeds, deterministic kernels) or rerun with "
                           f"{ALLOW_NONEXACT} to see the numbers flagged as not exact")
    return Probe(Identity(False, diff, True, message), coefficients, nll, hits)


def _check_targets(setup: Setup, logits: Any) -> None:
    """Every evaluation and calibration target must be one the objective can score
    (classification: an integer class of the first batch's logits)."""
    data, objective = setup.data, setup.objective
    if data.tokens:
        return
    assert data.examples is not None and data.calib_examples is not None
    check_targets(objective, logits, data.examples.targets, "evaluation")
    if data.calib_examples.targets is not None:
        check_targets(objective, logits, data.calib_examples.targets, "calibration")


def _check_axes(net: nn.Module, sites: Sequence[Site], x: Any) -> None:
    """With as many sequences as positions, a ``[positions, batch, ...]`` output has the
    shape of ``[batch, positions, ...]``: record once more with one sequence added (a
    repeat), where the two differ, so that a site with swapped axes is refused now."""
    if isinstance(x, ExampleBatch):  # any axis may equal the batch: always add one
        batch, positions = len(x), None
        bigger = ExampleBatch(_cat_first(x.inputs), None)
    else:
        batch, positions = x.shape
        if batch != positions:
            return
        bigger = torch.cat([x, x[:1]])
    try:
        record_batch(net, sites, bigger, None)
    except FcauditError as exc:
        if positions is None:
            raise FcauditError(
                f"{exc} (with {batch + 1} examples; with {batch} the shape fitted only "
                "because an axis has as many entries as the batch: are the output's axes "
                "swapped? give the site an adapter that puts the examples first)") from exc
        raise FcauditError(
            f"{exc} (with {batch + 1} sequences of {positions} tokens; with {batch} of "
            f"{positions} the shape fitted only because the two counts are equal: are the "
            "output's axes [positions, batch, ...]? give the site an adapter that transposes "
            "them)") from exc


def _cat_first(inputs: Any) -> Any:
    """The batch's inputs with its first example repeated at the end."""
    if isinstance(inputs, dict):
        return {k: torch.cat([v, v[:1]]) for k, v in inputs.items()}
    return torch.cat([inputs, inputs[:1]])


def _first_nonexact_site(setup: Setup, coefficients: dict[str, Tensor], x: Any,
                         logits: Any) -> str | None:
    for site in setup.sites:
        replayed = replay_batch(setup.model, x, {site: coefficients[site.name]},
                                objective=setup.objective)
        if not same_bits(replayed.logits, logits):
            return site.name
    return None


def ablation_plan(setup: Setup, first: Probe) -> dict[Site, int]:
    """The routing sites whose experts are ablated, with their expert counts (the last
    axis of the probe's logits ``[B, T, ..., E]``); an explicit ``expert_ablation`` with
    no such site is refused."""
    experts = {name: int(c.shape[-1]) for name, c in first.coefficients.items() if c.dim() >= 3}
    ablated = ablation_experts(setup.sites, setup.options, experts)
    if setup.options.expert_ablation and not ablated:
        raise FcauditError(f"{arg('expert_ablation', py='AuditOptions(expert_ablation=True)')}"
                           ": the audited sites have no router with per-expert logits [batch, "
                           "positions, experts] (a routing adapter's site); drop the option, "
                           "or audit the model's router sites")
    return ablated


def frontier_plan(setup: Setup, first: Probe) -> list[Covered]:
    """The families the savings frontier covers (none without ``frontier``); a frontier
    asked for a model with no soft-gate or routed family is refused."""
    asked = setup.options.frontier
    if asked is False or (asked is None and not setup.options.execution) or \
            not setup.data.tokens:  # token inputs only (other inputs refuse frontier=True)
        return []
    covered = frontier_families(setup.sites, first.coefficients,
                                declared_experts(setup.model) or [])
    if not covered and asked:
        raise FcauditError(f"{arg(FRONTIER, py='AuditOptions(frontier=True)')}: the audited "
                           "sites have no soft gate (one coefficient per token) and no router "
                           "with declared experts, so nothing could be skipped; drop the "
                           "option")
    return covered


def cache_identity(setup: Setup) -> dict[str, Any]:
    net, data = setup.model, setup.data.summary()
    param = next(net.parameters(), None)
    return {"model": setup.loaded.fingerprint or setup.loaded.spec,
            "model_class": type(net).__name__, "eval_data": data["eval_fingerprint"],
            "calib_data": data["calib_fingerprint"],
            "dtype": str(param.dtype) if param is not None else "unknown",
            "device": device_of(net).type, "sites": [s.name for s in setup.sites],
            "adapters": [getattr(s.adapter, "name", type(s.adapter).__name__)
                         for s in setup.sites],
            "layouts": [spell_axes(s.axes or (), s.positions or ()) for s in setup.sites],
            "objective": setup.objective.identity(),
            "fcaudit": __version__, "torch": torch.__version__,
            "package versions": setup.loaded.packages}


def execute(setup: Setup) -> Execution:
    """The execution section: counts, FLOPs and (with timing pairs) latency vs dense; for a
    routed model, the experts that ran (measured even without a dense counterpart)."""
    from fcaudit.engine.execution import measure_execution
    opts = setup.options
    if not opts.execution:
        return Execution(measured=False, reason="disabled (--no-execution)")
    experts = declared_experts(setup.model) or []
    if setup.dense is None and not experts:
        return Execution(measured=False, reason="no dense counterpart: pass --dense SPEC")
    dense_blocks = resolve_block_paths(setup.dense, setup.blocks_glob) \
        if setup.dense is not None else []
    if setup.blocks is None or dense_blocks is None:
        return Execution(measured=False, reason="the model does not declare its blocks: pass "
                                                "--blocks GLOB (e.g. 'layers.*')")
    x = torch.from_numpy(np.ascontiguousarray(setup.data.eval_ids)).to(device_of(setup.model)) \
        if setup.data.tokens else setup.data.examples
    routers = {s.name: s for s in routing_sites(setup.sites)}
    measured = measure_execution(
        setup.model, setup.dense, x, batch_size=opts.batch_size, block_paths=setup.blocks,
        dense_block_paths=dense_blocks or None, pairs=opts.timing_pairs, seed=opts.seed,
        timing=opts.timing_pairs > 0, dense_source=setup.dense_source or None,
        experts=[e for e in experts if e.name in routers], routers=routers,
        gated=[s.gated for s in setup.sites if s.gated])
    if not setup.data.tokens:
        measured.unit = "example"
    return measured


def _model_info(setup: Setup) -> ModelInfo:
    net, loaded = setup.model, setup.loaded
    param = next(net.parameters(), None)
    return ModelInfo(spec=loaded.spec, kind=loaded.kind, class_=type(net).__name__,
                     arch=(loaded.run_config or {}).get("arch"),
                     n_params=sum(p.numel() for p in net.parameters()),
                     fingerprint=loaded.fingerprint,
                     dtype=str(param.dtype) if param is not None else "unknown",
                     identity_note=loaded.identity_note, packages=loaded.packages or None)


def assemble(setup: Setup, cache: CoefficientCache, summary: Summary, stats: tuple,
             execution: Execution, identity: Identity, command: str | None,
             runtime: Runtime) -> AuditResult:
    variance, spread, profiles = stats[:3]
    opts = setup.options
    seeds = [opts.seed * 1000 + 17 + k for k in range(opts.repeats)]
    verdict, verdict_numbers = judge(variance, spread, summary.conditions, summary.retention,
                                     shuffled_axes(setup.sites), execution, identity)
    timed = execution.timing is not None
    return AuditResult(
        schema=SCHEMA, fcaudit_version=__version__, model=_model_info(setup),
        data=setup.data.summary(),
        sites=[_site_info(s, cache, setup.model, setup.layouts.get(s.name))
               for s in setup.sites],
        identity_replay_max_abs_diff=identity.max_abs_diff, conditions=summary.conditions,
        per_layer=summary.per_layer, retention=summary.retention,
        interaction=summary.interaction, variance=variance, variation=spread,
        profiles=profiles, execution=execution, verdict=verdict,
        verdict_numbers=verdict_numbers,
        seeds=Seeds(opts.seed, seeds, seeds, opts.seed * 1000 + 7),
        # how the audit is shown or scheduled changes no number: not part of its settings;
        # read field by field (``asdict`` deep-copies, and an objective may hold a lock)
        settings={**{f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)
                     if f.name not in ("schedule", "progress", *STOPPING_OPTIONS, *PLACEMENT)},
                  "bootstrap_resamples": opts.bootstrap,
                  "calibration_sequences_used_for_static": setup.data.n_calib,
                  "objective": setup.objective.name,
                  "layer_index": "a site's index within its family",
                  # custom conditions in the order given (audit.json sorts its keys)
                  **({"interventions": list(summary.custom)} if summary.custom else {})},
        versions=versions(), command=command,
        nondeterministic_keys=[*NONDETERMINISTIC_KEYS, *([TIMED_VERDICT_KEY] if timed else [])],
        runtime=runtime,
        identity=None if identity.exact and not identity.allowed_nonexact else identity,
        custom_conditions=summary.custom or None)


# recorded in audit.json's ``stopping`` section, not in ``settings``: a --target-ci audit
# that stopped at N has the settings of the fixed audit of those N sequences
STOPPING_OPTIONS = ("target_ci", "min_sequences")


def _site_info(site: Site, cache: CoefficientCache, model: nn.Module,
               layout: str | None) -> SiteInfo:
    """A site in audit.json: its axes in the model's words when they are not [example,
    token], and how they were found when no one declared them (``layout``)."""
    info = SiteInfo(site.name, site.family, site.layer,
                    list(cache.batch(0, f"site::{site.name}").shape[2:]),
                    _adapter_name(site, model))
    if (site.axes, site.positions) != (TOKEN_AXES, TOKEN_LAYOUT):
        info.axes, info.positions = list(site.axes or ()), list(site.positions or ())
    info.layout = layout
    return info


def _routing(setup: Setup, cache: CoefficientCache, runs: Sequence[Any],
             replays: Any) -> dict[str, Any] | None:
    """The routers' summary; its units are the tokens (patches) each router routes."""
    routed = routing_sites(setup.sites)
    if not routed:
        return None
    units = setup.data.eval_ids.size if setup.data.tokens else \
        setup.data.n_eval * int(cache.batch(0, f"site::{routed[0].name}").shape[1])
    return routing_summary(routed, tracked_runs(runs), replays.route_load,
                           replays.route_changed, units)


def _replay_inputs(setup: Setup, cache: CoefficientCache, profiles: Any,
                   first: Probe) -> ReplayInputs:
    """What feeding the runs needs: one random draw per repeat (a derangement, and position
    permutations for every position count the sites have) and the token ids, if any."""
    opts, lengths = setup.options, _position_counts(setup, first)
    return ReplayInputs(cache, setup.sites, profiles,
                        [draw(opts.seed * 1000 + 17 + k, setup.data.n_eval, lengths[0],
                              lengths[1:]) for k in range(opts.repeats)], opts.seed,
                        setup.data.eval_ids if setup.data.tokens else None)


def _position_counts(setup: Setup, first: Probe) -> list[int]:
    """The position counts of the sites' coefficients, the evaluation windows' first."""
    counts = [int(first.coefficients[s.name].shape[1]) for s in setup.sites]
    if setup.data.tokens:
        return [int(setup.data.eval_ids.shape[1]), *counts]
    return list(dict.fromkeys(counts))


def _original_hits(cache: CoefficientCache) -> np.ndarray:
    """The record pass's correct classifications per example (classification only)."""
    return np.concatenate([cache.batch(b, "hits").numpy() for b in range(cache.n_batches)])


def _adapter_name(site: Site, model: nn.Module) -> str | None:
    name = adapter_name(site.adapter, model.get_submodule(site.path))
    return None if name == "tensor" else name


def audit(model: Any, out: str | Path | None = None, *, sites: SiteSpec = None,
          data: DataSpec | AuditData | None = None, dense: Any = None,
          blocks: str | None = None, options: AuditOptions | None = None,
          interventions: Mapping[str, Any] | Sequence[Intervention] | None = None,
          progress: Progress | None = None, command: str | None = None,
          render: Renderer | None = None, site_axes: SiteAxes = None) -> AuditResult | None:
    """Run the whole Frozen Controller Audit and return its :class:`AuditResult`.

    The public entry is :func:`fcaudit.api.audit`, which also renders the report: this
    layer writes only ``audit.json`` (and calls ``render(result, out)`` first when given),
    so the engine never imports the report layer.

    ``model``: a spec (run folder, checkpoint folder, ``pkg.module:factory``), an
    ``nn.Module`` or a :class:`~fcaudit.io.loading.LoadedModel`. ``out``: the output
    folder (cache, ``audit.json``, report); None runs in a temporary cache and writes
    nothing. ``sites``: module-path globs or :class:`~fcaudit.Site` objects (default:
    the model's declaration). ``site_axes``: the coefficient layout of sites no one
    declared, ``{glob: "example,channel"}`` (a ``*`` after each position axis, e.g.
    ``"example,channel,row*,column*"``); without it such a layout is read off the first
    batch, a position axis only where proven. ``data``: a :class:`DataSpec` (text, token
    arrays or the built-in corpus) or ready :class:`AuditData`. ``interventions``: user-defined
    conditions, ``{name: fn}`` or :class:`~fcaudit.core.interventions.Intervention` objects.

    In a ``torchrun`` process group every rank calls this; rank 0 validates and claims
    ``out`` first, the batches are shared out, and rank 0 alone returns the result
    (the other ranks return None).
    """
    options = AuditOptions() if options is None else options
    place = options.placement() if isinstance(model, (str, Path)) else None
    with offload_space(place, out):  # weights on disk stay readable until the audit ends
        return _audit(model, out, sites=sites, data=data, dense=dense, blocks=blocks,
                      options=options, interventions=interventions, progress=progress,
                      command=command, render=render, site_axes=site_axes)


def _audit(model: Any, out: str | Path | None, *, sites: SiteSpec, data: Any, dense: Any,
           blocks: str | None, options: AuditOptions, interventions: Any,
           progress: Progress | None, command: str | None,
           render: Renderer | None, site_axes: SiteAxes = None) -> AuditResult | None:
    progress = progress or silent
    ranks = current()
    if not ranks.main:
        ranks.barrier(CLAIMED)
    setup = prepare(model, out, sites=sites, data=DataSpec() if data is None else data, dense=dense,
                    blocks=blocks, options=options, interventions=interventions,
                    site_axes=site_axes)
    if setup.out is None and ranks.world > 1:
        raise FcauditError(f"an audit over several processes needs {arg('out')}, a folder "
                           "every process sees")
    if options.target_ci is not None and ranks.world > 1:
        raise FcauditError(f"{arg('target_ci', owner='AuditOptions')} runs in one process: "
                           "start it without torchrun, or give a fixed number of sequences")
    x = first_batch(setup)
    layout_lines = resolve_layouts(setup, x)
    if ranks.main and options.progress:
        for line in [window_line(setup.data.summary()), *layout_lines]:
            print(f"fcaudit: {for_reader(line, cli=command is not None)}", file=sys.stderr,
                  flush=True)
    first = probe(setup)  # every rank: the same checks, and AUTO adapters learn their layout
    ablation_plan(setup, first)  # an impossible --expert-ablation stops before any file
    covered = frontier_plan(setup, first)  # so does an impossible --frontier
    if not ranks.main:
        _run(setup, open_cache(setup, setup.out / "cache", ranks), first, progress, command,
             ranks)
        return None
    if setup.out is None:
        import tempfile
        with tempfile.TemporaryDirectory(prefix="fcaudit-") as tmp:
            say_record_plan(setup, first, x, covered, Path(tmp))
            return _run(setup, open_cache(setup, Path(tmp), ranks, first), first, progress,
                        command, ranks)
    from fcaudit.io.outdir import hold_output, replacing_results
    say_record_plan(setup, first, x, covered, setup.out / "cache")
    with hold_output(setup.out, "audit", command):
        cache = open_cache(setup, setup.out / "cache", ranks, first)
        ranks.barrier(CLAIMED)
        result = _run(setup, cache, first, progress, command, ranks)
        assert result is not None
        with replacing_results(setup.out):
            write_outputs(result, setup.out, render)
    return result


CLAIMED = "rank 0 validated the inputs and claimed the output folder"


def say_record_plan(setup: Setup, first: Probe, x: Any, covered: Sequence[Covered],
                    folder: Path) -> None:
    """The record stage's passes and the cache's size (from the shards the probe's batch
    ``x`` would write), before any work; a cache the disk cannot hold is refused here (see
    :mod:`fcaudit.engine.cost`)."""
    frontier = {s.name: first.coefficients[s.name] for fam in covered for s in fam.sites}
    cost = record_cost(eval_shard(first.nll, first.coefficients, first.hits),
                       calibration_shard(setup, first.coefficients, x), frontier,
                       int(first.nll.shape[0]), setup.data.n_eval, setup.data.n_calib,
                       setup.options.batch_size)
    free = free_bytes(folder)
    warning = check_disk(cost, free, folder)
    if setup.options.progress:
        for line in (cost.line(free), warning):
            if line:
                print(f"fcaudit: {line}", file=sys.stderr, flush=True)


def open_cache(setup: Setup, folder: Path, ranks: Ranks,
               first: Probe | None = None) -> CoefficientCache:
    """The cache; rank 0 opens (or creates) it and adopts the probe's batch before the
    other ranks open it."""
    if ranks.main and not setup.objective.provable and any(folder.glob("**/*.sha256")):
        raise FcauditError(
            f"{folder} holds an earlier audit's results, and the objective reads "
            f"{setup.objective.state.removeprefix(UNREADABLE + ': ')}, whose state fcaudit "
            "cannot read as bits, so they cannot be proven to be this objective's: delete "
            f"that folder or choose another {arg('out')} (an objective that reads only "
            "functions, tensors, arrays, numbers and strings resumes from its cache)")
    cache = CoefficientCache(folder, cache_identity(setup), setup.options.batch_size,
                             setup.data.n_eval, owner=ranks.main)
    if first is not None:
        adopt_probe(cache, first.coefficients, first.nll, first.hits)
    return cache


def same_probe_on_every_rank(ranks: Ranks, first: Probe) -> None:
    """Every process computed the first batch's coefficients and NLL bit for bit alike: a
    rank whose model or code behaves differently is refused, not merged."""
    named = [*sorted(first.coefficients.items()), ("nll", first.nll)]
    digests = ranks.gather(digest_tensors(named).hex(), "comparing the first batch")
    odd = [r for r, d in enumerate(digests) if d != digests[0]]
    if odd:
        raise FcauditError(
            f"rank(s) {', '.join(map(str, odd))} computed other coefficients or NLL on the "
            f"first evaluation batch than rank 0 (of {ranks.world} processes): every process "
            "must run the same model, code, weights and data on the same kind of device; "
            "fix the differing processes and rerun")


@dataclass
class Measured:
    """One audit of ``setup``'s evaluation sequences up to (not including) execution:
    what :func:`_finish` assembles into the result."""

    setup: Setup
    runs: list
    replays: Any
    identity: Identity
    stats: tuple
    summary: Summary
    covered: list[Covered]
    points: list
    profiles: Any
    reuse: list
    recorded: dict[str, dict[str, int]]  # stage -> record batches proven and recorded


def _run(setup: Setup, cache: CoefficientCache, first: Probe, progress: Progress,
         command: str | None, ranks: Ranks) -> AuditResult | None:
    """Record and replay this rank's batches; rank 0 then summarizes every batch (with
    ``target_ci``, round after round: :func:`_run_to_target`)."""
    same_probe_on_every_rank(ranks, first)
    if setup.options.target_ci is not None:
        return _run_to_target(setup, cache, first, progress, command)
    timings: dict[str, float] = {}
    measured = _measure(setup, cache, first, progress, ranks, timings)
    if measured is None:
        return None
    return _finish(measured, cache, command, ranks, timings)


def _measure(setup: Setup, cache: CoefficientCache, first: Probe, progress: Progress,
             ranks: Ranks, timings: dict[str, float]) -> Measured | None:
    """Record and replay every batch of ``setup``'s evaluation sequences and summarize
    them (rank 0; the other ranks return None after their replays)."""
    opts = setup.options
    recorded = _summed(ranks.gather({
        "calibration": record_calibration(setup, cache, progress, ranks),
        "evaluation": record_evaluation(setup, cache, progress, ranks)}, "recorded"))
    profiles = calibration_profiles(setup, cache)
    cache.verify_all()
    timings["record_s"] = time.perf_counter() - setup.started
    inputs = _replay_inputs(setup, cache, profiles, first)
    tokens = inputs.ids
    skipped = not_applicable(setup.sites, tokens is not None)
    covered, points = frontier_points(setup, cache, frontier_plan(setup, first), progress,
                                      ranks)
    runs = plan_runs(setup.sites, opts, setup.interventions, ablation_plan(setup, first),
                     points, skipped)
    if ranks.main and opts.progress:
        print(f"fcaudit: {replay_line(len(runs), cache.n_batches)}", file=sys.stderr,
              flush=True)
    started = time.perf_counter()
    reuse = ranks.gather(replay_stage(setup, inputs, runs, progress, ranks), "replayed")
    if not ranks.main:
        return None
    replays = replay_results(cache, opts)
    timings["replay_s"] = time.perf_counter() - started
    diff = replays.identity_diff
    identity = dataclasses.replace(first.identity, exact=first.identity.exact and diff == 0,
                                   max_abs_diff=max(first.identity.max_abs_diff, diff))
    stats = describe(cache, setup.sites, tokens)
    summary = summarize(runs, replays.per_run, stats[3], setup.sites, opts, skipped,
                        accuracies(runs, replays.hits, _original_hits(cache)
                                   if setup.objective.accuracy else None))
    return Measured(setup, runs, replays, identity, stats, summary, covered, points, profiles,
                    reuse, recorded)


def _finish(m: Measured, cache: CoefficientCache, command: str | None, ranks: Ranks,
            timings: dict[str, float], rounds: list[dict[str, Any]] | None = None
            ) -> AuditResult:
    """Execution, runtime and the result of one measured audit."""
    setup, runs, replays, opts = m.setup, m.runs, m.replays, m.setup.options
    n = setup.data.n_eval
    tokens = setup.data.eval_ids if setup.data.tokens else None
    routing = _routing(setup, cache, runs, replays)
    started = time.perf_counter()
    execution = execute(setup)
    timings["execution_s"] = time.perf_counter() - started
    timings["total_s"] = time.perf_counter() - setup.started
    runtime = Runtime(host(), {k: round(v, 3) for k, v in timings.items()},
                      {**replays.schedule, "processes": ranks.world,
                       "process_group": ranks.backend}, cache.disk_usage(),
                      reuse_summary(m.reuse, len(runs), m.recorded), rounds=rounds,
                      placement=setup.loaded.placement)
    result = assemble(setup, cache, m.summary, m.stats, execution, m.identity, command,
                      runtime)
    result.routing = routing
    result.settings["expert_ablation_runs"] = len(ablation_runs(runs))
    if ablation_runs(runs):
        result.expert_importance = expert_importance(runs, replays.per_run, replays.route_load,
                                                     replays.still_selected, opts)
    result.token_profile = token_profile(m.profiles, tokens) if tokens is not None else None
    result.not_applicable = not_applicable(setup.sites, tokens is not None) or None
    result.settings["frontier_runs"] = len(frontier_runs(runs))
    if m.covered:
        result.frontier = frontier_summary(
            m.covered, m.points, dict(zip((r.key for r in runs), replays.per_run, strict=True)),
            replays.per_run[0], frontier_units(cache, m.covered, m.points),
            setup.data.eval_ids.size, execution, paired_bootstrap(n, opts))
    return result


def frontier_points(setup: Setup, cache: CoefficientCache, covered: Sequence[Covered],
                    progress: Progress, ranks: Ranks
                    ) -> tuple[list[Covered], list[FrontierPoint]]:
    """The covered families made ready (off values checked, a skipping model's own
    thresholds read) and every point to replay: the rules' points from calibration, and
    for a model that skips, the dynamic rule at its own thresholds."""
    if not covered:
        return [], []
    sites = [s for fam in covered for s in fam.sites]
    record_frontier_calibration(setup, cache, sites, progress, ranks)
    ranks.barrier("recorded the frontier's calibration")
    executed = own_skips(setup) if any(f.kind == GATE for f in covered) else None
    ready = []
    for fam in covered:
        reason = off_mismatch(setup, fam) if fam.kind == GATE else None
        fam = dataclasses.replace(fam, reason=reason) if reason else \
            own_thresholds(fam, executed, setup.data.eval_ids.size, eval_gates(cache, fam))
        ready.append(fam)
    live = [f for f in ready if f.reason is None]
    points = plan_points(live, frontier_calibration(setup, cache, sites),
                         setup.options.frontier_points)
    return ready, points + [p for f in live if (p := own_point(f)) is not None]


def own_skips(setup: Setup) -> list[float] | None:
    """Each declared block's executed fraction on the evaluation set (a counting pass,
    no FLOPs): below 1 where the model skips tokens on its own."""
    from fcaudit.engine.execution import execution_pass
    if setup.blocks is None:
        return None
    size, net = setup.options.batch_size, setup.model
    counted = execution_pass(net, setup.blocks, (x for _, x in batches(
        setup.data.eval_ids, size, device_of(net))), flops=False)
    return counted["blocks_executed_per_layer"]


def eval_gates(cache: CoefficientCache, fam: Covered) -> dict[str, Tensor]:
    return {s.name: torch.cat([cache.batch(b, f"site::{s.name}").reshape(-1)
                               for b in range(cache.n_batches)]) for s in fam.sites}


@torch.no_grad()
def off_mismatch(setup: Setup, fam: Covered) -> str | None:
    """Why switching the family's gates to their ``off`` value does not remove exactly one
    module per gate on the first evaluation batch (None: it does, bit for bit). The module
    is the site's declared gated module (its output zeroed), else the block of its layer
    (the block passing its input through, as ``h + 0 F(h)`` does, or its update zeroed, as
    for SkipGate's ``body``). A coefficient that only reweights (mixing weights, a keep-score
    that reorders tokens) removes no module, and gets no frontier: it would be mispriced."""
    gated = [s.gated for s in fam.sites]
    modules = gated if all(gated) else setup.blocks
    if modules is None or len(modules) != len(fam.sites):
        return (f"the {len(fam.sites)} gates are not one per declared block "
                f"({len(modules) if modules else 'no'} blocks): no module to price their skips")
    net = setup.model
    _, x = next(batches(setup.data.eval_ids, setup.options.batch_size, device_of(net)))
    recorded = record_batch(net, fam.sites, x)[1]
    off = replay_batch(net, x, {s: torch.full_like(recorded[s.name], s.off)
                                for s in fam.sites}).logits
    modes = (_zeroed,) if all(gated) else (_passed_through, _zeroed)
    diffs = []
    for mode in modes:
        removed = _with_hooks(net, x, {m: mode for m in modules if m})
        if torch.equal(off, removed):
            return None
        diffs.append(float((off.double() - removed.double()).abs().max()))
    return (f"setting {fam.family}'s gates to {fam.sites[0].off} does not remove exactly "
            f"one module per gate ({', '.join(m for m in modules if m)[:120]}; max logit "
            f"difference {min(diffs):.3g}): these coefficients do not switch a computation "
            "off, so no skipped FLOPs can be priced")


def _zeroed(_m: nn.Module, _args: tuple[Any, ...], out: Any) -> Any:
    return torch.zeros_like(out) if isinstance(out, Tensor) else out


def _passed_through(_m: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
    first = args[0] if args else None
    same = isinstance(first, Tensor) and isinstance(out, Tensor) and first.shape == out.shape
    return first if same else out


def _with_hooks(net: nn.Module, x: Tensor, hooks: Mapping[str, Callable[..., Any]]) -> Tensor:
    handles = [net.get_submodule(path).register_forward_hook(hook)
               for path, hook in hooks.items()]
    try:
        return logits_of(net(x))
    finally:
        for handle in handles:
            handle.remove()


def _run_to_target(pool: Setup, cache: CoefficientCache, first: Probe, progress: Progress,
                   command: str | None) -> AuditResult:
    """``target_ci``: round ``k`` audits the first ``n_k`` sequences of the (already
    ordered) pool exactly as a fixed audit of them would; stop when every counted
    half-width reaches the target or the pool is used up (engine/stopping.py)."""
    from fcaudit.engine import stopping as st
    opts, n_pool = pool.options, len(pool.data.eval_ids)
    target = float(opts.target_ci)  # type: ignore[arg-type]
    floor = st.min_sequences(opts.min_sequences, n_pool)
    n, previous, entries, spent = st.first_size(floor, opts.batch_size, n_pool), 0, [], []
    while True:
        started = time.perf_counter()
        cache.use_prefix(n)
        setup = dataclasses.replace(pool, data=dataclasses.replace(
            pool.data, eval_ids=pool.data.eval_ids[:n]))
        timings: dict[str, float] = {}
        m = _measure(setup, cache, first, progress, SINGLE_RANK, timings)
        assert m is not None
        entry = st.round_entry(n, opts.batch_size, previous, len(m.runs),
                               st.half_widths(m.summary.conditions), target)
        entries.append(entry)
        spent.append(_round_cost(n, m, time.perf_counter() - started))
        if opts.progress:
            print(f"fcaudit: target-ci round {len(entries)}: {n} of {n_pool} sequences, "
                  f"widest half-width {entry.half_widths[entry.widest]:.4g} nats "
                  f"({entry.widest}), target {target:g}", file=sys.stderr, flush=True)
        if entry.met or n == n_pool:
            break
        previous, n = n, st.next_size(n, entry.half_widths[entry.widest], target,
                                      opts.batch_size, n_pool)
    result = _finish(m, cache, command, SINGLE_RANK, timings, spent)
    result.stopping = st.stopping(pool.data, opts.seed, target, floor, entries, len(m.runs))
    return result


def _round_cost(n: int, m: Measured, wall_s: float) -> dict[str, Any]:
    """A round's runtime facts: its wall time and what it took from the cache."""
    replayed = reuse_summary(m.reuse, len(m.runs), m.recorded)
    return {"sequences": n, "wall_s": round(wall_s, 3),
            "record_batches_reused": m.recorded["evaluation"]["batches_reused"],
            "record_batches_recorded": m.recorded["evaluation"]["batches_new"],
            **{k: replayed[k] for k in ("batches_reused", "batches_recomputed",
                                        "runs_reused", "runs_recomputed")}}


def frontier_units(cache: CoefficientCache, covered: Sequence[Covered],
                   points: Sequence[FrontierPoint]) -> dict[str, np.ndarray]:
    """Point key -> skipped units per layer (tokens or expert slots), summed over the
    evaluation set's recorded coefficients."""
    by_family = {fam.family: fam for fam in covered}
    units = {p.key: np.zeros(len(by_family[p.family].sites)) for p in points}
    for b in range(cache.n_batches):
        coefficients = {s.name: cache.batch(b, f"site::{s.name}")
                        for fam in covered for s in fam.sites}
        for p in points:
            units[p.key] += skipped_units(p, coefficients, by_family[p.family])
    return units


def _summed(per_rank: Sequence[Mapping[str, Mapping[str, int]]]) -> dict[str, dict[str, int]]:
    """Every rank's record counts, added up per stage."""
    return {stage: {k: sum(r[stage][k] for r in per_rank) for k in per_rank[0][stage]}
            for stage in per_rank[0]}


def reuse_summary(per_rank: Sequence[Mapping[str, int]], n_runs: int,
                  recorded: Mapping[str, Mapping[str, int]]) -> dict[str, Any]:
    """What came from the cache: record batches only once recomputed bit for bit (one
    forward each, the price of reuse), replay batches only on top of proven records and
    when every run's fed tensors are bit for bit the stored ones (else replayed)."""
    reused = sum(r["batches_reused"] for r in per_rank)
    recomputed = sum(r["batches_recomputed"] for r in per_rank)
    kept = sum(r.get("runs_kept_from_earlier_rounds", 0) for r in per_rank)  # --target-ci
    proofs = {f"{stage}_batches_{what}": recorded[stage][f"batches_{what}"]
              for stage in ("evaluation", "calibration") for what in ("proven", "recorded")}
    return {"batches_reused": reused, "batches_recomputed": recomputed,
            "runs_reused": reused * n_runs + kept, "runs_recomputed": recomputed * n_runs - kept,
            **proofs,
            "rule": "a cached record batch (evaluation or calibration) is used only after its "
                    "original pass, recomputed now, equals it bit for bit (one forward pass "
                    "per reused batch); a cached replay batch only on top of those records "
                    "and when every run's SHA-256 of its token ids, schedule, identity and fed "
                    "coefficient tensors equals the stored one"}


def write_outputs(result: AuditResult, out: Path, render: Renderer | None = None) -> None:
    """The report (when asked) first, then audit.json: its presence means the audit finished."""
    from fcaudit.io.fileio import write_json
    if render is not None:
        render(result, out)
    write_json(out / "audit.json", result.to_json())
