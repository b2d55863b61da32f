"""Several audits side by side: ``fcaudit compare A B ... --out CMP`` (docs/compare.md).

A comparison reads finished audits only (their ``audit.json``, through
:class:`~fcaudit.engine.result.AuditResult`, so an audit of another schema is refused
there) and writes ``compare.md``, ``compare.html``, ``figures/`` and, last,
``compare.json`` into an output folder of kind ``compare`` (:mod:`fcaudit.io.outdir`:
only fcaudit's own files there are ever replaced).

Audits are compared on the same evaluation data: their numbers are then paired (the same
windows, the same calibration profiles), so a difference is a difference of the models.
Audits whose data differ are refused in one line naming the audits and the field, unless
the caller allows it, and then the report says first that the numbers are not paired.

Every table is built once as rows of raw values; ``compare.json`` holds those rows and
``compare.md`` shows the same rows formatted, so the two cannot disagree. A quantity one
audit lacks is shown as "—" (``null`` in JSON), never dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from fcaudit._version import __version__
from fcaudit.core.conditions import (
    CORRECT,
    PER_LAYER_CONDITIONS,
    REASSIGN,
    REPORTED_CONDITIONS,
    REPORTED_RETENTION,
    STATIC_LAYER,
    by_role,
)
from fcaudit.core.errors import UsageError, arg
from fcaudit.engine.analyses import ANALYSES, analysis_metrics
from fcaudit.engine.result import AuditResult, Retention, delta_key
from fcaudit.engine.result_views import (
    EXIT_MEAN_DEPTH,
    EXIT_THRESHOLD,
    NLL_CORRECT,
    execution_row,
)
from fcaudit.io.fileio import PLAIN_FILES, FileWriter
from fcaudit.io.outdir import COMPARE_RESULTS, check_output, hold_output
from fcaudit.io.results import replacing_results
from fcaudit.report.audit_report import CONDITION_MEANING, conditional_meaning
from fcaudit.report.figures import (
    FigureSpec,
    RenderedFigure,
    Span,
    comparison_figure,
    layer_figure,
    profile_figure,
    write_figures,
)
from fcaudit.report.format import fmt_count, fmt_num, fmt_pct_with_ci, fmt_with_ci
from fcaudit.report.markdown import (
    FIGURE_DIR,
    md_code,
    md_fenced,
    md_figures,
    md_table,
    md_text,
    to_html,
)
from fcaudit.report.report_parts import _ordered

COMPARE_SCHEMA = "fcaudit.compare/1"
MISSING = "—"  # a quantity this audit does not hold
# What makes two audits' numbers paired, checked in this order: the evaluation windows
# (their count, length and content digest) or examples (inputs other than token ids), then
# the calibration data, which the static profiles are estimated on.
DATA_FIELDS = ("seq_len", "eval_sequences", "eval_examples", "eval_fingerprint",
               "calib_sequences", "calib_examples", "calib_fingerprint")
REROUTED_CONDITIONS = by_role("rerouted")
LABELS = arg("labels", cli="--label")  # the CLI's --label is repeated, once per audit

Row = dict[str, Any]
AuditLike = str | Path | AuditResult


# ------------------------------------------------------------------------- loading


def _load(item: AuditLike) -> tuple[AuditResult, Path | None]:
    """An audit given as its result, its folder or its ``audit.json``."""
    if isinstance(item, AuditResult):
        return item, None
    path = Path(item).expanduser()
    if not path.exists():
        raise UsageError(f"{path} does not exist; pass folders written by `fcaudit audit`")
    file = path / "audit.json" if path.is_dir() else path
    if not file.exists():  # anything else there (a FIFO, a device) is refused by the reader
        raise UsageError(f"{path} is not an audit folder (it holds no audit.json); pass "
                         "folders written by `fcaudit audit`")
    return AuditResult.read(file), path


def _default_label(result: AuditResult, path: Path | None) -> str:
    """The audit folder's name (an audit given in memory: its model spec's last part)."""
    if path is None:
        return Path(str(result.model.spec)).name or str(result.model.spec)
    folder = path if path.is_dir() else path.parent
    return folder.resolve().name


def _check_labels(labels: Sequence[str], given: bool) -> None:
    blank = [i for i, label in enumerate(labels) if not label.strip()]
    if blank:
        raise UsageError(f"label {blank[0] + 1} is empty; give each audit a name with {LABELS}")
    seen: dict[str, int] = {}
    for i, label in enumerate(labels):
        if label in seen:
            how = "labels" if given else "folder names"
            raise UsageError(f"audits {seen[label] + 1} and {i + 1} have the same name "
                             f"{label!r} (their {how}); name each audit with {LABELS}, "
                             "one per audit in order")
        seen[label] = i


def _short(value: Any) -> str:
    text = "not recorded" if value is None else str(value)
    return text[:12] + "…" if len(text) > 16 else text


def _data_differences(labels: Sequence[str], results: Sequence[AuditResult]) -> list[Row]:
    """Every data field whose value is not the same in all audits, with each audit's."""
    return [{"field": key, "values": dict(zip(labels, values, strict=True))}
            for key in DATA_FIELDS
            if len(set(map(repr, values := [r.data.get(key) for r in results]))) > 1]


