"""``fcaudit reproduce``: the paper's study end to end, multi-seed, resumable.

Trains every (architecture, preset, seed) of the study, audits each trained
model (dependence and execution), aggregates across seeds and writes
``reproduction.json``, ``reproduction.md``, ``report.html`` and figures. Every
finished training run and audit is reused on rerun, so an interrupted study
resumes where it stopped. The ``trend`` preset trains a ladder of sizes and lengths
(:mod:`fcaudit.study.trend`) and also writes a summary per finished point and ``trend.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import shlex
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from fcaudit.api import (
    FigureSpec,
    RenderedFigure,
    Span,
    audit,
    md_code,
    md_fenced,
    md_figures,
    md_table,
    md_text,
    penalty_figure,
    profile_figure,
    ratio_figure,
    retention_figure,
    to_html,
    variance_figure,
    write_figures,
)
from fcaudit.core.conditions import (
    FRONTIER,
    STATIC_LAYER,
    by_kind,
)
from fcaudit.core.errors import FcauditError, UsageError, arg
from fcaudit.core.nll import logits_of
from fcaudit.engine.analyses import analysis_intervals
from fcaudit.engine.inputs import as_loaded
from fcaudit.engine.metrics import aggregate
from fcaudit.engine.objectives import CLASSIFICATION
from fcaudit.engine.result import ETA2_KEYS, AuditResult
from fcaudit.engine.run import AuditOptions
from fcaudit.io import digits
from fcaudit.io.data import AuditData, DataSpec
from fcaudit.io.fileio import PLAIN_FILES, FileWriter, read_json, write_json
from fcaudit.io.loading import LoadedModel, get_arch, is_run_folder
from fcaudit.io.outdir import STUDY_RESULTS, STUDY_TASKS, hold_output
from fcaudit.io.results import replacing_results
from fcaudit.io.runtime import versions
from fcaudit.study import lm_tasks, trend
from fcaudit.study.declare import Group, over_seeds
from fcaudit.study.folds import fold_seed
from fcaudit.study.presets import PAPER, PRESETS, ROWS, study
from fcaudit.study.train import TrainPreset, check_train_data, reads_text, run_schedule, train
from fcaudit.study.trend import SeedResult

SCHEMA = "fcaudit.reproduction/1"


# The penalties aggregated and plotted: every condition but the reference ones.
CONDITIONS = by_kind("random", "static")


def twin_metrics(dense_config: Mapping[str, Any] | None) -> dict[str, float]:
    """The trained dense twin's own evaluation accuracy (vision and task twins) or NLL
    (language twins), beside the model's."""
    results = (dense_config or {}).get("results", {})
    return {key: results[name] for key, name in (("twin_accuracy", "eval_accuracy"),
                                                 ("twin_nll", "eval_nll")) if name in results}


@dataclass(frozen=True)
class StudySettings:
    """What every training run and audit of the study shares."""

    options: AuditOptions
    steps: int | None = None  # override the presets' step counts (smoke tests)
    max_eval: int | None = 64
    max_calib: int | None = 64
    train_data: str | None = None  # train on this text instead of the built-in corpus


def study_options(**overrides: Any) -> AuditOptions:
    """The study's audit options: the savings frontier where a family has one (soft gates,
    routers; not MUDD's mixing weights), on top of the audit's defaults."""
    return AuditOptions(**{FRONTIER: None, **overrides})


TIMINGS = "timings.json"


class Clock:
    """Wall time of every training run and audit the study made, in ``OUT/timings.json``
    as each finishes. A resumed study so knows what each reused part took when it was
    made; a part made before (no entry) counts its own record: its training loop, or
    its audit's ``total_s``, which leave out loading and tokenizing."""

    def __init__(self, out: Path) -> None:
        self.path = out / TIMINGS
        self.seconds: dict[str, float] = \
            read_json(self.path, "study timings") if self.path.is_file() else {}

    @staticmethod
    def _key(part: Path) -> str:
        return f"{part.parent.name}/{part.name}"

    @contextlib.contextmanager
    def timing(self, part: Path) -> Iterator[None]:
        started = time.perf_counter()
        yield
        self.record(part, time.perf_counter() - started)

    def record(self, part: Path, seconds: float, made_before: bool = False) -> None:
        """``made_before``: this pass only proved an earlier one's results (all reused), so
        the earlier time, if known, stays the part's cost."""
        if made_before and self._key(part) in self.seconds:
            return
        self.seconds[self._key(part)] = round(seconds, 1)
        write_json(self.path, self.seconds)

    def of(self, part: Path, recorded: float) -> float:
        return self.seconds.get(self._key(part), recorded)


