"""Fold a static profile into the model (``fcaudit fold``, :func:`fold`): from an audit's
diagnosis to a model without controller computation, checked and timed.

An audit found that a static calibration profile (``static-layer``, per position, per
token id), or one exit depth for all (``fixed-exit``), keeps most of what the controllers
did. The fold writes the model with each controller replaced by what that condition
fixes (the condition's ``fold``), into the weights' folder, and checks that it computes
what the audit's condition computed:

1. the audit's model and data are loaded again and checked to be the audit's (the
   model's fingerprint, the data's SHA-256s, the sites);
2. what is fixed is recomputed from the calibration data, never read from a cache: the
   profiles (one record pass a batch, the audit's own sums in the audit's batch order),
   or the exit depth (the model's own exits, one pass a batch);
3. the condition is replayed on the evaluation data: its mean NLL must equal the one
   ``audit.json`` reports (:data:`FOLD_TOLERANCE`, relative), which proves the profiles
   (or the depth) and data are the audit's;
4. the folded model runs the same windows: its per-token losses must equal the replay's
   within :data:`FOLD_TOLERANCE` (relative to the loss), largest and mean difference
   reported; a fold that does not is refused, and nothing is written;
5. it is timed against the original and the dense twin side by side (pairs of one batch,
   the execution audit's method), and its FLOPs counted against theirs.

Which families fold, and by which conditions, is each architecture's registry entry
(:data:`fcaudit.io.arches.ARCHES`, ``folds``); the model builds its folded self
(``folded(key, values)``). Nothing here knows a family.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fcaudit.core.conditions import CONDITIONS
from fcaudit.core.errors import DataError, FcauditError, ModelError, UsageError, arg
from fcaudit.core.exits import exit_model, exit_scores
from fcaudit.core.flops import flop_counter
from fcaudit.core.interventions import StaticProfiles, static_any_length, static_tensor
from fcaudit.core.nll import device_of, model_limits
from fcaudit.core.registry import refusal
from fcaudit.engine.actions.reopen import Progress, read_audit, recomputed_profiles, reopened
from fcaudit.engine.execution import time_interleaved, warm_pass
from fcaudit.engine.options import MAX_TIMING_PAIRS, MIN_TIMING_PAIRS
from fcaudit.engine.passes import batches
from fcaudit.engine.result import AuditResult
from fcaudit.engine.result_parts import Estimate
from fcaudit.io.arches import ARCHES, arch_of, foldable
from fcaudit.io.data import AuditData, DataSpec
from fcaudit.io.examples import call_model
from fcaudit.io.hf_folds import HF_FOLDS, hf_fold, write_hf_folder

SCHEMA = "fcaudit.fold/1"
FOLD_TOLERANCE = 1e-5  # relative: per-token losses, and the audit's condition NLL


@dataclass
class Exactness:
    """The folded model against the audit's condition on the evaluation data."""

    audit_nll: float  # what audit.json reports for the condition
    replayed_nll: float  # the condition replayed here (the same profiles, the same data)
    folded_nll: float
    max_abs_diff: float  # per token, folded against replayed
    mean_abs_diff: float
    tokens: int
    bound_relative: float = FOLD_TOLERANCE


@dataclass
class FoldSpeed:
    """Latency of one batch: the folded model over another (median over interleaved
    pairs; < 1: the folded model is faster) and its FLOPs over the other's."""

    latency_ratio: Estimate
    flops_ratio: float
    folded_tokens_per_s: float
    other_tokens_per_s: float


@dataclass
class FoldResult:
    """What :func:`fold` wrote and measured (the run folder's ``config.json`` holds it as
    ``fold``)."""

    audit: str
    profile: str  # the condition folded (a static profile, or fixed exit)
    key: str  # what it fixes (the condition's fold: layer, layer_position, ... exit_depth)
    source: str  # the audited model
    arch: str  # the folded model's: an fcaudit architecture (a run folder), or a Hugging
    # Face family (a folder transformers loads)
    exactness: Exactness
    vs_original: FoldSpeed | None
    vs_dense: FoldSpeed | None
    timing: dict[str, Any]  # pairs, batch, positions, device
    out: str | None
    exit_depth: int | None = None  # fixed exit: the layers (steps) the folded model keeps
    schema: str = SCHEMA
    # what healing is measured on: the evaluation windows checked (token ids [N, T]), or
    # a task audit's examples (token ids) and their answers
    eval_ids: Any = dataclasses.field(default=None, repr=False, compare=False)
    eval_targets: Any = dataclasses.field(default=None, repr=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items()
                if k not in ("eval_ids", "eval_targets")}


