"""Exit models in the audit (docs/method.md, Early exit): the references' layers, measured
before the replays, and the section of audit.json that places the learned exit controller
between fixed exit and oracle exit.

The layers come from real passes: the model's own exits (hooks on its exit rules) on the
calibration windows, for fixed exit, and on the evaluation windows, for the depth it
reports; the oracle's from one full-depth pass per evaluation batch (hooks on its exit
heads). They are recomputed by every audit that runs an exit condition (no cache: a pass
per batch, the price of a reference that is never stale).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fcaudit.core.conditions import CORRECT, FIXED_EXIT, ORACLE_EXIT, needing
from fcaudit.core.errors import ModelError, arg
from fcaudit.core.exits import (
    ExitPlan,
    exit_depth,
    exit_model,
    exit_scores,
    exit_sites,
    head_predictions,
    oracle_layers,
    own_exits,
)
from fcaudit.core.hooks import hooks
from fcaudit.core.layout import has_positions
from fcaudit.core.nll import device_of
from fcaudit.core.replaying import replaying
from fcaudit.engine.exit_parts import ExitFrontier, ExitSummary
from fcaudit.engine.exit_sweep import own_threshold, sweep_layers
from fcaudit.engine.metrics import Bootstrap, retention
from fcaudit.engine.passes import batches, record_batch
from fcaudit.engine.result_parts import Retention
from fcaudit.io.examples import call_model


def asked(setup: Any) -> bool:
    """Whether the audit runs an exit condition on a model with exit sites."""
    wanted = set(needing("exits")) & set(setup.options.conditions)
    return bool(wanted) and bool(exit_sites(setup.sites))


@torch.no_grad()
def exit_plan(setup: Any) -> ExitPlan | None:
    """The references' layers for this audit, or None when it runs no exit condition."""
    if not asked(setup):
        return None
    from fcaudit.engine.execution import inference
    net = exit_model(setup.model, setup.sites)
    size, device = setup.options.batch_size, device_of(setup.model)
    calib, oracle, own = [], [], []
    with inference(setup.model):
        check_follows(setup, net, next(batches(setup.eval_source, size, device))[1])
        for _, x in batches(setup.calib_source, size, device):
            calib.append(own_exits(net, lambda x=x: call_model(setup.model, x)).cpu())
        for _, x in batches(setup.eval_source, size, device):
            own.append(own_exits(net, lambda x=x: call_model(setup.model, x)).cpu())
            preds = head_predictions(net, lambda x=x: call_model(setup.model, x))
            oracle.append(oracle_layers(preds).cpu())
    layers, own_layers = len(exit_sites(setup.sites)) + 1, torch.cat(own)
    with inference(setup.model):
        sweep = sweep_layers(setup, net, own_layers)
    return ExitPlan(exit_depth(calib, layers), torch.cat(oracle), own_layers,
                    has_positions(exit_sites(setup.sites)), own_threshold(net), sweep)


def check_follows(setup: Any, net: Any, x: Any) -> None:
    """Refuse, naming the site, an exit rule that does not follow its site's output: a
    replay of the recorded scores must reproduce the model's own exits bit for bit, and
    scores that stop every token after exit site ``k`` must stop every token there, for
    every ``k`` (one batch; the exit conditions and every replayed score rest on it)."""
    sites, run = exit_sites(setup.sites), lambda: call_model(setup.model, x)
    own = own_exits(net, run)
    _, coefficients, _ = record_batch(setup.model, setup.sites, x, None)
    fed = {"replaying the recorded scores": (own, coefficients)}
    for k in range(len(sites) + 1):
        layers = torch.full_like(own, k)
        fed[f"feeding scores that stop every token after exit layer {k}"] = (
            layers, exit_scores(sites, layers, coefficients))
    for what, (expected, scores) in fed.items():
        with replaying(setup.model, {s: scores[s.name] for s in sites}):
            got = own_exits(net, run)
        if not torch.equal(got, expected):
            wrong = got != expected
            site = sites[min(int(torch.minimum(got, expected)[wrong].min()), len(sites) - 1)]
            raise ModelError(f"exit site {site.name}: {what}, the model's exit rule stops "
                             f"{int(wrong.sum())} of {wrong.numel()} tokens at another layer; "
                             "its exit decision must read the site's output and nothing else "
                             "(no recomputed score, no state kept between calls)",
                             site=site.name)


def degenerate(own: torch.Tensor, layers: int) -> str | None:
    """A rule that does not adapt, in words: every unit stops at one and the same layer
    (none exits before the last, all after the first, or all after one layer between):
    a model of that fixed depth, whose FLOPs against the twin are no saving of adaptive
    depth (the execution answer says so: :func:`~fcaudit.engine.twin.execute`)."""
    if own.numel() == 0 or bool((own != own.flatten()[0]).any()):
        return None
    depth = int(own.flatten()[0]) + 1
    if depth == layers:
        return (f"no token exits before the last layer: the threshold is never reached, so "
                f"every token runs all {layers} layers (no savings)")
    if depth == 1:
        return ("every token exits after the first layer: the rule does not adapt (a "
                "depth-1 model, not a saving of adaptive depth)")
    return (f"every token exits after layer {depth} of {layers}: the rule does not adapt (a "
            f"depth-{depth} model, not a saving of adaptive depth)")


