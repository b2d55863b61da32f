"""The audit result: the one definition of ``audit.json`` (schema ``fcaudit.audit/1``).

:class:`AuditResult` and the dataclasses it nests are the schema. The engine builds
one, :meth:`AuditResult.to_json` writes it and :meth:`AuditResult.from_json` reads
it back (strictly: an unknown schema or a missing key is an error); the report, the
reproduction study and the CLI read results only through it. Condition names,
metric keys and the keys that may differ between identical runs are defined here
once.
"""

from __future__ import annotations

import dataclasses
import html
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fcaudit._version import __version__
from fcaudit.core.conditions import (  # noqa: F401 (audit.json's condition names)
    CORRECT,
    FRONTIER,
    GLOBAL_MEAN,
    MAIN_CONDITIONS,
    PER_LAYER_CONDITIONS,
    RANDOM_CONDITIONS,
    REASSIGN,
    REASSIGN_SHUFFLE,
    REPORTED_CONDITIONS,
    REPORTED_RETENTION,
    RETENTION_PROFILES,
    SHUFFLE,
    STATIC_CONDITIONS,
    audited,
    by_kind,
)
from fcaudit.core.errors import DataError, FcauditError, install_extra
from fcaudit.core.registry import refusal
from fcaudit.engine.analyses import (
    ANALYSES,
    expert_importance,
    frontier,
    routing,
    selection_parts,
    token_profile,
)
from fcaudit.engine.frontier_parts import ExitSummary, FrontierFamily
from fcaudit.engine.objectives import loss_name
from fcaudit.engine.result_parts import (  # noqa: F401 (re-exported: the schema's parts)
    DEPENDENCE_LABELS,
    EXECUTION_LABELS,
    EXITS,
    QUESTIONS,
    VARIATION_LABELS,
    ComponentShares,
    ConditionResult,
    ControllerCost,
    DataSummary,
    Estimate,
    Execution,
    ExecutionSection,
    ExpertExecution,
    ExpertImportance,
    Identity,
    ImportanceSummary,
    Interval,
    LayerConditionResult,
    LayerImportance,
    LayerRouting,
    LayerVariation,
    ModelInfo,
    NotMeasured,
    Profile,
    Retention,
    RoutingSummary,
    Runtime,
    Seeds,
    SideTiming,
    SiteInfo,
    SitePart,
    Stopping,
    StoppingRound,
    Timing,
    TokenProfile,
    VarianceShares,
    Variation,
    Verdict,
    VerdictPart,
    _omit_none,
    token_id_words,
)
from fcaudit.engine.result_views import (  # noqa: F401 (some re-exported)
    ETA2_KEYS,
    TABLES,
    TOKEN_ID_KEYS,
    condition_rows,
    condition_table_html,
    delta_key,
    metric_intervals,
    metrics,
)
from fcaudit.io.typedjson import SchemaError, load

SCHEMA = "fcaudit.audit/1"


# Dotted paths of audit.json that may differ between two runs of the same model, data,
# seeds and settings; everything else is byte-identical (docs/reliability.md).
NONDETERMINISTIC_KEYS = ("runtime", "command", "execution.timing",
                         "execution.speed_ratio_vs_dense", "execution.controller_cost")
TIMED_VERDICT_KEY = "verdict.execution"  # listed too when the verdict quotes timing


