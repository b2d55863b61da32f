"""The trend study (issue 14): FeatureGate's findings against model size and training length.

``fcaudit reproduce --preset tiny`` finds that at 1.3M parameters and 600 steps a static
per-layer gate profile keeps far less of the Correct-to-GlobalMean gap than the
paper's 76M and 504M models (:mod:`fcaudit.study.paper`), and layer identity explains
less of the gate variance. One point cannot say whether that gap is about model
size, training length or the method. ``fcaudit reproduce --preset trend`` trains
FeatureGate with its Dense twin, and MUDD as the contrast, at every point of
:data:`LADDER` (a model size and a training length), audits FeatureGate and MUDD, and
writes one small summary JSON per finished point (``OUT/points/<point>.json``: numbers
only, no weights, so it can be committed). :func:`write_trend` turns a folder of them
into ``trend.md`` and ``figures/trend.{png,svg}``; the study calls it on its own
points, and ``docs/trend/make_trend.py`` on the committed copies.

Every point trains with tiny's batch shape (16 sequences of 128 tokens, 2,048 tokens a
step), so two points differ only in size or only in length, and every audit replays
128-token windows. The learning rate is each size's preset's: 3e-3 x 128 / width. The
sizes are log-spaced (mid is the geometric middle of tiny and small); the length
lever is 2x at the smallest size. FeatureGate (with its Dense twin) is trained and
audited at every point; MUDD, the contrast, at the tiny size's points:

    point       layers x width  vocabulary  FeatureGate params  steps  tokens  MUDD
    tiny-600    4 x 128         2048        1.34M                600    1.23M   yes
    tiny-1200   4 x 128         2048        1.34M               1200    2.46M   yes
    mid-600     4 x 256         2048        4.24M                600    1.23M   no
    small-600   6 x 384         4096        13.90M               600    1.23M   no

Budget: about 2 hours on 2 cores, planned from the seconds per training step of
FeatureGate / Dense / MUDD with one thread (``benchmarks/trend_budget.py --threads 1``):
tiny 0.218 / 0.211 / 0.258, mid 0.595 / 0.592 / 0.663, small 1.833 / 1.802 / 1.978,
and two threads at 1.23x the one-thread rate. MUDD at mid and small (32 more minutes)
and a 3x length lever (11 more) did not fit. Measured (the study writes each run's
and audit's wall time to ``OUT/timings.json`` and each point's to its summary): 84
minutes in all, tiny-600 9, tiny-1200 18, mid-600 14, small-600 42 (two threads ran
tiny at about 15,000 tokens/s and small at 2,000); the 12 audits took 4 to 11 s each.
An interrupted study resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from fcaudit.api import (
    Anchor,
    RenderedFigure,
    Span,
    TrendPanel,
    TrendPoint,
    md_code,
    md_figures,
    md_table,
    md_text,
    trend_figure,
    write_figures,
)
from fcaudit.core.errors import UsageError
from fcaudit.engine.metrics import aggregate
from fcaudit.engine.result import AuditResult
from fcaudit.engine.result_views import (
    DELTA_REASSIGN,
    DELTA_SHUFFLE,
    NLL_CORRECT,
    RETENTION_LAYER,
    RETENTION_LAYER_POSITION,
    RETENTION_LAYER_TOKEN,
)
from fcaudit.io.fileio import PLAIN_FILES, FileWriter, read_json
from fcaudit.io.outdir import STUDY_POINTS
from fcaudit.study import paper
from fcaudit.study.declare import ci_span
from fcaudit.study.train import TRAIN_PRESETS, TrainPreset

SCHEMA = "fcaudit.trend-point/1"
POINTS = STUDY_POINTS  # the study folder's sub-folder of point summaries
SEEDS = 2
BATCH = TRAIN_PRESETS["tiny"]  # the batch shape and warm-up every point trains with


@dataclass(frozen=True)
class Point:
    """A rung of the ladder: a model size (a preset of featuregate, dense and mudd)
    trained for ``steps`` steps of :data:`BATCH`'s shape."""

    size: str
    steps: int

    @property
    def name(self) -> str:
        return f"{self.size}-{self.steps}"

    @property
    def schedule(self) -> TrainPreset:
        """tiny's batch shape and warm-up, this size's learning rate, this length."""
        return dataclasses.replace(BATCH, steps=self.steps, lr=TRAIN_PRESETS[self.size].lr)

    @property
    def tokens(self) -> int:
        return self.steps * BATCH.batch_size * BATCH.seq_len

    @property
    def arches(self) -> tuple[str, ...]:
        """Audited here: FeatureGate (trained with its Dense twin) at every point, and MUDD,
        the contrast, at the tiny size's points (see the budget in the module docstring)."""
        return ("featuregate", "mudd") if self.size == CONTRAST_SIZE else ("featuregate",)