def exit_summary(plan: ExitPlan | None, gap: Retention | None,
                 frontier: ExitFrontier | None = None) -> ExitSummary | None:
    """The audit.json section of an exit model, or None without an exit condition (no
    depth per position where the sites have no position axis)."""
    if plan is None:
        return None
    cal, own = plan.calibration, plan.own
    L = cal.layers
    return ExitSummary(
        depth=L, calibration_mean_depth=cal.mean, fixed_exit_depth=cal.fixed() + 1,
        fixed_exit_depth_per_position=[int(k) + 1 for k in cal.fixed_per_position()]
        if plan.positions else [],
        evaluation_mean_depth=float((own + 1).double().mean()),
        oracle_mean_depth=float((plan.oracle + 1).double().mean()),
        share_exiting_first_layer=float((own == 0).double().mean()),
        share_full_depth=float((own == L - 1).double().mean()),
        note=degenerate(own, L), gap_closed=gap, frontier=frontier)


def gap_closed(per_seq: dict[str, np.ndarray], boot: Bootstrap) -> Retention | None:
    """``(L(fixed) - L(learned)) / (L(fixed) - L(oracle))`` in percent with the paired
    bootstrap (the retention formula with fixed exit as the floor and the oracle as the
    top); undefined when the fixed-to-oracle gap is not clearly above 0. None when either
    reference was not run."""
    if FIXED_EXIT not in per_seq or ORACLE_EXIT not in per_seq:
        return None
    share = retention(per_seq[CORRECT], per_seq[ORACLE_EXIT], per_seq[FIXED_EXIT], boot)
    if share.defined:
        return share
    lo, hi = share.gap_ci95
    return Retention(share.gap, share.gap_ci95, None, None, False,
                     f"the {FIXED_EXIT}-to-{ORACLE_EXIT} gap {share.gap:+.4f} has a 95% "
                     f"interval [{lo:+.4f}, {hi:+.4f}] that is not above 0: the oracle's exits "
                     f"lose no less than fixed exit's, so no share of it is reported")


def with_exit_conditions(options: Any, sites: Any, model: Any) -> Any:
    """``options`` with the exit conditions added for a model with exit sites (checked now,
    before any pass): an exit model is always placed between fixed exit and the oracle
    (other models are left alone)."""
    if not exit_sites(sites):
        return options
    exit_model(model, sites)
    missing = tuple(n for n in needing("exits") if n not in options.conditions)
    return dataclasses.replace(options, conditions=(*options.conditions, *missing))


@torch.no_grad()
def check_twin(setup: Any) -> None:
    """Refuse a dense twin of another depth or width than an exit model: executed depth
    and FLOPs are read against it, so the twin must be the same network at full depth.
    Depth: the blocks each declares; width: the shape of what each block reads and
    returns per unit that exits, on the first evaluation window (the blocks that ran there:
    one ordinary pass, as changing the rule would be a call the audit's own checks do not
    expect). A unit is an example where the exit sites have no
    position axis (``[C, H, W]`` for a convolution: the last axis alone is its image
    width, not its channels), else a token (the last axis: an exit model's blocks see the
    running tokens packed)."""
    sites = exit_sites(setup.sites)
    if setup.dense is None or not sites or setup.blocks is None:
        return
    from fcaudit.engine.inputs import resolve_block_paths
    twin_blocks = resolve_block_paths(setup.dense, setup.blocks_glob) or []
    _, x = next(batches(setup.eval_source, 1, device_of(setup.model), [0]))
    axes = 1 if has_positions(sites) else None
    mine = block_shapes(setup.model, setup.blocks, x, axes)
    twin = block_shapes(setup.dense, twin_blocks, x, axes)
    ran = [i for i, p in enumerate(setup.blocks) if p in mine]
    if len(setup.blocks) != len(twin_blocks) or \
            any(mine[setup.blocks[i]] != twin.get(twin_blocks[i]) for i in ran):
        unit = "token" if axes else "example"
        raise ModelError(
            f"exit site {sites[0].name}: the dense twin has {len(twin_blocks)} blocks of "
            f"per-{unit} shapes (in -> out) {_shapes(twin)}, the model {len(setup.blocks)} of "
            f"{_shapes(mine)}; executed depth and FLOPs are read against the twin, so give "
            f"the same network run to full depth ({arg('dense')})", site=sites[0].name)


def block_shapes(net: Any, paths: Sequence[str], x: Any,
                 axes: int | None) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Per block that ran, in order: the shapes of its first input and first output tensor, the last
    ``axes`` axes (None: all but the batch axis)."""
    from fcaudit.engine.execution import inference
    seen: dict[str, tuple[tuple[int, ...], ...]] = {}

    def unit(t: Any) -> tuple[int, ...]:
        return tuple(t.shape[-axes:] if axes else t.shape[1:])

    def keep(path: str) -> Any:
        def hook(_m: Any, args: Any, out: Any) -> None:
            first = out[0] if isinstance(out, (tuple, list)) else out
            seen.setdefault(path, (unit(args[0]), unit(first)))
        return hook

    with inference(net), hooks(net, {p: keep(p) for p in paths}):
        call_model(net, x)
    return {p: seen[p] for p in paths if p in seen}


def _shapes(shapes: dict[str, tuple[tuple[int, ...], ...]]) -> str:
    return ", ".join(f"{list(i)} -> {list(o)}" for i, o in shapes.values()) or "none"