def _condition(profile: str, result: AuditResult) -> Any:
    keys = {k for a in (*ARCHES.values(), *HF_FOLDS.values()) for k in a.folds}
    folding = [c.name for c in CONDITIONS.values() if c.fold in keys]
    if profile not in folding:
        raise refusal(f"{arg('profile', profile)} does not fold", profile, folding,
                      option="profile")
    if profile not in result.conditions:
        raise UsageError(f"{arg('profile', profile)}: the audit did not compute it (it has "
                         f"{', '.join(result.conditions)}); fold a profile the audit measured",
                         option="profile")
    return CONDITIONS[profile]


def fold(audit: str | Path, profile: str, out: str | Path | None = None, *,
         model: Any = None, data: DataSpec | AuditData | None = None,
         timing_pairs: int = 10, force: bool = False,
         progress: Progress | None = None,
         accept: Callable[[nn.Module], None] | None = None) -> FoldResult:
    """Fold the audit's condition ``profile`` (a static profile, or fixed exit) into its
    model and write the result as a run folder at ``out`` (None: measure only).
    ``model``: the audited model (default: the one ``audit.json`` names); ``data``: the
    audit's data (default: the built-in corpus, as ``fcaudit audit`` without data
    options); both are checked to be the audit's.
    ``timing_pairs``: interleaved pairs timing the folded model against the original and
    the dense twin (0: not timed). ``accept``: called with the folded model before
    anything is written (a refusal there writes nothing: the command line checks the
    healing's weight globs with it)."""
    from fcaudit.io.outdir import hold_output
    from fcaudit.io.runs import building, check_run_out
    result = read_audit(audit)
    condition = _condition(profile, result)
    if timing_pairs and not MIN_TIMING_PAIRS <= timing_pairs <= MAX_TIMING_PAIRS:
        raise UsageError(f"{arg('timing_pairs', timing_pairs)}: {MIN_TIMING_PAIRS} to "
                         f"{MAX_TIMING_PAIRS}, or 0 (no timing)", option="timing_pairs")
    target = Path(out).expanduser() if out is not None else None
    if target is not None:
        check_run_out(target, force)
    say = progress or (lambda *_: None)
    with reopened(result, model, data) as setup:
        net, into = setup.model, _target(setup)
        if condition.fold not in into.folds:
            raise UsageError(f"{arg('profile', profile)}: {into.source} does not fold it; "
                             f"folds exist for {foldable()}", option="profile")
        values, feed = (_exit_fold if condition.kind == "exit" else _static_fold)(
            setup, condition, say)
        folded = into.build(condition.fold, values)
        if accept is not None:
            accept(folded)
        exact = _exactness(setup, feed, condition.name, folded, result, say)
        speed = _speeds(net, folded, setup, timing_pairs, say)
        done = FoldResult(str(audit), profile, condition.fold, str(setup.loaded.spec),
                          _arch_name(folded), exact, *speed,
                          None if target is None else str(target),
                          int(values[0]) + 1 if condition.kind == "exit" else None,
                          **_evaluation(setup.data))
        if target is not None:
            with hold_output(target, "run"), building(target) as work:
                into.write(work, folded, done)
        return done


def _evaluation(data: AuditData) -> dict[str, Any]:
    """The audit's evaluation data as healing reads it: token windows, or examples with
    their answers."""
    if data.tokens:
        return {"eval_ids": np.asarray(data.eval_ids)}
    return {"eval_ids": None if data.inputs is None else np.asarray(data.inputs),
            "eval_targets": None if data.targets is None else np.asarray(data.targets)}


@dataclass(frozen=True)
class _Target:
    """What the audited model folds into: ``source`` its architecture or family, ``folds``
    what it folds (a condition's ``fold``), ``build(key, values)`` the folded model,
    ``write(work, folded, done)`` its folder."""

    source: str
    folds: tuple[str, ...]
    build: Callable[[str, list[Tensor]], nn.Module]
    write: Callable[[Path, nn.Module, FoldResult], None]


def _target(setup: Any) -> _Target:
    """A model of fcaudit's own code (a run folder of ``fcaudit train``, or a checkpoint
    folder it loads, such as MUDDPythia's) folds into a run folder of an architecture of
    its own; a Hugging Face family with a fold entry into what the entry builds: a folder
    transformers loads, or a run folder of one of fcaudit's architectures."""
    net = setup.model
    entry = hf_fold(net)
    if entry is not None:
        return _Target(entry.name, entry.folds,
                       lambda key, values: entry.build(net, setup.sites, key, values),
                       lambda work, folded, done: _write(work, setup, folded, done)
                       if _own(folded) else write_hf_folder(work, folded, done.to_json(),
                                                            _tokenizer(setup)))
    try:
        arch = arch_of(net)
    except FcauditError:
        raise UsageError(f"{setup.loaded.spec} is a {setup.loaded.kind} model of a family that "
                         f"does not fold; folds exist for {foldable()}",
                         option="model") from None
    return _Target(arch.name, arch.folds, net.folded,
                   lambda work, folded, done: _write(work, setup, folded, done))