def _ensure_run(arch: str, preset: str, seed: int, folder: Path, st: StudySettings,
                schedule: TrainPreset | None, clock: Clock,
                task: str | None = None) -> dict[str, Any]:
    """The run's ``config.json``, training it first unless a finished run is there.

    A finished run trained with other settings (a smoke study's ``--steps``, say) is
    refused rather than reused, so a study never mixes training lengths silently.
    """
    expected = dataclasses.asdict(run_schedule(arch, preset, st.steps, schedule, task))
    if not is_run_folder(folder):
        with clock.timing(folder):
            train(arch, preset, seed, folder, force=True, steps=st.steps,
                  progress=st.options.progress,
                  data=st.train_data if reads_text(arch, task) else None,
                  schedule=schedule, task=task)
    config = read_json(folder / "config.json", "run config")
    if config["train"] != expected:
        raise UsageError(f"{folder} was trained with other settings ({config['train']}) "
                         f"than this study asks for ({expected}); choose another "
                         f"{arg('out')}, or "
                         "remove that run to retrain it")
    return config


def _audit(audit_dir: Path, model: str | LoadedModel, st: StudySettings, options: AuditOptions,
           dense: str | None, clock: Clock, vision: bool = False) -> AuditResult:
    """The audit in ``audit_dir``, always through the engine: a finished one is not read
    back as it is (its options or model may differ from this study's), but rerun, and the
    engine reuses every cached record and replay whose digests prove it the same. A
    ``vision`` model is scored by classification on the digits' own splits."""
    started = time.perf_counter()
    if vision:
        data: DataSpec | AuditData = digits.audit_data(st.max_eval, st.max_calib)
        # the savings frontier is counted in token units; not run on images (yet)
        options = dataclasses.replace(options, objective=CLASSIFICATION, frontier=False)
    else:
        data = DataSpec(max_eval=st.max_eval, max_calib=st.max_calib)
    result = audit(model, audit_dir, dense=dense, options=options, data=data)
    reuse = (result.runtime.reuse or {}) if result.runtime else {}
    clock.record(audit_dir, time.perf_counter() - started,
                 made_before=reuse.get("batches_recomputed") == 0
                 and reuse.get("batches_reused", 0) > 0)
    return result


def run_group(group: Group, out: Path, st: StudySettings, clock: Clock) -> list[SeedResult]:
    """Train and audit every seed of ``group`` (reusing what exists)."""
    done = []
    for seed in range(group.seeds):
        run = out / "runs" / f"{group.name}-s{seed}"
        config = _ensure_run(group.arch, group.preset, seed, run, st, group.schedule, clock,
                             group.task)
        wall = clock.of(run, config["results"]["train_wall_s"])
        dense, dense_config = None, None
        twin = group.dense_arch
        if twin is not None and st.options.execution:  # the twin serves execution only
            dense = out / "runs" / f"{twin}-{group.stem}-s{seed}"
            dense_config = _ensure_run(twin, group.preset, seed, dense, st, group.schedule,
                                       clock, group.task)
            wall += clock.of(dense, dense_config["results"]["train_wall_s"])
        audit_dir = out / "audits" / f"{group.name}-s{seed}"
        options = dataclasses.replace(st.options, seed=seed)
        if group.benchmarks:  # the study's local tasks, scored under each condition
            options = dataclasses.replace(
                options, lm_eval_tasks=lm_tasks.TASKS,
                lm_eval_include_path=str(lm_tasks.write_tasks(out / STUDY_TASKS)))
        audit = _audit(audit_dir, str(run), st, options,
                       None if dense is None else str(dense), clock,
                       vision=get_arch(group.arch).task == "vision")
        wall += clock.of(audit_dir, audit.runtime.timings["total_s"])
        folded = {} if group.fold is None else \
            fold_seed(group, run, audit_dir, audit, seed, st)
        done.append(SeedResult(seed, config, audit, dense_config, round(wall, 1), folded))
    return done


def analysis_bounds(audit: AuditResult) -> dict[str, float | None]:
    """The analyses' 95% intervals as ``<metric>_lo`` and ``<metric>_hi`` (what a table's
    ``estimate`` cell reads beside the metric; None where it has no interval)."""
    out: dict[str, float | None] = {}
    for key, ci in analysis_intervals(audit.analyses or {}).items():
        out[f"{key}_lo"], out[f"{key}_hi"] = (None, None) if ci is None else ci
    return out


def _fmt(stats: Mapping[str, Any] | None, digits: int = 4, pct: bool = False) -> str:
    if not stats or stats.get("mean") is None:
        return "undefined"
    unit = "%" if pct else ""
    sd = f" ± {stats['sd']:.{digits}f}" if stats.get("sd") is not None else ""
    return (f"{stats['mean']:.{digits}f}{unit}{sd} (range {stats['min']:.{digits}f} to "
            f"{stats['max']:.{digits}f}, n={stats['n']})")


