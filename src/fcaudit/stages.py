"""The two heavy stages, batch by batch into the cache: record and replay.

**Record**: calibration batches (float64 sums per batch, added in batch order later)
and evaluation batches (per-token NLL and every site's coefficients). **Replay**: every
planned run on every evaluation batch, batch-outer (all runs of a batch before the next
batch), the identity replay checked on each batch, per-layer runs on the suffix of the
model when prefix reuse is proven exact, routers' choices counted. Each finished batch is
a checksummed shard, so either stage resumes after an interruption, and under torchrun
each rank takes its own batches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from .adapters import same_bits
from .cache import CoefficientCache
from .contract import Site
from .distributed import SINGLE, Ranks
from .errors import FcauditError
from .interventions import StaticProfiles, batch_sums
from .nll import device_of, token_nll
from .options import AuditOptions, Progress, Setup
from .passes import batches, check_finite, check_finite_nll, record_batch, replay_batch
from .plan import ReplayInputs, Run, feed, routing_sites
from .replaying import BlockTrace
from .routers import changed_rows, expert_counts

IDENTITY_CAUSES = (
    "randomness in the forward pass (dropout or a model left in training mode, sampling, "
    "jitter noise), a model whose output depends on state that changes between calls, "
    "nondeterministic kernels (some CUDA operations), or a controller output the model "
    "uses in a way the site's adapter does not reproduce")


def record_calibration(setup: Setup, cache: CoefficientCache, progress: Progress,
                       ranks: Ranks = SINGLE) -> None:
    """This rank's calibration batches: each batch's float64 sums, cached."""
    net, size = setup.model, setup.options.batch_size
    n = -(-len(setup.data.calib_ids) // size)
    todo = ranks.mine([b for b in range(n) if not cache.has(cache.calib_name(b))])
    for done, (b, x) in enumerate(batches(setup.data.calib_ids, size, device_of(net), todo),
                                  start=1):
        _, coefficients, _ = record_batch(net, setup.sites, x)
        check_finite(coefficients, "calibration data")
        sums = batch_sums({k: c.cpu() for k, c in coefficients.items()})
        cache.write(cache.calib_name(b), {f"site::{k}": v for k, v in sums.items()})
        progress("record calibration", done, len(todo), "")


def calibration_profiles(setup: Setup, cache: CoefficientCache) -> StaticProfiles:
    """Static profiles from calibration data only: every batch's sums, added in batch
    order (so the result does not depend on which process recorded which batch)."""
    size, ids = setup.options.batch_size, setup.data.calib_ids
    profiles = StaticProfiles(setup.sites)
    for b in range(-(-len(ids) // size)):
        sums = cache.read(cache.calib_name(b))
        profiles.add_sums({k.removeprefix("site::"): v for k, v in sums.items()},
                          len(ids[b * size:(b + 1) * size]))
    return profiles


def _eval_shard(nll: Tensor, coefficients: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {"nll": nll.cpu(), **{f"site::{k}": v.cpu() for k, v in coefficients.items()}}


def adopt_probe(cache: CoefficientCache, coefficients: Mapping[str, Tensor], nll: Tensor) -> None:
    """Write the probe's batch as shard 0, or check it against a cached shard 0: a cache
    whose first batch a fresh pass does not reproduce bit for bit is never reused."""
    name = cache.eval_name(0)
    shard = _eval_shard(nll, coefficients)
    if not cache.has(name):
        check_finite(coefficients, "evaluation data")
        check_finite_nll(nll, "the unperturbed record pass, batch 0")
        cache.write(name, shard)
    elif not same_bits(cache.read(name), shard):
        raise FcauditError(
            f"the cache in {cache.folder} does not match this model: a fresh pass over the "
            "first batch gives other coefficients or NLL than the cached one (the model "
            "changed in a way its fingerprint cannot see, or its forward pass varies between "
            f"runs); delete {cache.folder} and rerun")


def record_evaluation(setup: Setup, cache: CoefficientCache, progress: Progress,
                      ranks: Ranks = SINGLE) -> None:
    """This rank's evaluation batches, one unperturbed pass each; resumes at the shards
    not yet on disk."""
    net, sites = setup.model, setup.sites
    todo = ranks.mine([b for b in range(cache.n_batches) if not cache.has(cache.eval_name(b))])
    for done, (b, x) in enumerate(batches(setup.data.eval_ids, cache.batch_size,
                                          device_of(net), todo), start=1):
        _, coefficients, nll = record_batch(net, sites, x)
        check_finite(coefficients, "evaluation data")
        check_finite_nll(nll, f"the unperturbed record pass, batch {b}")
        cache.write(cache.eval_name(b), _eval_shard(nll, coefficients))
        progress("record evaluation", done, len(todo), "")


def replay_stage(setup: Setup, inputs: ReplayInputs, runs: Sequence[Run], plan: str,
                 progress: Progress, ranks: Ranks = SINGLE) -> None:
    """This rank's batches under every run, batch by batch (every run of one batch before
    the next batch); each finished batch is cached, so an interrupted replay resumes there.
    """
    cache = inputs.cache
    todo = ranks.mine([b for b in range(cache.n_batches)
                       if not cache.has(cache.replay_name(plan, b))])
    for done, (b, x) in enumerate(batches(setup.data.eval_ids, cache.batch_size,
                                          device_of(setup.model), todo), start=1):
        cache.write(cache.replay_name(plan, b), _replay_one_batch(setup, inputs, runs, b, x))
        progress("replay", done, len(todo), f"batch {b + 1} of {cache.n_batches}")


@dataclass
class Replays:
    """Every batch's replay results, gathered: per-sequence NLL per run (run order), the
    identity replay's max |diff|, how the schedule went, and routing counts."""

    per_run: list[np.ndarray]
    identity_diff: float
    schedule: dict[str, Any]
    route_load: dict[str, Tensor]  # router site -> token-slots per expert (correct replay)
    route_changed: Tensor | None  # [tracked runs, router sites] tokens re-routed