def _own(folded: nn.Module) -> bool:
    """Whether a folded model is one of fcaudit's architectures (else a transformers one)."""
    try:
        arch_of(folded)
    except FcauditError:
        return False
    return True


def _arch_name(folded: nn.Module) -> str:
    """What the folded model is: its fcaudit architecture, or its transformers family."""
    return arch_of(folded).name if _own(folded) else str(folded.config.model_type)


def _tokenizer(setup: Any) -> str | None:
    """The audited model's tokenizer, written beside the folded model: its folder's
    ``tokenizer.json`` as it is, else the one it was loaded with (a GGUF file's)."""
    file = Path(str(setup.loaded.spec)) / "tokenizer.json"
    if file.is_file():
        return file.read_text(encoding="utf-8")
    loaded = setup.loaded.tokenizer
    return None if loaded is None else loaded.to_str()


Feed = Callable[[Tensor, Tensor], dict[Any, Tensor]]  # (inputs, token ids) -> site feeds


def _static_fold(setup: Any, condition: Any, say: Progress) -> tuple[list[Tensor], Feed]:
    """A static profile: each site's fixed rows, and the condition's feed of a batch (it
    reads only the coefficients' shape and dtype: no record pass)."""
    profiles, dtypes = recomputed_profiles(setup, say, "fold")
    values = _values(setup, profiles, condition.name, setup.model, dtypes)

    def feed(x: Tensor, ids: Tensor) -> dict[Any, Tensor]:
        like = {s.name: torch.zeros(*ids.shape, *profiles.shape(s)[1:], dtype=dtypes[s.name],
                                    device=x.device) for s in setup.sites}
        return {s: static_tensor(condition.name, s, profiles, like[s.name], ids)
                for s in setup.sites}
    return values, feed


def _exit_fold(setup: Any, condition: Any, say: Progress) -> tuple[list[Tensor], Feed]:
    """Fixed exit: the exit layer closest to the model's mean executed depth on the
    calibration data, recomputed (the model's own exits, one pass a batch), as one value;
    and the condition's feed of a batch: the scores that stop every unit there."""
    from fcaudit.engine.exits import calibration_depth
    net = exit_model(setup.model, setup.sites)
    layer = calibration_depth(setup, net, lambda stage, done, n, _: say(
        "fold: exit depth on calibration", done, n)).fixed()

    def feed(x: Tensor, ids: Tensor) -> dict[Any, Tensor]:
        _, coefficients, _ = setup.executor.record(x, None)
        scores = exit_scores(setup.sites, torch.full(ids.shape, layer), coefficients)
        return {s: scores[s.name] if s.name in scores else coefficients[s.name]
                for s in setup.sites}
    return [torch.tensor(layer)], feed


def _values(setup: Any, profiles: StaticProfiles, condition: str, net: nn.Module,
            dtypes: dict[str, torch.dtype]) -> list[Tensor]:
    """Each site's fixed rows ``[rows, *trailing]``, as the condition feeds them
    (:func:`static_any_length`, in the coefficients' dtype): one row; one per position of the
    model's context (positions past the calibration windows take the site's static-layer
    row); one per token id of its vocabulary (ids no calibration token had take it too,
    as the condition gives them)."""
    key = CONDITIONS[condition].profile
    vocab, context = model_limits(net)
    if key == "layer_position" and context is None or key == "layer_token" and vocab is None:
        what = "context" if key == "layer_position" else "vocabulary"
        raise ModelError(f"the model states no {what} to fold the {condition} profile into")
    rows = {"layer_position": context, "layer_token": vocab}.get(key, 1)
    ids = torch.arange(rows).view(1, rows) if key == "layer_token" else None
    out = []
    for site in setup.sites:
        like = torch.zeros(1, rows, *profiles.shape(site)[1:], dtype=dtypes[site.name])
        out.append(static_any_length(condition, site, profiles, like, ids)[0].contiguous())
    return out


