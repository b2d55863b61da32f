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

import numpy as np
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
    RANDOM_CONDITIONS,
    REASSIGN,
    RETENTION_PROFILES,
    SHUFFLE,
    STATIC_CONDITIONS,
    STATIC_LAYER,
    by_kind,
)
from fcaudit.core.errors import FcauditError, UsageError, arg
from fcaudit.core.nll import logits_of
from fcaudit.core.registry import refusal
from fcaudit.engine import result_views as keys  # metric keys, derived from condition names
from fcaudit.engine.inputs import as_loaded
from fcaudit.engine.metrics import aggregate
from fcaudit.engine.objectives import CLASSIFICATION
from fcaudit.engine.result import ETA2_KEYS, AuditResult, token_id_words
from fcaudit.engine.run import AuditOptions
from fcaudit.io import digits
from fcaudit.io.data import AuditData, DataSpec
from fcaudit.io.fileio import PLAIN_FILES, FileWriter, read_json, write_json
from fcaudit.io.loading import LoadedModel, get_arch, is_run_folder
from fcaudit.io.outdir import STUDY_RESULTS, hold_output
from fcaudit.io.results import replacing_results
from fcaudit.io.runtime import versions
from fcaudit.study import exits, paper, ssm, trend, vision
from fcaudit.study.train import TrainPreset, check_train_data, reads_text, run_schedule, train
from fcaudit.study.trend import SeedResult

SCHEMA = "fcaudit.reproduction/1"


@dataclass(frozen=True)
class Group:
    """One model family at one size, trained and audited over several seeds."""

    arch: str
    preset: str
    seeds: int
    dense: str | None = "own"  # "own": the trained Dense twin of the same seed; or the
    # twin's arch (the vision families' dense-vit, dense-cnn), trained at the same preset
    schedule: TrainPreset | None = None  # None: the preset's own training settings
    point: str = ""  # a trend point (size and length, "tiny-600"); names the run folders
    task: str | None = None  # a synthetic task (fcaudit train --task); None: the corpus

    @property
    def stem(self) -> str:
        return "-".join(filter(None, (self.task, self.point or self.preset)))

    @property
    def name(self) -> str:
        return f"{self.arch}-{self.stem}"

    @property
    def dense_arch(self) -> str | None:
        return "dense" if self.dense == "own" else self.dense


STUDY_PRESETS = ("tiny", "paper", "trend", "vision", "ssm", "exit")


def study(preset: str, seeds: int | None) -> list[Group]:
    """The groups of a study preset (``--seeds`` overrides every group's seed count);
    the groups of one trend point are consecutive."""
    if preset == "tiny":
        n = seeds or 3
        # soft gating, dynamic cross-layer mixing and hard routing (the three kinds the paper
        # separates), plus SkipGate: the positive control for real conditional execution
        return [Group("featuregate", "tiny", n), Group("mudd", "tiny", n, dense=None),
                Group("moe", "tiny", n), Group("skipgate", "tiny", 1)]
    if preset == "paper":
        return [Group("featuregate", "76m", seeds or 7), Group("featuregate", "504m", seeds or 3)]
    if preset == "vision":  # routing, per-example kernel mixing, token pruning (on digits)
        n = seeds or 3
        return [Group("vit-moe", "tiny", n, dense="dense-vit"),
                Group("tokenprune", "tiny", n, dense="dense-vit"),
                Group("condconv", "tiny", n, dense="dense-cnn")]
    if preset == "ssm":  # selection vs its LTI twin, on the corpus and on selective copying
        n = seeds or 3
        return [Group("mamba", "tiny", n, dense="s4d", schedule=ssm.CORPUS_SCHEDULE),
                Group("mamba", "tiny", n, dense="s4d", task=ssm.TASK)]
    if preset == "exit":  # early exit and adaptive depth, each beside its full-depth twin
        n = seeds or 3
        return [Group("earlyexit", "tiny", n), Group("ponder", "tiny", n, dense="dense-ponder"),
                Group("branchy", "tiny", n, dense="dense-cnn")]
    if preset == "trend":
        n = seeds or trend.SEEDS
        return [Group(arch, p.size, n, dense="own" if arch == "featuregate" else None,
                      schedule=p.schedule, point=p.name)
                for p in trend.LADDER for arch in p.arches]
    raise refusal(f"unknown study preset {preset!r}", preset, list(STUDY_PRESETS))