LADDER = (Point("tiny", 600), Point("tiny", 1200), Point("mid", 600), Point("small", 600))
CONTRAST_SIZE = "tiny"  # MUDD, the contrast, at the tiny size's points (both lengths)

# --------------------------------------------------------------------- point summary

# Per-seed numbers of a point: those with a 95% bootstrap interval over sequences, the rest.
WITH_CI = (RETENTION_LAYER, RETENTION_LAYER_POSITION,
           RETENTION_LAYER_TOKEN, DELTA_REASSIGN, DELTA_SHUFFLE, "frontier_gap_25")
PLAIN = ("eta2_layer", "eta2_token_id", NLL_CORRECT, "eval_nll", "unigram_nll", "wall_s")


@dataclass(frozen=True)
class SeedResult:
    """One trained and audited seed: its run's ``config.json``, its Dense twin's (trained
    alongside, for the execution audit), its audit, and the wall time all of it took."""

    seed: int
    config: Mapping[str, Any]
    audit: AuditResult
    dense_config: Mapping[str, Any] | None
    wall_s: float
    # a fold study's numbers of this seed (fcaudit.study.folds): metric key -> value
    folded: Mapping[str, float | None] = field(default_factory=dict)


def _estimate(value: float | None, ci95: Sequence[float] | None) -> dict[str, Any]:
    return {"value": value, "ci95": None if ci95 is None else list(ci95)}


def seed_numbers(r: SeedResult) -> dict[str, Any]:
    """The numbers of one seed, read off its audit's :meth:`AuditResult.metrics` (with
    their intervals for :data:`WITH_CI`) and its training run."""
    metrics, intervals = r.audit.metrics(), r.audit.metric_intervals()
    results = r.config["results"]
    return {"seed": r.seed,
            **{key: _estimate(metrics.get(key), intervals.get(key)) for key in WITH_CI},
            **{key: metrics[key] for key in ("eta2_layer", "eta2_token_id", NLL_CORRECT)},
            "eval_nll": results["eval_nll"], "unigram_nll": results["unigram_nll"],
            "wall_s": r.wall_s}


