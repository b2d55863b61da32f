"""Frontier planning: which families the savings frontier covers, and every point to
replay on them.

A family is covered when switching its gates ``off`` removes exactly one module per
gate (checked bit for bit on the first batch) or when its router has declared experts;
its points come from the calibration set's rules and, for a model that skips on its own,
from the dynamic rule at its own thresholds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fcaudit.core.conditions import FRONTIER
from fcaudit.core.discovery import declared_experts
from fcaudit.core.errors import FcauditError, arg
from fcaudit.core.hooks import hooks as hooked
from fcaudit.core.nll import device_of, logits_of
from fcaudit.engine.cache import CoefficientCache
from fcaudit.engine.frontier import (
    GATE,
    Covered,
    FrontierPoint,
    frontier_families,
    own_point,
    own_thresholds,
    plan_points,
    skipped_units,
)
from fcaudit.engine.options import Prepared, Progress
from fcaudit.engine.passes import Ranks, batches
from fcaudit.engine.probe import Probe
from fcaudit.engine.stages import frontier_calibration, record_frontier_calibration


def frontier_plan(setup: Prepared, first: Probe) -> list[Covered]:
    """The families the savings frontier covers (none without ``frontier``); a frontier
    asked for a model with no soft-gate or routed family is refused."""
    asked = setup.options.frontier
    if asked is False or (asked is None and not setup.options.execution) or \
            not setup.inputs.next_token:  # token windows only (others refuse frontier=True)
        return []
    covered = frontier_families(setup.sites, first.coefficients,
                                declared_experts(setup.model) or [])
    if not covered and asked:
        raise FcauditError(f"{arg(FRONTIER, py='AuditOptions(frontier=True)')}: the audited "
                           "sites have no soft gate (one coefficient per token) and no router "
                           "with declared experts, so nothing could be skipped; drop the "
                           "option")
    return covered


def frontier_points(setup: Prepared, cache: CoefficientCache, covered: Sequence[Covered],
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


def own_skips(setup: Prepared) -> list[float] | None:
    """Each declared block's executed fraction on the evaluation set (a counting pass,
    no FLOPs): below 1 where the model skips tokens on its own."""
    from fcaudit.engine.execution import execution_pass
    if setup.blocks is None:
        return None
    size, net = setup.options.batch_size, setup.model
    counted = execution_pass(net, setup.blocks, (x for _, x in batches(
        setup.eval_source, size, device_of(net))), flops=False)
    return counted["blocks_executed_per_layer"]


def eval_gates(cache: CoefficientCache, fam: Covered) -> dict[str, Tensor]:
    return {s.name: torch.cat([cache.coefficients(b, s.name).reshape(-1)
                               for b in range(cache.n_batches)]) for s in fam.sites}


@torch.no_grad()
def off_mismatch(setup: Prepared, fam: Covered) -> str | None:
    """Why switching the family's gates to their ``off`` value does not remove exactly one
    module per gate on the first evaluation batch (None: it does, bit for bit). The module
    is the site's declared gated module (its output zeroed), else the block of its layer
    (the block passing its input through, as ``h + 0 F(h)`` does, or its update zeroed, as
    for SkipGate's ``body``). A coefficient that only reweights (mixing weights, a keep-score
    that reorders tokens) removes no module, and gets no frontier: it would be mispriced."""
    gated = [s.gate.gated for s in fam.sites]
    modules = gated if all(gated) else setup.blocks
    if modules is None or len(modules) != len(fam.sites):
        return (f"the {len(fam.sites)} gates are not one per declared block "
                f"({len(modules) if modules else 'no'} blocks): no module to price their skips")
    net = setup.model
    _, x = next(batches(setup.eval_source, setup.options.batch_size, device_of(net)))
    recorded = setup.executor.record(x, sites=fam.sites)[1]
    off = setup.executor.replay(x, {s: torch.full_like(recorded[s.name], s.gate.off)
                                    for s in fam.sites}).logits
    modes = (_zeroed,) if all(gated) else (_passed_through, _zeroed)
    diffs = []
    for mode in modes:
        with hooked(net, {m: mode for m in modules if m}):
            removed = logits_of(net(x))
        if torch.equal(off, removed):
            return None
        diffs.append(float((off.double() - removed.double()).abs().max()))
    return (f"setting {fam.family}'s gates to {fam.sites[0].gate.off} does not remove exactly "
            f"one module per gate ({', '.join(m for m in modules if m)[:120]}; max logit "
            f"difference {min(diffs):.3g}): these coefficients do not switch a computation "
            "off, so no skipped FLOPs can be priced")


def _zeroed(_m: nn.Module, _args: tuple[Any, ...], out: Any) -> Any:
    return torch.zeros_like(out) if isinstance(out, Tensor) else out


def _passed_through(_m: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
    first = args[0] if args else None
    same = isinstance(first, Tensor) and isinstance(out, Tensor) and first.shape == out.shape
    return first if same else out


def frontier_units(cache: CoefficientCache, covered: Sequence[Covered],
                   points: Sequence[FrontierPoint]) -> dict[str, np.ndarray]:
    """Point key -> skipped units per layer (tokens or expert slots), summed over the
    evaluation set's recorded coefficients."""
    by_family = {fam.family: fam for fam in covered}
    units = {p.key: np.zeros(len(by_family[p.family].sites)) for p in points}
    for b in range(cache.n_batches):
        coefficients = {s.name: cache.coefficients(b, s.name)
                        for fam in covered for s in fam.sites}
        for p in points:
            units[p.key] += skipped_units(p, coefficients, by_family[p.family])
    return units