# The studies with a table and findings of their own (each module's ``TITLE``, ``table``
# and ``findings``), written under the preset's name in reproduction.json.
OWN_TABLES = {"vision": vision, "ssm": ssm, "exit": exits}

# What the paper reported (fcaudit.study.paper), shown beside our aggregates.
PAPER = {
    "featuregate": {keys.RETENTION_LAYER: paper.retention_text(),
                    "eta2_layer": paper.eta2_text(), "blocks": "every block runs",
                    "speed_ratio": f"{paper.SPEED_RATIO} "
                                   f"({100 * (paper.SPEED_RATIO - 1):.1f}% slower than Dense)"},
    "mudd": {REASSIGN: f"+{paper.MUDD[keys.DELTA_REASSIGN]} nats (MUDDPythia-1.4B)",
             SHUFFLE: f"+{paper.MUDD[keys.DELTA_SHUFFLE]} nats",
             "static": "static replacement also hurts strongly", "blocks": "every block runs"},
    "moe": {"routing": "the paper names sparse experts and token routing as dynamic "
                       "mechanisms; it reports no MoE measurement"},
}


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
        audit = _audit(audit_dir, str(run), st, dataclasses.replace(st.options, seed=seed),
                       None if dense is None else str(dense), clock,
                       vision=get_arch(group.arch).task == "vision")
        wall += clock.of(audit_dir, audit.runtime.timings["total_s"])
        done.append(SeedResult(seed, config, audit, dense_config, round(wall, 1)))
    return done


def _fmt(stats: Mapping[str, Any] | None, digits: int = 4, pct: bool = False) -> str:
    if not stats or stats.get("mean") is None:
        return "undefined"
    unit = "%" if pct else ""
    sd = f" ± {stats['sd']:.{digits}f}" if stats.get("sd") is not None else ""
    return (f"{stats['mean']:.{digits}f}{unit}{sd} (range {stats['min']:.{digits}f} to "
            f"{stats['max']:.{digits}f}, n={stats['n']})")


ROWS: tuple[tuple[str, str, int, bool], ...] = (
    (keys.NLL_CORRECT, "NLL (correct replay; classification: cross-entropy)", 4, False),
    (keys.ACCURACY_CORRECT, "accuracy (correct replay)", 4, False),
    ("twin_accuracy", "dense twin's accuracy", 4, False),
    *((keys.delta_key(n), f"penalty: {n}", 4, False) for n in RANDOM_CONDITIONS),
    ("interaction", "factorial interaction", 4, False),
    *((keys.delta_key(n), f"penalty: {n}", 4, False) for n in STATIC_CONDITIONS),
    *((keys.retention_key(p), f"retention: {p}", 2, True) for p in RETENTION_PROFILES),
    ("eta2_layer", "eta2 layer", 3, False),
    ("eta2_position", "eta2 position", 3, False),
    ("eta2_layer_position", "eta2 layer x position", 3, False),
    ("eta2_component", "eta2 component (which entry of a coefficient vector)", 3, False),
    ("eta2_residual", "eta2 residual (content)", 3, False),
    ("eta2_token_id", "token-id share of within-layer variance", 3, False),
    ("eta2_token_id_chance", "its chance level, (ids - 1) / (tokens - 1)", 3, False),
    ("epsilon2_token_id", "token-id share beyond chance (epsilon squared)", 3, False),
    ("blocks_executed_fraction", "blocks executed / present", 3, False),
    ("flops_ratio", "FLOPs ratio vs dense", 3, False),
    ("experts_executed_fraction", "experts executed / present", 3, False),
    ("tokens_executed_fraction", "patch tokens entering blocks / dense twin's", 3, False),
    *((keys.rerouted_key(n), f"expert sets re-routed: {n}", 3, False) for n in keys.REROUTED),
    ("speed_ratio", "time ratio vs dense", 3, False),
    ("frontier_gap_25", "frontier gap at 25% FLOPs saved (best static - dynamic, nats)", 4,
     False),
    ("frontier_own_delta", "own-threshold frontier point: penalty (nats)", 4, False),
    ("frontier_own_flops_saved", "own-threshold frontier point: FLOPs saved, counted", 3,
     False),
    ("frontier_measured_flops_saved", "FLOPs saved measured against dense", 3, False),
    ("frontier_on_curve", "on its own dynamic curve (1 = yes)", 0, False),
)


