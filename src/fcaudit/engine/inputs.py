"""The audit's inputs, resolved and checked: the model, its sites' interventions, the
data the model is scored on, and the window it is scored in (said in words).

Everything here runs before the audit's first forward pass; a mistake is refused in
one line naming the argument or flag (:mod:`fcaudit.core.errors`).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fcaudit.core.conditions import EXPERT_ABLATION, FRONTIER, PER_LAYER_CONDITIONS, audited
from fcaudit.core.contract import Site
from fcaudit.core.discovery import declared_blocks
from fcaudit.core.errors import ModelError, UsageError, arg
from fcaudit.core.interventions import Intervention
from fcaudit.core.layout import TOKEN_LAYOUT
from fcaudit.core.nll import model_limits, probe_vocab
from fcaudit.core.sites import SiteSpec, match_modules
from fcaudit.engine.objectives import (
    CLASSIFICATION,
    OBJECTIVES,
    TOKEN_NLL,
    BuiltinObjective,
    resolve,
    run_task,
)
from fcaudit.engine.options import AuditOptions
from fcaudit.io.data import (
    GIVEN_DATA,
    SEQ_LEN_GIVEN,
    TOKEN_WIDTH,
    AuditData,
    DataSpec,
    picked_note,
    resolve_data,
    source_words,
)
from fcaudit.io.digits import run_audit_data
from fcaudit.io.engines import VLLM
from fcaudit.io.examples import OTHER_INPUTS
from fcaudit.io.loading import LoadedModel, get_arch, input_spec, load, load_module
from fcaudit.io.placement import Placement

if TYPE_CHECKING:  # vLLM's module is imported only to serve
    from fcaudit.io.vllm import Serving


def as_loaded(model: str | Path | nn.Module | LoadedModel,
              dtype: torch.dtype | None = None,
              placement: Placement | None = None,
              serving: Serving | None = None) -> LoadedModel:
    """The model as loaded: given so, an in-memory module, or a spec loaded here (with
    ``placement``, dispatched by accelerate; with ``serving``, served by vLLM)."""
    if isinstance(model, LoadedModel):
        return model
    if serving is not None:
        if not isinstance(model, (str, Path)):
            raise UsageError(f"{arg('engine', VLLM)} serves a model folder given by its path, "
                             "not a module already in memory")
        from fcaudit.io.vllm import load_served
        return load_served(str(model), dtype, serving)
    if isinstance(model, nn.Module):
        if placement is not None:
            raise UsageError(f"{arg('device_map', placement.device_map)} places a model "
                             "fcaudit loads from a folder; give the folder's path, not a "
                             "module already in memory")
        return load_module(model, type(model).__name__)
    return load(str(model), dtype, placement)


def resolve_block_paths(model: nn.Module, pattern: str | None,
                        whose: str = "the model") -> list[str] | None:
    """The blocks whose executions are counted: the modules ``pattern`` matches, else the
    ones ``model`` declares (None: it declares none). A declared path that is no module of
    ``model`` is refused here, naming ``whose`` declaration it is, before any pass: every
    later hook on it would fail with a bare AttributeError."""
    if pattern is not None:
        return match_modules(model, pattern, "blocks", "blocks.*")
    paths = declared_blocks(model)
    for path in paths or ():
        if not isinstance(path, str) or not _is_module(model, path):
            raise ModelError(
                f"{whose} ({type(model).__name__}) declares execution block {path!r}, which is "
                "not one of its modules; make its execution_blocks() return module paths "
                "(`fcaudit sites --model SPEC --all` lists them) or name the blocks with "
                f"{arg('blocks', 'GLOB')}")
    return paths


def _is_module(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def custom_interventions(given: Mapping[str, Any] | Sequence[Intervention] | None,
                         sites: Sequence[Site], opted: Collection[str] = ()
                         ) -> list[Intervention]:
    """The user's interventions, each with a name no other run of the audit has (results
    are keyed by name: two runs under one name would be merged into one condition; the
    opt-in conditions in ``opted`` are runs of the audit too)."""
    if not given:
        return []
    if isinstance(given, Mapping):
        items = list(given.items())
    elif isinstance(given, (list, tuple)) and all(isinstance(i, Intervention) for i in given):
        items = [(i.name, i) for i in given]
    else:
        raise UsageError("audit(interventions=...) must be {name: fn} or a list of "
                         f"fcaudit.Intervention objects, not {given!r:.80}")
    builtin = {*audited(opted), *(f"{c}@{s.name}" for c in PER_LAYER_CONDITIONS for s in sites)}
    out: list[Intervention] = []
    for name, item in items:
        iv = item if isinstance(item, Intervention) else Intervention(str(name), item)
        if isinstance(iv.name, str) and iv.name in {o.name for o in out}:
            raise UsageError(f"two interventions are named {iv.name!r}: give each its own "
                             "name (results are reported by name, so both would be merged "
                             "into one condition)")
        if not isinstance(iv.name, str) or not iv.name or iv.name in builtin or \
                iv.name.startswith((f"{EXPERT_ABLATION}:", f"{FRONTIER}:")) or \
                not callable(iv.fn) or isinstance(iv.repeats, bool) or \
                not isinstance(iv.repeats, int) or iv.repeats < 1:
            raise UsageError(f"intervention {iv.name!r}: give a new name (not a built-in "
                             "condition or per-layer run), a callable and repeats >= 1")
        out.append(iv)
    return out


def check_arguments(sites: Any, data: Any, blocks: Any, options: Any) -> SiteSpec:
    """A Python caller's arguments of the wrong kind, each refused in one line naming the
    argument; a single glob string for ``sites`` is taken as one glob."""
    if not isinstance(options, AuditOptions):
        raise UsageError(f"audit(options=...) must be fcaudit.AuditOptions(...), not "
                         f"{type(options).__name__}")
    if not isinstance(data, (AuditData, DataSpec)):
        raise UsageError(f"audit(data=...) must be fcaudit.DataSpec(...) or "
                         f"fcaudit.AuditData(...), not {type(data).__name__}")
    if blocks is not None and not isinstance(blocks, str):
        raise UsageError(f"audit(blocks=...) must be one module-path glob string, not "
                         f"{type(blocks).__name__}")
    if isinstance(sites, str):
        return [sites]
    if sites is not None and (not isinstance(sites, (list, tuple)) or not sites
                              or not all(isinstance(s, (str, Site)) for s in sites)):
        raise UsageError(f"audit(sites=...) must be a non-empty list of module-path globs "
                         f"or fcaudit.Site objects, not {sites!r:.80}")
    return sites


def check_dense(dense: Any, options: AuditOptions) -> None:
    """A dense counterpart serves the execution audit only: given without it, refused
    (the command line asks before it loads the model)."""
    if dense is not None and not options.execution:
        no_execution = arg("execution", py="AuditOptions(execution=False)", cli="--no-execution")
        raise UsageError(f"{arg('dense')} is ignored with {no_execution} (the dense "
                         "counterpart only serves the execution audit): drop one of them",
                         option="dense")


def resolve_inputs(loaded: LoadedModel, data: DataSpec | AuditData, options: AuditOptions,
                   sites: Sequence[Site]) -> tuple[AuditData, Any]:
    """The data the audit scores, checked against the model, and the objective that
    scores them: the one given, used as given (or refused where it cannot score the
    data), else the data's own (:func:`decided_objective`)."""
    net = loaded.model
    default_len, default_why = loaded_seq_len(loaded)
    vision = bool(loaded.run_config) and get_arch(loaded.run_config["arch"]).task == "vision"
    task = run_task(loaded.run_config)  # a synthetic task's run: its data and objective
    given = options.objective
    if isinstance(data, AuditData):
        audit_data = data
    elif vision:  # a vision run: its own digits, in the dtype the model computes in
        audit_data = run_audit_data(data, loaded.spec, next(net.parameters()).dtype)
    elif task is not None:  # its task's sequences; as token windows for a token objective
        audit_data = importlib.import_module(task.task).run_audit_data(  # type: ignore[arg-type]
            data, loaded.spec, (loaded.run_config or {}).get("data"),
            tokens=_scores_tokens(given))
    else:
        audit_data = resolve_data(loaded.tokenizer, data, default_len)
    audit_data.check_arrays()  # read again for every audit: the caller may have changed it
    next_token = audit_data.checked().next_token
    objective = given if given is not None else decided_objective(next_token, vision, task)
    if not next_token:  # each kind's rules against model and options
        return _example_inputs(loaded, audit_data, options, objective), objective
    return _token_inputs(net, data, audit_data, options, objective, sites, default_why), objective