@dataclass
class AuditResult:
    """Everything an audit produced; :meth:`to_json` is ``audit.json``."""

    schema: str
    fcaudit_version: str
    model: ModelInfo
    data: DataSummary
    sites: list[SiteInfo]
    identity_replay_max_abs_diff: float
    conditions: dict[str, ConditionResult]
    per_layer: dict[str, list[LayerConditionResult]]
    retention: dict[str, Retention]
    interaction: Estimate | None  # None: shuffle is not applicable (see not_applicable)
    variance: dict[str, VarianceShares]
    variation: dict[str, Variation]
    profiles: dict[str, Profile]
    execution: ExecutionSection
    verdict: Verdict
    seeds: Seeds
    settings: dict[str, Any]
    versions: dict[str, str]
    command: str | None
    nondeterministic_keys: list[str]
    runtime: Runtime
    identity: Identity | None = _omit_none()
    custom_conditions: dict[str, ConditionResult] | None = _omit_none()
    stopping: Stopping | None = _omit_none()
    # conditions that cannot act on these sites or inputs, with the reason (not run)
    not_applicable: dict[str, str] | None = _omit_none()
    # the numbers each answer of ``verdict`` rests on, by question (variation, dependence,
    # execution), named like metrics()
    verdict_numbers: dict[str, dict[str, float | None]] | None = _omit_none()
    # the registered analyses' sections (fcaudit.engine.analyses), each written at the top
    # level of audit.json under its analysis's name
    analyses: dict[str, Any] | None = _omit_none()

    @property
    def token_profile(self) -> TokenProfile | None:
        """static-layer-token's coverage of the evaluation tokens (token ids only)."""
        return (self.analyses or {}).get(token_profile.ANALYSIS.name)

    @property
    def exits(self) -> ExitSummary | None:
        """An exit model audited with an exit condition: depths, the references' layers,
        the share of the fixed-to-oracle gap the learned controller closes, the frontier."""
        return (self.analyses or {}).get(EXITS)

    @property
    def frontier(self) -> dict[str, FrontierFamily] | None:
        """Per covered family: the savings frontier's curves and matched comparisons."""
        return (self.analyses or {}).get(frontier.ANALYSIS.name)

    @property
    def routing(self) -> dict[str, RoutingSummary] | None:
        """Per router family: expert load, and the top-k sets each condition changes."""
        return (self.analyses or {}).get(routing.ANALYSIS.name)

    @property
    def selection_parts(self) -> dict[str, dict[str, VarianceShares]] | None:
        """Per family that names its coefficients: each one's variance decomposed alone."""
        return (self.analyses or {}).get(selection_parts.ANALYSIS.name)

    @property
    def expert_importance(self) -> dict[str, ImportanceSummary] | None:
        """Per router family: each ablated expert's penalty beside its load."""
        return (self.analyses or {}).get(expert_importance.ANALYSIS.name)

    def to_json(self) -> dict[str, Any]:
        """The ``audit.json`` content (plain JSON types), each analysis's section at the
        top level under its name."""
        out = dump(self)
        sections = out.pop("analyses", {})
        if taken := sorted(set(sections) & set(out)):
            raise FcauditError(f"analyses {taken} are named like audit.json's own keys: "
                               "rename them")
        return {**out, **sections}

    @classmethod
    def from_json(cls, data: Any, source: str = "audit.json") -> AuditResult:
        """Parse ``audit.json`` content strictly: a wrong schema, or any field missing,
        unknown, of the wrong type or not finite, or a condition missing, is refused in
        one line naming ``source`` and the field (:mod:`fcaudit.io.typedjson`)."""
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            found = data.get("schema") if isinstance(data, dict) else type(data).__name__
            raise DataError(f"{source} has schema {found!r}, expected {SCHEMA!r}; rerun the "
                            "audit with this fcaudit version")
        try:
            if "analyses" in data:  # never written: the sections sit at the top level
                raise SchemaError("analyses", "is not a key of audit.json")
            data, held = _held_elsewhere(data)
            # sections read back by name: an analysis this fcaudit lacks is an unknown key
            sections = {a.name: data[a.name] for a in ANALYSES.values() if a.name in data}
            result = load(cls, {k: v for k, v in data.items() if k not in sections})
            sections = {k: load(ANALYSES[k].section_type or Any, v, k)
                        for k, v in sections.items()} | held
            if sections:
                result = dataclasses.replace(result, analyses={
                    a.name: sections[a.name] for a in ANALYSES.values() if a.name in sections})
            _check_conditions(result)
            check_consistent(result)
        except RecursionError as exc:  # data nested deeper than fcaudit's, given in memory
            raise DataError(f"{source} is not a valid {SCHEMA} result: it nests too deeply "
                            f"to be one; {_why_invalid(data.get('fcaudit_version'))}") from exc
        except SchemaError as exc:
            raise DataError(f"{source} is not a valid {SCHEMA} result: {exc}; "
                            f"{_why_invalid(data.get('fcaudit_version'))}") from exc
        return result._in_audit_order()

    def _in_audit_order(self) -> AuditResult:
        """``audit.json`` is written with sorted keys: the result with every table keyed by
        condition, family or site back in the order the audit made it (the main conditions
        in report order, custom ones as given, families and sites as listed); a new one, as
        no field of a built result is set."""
        given = self.settings.get("interventions")
        names = [*REPORTED_CONDITIONS, *(given if isinstance(given, list) else []),
                 *self.families, *(s.name for s in self.sites)]
        rank = {name: i for i, name in reversed(list(enumerate(names)))}
        def ordered(table: Any) -> Any:  # sorted() is stable: unknown keys keep file order
            return dict(sorted(table.items(), key=lambda kv: rank.get(kv[0], len(rank)))) \
                if isinstance(table, dict) else table
        return dataclasses.replace(
            self, **{name: ordered(getattr(self, name)) for name in _ORDERED_TABLES},
            analyses={k: ordered(v) for k, v in self.analyses.items()} if self.analyses else None)

    @classmethod
    def read(cls, path: str | Path) -> AuditResult:
        """Read an ``audit.json`` strictly (:meth:`from_json`); one that parses but whose
        bytes differ from the SHA-256 its output folder's marker recorded when fcaudit
        wrote it is refused too (:func:`~fcaudit.io.outdir.check_unchanged`): an edited
        number is well formed, yet not what the audit measured."""
        from fcaudit.io.fileio import read_json
        from fcaudit.io.outdir import check_unchanged
        result = cls.from_json(read_json(path, "audit result"), str(path))
        check_unchanged(path, "audit result")
        return result

    @property
    def families(self) -> list[str]:
        return list(dict.fromkeys(s.family for s in self.sites))

    def to_frame(self, table: str = "conditions") -> Any:
        """One table of the result as a pandas DataFrame (``pip install pandas``), to go on
        in a notebook: ``conditions`` (one row per condition, custom ones included),
        ``per_layer`` (one row per condition and site), ``retention`` (one row per static
        profile), ``routing`` (one row per router site and expert) or ``experts`` (expert
        importance: one row per ablated layer and expert) or ``frontier`` (one row per
        frontier point, with the origin of each rule omitted) or ``metrics`` (one row per
        number of :meth:`metrics`, with its interval where it has one), or an analysis's
        own table by its name (``tasks``: one row per benchmark task, metric and
        condition)."""
        try:
            import pandas as pd
        except ImportError as exc:
            raise FcauditError(f"to_frame() needs pandas: {install_extra('notebook')}") from exc
        own = {a.name: a for a in ANALYSES.values() if a.rows is not None}
        if table in own:
            section = (self.analyses or {}).get(table)
            if section is None:
                raise FcauditError(f"to_frame(table={table!r}): this audit has no {table} "
                                   "section (its analysis did not run)")
            return pd.DataFrame(own[table].rows(section))
        rows = TABLES.get(table)
        if rows is None:
            raise refusal(f"to_frame(table={table!r})", table, [*TABLES, *own])
        return pd.DataFrame(rows(self))

    def metrics(self) -> dict[str, float | None]:
        """The result's numbers, flat and named once (``delta_<condition>``,
        ``retention_<profile>``, ``eta2_*``, ...): what the study, the trend, the
        comparison and ``to_frame("metrics")`` read."""
        return metrics(self)

    def metric_intervals(self) -> dict[str, list[float] | None]:
        """The 95% intervals of :meth:`metrics` that have one, by the same keys."""
        return metric_intervals(self)

    def loss_name(self, per_unit: bool = False) -> str:
        """What its losses are called ("NLL", "cross-entropy", "answer loss"; ``per_unit``:
        "per-token NLL"), from the objective registry: every table names its loss column
        or row with it."""
        return loss_name(self.settings.get("objective"), per_unit)

    def verdict_parts(self) -> dict[str, VerdictPart]:
        """Each answer's label, the numbers it rests on and its sentence, by question (an
        exit model's exits first)."""
        numbers = self.verdict_numbers or {}
        asked = ((EXITS,) if self.verdict.exits else ()) + QUESTIONS
        return {q: VerdictPart(self.verdict.label(q), numbers.get(q, {}),
                               getattr(self.verdict, q))
                for q in asked}

    def _repr_html_(self) -> str:
        """What a notebook shows for a result: the three answers and the conditions."""
        esc = html.escape
        answers = "".join(
            f"<li><b>{q.title()}</b>{f' ({esc(p.label)})' if p.label else ''}: "
            f"{esc(p.sentence)}</li>" for q, p in self.verdict_parts().items())
        return (f"<div><p><b>fcaudit audit</b> of {esc(str(self.model.spec))} "
                f"({esc(self.model.class_)}, {len(self.sites)} sites)</p><ul>{answers}</ul>"
                f"<table><thead><tr><th>condition</th><th>{esc(self.loss_name())}</th>"
                "<th>&Delta; vs correct</th>"
                f"<th>95% CI</th></tr></thead><tbody>{condition_table_html(self, esc)}"
                "</tbody></table></div>")