def replay_results(cache: CoefficientCache, plan: str, options: AuditOptions) -> Replays:
    shards = [cache.read(cache.replay_name(plan, b)) for b in range(cache.n_batches)]
    per_run = torch.cat([s["nll"] for s in shards], dim=1).numpy()
    states = [int(s["prefix"]) for s in shards]
    schedule = {"requested": options.schedule,
                "batches_prefix_reused": states.count(PREFIX_REUSED),
                "batches_fell_back_to_full_passes": states.count(PREFIX_FELL_BACK),
                "batches": len(states)}
    load = {k.removeprefix("route_load::"): sum(s[k] for s in shards)
            for k in shards[0] if k.startswith("route_load::")}
    changed = sum(s["route_changed"] for s in shards) if "route_changed" in shards[0] else None
    return Replays(list(per_run), max(float(s["identity_diff"]) for s in shards), schedule,
                   load, changed)


PREFIX_OFF, PREFIX_REUSED, PREFIX_FELL_BACK = 0, 1, 2


@torch.no_grad()
def _replay_one_batch(setup: Setup, inputs: ReplayInputs, runs: Sequence[Run], b: int,
                      x: Tensor) -> dict[str, Tensor]:
    """Every run on batch ``b`` (the correct replay first), per-layer runs on the suffix
    only when prefix reuse is on and proven exact on this batch; for router sites, the
    expert load of the correct replay and how many tokens each main condition re-routes."""
    net = setup.model
    recorded = inputs.cache.batch(b, "nll")
    per_layer = any(r.site is not None for r in runs)
    traced = setup.blocks if setup.options.schedule == "prefix" and per_layer else None
    routed = routing_sites(inputs.sites)
    rows, diff, reuse, state = [], 0.0, None, PREFIX_OFF
    base: dict[str, Tensor] = {}
    shard: dict[str, Tensor] = {}
    changed = []
    for run in runs:
        fed = feed(run, b, inputs, x.device)
        known = reuse.get(run.site.path) if reuse is not None and run.site is not None else None
        tracked = bool(routed) and run.site is None and run.custom is None
        out = replay_batch(net, x, fed, known=known, select=tracked,
                           trace=traced if run.condition == "correct" else None)
        nll = token_nll(out.logits, x).cpu()
        check_finite_nll(nll, f"replay under {run.key}, batch {b}")
        if run.condition == "correct":
            diff = _identity_diff(setup, nll, recorded, b)
            base = out.chosen
            shard.update({f"route_load::{s.name}": expert_counts(base[s.name], fed[s].shape[-1])
                          for s in routed})
            if out.trace is not None:
                reuse, state = _prove_prefix(net, x, fed, inputs.sites, out.trace, out.logits)
        elif tracked:
            changed.append([changed_rows(base[s.name], out.chosen[s.name]) for s in routed])
        rows.append(nll.double().mean(1))
    if routed:
        shard["route_changed"] = torch.tensor(changed, dtype=torch.float64)
    return {"nll": torch.stack(rows), "identity_diff": torch.tensor(diff, dtype=torch.float64),
            "prefix": torch.tensor(state), **shard}


def _identity_diff(setup: Setup, nll: Tensor, recorded: Tensor, b: int) -> float:
    diff = float((nll - recorded).abs().max())
    if diff != 0 and not setup.options.allow_nonexact_identity:
        raise FcauditError(
            f"identity replay is not exact on batch {b}: the per-token NLL differs by up to "
            f"{diff:.3g} nats. Likely causes: {IDENTITY_CAUSES}. Rerun with "
            "--allow-nonexact-identity to see the numbers flagged as not exact")
    return diff


def _prove_prefix(net: nn.Module, x: Tensor, fed: Mapping[Site, Tensor], sites: Sequence[Site],
                  trace: BlockTrace, logits: Tensor) -> tuple[dict[str, Any] | None, int]:
    """Each site's reusable prefix, once the correct replay with the longest prefix stubbed
    reproduces the full correct replay bit for bit (else: full passes for this batch)."""
    prefixes = {s.path: {p: trace.outputs[p] for p in trace.prefix(s.path)} for s in sites}
    longest = max(prefixes.values(), key=len)
    if not longest:
        return None, PREFIX_OFF
    check = replay_batch(net, x, fed, known=longest).logits
    if not same_bits(check, logits):
        return None, PREFIX_FELL_BACK
    return prefixes, PREFIX_REUSED