def _refuse_different_data(labels: Sequence[str], differs: Sequence[Row]) -> None:
    first = differs[0]
    values = list(first["values"].items())
    base = values[0][1]
    other = next((label, v) for label, v in values if v != base)
    which = "calibration" if first["field"].startswith("calib") else "evaluation"
    raise UsageError(
        f"audits {labels[0]!r} and {other[0]!r} were measured on different {which} data "
        f"({first['field']}: {_short(base)} vs {_short(other[1])}), so their numbers are not "
        f"paired; compare audits of the same data, or pass "
        f"{arg('allow_different_data', py='allow_different_data=True')} to compare them anyway")


# -------------------------------------------------------------------------- tables


def _answers(labels: Sequence[str], results: Sequence[AuditResult]) -> list[Row]:
    return [{"model": label, **{q: p.sentence for q, p in r.verdict_parts().items()},
             "labels": {q: p.label for q, p in r.verdict_parts().items()},
             "identity_exact": r.identity.exact if r.identity is not None else
             r.identity_replay_max_abs_diff == 0}
            for label, r in zip(labels, results, strict=True)]


def _models(labels: Sequence[str], results: Sequence[AuditResult],
            sources: Sequence[Path | None]) -> list[Row]:
    return [{"model": label, "audit": None if src is None else str(src),
             "spec": r.model.spec, "class": r.model.class_, "n_params": r.model.n_params,
             "fingerprint": r.model.fingerprint, "fcaudit_version": r.fcaudit_version,
             **{key: r.data.get(key) for key in DATA_FIELDS}}
            for label, r, src in zip(labels, results, sources, strict=True)]


def _retention_cell(ret: Retention) -> Row:
    return {"value": ret.value, "ci95": ret.ci95, "defined": ret.value is not None,
            "reason": ret.reason}


def _with_accuracy(r: AuditResult) -> Mapping[str, Retention]:
    """The profiles whose retention this audit also measured on accuracy (objectives with
    an accuracy, e.g. classification): a share of examples, beside the loss's share."""
    return {n: ret for n, ret in r.retention.items() if ret.accuracy is not None}


