"""Measure: record, plan and replay every run on every batch, and summarize.

:func:`measure` takes a :class:`~fcaudit.engine.options.Prepared` audit, the opened
cache and the identity probe and returns typed :class:`Measurements` (rank 0; the other
ranks only record and replay their batches). Execution is measured later, with the
result (:mod:`fcaudit.engine.assemble`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fcaudit.core.interventions import StaticProfiles, draw
from fcaudit.engine.analyses import Section
from fcaudit.engine.analyses.runs import analysis_runs, analysis_sections
from fcaudit.engine.cache import CoefficientCache, EvaluationShard
from fcaudit.engine.exit_sweep import exit_frontier, exit_points
from fcaudit.engine.exits import ExitSummary, exit_plan, exit_summary
from fcaudit.engine.frontier import Covered, FrontierPoint
from fcaudit.engine.frontier_plan import frontier_plan, frontier_points
from fcaudit.engine.options import Prepared, Progress
from fcaudit.engine.passes import Ranks
from fcaudit.engine.plan import ReplayInputs, Run, plan_runs
from fcaudit.engine.probe import Probe, ablation_plan
from fcaudit.engine.result import Identity
from fcaudit.engine.stages import (
    Replays,
    calibration_profiles,
    record_calibration,
    record_evaluation,
    replay_results,
    replay_stage,
)
from fcaudit.engine.summary import (
    Description,
    Summary,
    accuracies,
    describe,
    example_hits,
    paired_bootstrap,
    summarize,
)


@dataclass(frozen=True)
class Measurements:
    """One audit of ``setup``'s evaluation sequences up to (not including) execution:
    what :func:`fcaudit.engine.assemble.build_result` turns into the result."""

    setup: Prepared
    runs: list[Run]
    replays: Replays
    identity: Identity  # the probe's, with every batch's identity replay
    description: Description
    summary: Summary
    covered: list[Covered]  # the frontier's families (none without a frontier)
    points: list[FrontierPoint]
    profiles: StaticProfiles
    reuse: list[dict[str, int]]  # per rank: replay batches reused and recomputed
    recorded: dict[str, dict[str, int]]  # stage -> record batches proven and recorded
    timings: dict[str, float] = field(default_factory=dict)  # record_s, replay_s
    exits: ExitSummary | None = None  # exit models run with an exit condition
    analyses: dict[str, Section] = field(default_factory=dict)  # by analysis name
    # each site's coefficient shape on the first batch, as the probe recorded it
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


def measure(setup: Prepared, cache: CoefficientCache, first: Probe, progress: Progress,
            ranks: Ranks) -> Measurements | None:
    """Record and replay every batch of ``setup``'s evaluation sequences and summarize
    them (rank 0; the other ranks return None after their replays)."""
    opts = setup.options
    recorded = _summed(ranks.gather({
        "calibration": record_calibration(setup, cache, progress, ranks),
        "evaluation": record_evaluation(setup, cache, progress, ranks)}, "recorded"))
    profiles = calibration_profiles(setup, cache)
    cache.verify_all()
    timings = {"record_s": time.perf_counter() - setup.started}
    inputs = _replay_inputs(setup, cache, profiles, first, progress)
    skipped = setup.not_applicable
    covered, points = frontier_points(setup, cache, frontier_plan(setup, first), progress,
                                      ranks)
    runs = plan_runs(setup.sites, opts, setup.conditions, setup.interventions,
                     ablation_plan(setup, first),
                     points, skipped, exit_points(inputs.exits)) + analysis_runs(setup, first)
    started = time.perf_counter()
    reuse = ranks.gather(replay_stage(setup, inputs, runs, progress, ranks), "replayed")
    if not ranks.main:
        return None
    replays = replay_results(cache, opts)
    timings["replay_s"] = time.perf_counter() - started
    diff = replays.identity_diff
    identity = dataclasses.replace(first.identity, exact=first.identity.exact and diff == 0,
                                   max_abs_diff=max(first.identity.max_abs_diff, diff))
    description = describe(cache, setup.sites, inputs.ids)
    original = _original_hits(cache) if setup.objective.accuracy else None
    summary = summarize(runs, replays.per_run, description.original_nll, setup.sites, opts,
                        setup.conditions,
                        skipped, accuracies(runs, replays.hits, original),
                        example_hits(runs, replays.hits, original))
    return Measurements(setup, runs, replays, identity, description, summary, covered, points,
                        profiles, reuse, recorded, timings,
                        _exits(setup, inputs, runs, replays.per_run, summary),
                        analysis_sections(setup, runs, replays.per_run, profiles),
                        {name: tuple(t.shape) for name, t in first.coefficients.items()})


def _exits(setup: Prepared, inputs: ReplayInputs, runs: Sequence[Run],
           per_run: Sequence[np.ndarray], summary: Summary) -> ExitSummary | None:
    """The exits section: depths, the gap closed and the exit frontier."""
    per_seq = dict(zip((r.key for r in runs), per_run, strict=True))
    boot = paired_bootstrap(setup.inputs.n_eval, setup.options)
    frontier = exit_frontier(inputs.exits, per_seq, boot)
    return exit_summary(inputs.exits, summary.exit_gap, boot, frontier)


def _replay_inputs(setup: Prepared, cache: CoefficientCache, profiles: StaticProfiles,
                   first: Probe, progress: Progress) -> ReplayInputs:
    """What feeding the runs needs: one random draw per repeat (a derangement, and position
    permutations for every position count the sites have), the token ids, if any, and the
    exit references' layers (real passes, with progress)."""
    lengths, seeds = _position_counts(setup, first), setup.seeds
    return ReplayInputs(cache, setup.sites, profiles,
                        [draw(seed, setup.inputs.n_eval, lengths[0], lengths[1:])
                         for seed in seeds.draws], seeds.interventions,
                        setup.token_ids, exit_plan(setup, progress))