# ------------------------------------------------------------------------------- report

RATIOS = (("flops_ratio", "FLOPs"), ("speed_ratio", "time"),
          ("blocks_executed_fraction", "blocks executed"))


def _seed_span(stats: Mapping[str, Any] | None) -> Span:
    """A metric's mean over seeds with its seed range."""
    stats = stats or {}
    return Span(stats.get("mean"), stats.get("min"), stats.get("max"))


def _figure_specs(groups: Mapping[str, Mapping[str, Any]]) -> list[FigureSpec]:
    profiles = {name: [(f"seed {seed}", a.profiles[a.families[0]])
                       for seed, a in enumerate(g["audits"])] for name, g in groups.items()}
    penalties = {name: {c: over_seeds([a.conditions[c].delta for a in g["audits"]],
                                      [a.conditions[c].ci95 for a in g["audits"]])
                        for c in CONDITIONS  # not those a layout has no use for (no positions)
                        if all(c in a.conditions for a in g["audits"])}
                 for name, g in groups.items()}
    retention = {name: [Span.of(r.value, r.ci95)
                        for r in (a.retention[STATIC_LAYER] for a in g["audits"])]
                 for name, g in groups.items()}
    shares = {name: {k: (g["aggregate"].get(k) or {}).get("mean") for k in ETA2_KEYS}
              for name, g in groups.items()}
    ratios = {name: {label: _seed_span(g["aggregate"].get(key)) for key, label in RATIOS}
              for name, g in groups.items()}
    return [
        ("study_profiles", "Per-layer coefficient profiles across seeds (band: ±1 sd).",
         partial(profile_figure, profiles)),
        ("study_penalties", "Penalties per condition: mean over seeds; error bars span the "
         "seeds' 95% intervals.", partial(penalty_figure, penalties)),
        ("study_retention", "Static-layer retention per seed.",
         partial(retention_figure, retention)),
        ("study_variance", "Variance shares (mean over seeds).", partial(variance_figure, shares)),
        ("study_execution", "FLOPs, time and blocks against dense (bars: seed range).",
         partial(ratio_figure, ratios)),
    ]


def _markdown(result: Mapping[str, Any], figures: Sequence[RenderedFigure]) -> str:
    groups = result["groups"]
    listing = ", ".join(f"{md_text(n)} ({len(g['audits'])})" for n, g in groups.items())
    blocks = ["# fcaudit reproduction: Dynamic Parameterization Is Not Dynamic Inference",
              f"Study preset {md_text(result['preset'])}; groups (seeds): {listing}."]
    rows = result.get(result["preset"])
    if rows:
        blocks += [f"## {PRESETS[result['preset']].title}",
                   md_table(tuple(rows[0]), ([md_text(v) for v in r.values()] for r in rows),
                            "l" * len(rows[0]))]
    if result["findings"]:
        blocks += ["## Findings at this scale",
                   md_table(("finding" if rows else "paper finding", "here"),
                            ((md_text(f), md_text(v)) for f, v in result["findings"]), "ll")]
    else:
        blocks += ["## Findings across scales",
                   "What the ladder of sizes and lengths shows, and cannot show: "
                   "[trend.md](trend.md)."]
    for name, g in groups.items():
        paper = PAPER.get(name.split("-")[0], {})
        blocks += [f"## {md_text(name)}: mean ± sd over seeds",
                   md_table(("metric", "ours"),
                            ((label, _fmt(g["aggregate"].get(key), digits, pct))
                             for key, label, digits, pct in ROWS if key in g["aggregate"]),
                            "lr")]
        if paper:
            blocks.append("\n".join(f"- paper, {k}: {md_text(v)}" for k, v in paper.items()))
    blocks += ["## Figures", *md_figures(figures),
               "## Rerun",
               "Every number above comes from these commands; each audit's own report is "
               "under `audits/`.",
               md_fenced(result["command"] or ""),
               md_table(("package", "version"),
                        ((md_text(k), md_code(v)) for k, v in result["versions"].items()), "ll")]
    return "\n\n".join(blocks) + "\n"


def reproduce(preset: str, out: str | Path, *, seeds: int | None = None,
              mudd_checkpoint: str | None = None, settings: StudySettings | None = None,
              command: str | None = None) -> dict[str, Any]:
    """Run (or resume) the study and write the aggregated reproduction report.

    The study folder is held for the whole study; its previous results stay aside in
    ``.previous/`` until the new ones are complete (and come back if the study fails).
    """
    groups = study(preset, seeds)  # an unknown preset fails before anything is loaded
    check_train_data(settings.train_data if settings is not None else None, preset, groups)
    checkpoint = _probed(mudd_checkpoint) if mudd_checkpoint else None
    results = (*STUDY_RESULTS, "trend.md") if preset == "trend" else STUDY_RESULTS
    with hold_output(out, "study", command), replacing_results(out, results) as files:
        return _study(preset, out, seeds=seeds, mudd_checkpoint=checkpoint,
                      settings=settings, command=command, files=files)