def _quantities(labels: Sequence[str], results: Sequence[AuditResult]) -> list[Row]:
    """One row per quantity (the loss of correct, named as the objectives name it; each
    condition's penalty, the interaction, each profile's retention, each custom
    condition's penalty; an exit model's threshold and mean executed depth); each model's
    value with its interval (from :meth:`AuditResult.metrics`), or None where its audit
    lacks it."""
    flat = [(r.metrics(), r.metric_intervals()) for r in results]

    def row(kind: str, name: str, key: str | None = None,
            cell: Callable[[AuditResult], Row | None] | None = None) -> Row:
        cells = [cell(r) if cell is not None else _metric_cell(*f, key or name)
                 for r, f in zip(results, flat, strict=True)]
        return {"kind": kind, "name": name, "models": dict(zip(labels, cells, strict=True))}

    def names(pick: Callable[[AuditResult], Mapping[str, Any]],
              canonical: Sequence[str]) -> list[str]:
        union = {n: None for r in results for n in pick(r)}
        return [n for n, _ in _ordered(union, canonical)]

    # what the audits' losses are called (the objective registry's names), each once
    loss = " / ".join(dict.fromkeys(r.loss_name() for r in results))
    rows = [{**row("nll", CORRECT, NLL_CORRECT), "loss": loss}]
    rows += [row("penalty", name, delta_key(name))
             for name in names(lambda r: r.conditions, REPORTED_CONDITIONS) if name != CORRECT]
    rows.append(row("interaction", "interaction"))  # None: shuffle not applicable
    rows += [row("retention", name, cell=lambda r, n=name: _retention_cell(r.retention[n])
                 if n in r.retention else None)
             for name in names(lambda r: r.retention, REPORTED_RETENTION)]
    rows += [row("accuracy retention", name, cell=lambda r, n=name: _retention_cell(
                 r.retention[n].accuracy) if n in _with_accuracy(r) else None)
             for name in names(_with_accuracy, REPORTED_RETENTION)]
    rows += [row("custom", name, delta_key(name))
             for name in names(lambda r: r.custom_conditions or {}, ())]
    if any(r.exits is not None for r in results):  # exit models: where they stop
        rows += [row("exit", name) for name in (EXIT_THRESHOLD, EXIT_MEAN_DEPTH)]
    # the numbers of the analyses compared by name (benchmark tasks: each task's metric
    # under each condition, and each profile's retention of it)
    rows += [row("analysis", name) for name in dict.fromkeys(
        key for r in results for key in analysis_metrics(
            {k: v for k, v in (r.analyses or {}).items()
             if k in ANALYSES and ANALYSES[k].compared}))]
    return rows


def _metric_cell(metrics: Mapping[str, float | None], intervals: Mapping[str, Any],
                 key: str) -> Row | None:
    """One model's value of a metric with its interval (None: the audit lacks it)."""
    value = metrics.get(key)
    return None if value is None else {"value": value, "ci95": intervals.get(key)}


QUANTITY_TITLE = {"nll": "{loss} of correct replay (nats)", "penalty": "Δ {name} (nats)",
                  "interaction": "interaction I (nats)", "retention": "retention {name}",
                  "accuracy retention": "retention {name} on accuracy",
                  "custom": "Δ {name} (custom, nats)", "exit": "{exit}",
                  "analysis": "{name}"}
EXIT_TITLE = {EXIT_THRESHOLD: "exit threshold", EXIT_MEAN_DEPTH: "mean executed depth (layers)"}


def _quantity_title(row: Row) -> str:
    return QUANTITY_TITLE[row["kind"]].format(name=md_code(row["name"]),
                                              loss=md_text(row.get("loss", "")),
                                              exit=EXIT_TITLE.get(row["name"], ""))


def _quantity_cell(kind: str, cell: Row | None) -> str:
    if cell is None:
        return MISSING
    if kind in ("retention", "accuracy retention"):
        if not cell["defined"]:
            return "undefined"
        return fmt_pct_with_ci(cell["value"], cell["ci95"])
    if kind == "nll":
        return fmt_num(cell["value"])
    if kind in ("exit", "analysis"):  # a threshold, a depth, a task's value: no sign
        return fmt_with_ci(cell["value"], cell["ci95"], sign=False)
    return fmt_with_ci(cell["value"], cell["ci95"])


