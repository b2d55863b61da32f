"""Build the result: execution measured, then one :class:`~fcaudit.engine.result.
AuditResult` from everything computed first (the constructor is called once, nothing is
patched after)."""

from __future__ import annotations

import time
from typing import Any

from torch import nn

from fcaudit._version import __version__
from fcaudit.core.adapters import adapter_name
from fcaudit.core.contract import Site
from fcaudit.core.layout import TOKEN_AXES, TOKEN_LAYOUT, shuffled_axes
from fcaudit.engine.budget import AuditPlan
from fcaudit.engine.cache import CoefficientCache
from fcaudit.engine.distributed import Ranks
from fcaudit.engine.frontier import frontier_summary
from fcaudit.engine.frontier_plan import frontier_units
from fcaudit.engine.measure import Measurements, reuse_summary
from fcaudit.engine.objectives import loss_name
from fcaudit.engine.options import Prepared, option_specs
from fcaudit.engine.parts import site_parts, space
from fcaudit.engine.plan import ablation_runs, frontier_runs, routing_sites, tracked_runs
from fcaudit.engine.result import (
    NONDETERMINISTIC_KEYS,
    SCHEMA,
    TIMED_VERDICT_KEY,
    AuditResult,
    Execution,
    ModelInfo,
    Runtime,
    Seeds,
    SiteInfo,
    Verdict,
)
from fcaudit.engine.summary import (
    expert_importance,
    paired_bootstrap,
    routing_summary,
)
from fcaudit.engine.target_ci import Rounds
from fcaudit.engine.twin import execute
from fcaudit.engine.verdicts import judge
from fcaudit.io.runtime import host, versions


def build_result(m: Measurements, cache: CoefficientCache, command: str | None,
                 ranks: Ranks, rounds: Rounds | None = None,
                 plan: AuditPlan | None = None) -> AuditResult:
    """Execution, runtime and the result of one measured audit (with ``rounds``, the last
    round of a ``--target-ci`` audit; ``plan``: the cost said before the work, kept beside
    what was measured)."""
    setup, description, summary = m.setup, m.description, m.summary
    routing = _routing(setup, m)
    timings = dict(m.timings)
    started = time.perf_counter()
    execution = execute(setup, m.exits.note if m.exits is not None else None)
    timings["execution_s"] = time.perf_counter() - started
    timings["total_s"] = time.perf_counter() - setup.started
    identity = m.identity
    seeds = setup.seeds
    verdict, verdict_numbers = _verdict(m, execution)
    return AuditResult(
        schema=SCHEMA, fcaudit_version=__version__, model=_model_info(setup),
        data=setup.inputs.summary(),
        sites=[_site_info(s, m) for s in setup.sites],
        identity_replay_max_abs_diff=identity.max_abs_diff, conditions=summary.conditions,
        per_layer=summary.per_layer, retention=summary.retention,
        interaction=summary.interaction, variance=description.variance,
        variation=description.variation, profiles=description.profiles,
        execution=execution, verdict=verdict, verdict_numbers=verdict_numbers,
        seeds=Seeds(seeds.master, seeds.draws, seeds.draws, seeds.bootstrap),
        settings=_settings(m, execution), versions=versions(), command=command,
        analyses=m.analyses or None,
        nondeterministic_keys=[*NONDETERMINISTIC_KEYS, *([TIMED_VERDICT_KEY]
                                                        if execution.timing is not None
                                                        else [])],
        runtime=_runtime(m, cache, ranks, timings, rounds, plan),
        identity=None if identity.exact and not identity.allowed_nonexact else identity,
        custom_conditions=summary.custom or None, routing=routing,
        stopping=rounds.stopping if rounds is not None else None, exits=m.exits,
        **_extras(m, cache, execution))


def _verdict(m: Measurements, execution: Execution) -> tuple[Verdict, dict[str, Any]]:
    """The verdict and the numbers each of its answers rests on."""
    setup = m.setup
    kinds = {s.family: setup.kinds[s.name] for s in setup.sites if s.name in setup.kinds}
    return judge(m.description.variance, m.description.variation, m.summary.conditions,
                 m.summary.retention, shuffled_axes(setup.sites), execution, m.identity,
                 m.exits, loss_name(setup.objective.name), kinds)


def _settings(m: Measurements, execution: Execution) -> dict[str, Any]:
    """The options and facts that change numbers, each at the value the audit ran with
    (an option another one switched off reads as off: None, or 0 timing pairs); how the
    audit is shown, scheduled, stopped or placed changes none: recorded elsewhere
    (``OptionSpec.recorded``; read field by field: ``asdict`` deep-copies, and an
    objective may hold a lock)."""
    setup, summary, opts = m.setup, m.summary, m.setup.options
    return {**{f.name: getattr(opts, f.name) for f, spec in option_specs()
               if spec.recorded == "settings"},
            "conditions": list(opts.conditions),  # JSON's list: equal once read back
            "bootstrap_resamples": opts.bootstrap,
            "calibration_sequences_used_for_static": setup.inputs.n_calib,
            "objective": setup.objective.name,
            "timing_pairs": execution.timing.pairs if execution.timing is not None else 0,
            "expert_ablation": bool(ablation_runs(m.runs)),
            "frontier": bool(m.covered),
            "frontier_points": opts.frontier_points if m.covered else None,
            "exit_threshold": opts.exit_threshold if opts.early_exit else None,
            "layer_index": "a site's index within its family",
            # custom conditions in the order given (audit.json sorts its keys)
            **({"interventions": list(summary.custom)} if summary.custom else {}),
            "expert_ablation_runs": len(ablation_runs(m.runs)),
            "frontier_runs": len(frontier_runs(m.runs))}


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


def _extras(m: Measurements, cache: CoefficientCache, execution: Execution) -> dict[str, Any]:
    """The sections only some audits have: expert importance (expert ablation), the
    conditions not applicable, the savings frontier."""
    setup, runs, replays, opts = m.setup, m.runs, m.replays, m.setup.options
    frontier = None
    if m.covered:
        frontier = frontier_summary(
            m.covered, m.points, dict(zip((r.key for r in runs), replays.per_run, strict=True)),
            replays.per_run[0], frontier_units(cache, m.covered, m.points),
            setup.data.eval_ids.size, execution, paired_bootstrap(setup.inputs.n_eval, opts))
    return {"expert_importance": expert_importance(
                runs, replays.per_run, replays.route_load, replays.still_selected, opts)
            if ablation_runs(runs) else None,
            "not_applicable": dict(setup.not_applicable) or None,
            "frontier": frontier}


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


def _routing(setup: Prepared, m: Measurements) -> dict[str, Any] | None:
    """The routers' summary; its units are the tokens (patches) each router routes."""
    routed = routing_sites(setup.sites)
    if not routed:
        return None
    runs, replays = m.runs, m.replays
    units = setup.inputs.routed_units(lambda: int(m.shapes[routed[0].name][1]))
    return routing_summary(routed, tracked_runs(runs), replays.route_load,
                           replays.route_changed, units)


def _adapter_name(site: Site, model: nn.Module) -> str | None:
    name = adapter_name(site.adapter, model.get_submodule(site.path))
    return None if name == "tensor" else name
