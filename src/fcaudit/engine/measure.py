"""Measure: record, plan and replay every run on every batch, and summarize.

:func:`measure` takes a :class:`~fcaudit.engine.options.Prepared` audit, the opened
cache and the identity probe and returns typed :class:`Measurements` (rank 0; the other
ranks only record and replay their batches). Execution is measured later, with the
result (:mod:`fcaudit.engine.measure`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from torch import nn

from fcaudit._version import __version__
from fcaudit.core.adapters import adapter_name
from fcaudit.core.contract import Site
from fcaudit.core.interventions import StaticProfiles, draw
from fcaudit.core.layout import TOKEN_AXES, TOKEN_LAYOUT, shuffled_axes
from fcaudit.engine.analyses import ANALYSES, Section
from fcaudit.engine.analyses.exits import plan_note
from fcaudit.engine.analyses.runs import Recorded, analysis_sections, resolve_later
from fcaudit.engine.budget import AuditPlan
from fcaudit.engine.cache import CoefficientCache, EvaluationShard
from fcaudit.engine.exits import exit_plan
from fcaudit.engine.frontier_parts import ExitSummary
from fcaudit.engine.objectives import loss_name
from fcaudit.engine.options import Prepared, Progress, option_specs, silent
from fcaudit.engine.passes import Ranks
from fcaudit.engine.plan import ReplayInputs, Run, plan_runs
from fcaudit.engine.prepare import execute
from fcaudit.engine.probe import Probe
from fcaudit.engine.result import (
    EXITS,
    NONDETERMINISTIC_KEYS,
    SCHEMA,
    TIMED_VERDICT_KEY,
    AuditResult,
    ExecutionSection,
    Identity,
    ModelInfo,
    Runtime,
    Seeds,
    SiteInfo,
    Timing,
    Verdict,
)
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
    site_parts,
    space,
    summarize,
)
from fcaudit.engine.verdicts import judge
from fcaudit.io.runtime import host, versions

if TYPE_CHECKING:  # the rounds of --target-ci run measure: a type only
    from fcaudit.engine.run import Rounds


@dataclass(frozen=True)
class Measurements:
    """One audit of ``setup``'s evaluation sequences up to (not including) execution:
    what :func:`fcaudit.engine.measure.build_result` turns into the result."""

    setup: Prepared
    runs: list[Run]
    replays: Replays
    identity: Identity  # the probe's, with every batch's identity replay
    description: Description
    summary: Summary
    states: dict[str, Any]  # what each analysis placed once recorded, by name
    profiles: StaticProfiles
    reuse: list[dict[str, int]]  # per rank: replay batches reused and recomputed
    recorded: dict[str, dict[str, int]]  # stage -> record batches proven and recorded
    timings: dict[str, float] = field(default_factory=dict)  # record_s, replay_s
    # an exit rule that stops every unit at one layer, said in words (no saving is counted)
    exit_note: str | None = None
    # each site's coefficient shape on the first batch, as the probe recorded it
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    progress: Progress = silent  # where the analyses' own work reports (benchmark tasks)


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
    states, later = resolve_later(Recorded(setup, cache, progress, ranks, inputs.exits),
                                  first.later)
    runs = plan_runs(setup.sites, opts, setup.conditions, setup.interventions, first.planned,
                     later, skipped)
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
    shapes = {name: tuple(t.shape) for name, t in first.coefficients.items()}
    return Measurements(setup, runs, replays, identity, description, summary, states,
                        profiles, reuse, recorded, timings, plan_note(inputs.exits), shapes,
                        progress)


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


# ---------------------------------------------------------------------- assemble
# Build the result: execution measured, then one :class:`~fcaudit.engine.result.
# AuditResult` from everything computed first (the constructor is called once, nothing is
# patched after).

def build_result(m: Measurements, cache: CoefficientCache, command: str | None,
                 ranks: Ranks, rounds: Rounds | None = None,
                 plan: AuditPlan | None = None) -> AuditResult:
    """Execution, runtime and the result of one measured audit (with ``rounds``, the last
    round of a ``--target-ci`` audit; ``plan``: the cost said before the work, kept beside
    what was measured)."""
    setup, description, summary = m.setup, m.description, m.summary
    timings = dict(m.timings)
    started = time.perf_counter()
    execution = execute(setup, m.exit_note)
    timings["execution_s"] = time.perf_counter() - started
    timings["total_s"] = time.perf_counter() - setup.started
    identity = m.identity
    seeds = setup.seeds
    analyses = analysis_sections(setup, m.runs, m.replays, m.profiles, description.parts,
                                 m.shapes, m.states, cache, execution, m.progress)
    verdict, verdict_numbers = _verdict(m, execution, analyses.get(EXITS))
    return AuditResult(
        schema=SCHEMA, fcaudit_version=__version__, model=_model_info(setup),
        data=setup.data_summary,
        sites=[_site_info(s, m) for s in setup.sites],
        identity_replay_max_abs_diff=identity.max_abs_diff, conditions=summary.conditions,
        per_layer=summary.per_layer, retention=summary.retention,
        interaction=summary.interaction, variance=description.variance,
        variation=description.variation, profiles=description.profiles,
        execution=execution, verdict=verdict, verdict_numbers=verdict_numbers,
        seeds=Seeds(seeds.master, seeds.draws, seeds.draws, seeds.bootstrap),
        settings=_settings(m, execution, analyses), versions=versions(), command=command,
        analyses=analyses or None,
        nondeterministic_keys=[*NONDETERMINISTIC_KEYS, *([TIMED_VERDICT_KEY]
                                                        if _timing(execution) is not None
                                                        else [])],
        runtime=_runtime(m, cache, ranks, timings, rounds, plan),
        identity=None if identity.exact and not identity.allowed_nonexact else identity,
        custom_conditions=summary.custom or None,
        stopping=rounds.stopping if rounds is not None else None,
        not_applicable=dict(setup.not_applicable) or None)


def _timing(execution: ExecutionSection) -> Timing | None:
    return execution.timing if execution.measured else None


def _verdict(m: Measurements, execution: ExecutionSection, exits: ExitSummary | None
             ) -> tuple[Verdict, dict[str, Any]]:
    """The verdict and the numbers each of its answers rests on (an exit model's exits,
    the exits analysis's section, answered first)."""
    setup = m.setup
    kinds = {s.family: setup.kinds[s.name] for s in setup.sites if s.name in setup.kinds}
    return judge(m.description.variance, m.description.variation, m.summary.conditions,
                 m.summary.retention, shuffled_axes(setup.sites), execution, m.identity,
                 exits, loss_name(setup.objective.name), kinds)


def _settings(m: Measurements, execution: ExecutionSection,
              analyses: Mapping[str, Section]) -> dict[str, Any]:
    """The options and facts that change numbers, each at the value the audit ran with
    (an option another one switched off reads as off: None, or 0 timing pairs); how the
    audit is shown, scheduled, stopped or placed changes none: recorded elsewhere
    (``OptionSpec.recorded``; read field by field: ``asdict`` deep-copies, and an
    objective may hold a lock)."""
    setup, summary, opts = m.setup, m.summary, m.setup.options
    return {**{f.name: _as_json(getattr(opts, f.name)) for f, spec in option_specs()
               if spec.recorded == "settings"},
            "conditions": list(setup.conditions),  # JSON's list: equal once read back
            "bootstrap_resamples": opts.bootstrap,
            "calibration_sequences_used_for_static": setup.inputs.n_calib,
            "objective": setup.objective.name,
            "timing_pairs": t.pairs if (t := _timing(execution)) is not None else 0,
            "layer_index": "a site's index within its family",
            # custom conditions in the order given (audit.json sorts its keys)
            **({"interventions": list(summary.custom)} if summary.custom else {}),
            **{key: value for a in ANALYSES.values() if a.settings is not None
               for key, value in a.settings(m, analyses).items()}}


def _as_json(value: Any) -> Any:
    """An option's value as audit.json reads it back (a tuple: a list; a path: text)."""
    return list(value) if isinstance(value, tuple) else \
        str(value) if isinstance(value, Path) else value


def _runtime(m: Measurements, cache: CoefficientCache, ranks: Ranks,
             timings: dict[str, float], rounds: Rounds | None,
             plan: AuditPlan | None) -> Runtime:
    return Runtime(host(), {k: round(v, 3) for k, v in timings.items()},
                   {**m.replays.schedule, "processes": ranks.world,
                    "process_group": ranks.backend}, cache.disk_usage(),
                   reuse_summary(m.reuse, len(m.runs), m.recorded),
                   rounds=rounds.spent if rounds is not None else None,
                   placement=m.setup.loaded.placement,
                   plan=plan.to_json() if plan is not None else None)


def _model_info(setup: Prepared) -> ModelInfo:
    net, loaded = setup.model, setup.loaded
    param = next(net.parameters(), None)
    return ModelInfo(spec=loaded.spec, kind=loaded.kind, class_=type(net).__name__,
                     arch=(loaded.run_config or {}).get("arch"),
                     n_params=sum(p.numel() for p in net.parameters()),
                     fingerprint=loaded.fingerprint,
                     dtype=str(param.dtype) if param is not None else "unknown",
                     identity_note=loaded.identity_note, packages=loaded.packages or None)


def _site_info(site: Site, m: Measurements) -> SiteInfo:
    """A site in audit.json: its axes in the model's words when they are not [example,
    token], how they were found when no one declared them (``layout``) and its kind."""
    setup, declared = m.setup, (site.axes, site.positions) != (TOKEN_AXES, TOKEN_LAYOUT)
    return SiteInfo(site.name, site.family, site.layer, list(m.shapes[site.name][2:]),
                    _adapter_name(site, setup.model),
                    axes=list(site.axes or ()) if declared else None,
                    positions=list(site.positions or ()) if declared else None,
                    layout=setup.layouts.get(site.name), parts=site_parts(site),
                    selection=space(site), kind=setup.kinds.get(site.name))


def _adapter_name(site: Site, model: nn.Module) -> str | None:
    name = adapter_name(site.adapter, model.get_submodule(site.path))
    return None if name == "tensor" else name