def _routing(labels: Sequence[str], results: Sequence[AuditResult]) -> list[Row]:
    """One row per model and router family: load balance, re-routed shares, and the
    expert whose removal costs most (when expert importance was measured)."""
    rows = []
    for label, r in zip(labels, results, strict=True):
        for fam, summary in (r.routing or {}).items():
            entropy = [x.entropy_normalized for x in summary.per_layer]
            importance = (r.expert_importance or {}).get(fam)
            measured = [(layer.layer, x) for layer in (importance.per_layer if importance else ())
                        for x in layer.experts if x.delta is not None]
            top = max(measured, key=lambda item: item[1].delta, default=None)
            rows.append({
                "model": label, "family": fam, "num_experts": summary.num_experts,
                "layers": len(summary.per_layer),
                "load_entropy_normalized_mean": sum(entropy) / len(entropy) if entropy else None,
                "load_entropy_normalized_min": min(entropy, default=None),
                "rerouted": dict(summary.changed),
                "top_expert": None if top is None else {
                    "layer": top[0], "expert": top[1].expert, "delta": top[1].delta,
                    "ci95": top[1].ci95}})
    return rows


def _per_layer(labels: Sequence[str], results: Sequence[AuditResult]
               ) -> dict[str, dict[str, list[list[float | None]]]]:
    """Per-layer quantity -> series (a model, with its family when audits hold several)
    -> ``[layer, value, lo, hi]`` rows: what the overlaid figures draw."""
    families = {fam for r in results for fam in r.families}

    def name(label: str, fam: str) -> str:
        return f"{label}: {fam}" if len(families) > 1 else label

    out: dict[str, dict[str, list[list[float | None]]]] = {}

    def add(quantity: str, series: str, layer: int, value: float | None,
            ci: Sequence[float] | None = None) -> None:
        lo, hi = ci if ci is not None else (None, None)
        out.setdefault(quantity, {}).setdefault(series, []).append([layer, value, lo, hi])

    for label, r in zip(labels, results, strict=True):
        for cond, entries in _ordered(r.per_layer, PER_LAYER_CONDITIONS):
            for e in entries:
                add(per_layer_key(cond), name(label, e.family), e.layer, e.delta, e.ci95)
        for fam, v in r.variation.items():
            for x in v.per_layer:
                add("sd across inputs", name(label, fam), x.layer, x.sd_across_inputs)
                add("sd across positions", name(label, fam), x.layer, x.sd_across_positions)
        shares = r.execution.blocks_executed_per_layer if r.execution.measured else None
        for k, share in enumerate(shares or ()):
            add("blocks executed", label, k, share)
        for fam, summary in (r.routing or {}).items():
            for x in summary.per_layer:
                add("load entropy", name(label, fam), x.layer, x.entropy_normalized)
    return out


PENALTY_AXIS = "Δ {loss} (nats), 95% CI"  # a penalty's axis, in the audits' loss
def per_layer_key(condition: str) -> str:
    """A per-layer figure's quantity: one condition's penalty, layer by layer."""
    return f"{condition}@layer"


PER_LAYER_FIGURES = {  # quantity -> (title, y label, reference line)
    per_layer_key(REASSIGN): ("Penalty of reassigning one layer's coefficients (others correct)",
                       PENALTY_AXIS, 0.0),
    per_layer_key(STATIC_LAYER): ("Penalty of one layer's static profile (others correct)",
                           PENALTY_AXIS, 0.0),
    "sd across inputs": ("Coefficient sd across inputs, per layer", "sd", None),
    "sd across positions": ("Coefficient sd across positions, per layer", "sd", None),
    "blocks executed": ("Share of units (tokens or examples) that ran each block", "fraction",
                        None),
    "load entropy": ("Expert load entropy / log E per routed layer (1: balanced)",
                               "normalized entropy", None),
}


# -------------------------------------------------------------------- the comparison


