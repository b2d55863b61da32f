"""The identity probe: the first evaluation batch recorded and replayed in memory,
before anything is written.

Sites that run twice, outputs no adapter fits, non-floating coefficients, targets the
objective cannot score, swapped axes and a non-exact identity replay all stop the audit
here, naming the site and the likely causes; the probe's coefficients then size the
expert ablations and the cache, and every rank must have computed them alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fcaudit.core.adapters import same_bits
from fcaudit.core.arrays import blamed_on_inputs
from fcaudit.core.digest import digest_tensors
from fcaudit.core.errors import FcauditError, IdentityError, ModelError
from fcaudit.core.layout import check_family_positions
from fcaudit.core.nll import device_of
from fcaudit.engine.analyses.base import Later
from fcaudit.engine.inputs import resolve_block_paths
from fcaudit.engine.objectives import check_targets
from fcaudit.engine.options import Prepared
from fcaudit.engine.passes import (
    Executor,
    Ranks,
    batches,
    check_finite,
    check_finite_losses,
    check_units,
    why_passes_differ,
)
from fcaudit.engine.plan import Run
from fcaudit.engine.result import Identity
from fcaudit.engine.stages import ALLOW_NONEXACT, IDENTITY_CAUSES
from fcaudit.engine.summary import check_parts
from fcaudit.io.examples import ExampleBatch, call_model


@dataclass
class Probe:
    """The first evaluation batch, recorded and replayed in memory (and the wall seconds of
    those two passes, from which the plan estimates the audit's time)."""

    identity: Identity
    coefficients: dict[str, Tensor]
    nll: Tensor
    hits: Tensor | None = None  # classification: 1 per correctly classified example
    record_s: float = 0.0  # the record pass of the first batch
    replay_s: float = 0.0  # its identity replay
    # decided from it once (engine.run): the analyses' runs (expert ablations, ...), and
    # by analysis name the plans placed once the audit is recorded (the savings frontier)
    planned: tuple[Run, ...] = ()
    later: tuple[tuple[str, Later], ...] = ()


def first_batch(setup: Prepared) -> Any:
    """The first evaluation batch, on the model's device."""
    return next(batches(setup.eval_source, setup.options.batch_size, device_of(setup.model)))[1]


@torch.no_grad()
def probe(setup: Prepared) -> Probe:
    """Record and replay the first evaluation batch in memory, before anything is written.

    Sites that run twice, outputs no adapter fits, non-floating coefficients, targets the
    objective cannot score and a non-exact identity replay all stop the audit here (the
    last one unless ``allow_nonexact_identity``), naming the site and the likely causes.
    """
    net, sites, objective = setup.model, setup.sites, setup.objective
    x = first_batch(setup)
    with blamed_on_inputs(lambda: call_model(net, x), x, "the first evaluation batch"):
        if objective.checks_targets:  # every target against the logits, before any score
            _check_targets(setup, setup.executor.record(x, None)[0])
        started = time.perf_counter()
        logits, coefficients, nll = setup.executor.record(x, objective)
        record_s = time.perf_counter() - started
    check_finite(coefficients, "evaluation data")  # before any file is written
    check_finite_losses(nll, objective, "the unperturbed record pass, batch 0")
    check_family_positions(sites, coefficients)
    check_parts(sites, coefficients)
    _check_axes(setup.executor, x)
    if setup.blocks_glob is not None and setup.blocks is not None:
        from fcaudit.engine.execution import refuse_idle_blocks
        refuse_idle_blocks(setup.blocks_glob, x, {"the model": (net, setup.blocks), **(
            {"the dense model": (setup.dense, resolve_block_paths(
                setup.dense, setup.blocks_glob) or [])} if setup.dense is not None else {})})
    started = time.perf_counter()
    replayed = setup.executor.replay(x, {s: coefficients[s.name] for s in sites},
                            objective=objective)
    replay_s = time.perf_counter() - started
    hits = objective.hits(logits, x)
    if same_bits(logits, replayed.logits):
        return Probe(Identity(True, 0.0, setup.options.allow_nonexact_identity,
                              "identity replay is bitwise exact"), coefficients, nll, hits,
                     record_s, replay_s)
    units = objective.units(replayed.output, x)
    check_units(units, nll.shape, objective, "the identity replay of batch 0")
    diff = float((units - nll).abs().max())
    again, _, _ = setup.executor.record(x, objective)
    culprit, fix = None, None
    if not same_bits(logits, again):
        cause, fix = why_passes_differ(net, lambda: setup.executor.record(x, None)[0])
    else:
        culprit = _first_nonexact_site(setup, coefficients, x, logits)
        cause = f"replaying site {culprit} alone already changes the output" if culprit \
            else "replaying all sites together changes the output"
    unit = "per-token NLL" if objective.tokens else f"{objective.name} loss"
    if fix is None:
        message = (f"identity replay is not exact: replaying the recorded coefficients "
                   f"changes the {unit} by up to {diff:.3g} nats ({cause}). Likely causes: "
                   f"{IDENTITY_CAUSES}")
        fix = "fix the model (model.eval(), fixed seeds, deterministic kernels)"
    else:  # state carried across calls: said first, with its own fix
        message = (f"identity replay is not exact: {cause}; replaying the recorded "
                   f"coefficients changes the {unit} by up to {diff:.3g} nats")
    if not setup.options.allow_nonexact_identity:
        raise IdentityError(f"{message}. No verdict can rest on such a replay: {fix} or rerun "
                            f"with {ALLOW_NONEXACT} to see the numbers flagged as not exact",
                            site=culprit, max_abs_diff=diff)
    return Probe(Identity(False, diff, True, message), coefficients, nll, hits, record_s,
                 replay_s)


def _check_targets(setup: Prepared, logits: Any) -> None:
    """Every evaluation and calibration target must be one the objective can score
    (classification: an integer class of the first batch's logits)."""
    for where, targets in setup.inputs.targets():
        check_targets(setup.objective, logits, targets, where)


def _check_axes(executor: Executor, x: Any) -> None:
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
        executor.record(bigger, None)
    except FcauditError as exc:
        if positions is None:
            raise ModelError(
                f"{exc} (with {batch + 1} examples; with {batch} the shape fitted only "
                "because an axis has as many entries as the batch: are the output's axes "
                "swapped? give the site an adapter that puts the examples first)") from exc
        raise ModelError(
            f"{exc} (with {batch + 1} sequences of {positions} tokens; with {batch} of "
            f"{positions} the shape fitted only because the two counts are equal: are the "
            "output's axes [positions, batch, ...]? give the site an adapter that transposes "
            "them)") from exc


def _cat_first(inputs: Any) -> Any:
    """The batch's inputs with its first example repeated at the end."""
    if isinstance(inputs, dict):
        return {k: torch.cat([v, v[:1]]) for k, v in inputs.items()}
    return torch.cat([inputs, inputs[:1]])


def _first_nonexact_site(setup: Prepared, coefficients: dict[str, Tensor], x: Any,
                         logits: Any) -> str | None:
    for site in setup.sites:
        replayed = setup.executor.replay(x, {site: coefficients[site.name]},
                                objective=setup.objective)
        if not same_bits(replayed.logits, logits):
            return site.name
    return None


def same_probe_on_every_rank(ranks: Ranks, first: Probe) -> None:
    """Every process computed the first batch's coefficients and NLL bit for bit alike: a
    rank whose model or code behaves differently is refused, not merged."""
    named = [*sorted(first.coefficients.items()), ("nll", first.nll)]
    digests = ranks.gather(digest_tensors(named).hex(), "comparing the first batch")
    odd = [r for r, d in enumerate(digests) if d != digests[0]]
    if odd:
        raise ModelError(
            f"rank(s) {', '.join(map(str, odd))} computed other coefficients or NLL on the "
            f"first evaluation batch than rank 0 (of {ranks.world} processes): every process "
            "must run the same model, code, weights and data on the same kind of device; "
            "fix the differing processes and rerun")