def findings(groups: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str]]:
    """Each of the paper's findings, and whether it holds at this scale (from the numbers)."""
    out = []
    fg = next((g for n, g in groups.items() if n.startswith("featuregate")), None)
    mudd = next((g for n, g in groups.items() if n.startswith("mudd")), None)

    def mean(g: Mapping[str, Any] | None, key: str) -> float | None:
        return None if g is None else (g["aggregate"].get(key) or {}).get("mean")

    ret = mean(fg, keys.RETENTION_LAYER)
    if fg is not None:
        out.append(("FeatureGate: a static per-layer profile keeps almost all (>= 90%) of the "
                    "Correct-to-GlobalMean gap (paper: "
                    f"{' / '.join(f'{v:.2f}%' for v in paper.RETENTION.values())})",
                    "undefined (no clear gap)" if ret is None else
                    f"{'holds' if ret >= 90 else 'does not hold'}: {ret:.2f}% on average"))
        eta = mean(fg, "eta2_layer")
        out.append(("FeatureGate: layer identity explains most of the coefficient variance "
                    f"(paper: {paper.eta2_text()})",
                    f"{'holds' if eta is not None and eta >= 0.8 else 'does not hold'}: "
                    f"{100 * (eta or 0):.1f}% on average"))
        frac = mean(fg, "blocks_executed_fraction")
        if frac is not None:
            out.append(("FeatureGate runs every block",
                        f"{'holds' if frac >= 0.999 else 'does not hold'}: {frac:.3f} of "
                        "blocks executed per token"))
        speed = mean(fg, "speed_ratio")
        if speed is not None:
            out.append(("FeatureGate is slower than Dense (paper: "
                        f"{100 * (paper.SPEED_RATIO - 1):.1f}% slower)",
                        f"{'holds' if speed > 1 else 'does not hold'}: time ratio "
                        f"{speed:.3f} on average"))
    if mudd is not None:
        r, s = mean(mudd, keys.DELTA_REASSIGN), mean(mudd, keys.DELTA_SHUFFLE)
        out.append(("MUDD: reassignment and token shuffling raise NLL strongly (paper: +1.91 "
                    "and +2.96 nats on MUDDPythia-1.4B)",
                    f"{'holds' if min(r, s) > 0.1 else 'does not hold'}: reassign {r:+.3f}, "
                    f"shuffle {s:+.3f} nats on average"))
        if fg is not None:
            fr = mean(fg, keys.DELTA_REASSIGN)
            # every MUDD seed above every FeatureGate seed: the seed ranges do not overlap
            apart = mudd["aggregate"][keys.DELTA_REASSIGN]["min"] > \
                fg["aggregate"][keys.DELTA_REASSIGN]["max"]
            out.append(("The contrast: MUDD depends on the assignment more than FeatureGate",
                        f"{'holds' if apart else 'does not hold'}: reassign penalty {r:+.3f} "
                        f"(MUDD) vs {fr:+.3f} (FeatureGate), seed ranges "
                        f"{'apart' if apart else 'overlap'}"))
        frac = mean(mudd, "blocks_executed_fraction")
        if frac is not None:
            out.append(("MUDD runs every block", f"{'holds' if frac >= 0.999 else 'does not hold'}"
                                                 f": {frac:.3f} of blocks executed per token"))
    out += _routing_findings(next((g for n, g in groups.items() if n.startswith("moe")), None),
                             mean)
    return out + _token_findings(groups, mean)


TOKEN_GROUPS = (("featuregate", "FeatureGate"), ("mudd", "MUDD"), ("moe", "MoE"))