@dataclass
class Comparison:
    """Audits side by side: the rows of every table (raw values) and, when written, the
    files. :meth:`to_json` is ``compare.json``."""

    labels: list[str]
    results: list[AuditResult] = field(repr=False)
    sources: list[Path | None]
    data: Row
    tables: dict[str, list[Row]]
    per_layer: dict[str, dict[str, list[list[float | None]]]]
    command: str | None = None
    files: list[Path] = field(default_factory=list)

    @property
    def loss(self) -> str:
        """What the audits' losses are called (the row of correct replay's says it)."""
        return next(r["loss"] for r in self.tables["quantities"] if r["kind"] == "nll")

    def to_json(self) -> dict[str, Any]:
        return {"schema": COMPARE_SCHEMA, "fcaudit_version": __version__,
                "labels": list(self.labels), "command": self.command, "data": self.data,
                "tables": self.tables, "per_layer": self.per_layer}

    def to_markdown(self, figures: Sequence[RenderedFigure] = ()) -> str:
        blocks = [f"# Comparison of {len(self.labels)} audits: "
                  + ", ".join(md_text(label) for label in self.labels), _data_block(self.data)]
        blocks += _models_md(self.tables["models"])
        blocks += _answers_md(self.tables["answers"])
        blocks += _quantities_md(self.labels, self.tables["quantities"])
        blocks += _execution_md(self.tables["execution"])
        blocks += _routing_md(self.labels, self.tables["routing"], self.loss)
        blocks += ["## Figures", *(md_figures(figures) or ["No figure data in these audits."])]
        if self.command:
            blocks += ["## Command", md_fenced(self.command)]
        return "\n\n".join(blocks) + "\n"

    def _figure_specs(self) -> list[FigureSpec]:
        def spans(kinds: tuple[str, ...]) -> dict[str, dict[str, Span]]:
            return {label: {row["name"]: Span.of(cell["value"], cell["ci95"])
                            for row in self.tables["quantities"] if row["kind"] in kinds
                            and (cell := row["models"][label]) is not None}
                    for label in self.labels}

        profiles: dict[str, list[tuple[str, Any]]] = {}
        for label, r in zip(self.labels, self.results, strict=True):
            for fam, p in r.profiles.items():
                profiles.setdefault(fam, []).append((label, p))
        specs: list[FigureSpec] = [
            ("penalties-retentions", "Penalty of each condition and gap retention of each "
             "static profile, per model, with 95% bootstrap CIs.",
             partial(comparison_figure, spans(("penalty", "interaction")), spans(("retention",)),
                     loss=self.loss)),
            ("profile", "Coefficient per layer, one line per model: mean with ±1 sd.",
             partial(profile_figure, profiles))]
        for quantity, series in self.per_layer.items():
            title, ylabel, ref = PER_LAYER_FIGURES.get(quantity, (
                f"Penalty of {quantity} (others correct)", PENALTY_AXIS, 0.0))
            ylabel = ylabel.format(loss=self.loss)
            lines = {s: [(int(k), Span(v, lo, hi)) for k, v, lo, hi in rows]
                     for s, rows in series.items()}
            specs.append((_stem(quantity), f"{title}, one line per model.",
                          partial(layer_figure, lines, title, ylabel, ref)))
        return specs

    def write(self, out: str | Path, files: FileWriter = PLAIN_FILES) -> list[Path]:
        """Write the figures, compare.md, compare.html, then compare.json (completion),
        through ``files`` (the folder's results writer)."""
        out = Path(out)
        figures = write_figures(self._figure_specs(), out / FIGURE_DIR, files)
        markdown = self.to_markdown(figures)
        title = f"fcaudit comparison: {', '.join(self.labels)}"
        paths = [p for f in figures for p in (f.png_path, f.svg_path)]
        for name, text in (("compare.md", markdown),
                           ("compare.html", to_html(title, markdown, figures))):
            paths.append(out / name)
            files.write_text(paths[-1], text)
        paths.append(out / "compare.json")
        files.write_json(paths[-1], self.to_json())
        self.files = paths
        return paths


def _stem(quantity: str) -> str:
    """A figure's file stem: ``reassign@layer`` -> ``per-layer-reassign``."""
    slug = "".join(c if c.isalnum() else "-" for c in quantity.removesuffix("@layer"))
    return "per-layer-" + "-".join(part for part in slug.split("-") if part)


# ------------------------------------------------------------------------ markdown