def _exactness(setup: Any, feed: Feed, condition: str, folded: nn.Module,
               result: AuditResult, say: Progress) -> Exactness:
    """The condition replayed and the folded model run on every evaluation batch."""
    size, net = setup.options.batch_size, setup.model
    objective = setup.objective
    n = -(-setup.inputs.n_eval // size)
    replayed, ours, worst, total, tokens = [], [], 0.0, 0.0, 0
    folded.to(device_of(net))
    for done, (_, x) in enumerate(batches(setup.eval_source, size, device_of(net)), start=1):
        out = setup.executor.replay(x, feed(x, setup.inputs.batch_token_ids(x)),
                                    objective=objective)
        want = objective.units(out.output, x).double()
        with torch.no_grad():
            got = objective.units(call_model(folded, x), x).double()
        diff = (got - want).abs()
        scale = want.abs().clamp_min(1.0)
        if bool((diff > FOLD_TOLERANCE * scale).any()):
            raise ModelError(f"the folded model does not compute the {condition} condition: "
                             f"a per-token loss differs by {float(diff.max()):.3g} (bound "
                             f"{FOLD_TOLERANCE:g} relative); nothing was written")
        worst, total, tokens = max(worst, float(diff.max())), total + float(diff.sum()), \
            tokens + diff.numel()
        replayed.append(_per_unit(want))
        ours.append(_per_unit(got))
        say("fold: check exactness", done, n)
    replayed_nll, folded_nll = float(np.concatenate(replayed).mean()), \
        float(np.concatenate(ours).mean())
    audit_nll = result.conditions[condition].nll
    if abs(replayed_nll - audit_nll) > FOLD_TOLERANCE * max(1.0, abs(audit_nll)):
        raise DataError(f"the {condition} condition replayed here gives NLL "
                        f"{replayed_nll:.6f}, and the audit reports {audit_nll:.6f}: the model, "
                        "data or code changed since the audit; rerun the audit, then fold it")
    return Exactness(audit_nll, replayed_nll, folded_nll, worst, total / max(tokens, 1), tokens)


def _per_unit(losses: Tensor) -> np.ndarray:
    """Per-sequence mean losses (the audit's unit)."""
    return (losses.reshape(losses.shape[0], -1).mean(-1)).cpu().numpy()


def _flops(model: nn.Module, x: Tensor) -> int:
    warm_pass(model, x)  # as the execution audit counts: weights-only work made once
    with torch.no_grad(), flop_counter() as counter:
        call_model(model, x)
    return int(counter.get_total_flops())


def _speeds(net: nn.Module, folded: nn.Module, setup: Any, pairs: int, say: Progress
            ) -> tuple[FoldSpeed | None, FoldSpeed | None, dict[str, Any]]:
    """The folded model against the original and the dense twin (the architecture's
    counterpart: only its speed is read), one evaluation batch, interleaved pairs."""
    if not pairs:
        return None, None, {"pairs": 0}
    _, x = next(batches(setup.eval_source, setup.options.batch_size, device_of(net)))
    twin = getattr(net, "dense_counterpart", None)
    dense = twin().to(device_of(net)).eval() if callable(twin) else None
    speeds = []
    for i, other in enumerate((net, dense)):
        if other is None:
            speeds.append(None)
            continue
        timed = time_interleaved(folded, other, x, pairs=pairs, seed=setup.options.seed)
        speeds.append(FoldSpeed(timed.speed_ratio_vs_dense, _flops(folded, x) / _flops(other, x),
                                timed.model.tokens_per_s, timed.dense.tokens_per_s))
        say("fold: timing", i + 1, 2)
    ids = setup.inputs.batch_token_ids(x)  # token ids [B, T], of an example batch too
    return speeds[0], speeds[1], {"pairs": pairs, "batch_size": int(ids.shape[0]),
                                  "seq_len": int(ids.shape[1]), "device": str(ids.device),
                                  "dense": "the architecture's dense counterpart"}


def _write(work: Path, setup: Any, folded: nn.Module, done: FoldResult) -> None:
    """The folded run folder: weights, config (the source run's, the folded model's config,
    the fold's record) and the source run's tokenizer."""
    from fcaudit.io.fileio import write_text
    from fcaudit.io.runs import write_run
    config = dict(setup.loaded.run_config or {})
    for key in ("weights_sha256", "versions", "fcaudit_run", "results", "train", "fold"):
        config.pop(key, None)
    tokenizer = _tokenizer(setup)
    if tokenizer is not None:
        write_text(work / "tokenizer.json", tokenizer)
    write_run(work, folded, None, {**config, "arch": done.arch,
                                   "model_config": dataclasses.asdict(folded.config),
                                   "fold": done.to_json()})


__all__ = ["FOLD_TOLERANCE", "Exactness", "FoldResult", "FoldSpeed", "fold"]