def over_seeds(seeds: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Mean, sd, min and max over seeds of every number, and for those with intervals the
    span of the seeds' intervals (lowest low to highest high)."""
    stats = aggregate([{k: s[k]["value"] for k in WITH_CI} | {k: s[k] for k in PLAIN}
                       for s in seeds])
    for key in WITH_CI:
        cis = [s[key]["ci95"] for s in seeds if s[key]["ci95"] is not None]
        stats[key]["ci95_span"] = list(ci_span(cis)) if cis else None
    return stats


def point_summary(point: Point, results: Mapping[str, Sequence[SeedResult]]) -> dict[str, Any]:
    """The summary JSON of one finished point (schema :data:`SCHEMA`).

    Steps, tokens and learning rate are read from the runs, so a smoke study with
    ``--steps`` records what it trained, not the ladder's plan.
    """
    first = results["featuregate"][0]
    train, audit = first.config["train"], first.audit
    models = {}
    for arch, seeds in results.items():
        per_seed = [seed_numbers(r) for r in seeds]
        dense = seeds[0].dense_config
        models[arch] = {"n_params": seeds[0].config["results"]["n_params"],
                        "dense_n_params": dense["results"]["n_params"] if dense else None,
                        "seeds": per_seed, "mean": over_seeds(per_seed)}
    wall = sum(s["wall_s"] for m in models.values() for s in m["seeds"])
    return {
        "schema": SCHEMA, "point": point.name, "size": point.size, "planned_steps": point.steps,
        "steps": train["steps"], "batch_size": train["batch_size"], "seq_len": train["seq_len"],
        "lr": train["lr"], "training_tokens": train["steps"] * train["batch_size"]
        * train["seq_len"],
        "corpus": first.config["data"].get("corpus") or first.config["data"]["path"],
        "corpus_tokens": first.config["data"]["train_tokens"],
        "vocab_size": first.config["model_config"]["vocab_size"],
        "n_params": models["featuregate"]["n_params"],
        "wall_s": round(wall, 1),
        "audit": {**{k: audit.data[k] for k in ("eval_sequences", "calib_sequences", "seq_len")},
                  "repeats": audit.settings["repeats"],
                  "bootstrap": audit.settings["bootstrap"]},
        "models": models,
        "versions": audit.versions,
    }


_POINT_KEYS = ("point", "size", "planned_steps", "steps", "training_tokens", "corpus",
               "corpus_tokens", "vocab_size", "lr", "n_params", "wall_s", "audit", "models")


def read_points(folder: str | Path) -> list[dict[str, Any]]:
    """Every point summary in ``folder``, smallest model first, then shortest training."""
    files = sorted(Path(folder).glob("*.json"))
    if not files:
        raise UsageError(f"no point summaries (*.json) in {folder}; run `fcaudit reproduce "
                         "--preset trend` first, or point at its points/ folder")
    points = []
    for path in files:
        data = read_json(path, "trend point summary")
        missing = [k for k in _POINT_KEYS if k not in data] if isinstance(data, dict) else []
        if not isinstance(data, dict) or data.get("schema") != SCHEMA or missing \
                or "featuregate" not in data["models"]:
            raise UsageError(f"{path} is not a complete {SCHEMA} point summary"
                             + (f" (missing {', '.join(missing)})" if missing else "")
                             + "; rerun `fcaudit reproduce --preset trend`")
        points.append(data)
    return sorted(points, key=lambda p: (p["n_params"], p["training_tokens"],
                                         p["planned_steps"]))


# ------------------------------------------------------------------------- reading

Stats = Mapping[str, Any]


def stats(point: Mapping[str, Any], arch: str, key: str) -> Stats | None:
    """One number's statistics over seeds at a point (None: that model was not audited)."""
    model = point["models"].get(arch)
    return None if model is None else model["mean"].get(key)


@dataclass(frozen=True)
class Metric:
    """How one number is named, scaled (fractions shown as percent) and written, its
    column head in trend.md's tables and, where it is plotted, its panel's label and
    reference line."""

    key: str
    label: str
    scale: float
    unit: str  # of a value; differences of percentages are "points"
    digits: int
    head: str
    panel: str = ""
    ref: float | None = None

    def shown(self, x: float) -> float:
        """The value as written: what a reader can compare."""
        return round(x * self.scale, self.digits)

    def number(self, x: float) -> str:
        return f"{x * self.scale:.{self.digits}f}"

    def show(self, x: float) -> str:
        return self.number(x) + self.unit

    def change(self, d: float) -> str:
        unit = " points" if self.unit == "%" else self.unit
        return f"{d * self.scale:+.{self.digits}f}{unit}"


METRICS = {m.key: m for m in (  # in the order of trend.md's table columns
    Metric("eval_nll", "eval NLL", 1.0, "", 3, "eval NLL (nats)"),
    Metric(RETENTION_LAYER, "static-layer retention", 1.0, "%", 1,
           "static-layer retention (%)", "static-layer\nretention (%)", 100.0),
    Metric(RETENTION_LAYER_POSITION, "static-layer-position retention", 1.0, "%", 1,
           "static-layer-position retention (%)", "static-layer-position\nretention (%)", 100.0),
    Metric("eta2_layer", "layer share of gate variance (eta2 layer)", 100.0, "%", 1,
           "eta2 layer (%)", "eta2 layer (%)"),
    Metric(DELTA_REASSIGN, "reassign penalty", 1.0, " nats", 3, "reassign (nats)",
           "reassign penalty\n(nats)", 0.0),
    Metric(DELTA_SHUFFLE, "shuffle penalty", 1.0, " nats", 3, "shuffle (nats)",
           "shuffle penalty\n(nats)", 0.0),
    Metric(RETENTION_LAYER_TOKEN, "static-layer-token retention", 1.0, "%", 1,
           "static-layer-token retention (%)"),
    Metric("eta2_token_id", "token-id share of gate variance", 100.0, "%", 1,
           "token-id share (%)"),
    Metric("frontier_gap_25", "frontier gap at 25% FLOPs saved", 1.0, " nats", 4,
           "frontier gap at 25% saved (nats)"),
)}


def _millions(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n < 1e7 else f"{n / 1e6:.1f}M"


def _distinct(points: Sequence[Mapping[str, Any]], key: str) -> list[Mapping[str, Any]]:
    """The first point of each value of ``key``, ordered by it."""
    return sorted({p[key]: p for p in reversed(points)}.values(), key=lambda p: p[key])


def size_axis(points: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """One point per model size at the shortest training length, smallest first."""
    shortest = min(p["training_tokens"] for p in points)
    return _distinct([p for p in points if p["training_tokens"] == shortest], "n_params")


def length_axis(points: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """One point per training length of the smallest model, shortest first."""
    smallest = min(p["n_params"] for p in points)
    return _distinct([p for p in points if p["n_params"] == smallest], "training_tokens")


def describe(points: Sequence[Mapping[str, Any]], arch: str, metric: Metric, axis: str,
             held: str) -> str:
    """One sentence on how a number moves along one axis; it names a direction only when
    every step goes that way, and calls it established only when the first and last point
    have two or more seeds each and their seed ranges do not overlap."""
    name = f"{'FeatureGate' if arch == 'featuregate' else 'MUDD'}'s {metric.label}"
    values = [(p["point"], s) for p in points
              if (s := stats(p, arch, metric.key)) is not None and s["mean"] is not None]
    missing = [p["point"] for p in points if p["point"] not in dict(values)]
    held += f"; undefined at {', '.join(missing)}" if missing else ""
    if len(points) < 2:
        return f"{name} has a single point along {axis}: there is no trend to read."
    if len(values) < 2:
        return (f"{name} cannot be followed along {axis}: only {len(values)} of {len(points)} "
                "points have a defined value.")
    means = [s["mean"] for _, s in values]
    # directions as written: a difference below the printed precision is no step
    steps = [b - a for a, b in itertools.pairwise(metric.shown(m) for m in means)]
    path = " → ".join(f"{metric.show(s['mean'])} ({n})" for n, s in values)
    total = metric.change(means[-1] - means[0])
    first, last = values[0][1], values[-1][1]
    if not any(steps):
        return (f"{name} stays at {metric.show(means[0])} along {axis} ({held}), at all "
                f"{len(values)} points.")
    if all(d > 0 for d in steps) or all(d < 0 for d in steps):
        word = "rises" if steps[0] > 0 else "falls"
        word += f" with {axis}" + (" at every step" if len(steps) > 1 else "")
        if min(first["n"], last["n"]) < 2:
            return (f"{name} {word} ({held}): {path}, {total} in all, from one seed at an end "
                    "point, so not tested against the spread between seeds.")
        if _apart(first, last) if steps[0] > 0 else _apart(last, first):
            return (f"{name} {word} ({held}): {path}, {total} in all; the seed ranges of the "
                    "first and last point do not overlap.")
        return (f"{name} {word} by the means ({held}): {path}, {total} in all, but the seed "
                "ranges of the first and last point overlap, so the seeds do not establish the "
                "direction.")
    return (f"{name} does not move in one direction with {axis} ({held}): {path}, {total} "
            "first to last.")


def _apart(low: Stats, high: Stats) -> bool:
    """Every seed of ``high`` above every seed of ``low``."""
    return high["min"] > low["max"]


def _levers(by_size: Sequence[Mapping[str, Any]],
            by_length: Sequence[Mapping[str, Any]]) -> str:
    """How far each axis moves static-layer retention, end to end, for its own factor."""
    metric = METRICS[RETENTION_LAYER]
    parts = []
    for axis, key, ladder in (("parameters", "n_params", by_size),
                              ("training tokens", "training_tokens", by_length)):
        ends = [p for p in ladder if stats(p, "featuregate", metric.key)["mean"] is not None]
        if len(ends) >= 2:
            first, last = ends[0], ends[-1]
            change = (stats(last, "featuregate", metric.key)["mean"]
                      - stats(first, "featuregate", metric.key)["mean"])
            parts.append(f"by {metric.change(change)} over a {last[key] / first[key]:.1f}x "
                         f"increase in {axis} ({first['point']} to {last['point']})")
    return (f"End to end, FeatureGate's static-layer retention changes {' and '.join(parts)}."
            if parts else "")


def _largest(points: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    return max(points, key=lambda p: (p["n_params"], p["training_tokens"]))


def shows(points: Sequence[Mapping[str, Any]]) -> list[str]:
    """The paragraphs on what the numbers show, each sentence computed from them."""
    by_size, by_length = size_axis(points), length_axis(points)
    at_tokens = f"at {_millions(by_size[0]['training_tokens'])} training tokens"
    at_size = f"at {_millions(by_length[0]['n_params'])} parameters"
    main = [describe(by_size, "featuregate", METRICS[k], "model size", at_tokens)
            for k in (RETENTION_LAYER, "eta2_layer")]
    main += [describe(by_length, "featuregate", METRICS[k], "training length", at_size)
             for k in (RETENTION_LAYER, "eta2_layer")]
    main.append(_levers(by_size, by_length))
    top = _largest(points)
    ret, eta = (stats(top, "featuregate", k) for k in (RETENTION_LAYER, "eta2_layer"))
    where = (f"At the largest point ({top['point']}: {_millions(top['n_params'])} parameters, "
             f"{_millions(top['training_tokens'])} training tokens)")
    if ret["mean"] is None:
        main.append(f"{where} the static-layer retention is undefined (no clear gap).")
    else:
        gap = paper.RETENTION["76M"] - ret["mean"]
        seeds = f" (seeds {ret['min']:.1f}% to {ret['max']:.1f}%)" if ret["n"] > 1 else ""
        main.append(f"{where} the static per-layer profile keeps {ret['mean']:.1f}% of the "
                    f"gap{seeds}, {abs(gap):.1f} "
                    f"points {'below' if gap > 0 else 'above'} the paper's "
                    f"{paper.RETENTION['76M']:.2f}% at 76M; layer identity explains "
                    f"{100 * eta['mean']:.1f}% of the gate variance (paper: {paper.eta2_text()}).")
    other = [describe(by_size, "featuregate", METRICS[k], "model size", at_tokens)
             for k in (RETENTION_LAYER_POSITION, DELTA_REASSIGN, DELTA_SHUFFLE)]
    other += [describe(by_length, "featuregate", METRICS[k], "training length", at_size)
              for k in (RETENTION_LAYER_POSITION, DELTA_REASSIGN, DELTA_SHUFFLE)]
    return [" ".join(filter(None, main)), " ".join(other), _contrast(points)]


def _contrast(points: Sequence[Mapping[str, Any]]) -> str:
    """MUDD beside FeatureGate: at how many points its penalties are the larger ones."""
    both = [p for p in points if "mudd" in p["models"]]
    if not both:
        return "MUDD was not audited at these points, so there is no contrast."
    parts = []
    for key in (DELTA_REASSIGN, DELTA_SHUFFLE):
        pairs = [(stats(p, "mudd", key), stats(p, "featuregate", key)) for p in both]
        above = sum(m["mean"] > f["mean"] for m, f in pairs)
        tested = [(m, f) for m, f in pairs if min(m["n"], f["n"]) >= 2]
        apart = sum(_apart(f, m) for m, f in tested)
        spread = ("one seed, so no seed ranges to compare" if not tested else
                  f"the seed ranges apart at {apart}" + (
                      "" if len(tested) == len(pairs) else
                      f" of the {len(tested)} points with two or more seeds"))
        parts.append(f"its {METRICS[key].label} is above FeatureGate's at {above} of "
                     f"{len(both)} points, with {spread}")
    trend = describe(size_axis(both), "mudd", METRICS[DELTA_REASSIGN], "model size",
                     f"at {_millions(size_axis(both)[0]['training_tokens'])} training tokens")
    return (f"MUDD, the contrast: {parts[0]}; {parts[1]}. {trend} At 1.4B parameters the "
            f"paper reports +{paper.MUDD[DELTA_REASSIGN]} nats (reassign) and "
            f"+{paper.MUDD[DELTA_SHUFFLE]} nats (shuffle).")


def cannot_show(points: Sequence[Mapping[str, Any]]) -> str:
    """What the ladder cannot show, with its own numbers."""
    seeds = min(len(m["seeds"]) for p in points for m in p["models"].values())
    top_params = max(p["n_params"] for p in points)
    longest = max(points, key=lambda p: p["training_tokens"])
    top_tokens, corpus = longest["training_tokens"], longest["corpus_tokens"]
    vocabs = sorted({p["vocab_size"] for p in points})
    rates = sorted({p["lr"] for p in points}, reverse=True)
    audit = points[0]["audit"]
    lr_note = (f"the learning rate falls with width ({', '.join(f'{r:g}' for r in rates)}), "
               "so size and learning rate change together; ") if len(rates) > 1 else ""
    vocab_note = (f"sizes use different vocabularies ({', '.join(map(str, vocabs))} tokens), so "
                  "eval NLL compares only points of one vocabulary; ") if len(vocabs) > 1 else ""
    spread = ("1 seed: no seed range" if seeds == 1 else
              f"{seeds} seeds: a seed range of {seeds} values")
    passes = top_tokens / corpus
    text = f"the {_millions(corpus)}-token training text ({longest['corpus']})"
    repeats = (f"{passes:.1f} passes over {text}, so at this scale training longer repeats "
               "the same text rather than adding new text" if passes > 1 else
               f"{passes:.2f} of one pass over {text}, which longer training would soon "
               "repeat")
    return (f"What it cannot show: each point has {spread} and no interval over training "
            "runs; the largest model "
            f"has {_millions(top_params)} parameters, {76e6 / top_params:.0f}x fewer than the "
            f"paper's 76M and {504e6 / top_params:.0f}x fewer than its 504M, so whether "
            "retention reaches ~99% there is an extrapolation these points do not support; "
            f"the longest training sees {_millions(top_tokens)} tokens, {repeats}; "
            f"{lr_note}{vocab_note}every audit measures {audit['eval_sequences']} evaluation "
            f"and {audit['calib_sequences']} calibration sequences of {audit['seq_len']} tokens "
            "from one corpus. Each length is its own learning-rate schedule, not a checkpoint "
            "of a longer run, and no point is tested for convergence; beyond its sizes, the "
            "paper's training recipe is not known here.")


# ------------------------------------------------------------------------- rendering


def _cell(s: Stats | None, metric: Metric) -> str:
    """A point made before a column existed has no entry: "not measured" (rerun the study
    to fill it); a column measured with no defined value (MUDD's frontier) is "undefined"."""
    if s is None:
        return "not measured"
    if s["mean"] is None:
        return "undefined"
    return (f"{metric.number(s['mean'])} [{metric.number(s['min'])}, "
            f"{metric.number(s['max'])}]" if s["n"] > 1 else metric.number(s["mean"]))


WALL_HEAD = "point wall (min, all its runs and audits)"


def _table(points: Sequence[Mapping[str, Any]], arch: str,
           paper: Sequence[Sequence[str]]) -> str:
    """One row per point (mean [lowest seed, highest seed]), then the paper's rows; the
    FeatureGate table also carries each point's wall time."""
    wall = arch == "featuregate"
    rows = []
    for p in points:
        if arch not in p["models"]:
            continue
        m = p["models"][arch]
        rows.append((md_text(p["point"]), _millions(m["n_params"]), str(p["steps"]),
                     _millions(p["training_tokens"]), str(len(m["seeds"])),
                     *(_cell(m["mean"].get(k), METRICS[k]) for k in METRICS),
                     *([f"{p['wall_s'] / 60:.1f}"] if wall else [])))
    rows += [(*r, *([""] if wall else [])) for r in paper]
    heads = (*(m.head for m in METRICS.values()), *([WALL_HEAD] if wall else []))
    return md_table(("point", "parameters", "steps", "training tokens", "seeds", *heads),
                    rows, "lrrrr" + "r" * (len(METRICS) + wall))


def _paper_row(name: str, params: str, seeds: str, cells: Mapping[str, str]) -> list[str]:
    return [name, params, "", "", seeds, *(cells.get(k, "") for k in METRICS)]


def _panels(points: Sequence[Mapping[str, Any]]) -> list[TrendPanel]:
    def series(arch: str, metric: Metric) -> list[TrendPoint]:
        out = []
        for p in points:
            s = stats(p, arch, metric.key)
            if s is None:
                continue
            k = metric.scale
            span = s.get("ci95_span") or (s["min"], s["max"])
            seeds = p["models"][arch]["seeds"]
            each = [x["value"] if isinstance(x, dict) else x
                    for x in (sd[metric.key] for sd in seeds)]
            out.append(TrendPoint(p["n_params"], p["training_tokens"],
                                  Span(*(None if x is None else x * k for x in (s["mean"], *span))),
                                  tuple(x * k for x in each if x is not None), p["point"]))
        return out

    anchors = {
        RETENTION_LAYER: [Anchor(f"{size} {v:.2f}%", "FeatureGate", v, v, paper.PARAMS[size])
                          for size, v in paper.RETENTION.items()],
        "eta2_layer": [Anchor(paper.eta2_text(), "FeatureGate", *paper.ETA2_LAYER)],
        **{key: [Anchor(f"MUDDPythia-1.4B {v:+.2f}", "MUDD", v, v, paper.PARAMS["1.4B"])]
           for key, v in paper.MUDD.items()}}
    return [TrendPanel(m.panel, {"FeatureGate": series("featuregate", m),
                                 "MUDD": series("mudd", m)}, anchors.get(m.key, ()), m.ref)
            for m in METRICS.values() if m.panel]


FIGURE_CAPTION = ("FeatureGate and MUDD against parameters (left) and training tokens (right): "
                  "mean over seeds (dots: each seed; bars: from the lowest to the highest of "
                  "the seeds' 95% bootstrap intervals, for eta2 the seed range); stars, lines "
                  "and the band: the paper.")


def _mudd_points(points: Sequence[Mapping[str, Any]]) -> str:
    """Where the contrast was trained, in words."""
    names = [p["point"] for p in points if "mudd" in p["models"]]
    if len(names) == len(points):
        return "at every point"
    return f"at {', '.join(names)}" if names else "at no point"


def markdown(points: Sequence[Mapping[str, Any]], figures: Sequence[RenderedFigure],
             command: str) -> str:
    """``trend.md``: what the ladder shows and cannot show, the tables, the figure."""
    listing = ", ".join(f"{p['point']} ({_millions(p['n_params'])} parameters, "
                        f"{_millions(p['training_tokens'])} tokens)" for p in points)
    eta2 = f"{paper.ETA2_LAYER[0]:.0f} to {paper.ETA2_LAYER[1]:.0f}"
    paper_fg = [_paper_row(f"paper {size}", size, str(paper.RETENTION_SEEDS[size]),
                           {RETENTION_LAYER: f"{value:.2f}", "eta2_layer": eta2})
                for size, value in paper.RETENTION.items()]
    paper_mudd = [_paper_row("paper MUDDPythia-1.4B", "1.4B", "", {
        RETENTION_LAYER: "static hurts strongly",
        DELTA_REASSIGN: f"{paper.MUDD[DELTA_REASSIGN]}",
        DELTA_SHUFFLE: f"{paper.MUDD[DELTA_SHUFFLE]}"})]
    blocks = [
        "# FeatureGate's findings against model size and training length (CPU scale)",
        f"{len(points)} points: {md_text(listing)}. FeatureGate (with its Dense twin) at "
        f"every point and MUDD {_mudd_points(points)} are trained on "
        f"{md_text(points[0]['corpus'])} and audited on the "
        "built-in evaluation and calibration plays; cells are the mean over seeds [lowest "
        "seed, highest seed]. Retention is the share of the "
        "Correct-to-GlobalMean gap a static profile keeps; penalties are NLL increases over "
        "correct replay.",
        "## What the trend shows", *shows(points),
        "## What it cannot show", cannot_show(points),
        "## FeatureGate", _table(points, "featuregate", paper_fg),
        "## MUDD (the contrast)", _table(points, "mudd", paper_mudd),
        "## Figure", *md_figures(figures),
        "## Rerun", f"This page is written from the point summaries by {md_code(command)}.",
    ]
    return "\n\n".join(blocks) + "\n"


def write_trend(points_dir: str | Path, out: str | Path,
                command: str = "python docs/trend/make_trend.py",
                files: FileWriter = PLAIN_FILES) -> str:
    """Write ``out/trend.md`` and ``out/figures/trend.{png,svg}`` from the point summaries
    in ``points_dir``; the same summaries give byte-identical files. Returns the Markdown."""
    points = read_points(points_dir)
    out = Path(out)
    figures = write_figures([("trend", FIGURE_CAPTION, partial(trend_figure, _panels(points)))],
                            out / "figures", files)
    text = markdown(points, figures, command)
    files.write_text(out / "trend.md", text)
    return text