def _data_block(data: Row) -> str:
    if data["identical"]:
        every = "Both" if data["audits"] == 2 else f"All {data['audits']}"
        return (f"**Identical evaluation data.** {every} audits were measured "
                f"on the same {_eval_units(data)} (fingerprint "
                f"{md_code(_short(data['eval_fingerprint']))}) with the same calibration "
                "data, so every number below is paired across models: where models differ "
                "(checkpoints of one run, or families on the built-in corpus), the data by "
                "design do not.")
    fields = "; ".join(f"{md_code(d['field'])}: " + ", ".join(
        f"{md_text(label)} {md_code(_short(v))}" for label, v in d["values"].items())
        for d in data["differs"])
    return ("> **Warning: these audits were measured on different data; their numbers are "
            "not paired**, and a difference between two columns mixes the models with the data "
            f"(compared anyway, as asked with `--allow-different-data`). Differing: {fields}.")


def _eval_units(row: Row) -> str:
    """The evaluation data in its own units: token windows, or examples of other inputs."""
    if row.get("eval_sequences") is None and row.get("eval_examples") is not None:
        return f"{fmt_num(row['eval_examples'])} evaluation examples"
    return (f"{fmt_num(row.get('eval_sequences'))} evaluation windows of "
            f"{fmt_num(row.get('seq_len'))} tokens")


def _models_md(rows: Sequence[Row]) -> list[str]:
    cells = [(md_text(r["model"]), md_code(r["audit"]) if r["audit"] else "(in memory)",
              md_code(r["spec"]), md_text(r["class"]), fmt_num(r["n_params"]),
              _eval_units(r),
              md_code(_short(r["eval_fingerprint"])), md_code(r["fcaudit_version"]))
             for r in rows]
    return ["## Models", md_table(("model", "audit", "spec", "class", "parameters",
                                   "evaluation data", "eval fingerprint", "fcaudit"),
                                  cells, "lllllrll")]


def _answers_md(rows: Sequence[Row]) -> list[str]:
    cells = [(md_text(r["model"]) + ("" if r["identity_exact"] else
                                     " (identity replay not exact)"),
              md_text(r["variation"]), md_text(r["dependence"]), md_text(r["execution"]))
             for r in rows]
    return ["## The three answers per model",
            "Each audit's own verdict lines: do the coefficients vary, does the frozen model "
            "depend on them staying matched, does the mechanism change execution.",
            md_table(("model", "variation", "dependence", "execution"), cells, "llll")]


def _quantities_md(labels: Sequence[str], rows: Sequence[Row]) -> list[str]:
    cells = [(_quantity_title(r),
              md_text(CONDITION_MEANING.get(r["name"], "")) if r["kind"] == "penalty" else "",
              *(_quantity_cell(r["kind"], r["models"][label]) for label in labels))
             for r in rows]
    return ["## Penalties and retentions",
            "Δ: the loss minus the correct replay's, with its paired 95% bootstrap CI (an "
            "exit model's mean executed depth: its bootstrap CI over examples); retention: "
            "the share of the correct-to-global-mean gap a static profile keeps (undefined "
            "when that gap's CI is not above 0, or when the share's own CI is wider than the "
            f"whole 0–100% scale). {MISSING}: not in that audit.",
            md_table(("quantity", "coefficients fed", *map(md_text, labels)), cells,
                     "ll" + "r" * len(labels))]


def _execution_md(rows: Sequence[Row]) -> list[str]:
    def cells(r: Row) -> tuple[str, ...]:
        if not r["measured"]:
            return (md_text(r["model"]), md_text(r["unit"]),
                    f"not measured: {md_text(r['reason'] or '')}", *[MISSING] * 5)
        speed = MISSING if r["speed_ratio_vs_dense"] is None else \
            fmt_with_ci(r["speed_ratio_vs_dense"], r["speed_ratio_ci95"], sign=False)
        return (md_text(r["model"]), md_text(r["unit"]),
                f"{fmt_num(r['blocks_executed'], 2)} of {fmt_num(r['blocks_present'])}",
                fmt_count(r["flops_per_token"]), fmt_num(r["flops_ratio"]), speed,
                fmt_num(r["conditional_execution"]) +
                (" (degenerate exit rule: a fixed depth)" if r["degenerate_rule"] else ""),
                MISSING if r["experts_per_token"] is None else f"{r['experts_per_token']:.2f}")
    return ["## Execution",
            "Blocks and FLOPs per unit: per token of token ids, per example of other inputs. "
            f"Conditional execution is yes with {conditional_meaning('unit')}.",
            md_table(("model", "unit", "blocks executed per unit", "FLOPs per unit",
                      "FLOPs model / dense", "latency model / dense [95% CI]",
                      "conditional execution", "experts run per token per layer"),
                     [cells(r) for r in rows], "llrrrrll")]