def _probed(spec: str) -> LoadedModel:
    """``--mudd-checkpoint`` loaded and run once now, so a bad folder fails in seconds,
    before hours of training, and is not loaded a second time."""
    from fcaudit.io.mudd_checkpoint import is_mudd_folder
    path = Path(spec)
    if (path.exists() and not is_mudd_folder(path)) or (":" in spec and not path.exists()):
        what = "an fcaudit run folder" if is_run_folder(path) else \
            "not a folder" if not path.is_dir() else "a folder"
        raise UsageError(f"{arg('mudd_checkpoint', spec)} is {what}, not a MUDDPythia / "
                         "MUDDFormer "
                         "checkpoint folder (its config.json names model_type muddpythia or "
                         "muddformer); the study trains and audits its own runs: pass a MUDD "
                         "checkpoint folder, or drop the option")
    loaded = as_loaded(spec)
    if loaded.tokenizer is None:
        raise UsageError(f"{arg('mudd_checkpoint', spec)} has no tokenizer.json: the study "
                         "audits "
                         "it on the built-in text; copy the model's tokenizer.json into it")
    ids = torch.tensor([loaded.tokenizer.encode("To be, or not to be").ids[:4]])
    try:
        with torch.no_grad():
            logits_of(loaded.model(ids))
    except FcauditError as exc:
        raise UsageError(f"{arg('mudd_checkpoint', spec)}: {exc.raw}") from exc
    return loaded


def _group(audits: list[AuditResult], per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """A group's audits, each seed's metrics and their aggregate over seeds."""
    return {"audits": audits, "per_seed": per_seed, "aggregate": aggregate(per_seed)}


def _study(preset: str, out: str | Path, *, seeds: int | None,
           mudd_checkpoint: LoadedModel | None, settings: StudySettings | None,
           command: str | None, files: FileWriter = PLAIN_FILES) -> dict[str, Any]:
    out = Path(out)
    st = settings or StudySettings(study_options())
    if preset == "trend":
        # the trend reads whole-family conditions only; the per-layer variants would more
        # than double each audit's replays for numbers no point summary holds
        st = dataclasses.replace(st, options=dataclasses.replace(st.options, per_layer=False))
    groups: dict[str, dict[str, Any]] = {}
    clock = Clock(out)
    points = {p.name: p for p in trend.LADDER}
    for stem, members in itertools.groupby(study(preset, seeds), key=lambda g: g.stem):
        done = {group.arch: run_group(group, out, st, clock) for group in members}
        for arch, seed_results in done.items():
            groups[f"{arch}-{stem}"] = _group([r.audit for r in seed_results], [
                {**r.audit.metrics(), **analysis_bounds(r.audit), **twin_metrics(
                    r.dense_config), **r.folded} for r in seed_results])
        if preset == "trend":  # the point is finished: its summary, before the next one
            write_json(out / trend.POINTS / f"{stem}.json", trend.point_summary(points[stem], done))
    if mudd_checkpoint:
        audit = _audit(out / "audits" / "muddpythia-checkpoint", mudd_checkpoint, st, st.options,
                       None, clock)
        groups["mudd-checkpoint"] = _group([audit], [audit.metrics()])
    declared = PRESETS[preset]
    command = command or shlex.join(["fcaudit", "reproduce", "--preset", preset, "--out",
                                     str(out)])
    result = {"schema": SCHEMA, "preset": preset, "command": command, "groups": groups,
              # one scale's findings; a trend's are in trend.md, point by point
              "findings": declared.judge(groups),
              "versions": versions()}
    if declared.columns:
        result[preset] = declared.table(groups)
    if preset == "trend":
        trend.write_trend(out / trend.POINTS, out, command, files)
    figures = write_figures(_figure_specs(groups), out / "figures", files)
    markdown = _markdown(result, figures)
    summary = {**result, "groups": {n: {"aggregate": g["aggregate"], "seeds": len(g["audits"]),
                                        "per_seed": g["per_seed"]}
                                    for n, g in groups.items()}}
    files.write_text(out / "reproduction.md", markdown)
    files.write_text(out / "report.html", to_html("fcaudit reproduction", markdown, figures))
    files.write_json(out / "reproduction.json", summary)  # last: it means the study finished
    return summary