def _scores_tokens(objective: Any) -> bool:
    """Whether ``objective`` (a name, a callable, or None) is a built-in that scores token
    ids (next-token NLL)."""
    return isinstance(objective, str) and objective in OBJECTIVES and OBJECTIVES[objective].tokens


def decided_objective(next_token: bool, vision: bool, task: BuiltinObjective | None) -> str:
    """The objective when none is given: token windows by next-token NLL; a synthetic
    task's run on examples (its task's, or the caller's) by its task's objective; other
    inputs (a vision run's digits among them) by classification."""
    if next_token and not vision:
        return TOKEN_NLL
    return task.name if task is not None else CLASSIFICATION


def _token_inputs(net: nn.Module, given: DataSpec | AuditData, data: AuditData,
                  options: AuditOptions, objective: Any, sites: Sequence[Site],
                  default_why: str) -> AuditData:
    """Token ids: sites with a token axis, ids within the vocabulary and windows within
    the context; with ``target_ci``, the pool in its audit order."""
    builtin = OBJECTIVES.get(objective) if isinstance(objective, str) else None
    examples = builtin.name if builtin is not None and not builtin.tokens else None
    if examples or any(s.positions not in (None, TOKEN_LAYOUT) for s in sites):
        raise UsageError(
            "token ids are scored by next-token NLL on sites [batch, tokens, ...]: for "
            f"{arg('objective', examples or CLASSIFICATION, owner='AuditOptions')} or sites "
            f"without a token axis give {OTHER_INPUTS}")
    if "seq_len_source" not in data.sources:  # a copy: the caller's data stays as given
        data = dataclasses.replace(data, sources={
            **data.sources, "seq_len_source": window_source(given, default_why)})
    vocab, ctx = model_limits(net)
    if vocab is None:
        vocab = probe_vocab(net, data.eval_ids.shape[1])
    data.validate(vocab, ctx)
    if options.target_ci is not None:  # the floor is checked against the pool, then ordered
        from fcaudit.engine.run import min_sequences, ordered_pool
        min_sequences(options.min_sequences, len(data.eval_ids))
        data = ordered_pool(data, options.seed)
    return data