def _routing_md(labels: Sequence[str], rows: Sequence[Row], loss: str) -> list[str]:
    if not rows:
        return []
    def top(t: Row | None) -> str:
        if t is None:
            return MISSING
        return f"layer {t['layer']} expert {t['expert']}: {fmt_with_ci(t['delta'], t['ci95'])}"
    cells = [(md_text(r["model"]), md_code(r["family"]), fmt_num(r["num_experts"]),
              f"{fmt_num(r['load_entropy_normalized_mean'], 3)} "
              f"(min {fmt_num(r['load_entropy_normalized_min'], 3)})",
              *(MISSING if c not in r["rerouted"] else f"{100 * r['rerouted'][c]:.1f}%"
                for c in REROUTED_CONDITIONS), top(r["top_expert"]))
             for r in rows]
    blocks = ["## Routing",
              "Load entropy / log E: 1 is a perfectly balanced expert load (mean over routed "
              "layers, and the least balanced layer). Re-routed: the share of (token, layer) "
              "top-k sets an intervention changes. Most important expert: the removal that "
              f"costs most {md_text(loss)} (expert importance).",
              md_table(("model", "family", "experts", "load entropy / log E",
                        *(f"re-routed: {c}" for c in REROUTED_CONDITIONS),
                        f"most important expert (Δ {md_text(loss)} removed)"), cells,
                       "llrr" + "rrr" + "l")]
    routed = {r["model"] for r in rows}
    if absent := [label for label in labels if label not in routed]:
        blocks.append("No routers in: " + ", ".join(md_text(label) for label in absent) + ".")
    return blocks


# ------------------------------------------------------------------------------ API


def compare(paths_or_results: Sequence[AuditLike], out: str | Path | None = None, *,
            labels: Sequence[str] | None = None, allow_different_data: bool = False,
            command: str | None = None) -> Comparison:
    """Compare finished audits (folders, ``audit.json`` files or AuditResults) side by side.

    Audits must share their evaluation and calibration data (:data:`DATA_FIELDS`) unless
    ``allow_different_data``, and then the report says the numbers are not paired.
    ``labels`` name the models (default: the audit folders' names). With ``out``, write
    compare.md, compare.html, figures/ and compare.json there; every refusal comes
    before anything is written.
    """
    items = list(paths_or_results)
    if len(items) < 2:
        raise UsageError(f"compare needs at least two audits, got {len(items)}")
    if labels is not None and len(labels) != len(items):
        raise UsageError(f"{len(labels)} {LABELS} for {len(items)} "
                         "audits: give one label per audit, in order")
    loaded = [_load(item) for item in items]
    results = [r for r, _ in loaded]
    sources = [src for _, src in loaded]
    names = list(labels) if labels is not None else \
        [_default_label(r, src) for r, src in loaded]
    _check_labels(names, labels is not None)
    differs = _data_differences(names, results)
    if differs and not allow_different_data:
        _refuse_different_data(names, differs)
    if out is not None:
        check_output(out, "compare")
    first = results[0].data
    data = {"identical": not differs, "audits": len(results), "differs": differs,
            **({} if differs else {key: first.get(key) for key in DATA_FIELDS})}
    comparison = Comparison(
        names, results, sources, data,
        {"models": _models(names, results, sources), "answers": _answers(names, results),
         "quantities": _quantities(names, results),
         "execution": [execution_row(n, r.execution) for n, r in zip(names, results, strict=True)],
         "routing": _routing(names, results)},
        _per_layer(names, results), command)
    if out is not None:
        with hold_output(out, "compare", command), \
                replacing_results(out, COMPARE_RESULTS) as files:
            comparison.write(out, files)
    return comparison