def _position_counts(setup: Prepared, first: Probe) -> list[int]:
    """The position counts of the sites' coefficients, the evaluation windows' first."""
    return setup.inputs.position_counts([int(first.coefficients[s.name].shape[1])
                                         for s in setup.sites])


def _original_hits(cache: CoefficientCache) -> np.ndarray:
    """The record pass's correct classifications per example (classification only)."""
    return np.concatenate([cache.batch(b, EvaluationShard.HITS).numpy()
                           for b in range(cache.n_batches)])


def _summed(per_rank: Sequence[Mapping[str, Mapping[str, int]]]) -> dict[str, dict[str, int]]:
    """Every rank's record counts, added up per stage."""
    return {stage: {k: sum(r[stage][k] for r in per_rank) for k in per_rank[0][stage]}
            for stage in per_rank[0]}


def reuse_summary(per_rank: Sequence[Mapping[str, Any]], n_runs: int,
                  recorded: Mapping[str, Mapping[str, int]]) -> dict[str, Any]:
    """What came from the cache: record batches only once recomputed bit for bit (one
    forward each, the price of reuse), replay batches only on top of proven records, when
    every run's fed tensors are bit for bit the stored ones (else replayed), and once a
    fresh sample of their runs replayed again equals them bit for bit (the proof is the
    same on every rank: one seed, one sample)."""
    reused = sum(r["batches_reused"] for r in per_rank)
    recomputed = sum(r["batches_recomputed"] for r in per_rank)
    kept = sum(r.get("runs_kept_from_earlier_rounds", 0) for r in per_rank)  # --target-ci
    proofs = {f"{stage}_batches_{what}": recorded[stage][f"batches_{what}"]
              for stage in ("evaluation", "calibration") for what in ("proven", "recorded")}
    return {"batches_reused": reused, "batches_recomputed": recomputed,
            "runs_reused": reused * n_runs + kept, "runs_recomputed": recomputed * n_runs - kept,
            **proofs, **per_rank[0]["proof"],
            "rule": "a cached record batch (evaluation or calibration) is used only after its "
                    "original pass, recomputed now, equals it bit for bit (one forward pass "
                    "per reused batch); a cached replay batch only on top of those records, "
                    "when every run's SHA-256 of its token ids, schedule, identity and fed "
                    "coefficient tensors equals the stored one, and once the runs sampled "
                    "afresh at this resume (verify_reuse sample: every run of the plan on one "
                    "cached batch drawn with verify_seed; all: every run of every cached "
                    "batch), replayed again, equal their cached results bit for bit"}