def _example_inputs(loaded: LoadedModel, data: AuditData, options: AuditOptions,
                    spec: Any) -> AuditData:
    """Inputs that are not token ids (``AuditData(inputs=...)``): an objective (``spec``)
    that scores them, no token-only option, and inputs the model takes."""
    objective = resolve(spec)
    if objective.tokens:
        raise UsageError(
            f"{arg('objective', objective.name, owner='AuditOptions')} scores token ids, but "
            f"the data are other inputs: choose {arg('objective', CLASSIFICATION)} (integer "
            "targets) or a callable (model_output, batch) -> per-unit losses, or give token "
            "ids as AuditData(eval_ids=..., calib_ids=...)")
    if options.frontier:
        raise UsageError(f"{arg(FRONTIER, py='AuditOptions(frontier=True)')} is measured "
                         "on token inputs only; drop it for these inputs")
    if options.target_ci is not None:
        raise UsageError(f"{arg('target_ci', py='AuditOptions(target_ci=...)')} grows a pool "
                         "of token windows; for these inputs give a fixed evaluation set")
    data.check_inputs(input_spec(loaded))
    data.validate(*model_limits(loaded.model))  # token ids among them: the model's bounds
    return data


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


def window_source(data: DataSpec | AuditData, default: str) -> str:
    """Where the scoring window's length came from, in words (audit.json data section)."""
    if isinstance(data, AuditData):
        return GIVEN_DATA
    if data.tokens is not None:
        return TOKEN_WIDTH
    return SEQ_LEN_GIVEN if data.seq_len is not None else default


def window_line(data: Mapping[str, Any]) -> str:
    """One line saying how long the scored windows are and why, for the start of an audit
    and its summary (a model scored past its training length scores differently); its
    option is rendered for its reader (:func:`fcaudit.core.errors.render`)."""
    picked = picked_note(data, for_api=True)
    picked = f"; {picked}" if picked else ""
    if "eval_examples" in data:
        return (f"scoring {data['eval_examples']} evaluation examples "
                f"({data['calib_examples']} calibrate the static profiles){picked}")
    source, change = source_words(data.get("seq_len_source", "source not recorded"),
                                  arg("seq_len", owner="DataSpec"))
    said = f"{source}; {change}" if change else source
    return f"scoring windows of {data['seq_len']} tokens ({said}){picked}"