def _token_findings(groups: Mapping[str, Mapping[str, Any]], mean: Any) -> list[tuple[str, str]]:
    """Beyond the paper: how much a static profile per (layer, token id) keeps, and how
    much of the within-layer variance the token id explains, per controller kind."""
    out = []
    for prefix, label in TOKEN_GROUPS:
        group = next((g for n, g in groups.items() if n.startswith(f"{prefix}-")), None)
        if group is None:
            continue
        ret, share = mean(group, keys.RETENTION_LAYER_TOKEN), mean(group, "eta2_token_id")
        words = None if share is None else token_id_words(
            share, mean(group, "eta2_token_id_chance"), mean(group, "epsilon2_token_id"))
        out.append((f"{label}: a static profile per (layer, token id) (not in the paper)",
                    ("retention undefined (no clear gap)" if ret is None else
                     f"keeps {ret:.2f}% of the gap on average")
                    + ("; no variance within layers" if words is None else
                       f"; of the within-layer variance, the token id {words} on average")))
    return out


def _routing_findings(moe: Mapping[str, Any] | None, mean: Any) -> list[tuple[str, str]]:
    """Hard routing (our MoE), the third kind of controller the paper separates."""
    if moe is None:
        return []
    out = []
    share = mean(moe, "experts_executed_fraction")
    if share is not None:
        out.append(("MoE (hard routing): routing changes what is computed",
                    f"{'holds' if share < 0.99 else 'does not hold'}: each token runs "
                    f"{100 * share:.1f}% of the experts (2 of 8 per layer when it holds)"))
    r, moved = mean(moe, keys.DELTA_REASSIGN), mean(moe, keys.rerouted_key(REASSIGN))
    if r is not None and moved is not None:
        out.append(("MoE: the frozen model depends on its routing staying matched to the input",
                    f"{'holds' if r > 0.1 else 'does not hold'}: reassigning router logits "
                    f"re-routes {100 * moved:.1f}% of the (token, layer) expert sets and costs "
                    f"{r:+.3f} nats on average"))
    return out


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
    penalties = {name: {c: Span(float(np.mean([a.conditions[c].delta for a in g["audits"]])),
                                min(a.conditions[c].ci95[0] for a in g["audits"]),
                                max(a.conditions[c].ci95[1] for a in g["audits"]))
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
    for key, module in OWN_TABLES.items():
        if result.get(key):
            rows = result[key]
            blocks += [f"## {module.TITLE}",
                       md_table(tuple(rows[0]), ([md_text(v) for v in r.values()] for r in rows),
                                "l" * len(rows[0]))]
    if result["findings"]:
        own = any(result.get(key) for key in OWN_TABLES)
        blocks += ["## Findings at this scale",
                   md_table(("finding" if own else "paper finding", "here"),
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
    from fcaudit.io.loading import is_run_folder
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
            per_seed = [{**r.audit.metrics(), **twin_metrics(r.dense_config)}
                        for r in seed_results]
            groups[f"{arch}-{stem}"] = {"audits": [r.audit for r in seed_results],
                                        "per_seed": per_seed, "aggregate": aggregate(per_seed)}
        if preset == "trend":  # the point is finished: its summary, before the next one
            write_json(out / trend.POINTS / f"{stem}.json", trend.point_summary(points[stem], done))
    if mudd_checkpoint:
        audit = _audit(out / "audits" / "muddpythia-checkpoint", mudd_checkpoint, st, st.options,
                       None, clock)
        groups["mudd-checkpoint"] = {"audits": [audit], "per_seed": [audit.metrics()],
                                     "aggregate": aggregate([audit.metrics()])}
    command = command or shlex.join(["fcaudit", "reproduce", "--preset", preset, "--out",
                                     str(out)])
    result = {"schema": SCHEMA, "preset": preset, "command": command, "groups": groups,
              # one scale's findings; a trend's are in trend.md, point by point
              "findings": [] if preset == "trend" else
              OWN_TABLES[preset].findings(groups) if preset in OWN_TABLES else findings(groups),
              "versions": versions()}
    if preset in OWN_TABLES:
        result[preset] = OWN_TABLES[preset].table(groups)
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