# AuditResult tables keyed by condition, family or site (see AuditResult._in_audit_order)
_ORDERED_TABLES = ("conditions", "per_layer", "retention", "variance", "variation", "profiles",
                   "custom_conditions", "not_applicable")


def dump(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {}
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            if item is None and f.metadata.get("omit_none"):
                continue
            out[f.metadata.get("json", f.name)] = dump(item)
        return out
    if isinstance(value, dict):
        return {str(k): dump(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [dump(v) for v in value]
    return value


def _why_invalid(written: object) -> str:
    """What to do about a result that does not parse: another fcaudit version wrote it, or
    it was changed since."""
    if isinstance(written, str) and written != __version__:
        return (f"it was written by fcaudit {written} (this is {__version__}): read it with "
                "that version, or rerun the audit")
    return "it was edited or damaged since fcaudit wrote it: rerun the audit or restore the file"


_DEFINED = {"conditions": REPORTED_CONDITIONS, "per_layer": PER_LAYER_CONDITIONS,
            "retention": REPORTED_RETENTION}  # the names each of these sections may hold


def _held_elsewhere(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The content without what files written before an analysis held elsewhere, and
    those sections, read from there (each analysis's ``earlier``)."""
    held = {}
    for a in ANALYSES.values():
        if a.earlier is not None:
            data, section = a.earlier(data)
            if section is not None:
                held[a.name] = section
    return data, held


def _check_conditions(r: AuditResult) -> None:
    """What the types cannot say: every main condition (and every opt-in one asked for) is
    measured or declared not applicable (never both; original and correct always
    measured), every static profile has its retention, no section names a condition the
    schema does not define, and the interaction is there exactly when shuffle was
    measured."""
    skipped = r.not_applicable or {}
    given = r.settings.get("conditions")
    opted = given if isinstance(given, list) else []  # the opt-in ones it was asked to run
    for name in audited(opted):
        if name in skipped and name in by_kind("reference"):  # the reference: always run
            raise SchemaError(f"not_applicable.{name}", "names a condition every audit runs")
        if (name in r.conditions) == (name in skipped):
            raise SchemaError(f"conditions.{name}", "is measured, yet not_applicable lists it"
                              if name in skipped else "is missing (and not_applicable does "
                              "not list it)")
    for key, known in _DEFINED.items():
        unknown = [n for n in getattr(r, key) if n not in known]
        if unknown:
            raise SchemaError(f"{key}.{unknown[0]}", "is not a condition this schema defines")
    missing = [n for n in audited(opted, REPORTED_RETENTION) if n not in r.retention]
    if missing:
        raise SchemaError(f"retention.{missing[0]}", "is missing")
    if (SHUFFLE in r.conditions) != (r.interaction is not None):
        raise SchemaError("interaction", "is missing, yet shuffle was measured"
                          if r.interaction is None else "is given, yet shuffle was not run")


def dumps(result: AuditResult) -> str:
    """Deterministic JSON text of a result (sorted keys, fixed indent)."""
    return json.dumps(result.to_json(), indent=2, sort_keys=True, allow_nan=False) + "\n"


# ---------------------------------------------------------------------- result_checks
# What an audit result's numbers say of each other, checked when a result is read.
#
# A well-typed ``audit.json`` can still be one fcaudit never wrote: a penalty edited by hand
# keeps its type. These invariants hold in every result fcaudit builds, by construction
# (:mod:`fcaudit.engine.summary`, :mod:`fcaudit.engine.metrics`), up to float rounding, so a
# file that breaks one was edited or damaged:
#
# * a condition's penalty is its NLL minus ``correct``'s (``delta = nll - correct.nll``), its
#   NLL the mean of its repeats and each repeat's penalty that repeat minus ``correct``
#   (per layer and for custom conditions alike);
# * a retention's gap is ``global-mean``'s NLL minus ``correct``'s; it has a value (and an
#   interval) exactly when it is ``defined``, which needs its gap's interval above 0, and the
#   value is ``100 (G - P) / (G - C)`` of the conditions' NLLs (on accuracy: of their
#   accuracies);
# * the interaction is ``Delta(reassign+shuffle) - Delta(reassign) - Delta(shuffle)``;
# * every estimate lies inside its own 95% interval (penalties, gaps, shares, the exit and
#   savings frontiers; the timing ratio of ``execution`` is not one of these: its interval
#   is over timing pairs, measured and not rebuilt).
#
# The first broken invariant is raised as a :class:`~fcaudit.io.typedjson.SchemaError` at the
# field's dotted path, as a type error is.

REL = 1e-9  # float rounding between a mean of differences and a difference of means
POINTS = (("value", "ci95"), ("delta", "ci95"), ("gap", "gap_ci95"))  # estimate, interval
NOT_REBUILT = ("execution", "runtime")  # measured sections whose intervals are not built here


def check_consistent(result: Any) -> None:
    """Raise :class:`SchemaError` at the first invariant ``result`` (an AuditResult)
    breaks (see the module docstring)."""
    correct = result.conditions[CORRECT]
    for path, cond in _conditions(result):
        _condition(path, cond, correct.nll)
    for name, ret in result.retention.items():
        _retention(f"retention.{name}", ret, result.conditions, name, "nll")
        if ret.accuracy is not None:
            _retention(f"retention.{name}.accuracy", ret.accuracy, result.conditions, name,
                       "accuracy")
    parts = [result.conditions.get(n) for n in (REASSIGN_SHUFFLE, REASSIGN, SHUFFLE)]
    if result.interaction is not None and None not in parts:
        both, reassign, shuffle = parts
        _same("interaction.value", result.interaction.value,
              both.delta - reassign.delta - shuffle.delta, "the interaction is "
              "Delta(reassign+shuffle) - Delta(reassign) - Delta(shuffle)",
              both.nll, reassign.nll, shuffle.nll)
    for path, node in _dataclasses(result, ""):
        _inside(path, node)


def _conditions(result: Any) -> Iterator[tuple[str, Any]]:
    for name, cond in result.conditions.items():
        yield f"conditions.{name}", cond
    for name, conds in result.per_layer.items():
        for i, cond in enumerate(conds):
            yield f"per_layer.{name}[{i}]", cond
    for name, cond in (result.custom_conditions or {}).items():
        yield f"custom_conditions.{name}", cond


def _condition(path: str, cond: Any, correct: float) -> None:
    _same(f"{path}.delta", cond.delta, cond.nll - correct, "the penalty is nll - correct.nll",
          cond.nll, correct)
    if len(cond.repeats) != len(cond.repeat_deltas) or not cond.repeats:
        raise SchemaError(f"{path}.repeat_deltas", f"holds {len(cond.repeat_deltas)} values for "
                                                   f"{len(cond.repeats)} repeats")
    _same(f"{path}.nll", cond.nll, sum(cond.repeats) / len(cond.repeats),
          "the NLL is the mean of its repeats", *cond.repeats)
    for i, (nll, delta) in enumerate(zip(cond.repeats, cond.repeat_deltas, strict=True)):
        _same(f"{path}.repeat_deltas[{i}]", delta, nll - correct,
              "a repeat's penalty is its NLL minus correct.nll", nll, correct)


def _retention(path: str, ret: Any, conditions: dict[str, Any], profile: str,
               measure: str) -> None:
    """``measure``: the conditions' field the retention reads (``nll``, ``accuracy``; the
    accuracy gap is correct's minus global-mean's, the loss gap the other way round)."""
    if (ret.value is None) != (ret.ci95 is None) or ret.defined != (ret.value is not None):
        raise SchemaError(f"{path}.defined", f"is {str(ret.defined).lower()}, yet the value "
                                             f"is {ret.value} with interval {ret.ci95}")
    if ret.defined and not ret.gap_ci95[0] > 0:
        raise SchemaError(f"{path}.value", f"is given, yet the gap's interval {ret.gap_ci95} "
                                           "is not above 0 (no share of noise is reported)")
    sign = -1.0 if measure == "accuracy" else 1.0
    top, floor = (getattr(conditions.get(n), measure, None) for n in (CORRECT, GLOBAL_MEAN))
    if top is None or floor is None:
        return
    _same(f"{path}.gap", ret.gap, sign * (floor - top), f"the gap is {GLOBAL_MEAN} minus "
          f"{CORRECT} ({measure})", floor, top)
    kept = getattr(conditions.get(profile), measure, None)
    if ret.value is not None and kept is not None:
        expected = 100.0 * sign * (floor - kept) / ret.gap
        scale = 100.0 * max(1.0, abs(floor), abs(kept), abs(top)) / abs(ret.gap)
        _same(f"{path}.value", ret.value, expected, f"the share is 100 ({GLOBAL_MEAN} - "
              f"{profile}) / gap ({measure})", scale)


def _same(path: str, found: float, expected: float, why: str, *scale: float) -> None:
    """``found`` equals ``expected`` within float rounding of numbers of size ``scale``."""
    size = max([1.0, abs(expected), *(abs(s) for s in scale)])
    if abs(found - expected) > REL * size:
        raise SchemaError(path, f"is {found!r}, but {why}: {expected!r}")


def _dataclasses(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    """Every dataclass in the result with its dotted path, the sections in
    :data:`NOT_REBUILT` left out."""
    if dataclasses.is_dataclass(node):
        yield path, node
        for f in dataclasses.fields(node):
            if not (path == "" and f.name in NOT_REBUILT):  # analyses: at audit.json's top
                yield from _dataclasses(getattr(node, f.name), "" if path == "" and
                                        f.name == "analyses" else _dotted(path, f.name))
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _dataclasses(value, _dotted(path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _dataclasses(value, f"{path}[{i}]")


def _dotted(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _inside(path: str, node: Any) -> None:
    """Each estimate of ``node`` inside its own interval (fcaudit widens an interval to
    hold its estimate: :func:`fcaudit.engine.metrics.interval`)."""
    for point, bounds in POINTS:
        value, ci = getattr(node, point, None), getattr(node, bounds, None)
        if isinstance(value, float) and isinstance(ci, list) and not ci[0] <= value <= ci[1]:
            raise SchemaError(f"{path}.{point}", f"is {value!r}, outside its own interval "
                                                 f"{bounds} {ci}")
