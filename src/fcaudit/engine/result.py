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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TypedDict

from fcaudit._version import __version__
from fcaudit.core.conditions import (  # noqa: F401 (audit.json's condition names)
    MAIN_CONDITIONS,
    RANDOM_CONDITIONS,
    STATIC_CONDITIONS,
)
from fcaudit.core.errors import FcauditError
from fcaudit.io.typedjson import Length, Ordered, SchemaError, load

SCHEMA = "fcaudit.audit/1"

PER_LAYER_CONDITIONS = ("reassign", "static-layer")  # one site intervened, others correct
RETENTION_PROFILES = ("static-layer", "static-layer-position", "static-layer-token")
ETA2_KEYS = ("eta2_layer", "eta2_position", "eta2_layer_position", "eta2_component",
             "eta2_residual")

# Dotted paths of audit.json that may differ between two runs of the same model, data,
# seeds and settings; everything else is byte-identical (docs/reliability.md).
NONDETERMINISTIC_KEYS = ("runtime", "command", "execution.timing",
                         "execution.speed_ratio_vs_dense")
TIMED_VERDICT_KEY = "verdict.execution"  # listed too when the verdict quotes timing

Interval = Annotated[list[float], Length(2), Ordered()]  # a 95% interval [lo, hi]


def _omit_none() -> Any:
    """A field written to JSON only when it has a value."""
    return field(default=None, metadata={"omit_none": True})


@dataclass
class ConditionResult:
    """One replay condition: mean NLL, penalty vs correct with its paired interval, and
    each repetition (random conditions are repeated with K seeds)."""

    nll: float
    delta: float
    ci95: Interval
    repeats: list[float]
    repeat_deltas: list[float]
    # classification: share of evaluation examples classified correctly (repeats averaged)
    accuracy: float | None = _omit_none()


@dataclass
class LayerConditionResult(ConditionResult):
    """A per-layer variant: only ``site`` intervened, every other site correct."""

    layer: int = 0
    site: str = ""
    family: str = ""


@dataclass
class Retention:
    """Gap retention ``R(P)`` in percent; ``value`` is None when the gap is not clear."""

    gap: float
    gap_ci95: Interval
    value: float | None
    ci95: Interval | None
    defined: bool
    reason: str | None = _omit_none()


@dataclass
class Estimate:
    value: float
    ci95: Interval


@dataclass
class ComponentShares:
    index: list[int]
    eta2_layer: float
    eta2_position: float
    eta2_layer_position: float
    eta2_residual: float
    ss_total: float


@dataclass
class VarianceShares:
    """Variance decomposition of one family's coefficients (shares sum to 1)."""

    eta2_layer: float
    eta2_position: float
    eta2_layer_position: float
    eta2_component: float
    eta2_residual: float
    ss_total: float
    n_values: int
    components: list[ComponentShares] | None = _omit_none()
    components_note: str | None = _omit_none()
    # what the trailing index is: "expert" (a router's logits), "component" (any other
    # vector coefficient); None for one value per token, where that share is 0
    component_axis: str | None = _omit_none()
    # the token-id share: within each layer (and component), the share of variance the
    # current token id explains (one-way ANOVA, pooled over the family's layers); apart
    # from the shares above, which split the total. None: no variance within layers
    eta2_token_id: float | None = None

    def axes(self) -> list[tuple[str, float]]:
        """Every axis of the decomposition with its share, named; the shares sum to 1
        (all 0 when the coefficients do not vary at all)."""
        named = [("layer identity", self.eta2_layer), ("position", self.eta2_position),
                 ("layer-by-position interaction", self.eta2_layer_position)]
        if self.component_axis or self.eta2_component:
            named.append((self.component_axis or "component", self.eta2_component))
        return [*named, ("input and token content", self.eta2_residual)]

    def sentence(self) -> str:
        """The decomposition in words, every axis named (one place for verdict and report)."""
        if self.ss_total <= 0:
            return "they have no variance to decompose"
        parts = ", ".join(f"{name} {100 * share:.1f}%" for name, share in self.axes())
        total = 100 * sum(share for _, share in self.axes())
        token = "" if self.eta2_token_id is None else (
            f"; within layers, the current token id explains {100 * self.eta2_token_id:.1f}%")
        return f"their variance splits into {parts} (total {total:.1f}%){token}"


@dataclass
class TokenProfile:
    """How far static-layer-token's profiles (one per layer and token id, from the
    calibration set) cover the evaluation tokens: a token whose id no calibration token
    had is fed the static-layer profile instead."""

    calibration_token_ids: int  # distinct ids in the calibration set
    eval_tokens: int
    eval_tokens_unseen: int  # fed the static-layer profile
    eval_token_ids_unseen: int  # distinct ids among them


@dataclass
class LayerVariation:
    layer: int
    site: str
    mean: float
    sd_total: float
    sd_across_inputs: float
    sd_across_positions: float


@dataclass
class Variation:
    per_layer: list[LayerVariation]
    across_layer_sd: float
    mean_sd_across_inputs: float
    mean_sd_across_positions: float
    ratio_inputs_to_layers: float | None
    ratio_positions_to_layers: float | None


@dataclass
class Profile:
    """Per-layer mean and sd, and the layer x position mean map (every
    ``position_stride``-th position), for figures."""

    sites: list[str]
    mean: list[float]
    sd: list[float]
    position_mean: list[list[float]]
    position_stride: int


@dataclass
class SideTiming:
    median_s: float
    min_s: float
    max_s: float
    tokens_per_s: float


@dataclass
class Timing:
    speed_ratio_vs_dense: Estimate
    ratio_definition: str
    slowdown_percent: float
    model: SideTiming
    dense: SideTiming
    pairs_s: list[list[float]]
    pairs: int
    warmup: int
    bootstrap_resamples: int
    seed: int
    threads: int
    device: str
    device_name: str
    batch_size: int
    seq_len: int


@dataclass
class ExpertExecution:
    """What routing made the experts compute (counted by hooks on the experts)."""

    layers: list[str]  # the routed layers (their router sites)
    num_experts_per_layer: list[int]
    top_k_per_layer: list[int]
    experts_per_token_per_layer: list[float]  # experts that ran per token, mean over tokens
    experts_per_token_mean_over_layers: float
    experts_per_token_summed_over_layers: float
    experts_present_summed_over_layers: int
    matches_routing: bool  # the experts that ran are exactly the routers' top-k choices
    active_expert_flops_per_token: float | None  # summed over layers
    all_expert_flops_per_token: float | None  # had every token run every expert
    # in some routed layer a token runs fewer than every expert, the ones its router picks
    routing_changes_computation: bool
    # expert FLOPs per executed token-slot, per routed layer (the frontier's unit cost)
    flops_per_slot_per_layer: list[float] | None = _omit_none()

    def experts_present_text(self) -> str:
        """Experts present per routed layer: one number, or the range when layers differ."""
        low, high = min(self.num_experts_per_layer), max(self.num_experts_per_layer)
        return str(low) if low == high else f"{low} to {high}"


@dataclass
class Execution:
    """The execution section (docs/method.md, Execution); when ``measured`` is false only
    ``reason`` is set."""

    measured: bool
    reason: str | None = _omit_none()
    dense: str | None = _omit_none()
    blocks_executed: float | None = _omit_none()
    blocks_present: int | None = _omit_none()
    executed_fraction: float | None = _omit_none()
    blocks_executed_per_layer: list[float] | None = _omit_none()
    blocks: list[str] | None = _omit_none()
    dense_blocks_executed: float | None = _omit_none()
    dense_blocks_present: int | None = _omit_none()
    tokens_counted: int | None = _omit_none()
    flops_per_token: float | None = _omit_none()
    dense_flops_per_token: float | None = _omit_none()
    flops_ratio: float | None = _omit_none()
    flops_counted: str | None = _omit_none()
    uncounted_operators: list[str] | None = _omit_none()
    # what a token computes depends on its input: fewer blocks or FLOPs than dense
    # (saves_against_dense), or experts skipped per token (experts.routing_changes_computation)
    conditional_execution: bool | None = _omit_none()
    saves_against_dense: bool | None = _omit_none()  # > 1% fewer blocks or FLOPs than dense
    speed_ratio_vs_dense: float | None = None
    timing: Timing | None = None
    experts: ExpertExecution | None = _omit_none()
    # FLOPs per token that entered each block, counted on the model and the dense twin
    flops_per_block: list[float] | None = _omit_none()
    dense_flops_per_block: list[float] | None = _omit_none()
    # soft gates' gated modules (e.g. Qwen2-MoE's shared experts): FLOPs per token
    gated_flops_per_token: dict[str, float] | None = _omit_none()
    # what "per token" counts for inputs that are not token ids: "example" (blocks run per
    # example, FLOPs per example; experts per routed token); absent for token ids
    unit: str | None = _omit_none()
    # per example, the positions entering each block whose input is [B, P, C] (patch
    # tokens; None for other inputs): fewer than P where tokens are pruned
    positions_per_block: list[float | None] | None = _omit_none()
    dense_positions_per_block: list[float | None] | None = _omit_none()

    def omitted(self) -> set[str]:
        """An unmeasured execution is written as ``{measured, reason}`` alone."""
        if self.measured:
            return set()
        return {f.name for f in dataclasses.fields(self)} - {"measured", "reason"}


@dataclass
class LayerRouting:
    """One router under the original routing, and how interventions change its choices."""

    site: str
    layer: int
    load: list[float]  # share of token-slots routed to each expert
    entropy: float  # nats
    entropy_normalized: float  # entropy / log E: 1 = perfectly balanced
    changed: dict[str, float]  # condition -> share of tokens whose top-k set changed


@dataclass
class RoutingSummary:
    """Routing-aware metrics of one router family (issue: Mixture-of-Experts)."""

    num_experts: int
    tokens: int  # evaluation tokens per layer
    per_layer: list[LayerRouting]
    changed: dict[str, float]  # condition -> share of (token, layer) top-k sets changed
    note: str


@dataclass
class ExpertImportance:
    """One expert of one routed layer, removed from every token's choice (its logit put
    below the others; the family's rule picks the next expert and weights it as it does).

    ``delta``: NLL of that replay minus the correct replay's, with its paired interval;
    None, with ``reason``, when the rule still picked the expert (``selected_after`` > 0:
    token-slots that chose it under ablation), so no removal was measured. ``load``:
    its share of the original routing's token-slots."""

    expert: int
    delta: float | None
    ci95: Interval | None
    load: float
    selected_after: int
    reason: str | None = _omit_none()


@dataclass
class LayerImportance:
    site: str
    layer: int
    experts: list[ExpertImportance]


@dataclass
class ImportanceSummary:
    """Expert importance of one router family: one replay per layer and expert."""

    num_experts: int
    per_layer: list[LayerImportance]
    replays: int  # layers x experts
    note: str


@dataclass
class FrontierPointResult:
    """One frontier replay: a rule at one level (docs/method.md, Savings frontier)."""

    rule: str  # dynamic, static-layer, static-layer-position (gates); dynamic, static-k
    level: float  # target share of gated units skipped, set on calibration
    threshold: float | None  # gates: tau on |g - off| (off below); routers, dynamic: top-p mass
    layers: list[int] | None  # static-layer: layers zeroed; static-k: k per layer
    skipped_fraction: float  # of the gated units (token-layers or expert slots), evaluation
    flops_saved_per_token: float
    flops_saved_fraction: float  # of total_flops_per_token
    nll: float
    delta: float
    ci95: Interval
    # the dynamic rule at the model's own per-layer thresholds (a model that skips)
    own_thresholds: list[float] | None = _omit_none()


@dataclass
class FrontierMatch:
    """The curves interpolated at one FLOPs-saved fraction (None: beyond a curve's reach);
    ``gap[rule]``: that static rule's penalty minus the dynamic one's, paired interval."""

    saved: float
    dynamic: Estimate | None
    static: dict[str, Estimate | None]
    gap: dict[str, Estimate | None]


@dataclass
class FrontierCheck:
    """A model that really skips (SkipGate): its measured point against its dynamic curve."""

    measured_flops_saved_fraction: float  # dense FLOPs minus the model's, counted
    accounted_flops_saved_fraction: float  # the own-threshold point's skips x block FLOPs
    delta: float  # the own-threshold point's replay penalty (0: zeroing = skipping)
    ci95: Interval
    pooled_curve_delta: Estimate | None  # the calibrated dynamic rule at the same FLOPs
    on_curve: bool
    note: str


@dataclass
class FrontierFamily:
    """One family's savings frontier: every point, the matched comparisons at 10/25/50%
    saved, the mean gap over the common range (``area``) and the one sentence."""

    kind: str  # gate or router
    flops_per_unit: list[float] | None  # per layer: per skipped token (gate) or slot (router)
    total_flops_per_token: float | None  # the denominator of the saved fractions
    flops_source: str | None
    points: list[FrontierPointResult]
    matched: list[FrontierMatch]
    area: dict[str, Estimate | None]  # static rule -> mean (static - dynamic) penalty
    best_static: str | None  # the static rule with the smallest gap at 25% saved
    gap_at_25: Estimate | None
    sentence: str
    check: FrontierCheck | None = _omit_none()
    reason: str | None = _omit_none()


@dataclass
class Verdict:
    variation: str
    dependence: str
    execution: str


@dataclass
class Identity:
    """The identity replay check: ``correct`` must reproduce ``original`` bit for bit."""

    exact: bool
    max_abs_diff: float
    allowed_nonexact: bool
    note: str


@dataclass
class ModelInfo:
    spec: str
    kind: str
    class_: str = field(metadata={"json": "class"})
    arch: str | None
    n_params: int
    fingerprint: str
    dtype: str
    identity_note: str | None = _omit_none()
    # installed distribution -> version of the packages the model's classes come from
    packages: dict[str, str] | None = _omit_none()


class DataSummary(TypedDict, total=False):
    """``data``: what the audit measured on. The keys fcaudit defines are typed (compare
    pairs audits by them); the sources a caller records (``AuditData(sources=...)``) are
    free-form."""

    eval_sequences: int
    calib_sequences: int
    seq_len: int
    eval_tokens: int
    eval_examples: int
    calib_examples: int
    eval_fingerprint: str
    calib_fingerprint: str


@dataclass
class SiteInfo:
    name: str
    family: str
    layer: int
    trailing_shape: list[int]
    adapter: str | None = _omit_none()
    # the coefficient's leading axes in the model's words and which are positions, for
    # sites declared with other axes than [example, token]
    axes: list[str] | None = _omit_none()
    positions: list[int] | None = _omit_none()
    # how the layout was found when neither the model nor the user declared it
    layout: str | None = _omit_none()


@dataclass
class Seeds:
    master: int
    reassign: list[int]
    shuffle: list[int]
    bootstrap: int


@dataclass
class Runtime:
    """Facts of this run that change no number (host, wall times, how the replays were
    scheduled): the one section two identical audits may differ in."""

    host: dict[str, Any]
    timings: dict[str, float]
    schedule: dict[str, Any] | None = _omit_none()
    cache: dict[str, Any] | None = _omit_none()
    reuse: dict[str, Any] | None = _omit_none()  # replay batches reused from the cache
    # --target-ci: each round's wall time and what it took from the cache (record passes of
    # sequences already recorded, replay batches whose every fed tensor matched)
    rounds: list[dict[str, Any]] | None = _omit_none()
    placement: dict[str, Any] | None = _omit_none()  # accelerate's device map, budget


@dataclass
class StoppingRound:
    """One round of a ``--target-ci`` audit: the first ``sequences`` of the pool's seeded
    order, audited as a fixed audit of exactly those sequences would be."""

    sequences: int
    batches: int
    record_batches_new: int  # evaluation batches this round adds to the previous round's
    replay_passes: int  # batches x planned runs: every run of every batch is replayed
    half_widths: dict[str, float]  # counted condition -> max(delta - lo, hi - delta)
    widest: str
    met: bool  # every counted half-width <= target


@dataclass
class Stopping:
    """The ``--target-ci`` stopping rule, what it cost and why it stopped (deterministic
    given model, data, seeds and options; wall times are in ``runtime.rounds``)."""

    target_ci: float
    min_sequences: int
    pool_sequences: int
    pool_fingerprint: str  # SHA-256 of the pool's windows in their given order
    order_seed: int  # numpy default_rng(order_seed).permutation(pool) is the audit order
    pool_rows: list[int]  # the audited sequences: pool rows, in audit order
    conditions: list[str]  # the penalties whose half-widths must reach the target
    rule: str
    growth: str
    rounds: list[StoppingRound]
    sequences_used: int
    reached: bool
    reason: str
    replay_passes_total: int  # summed over rounds
    replay_passes_fixed: int  # a fixed audit of sequences_used sequences
    caveat: str


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
    execution: Execution
    verdict: Verdict
    seeds: Seeds
    settings: dict[str, Any]
    versions: dict[str, str]
    command: str | None
    nondeterministic_keys: list[str]
    runtime: Runtime
    identity: Identity | None = _omit_none()
    custom_conditions: dict[str, ConditionResult] | None = _omit_none()
    routing: dict[str, RoutingSummary] | None = _omit_none()
    expert_importance: dict[str, ImportanceSummary] | None = _omit_none()
    token_profile: TokenProfile | None = _omit_none()
    frontier: dict[str, FrontierFamily] | None = _omit_none()
    stopping: Stopping | None = _omit_none()
    # conditions that cannot act on these sites or inputs, with the reason (not run)
    not_applicable: dict[str, str] | None = _omit_none()

    def to_json(self) -> dict[str, Any]:
        """The ``audit.json`` content (plain JSON types)."""
        return _dump(self)

    @classmethod
    def from_json(cls, data: Any, source: str = "audit.json") -> AuditResult:
        """Parse ``audit.json`` content strictly: a wrong schema, or any field missing,
        unknown, of the wrong type or not finite, or a condition missing, is refused in
        one line naming ``source`` and the field (:mod:`fcaudit.io.typedjson`)."""
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            found = data.get("schema") if isinstance(data, dict) else type(data).__name__
            raise FcauditError(f"{source} has schema {found!r}, expected {SCHEMA!r}; rerun the "
                               "audit with this fcaudit version")
        try:
            result = load(cls, data)
            _check_conditions(result)
        except SchemaError as exc:
            raise FcauditError(f"{source} is not a valid {SCHEMA} result: {exc}; "
                               f"{_why_invalid(data.get('fcaudit_version'))}") from exc
        result._in_audit_order()
        return result

    def _in_audit_order(self) -> None:
        """``audit.json`` is written with sorted keys: put every table keyed by condition,
        family or site back in the order the audit made it (the main conditions in report
        order, custom ones as given, families and sites as listed)."""
        given = self.settings.get("interventions")
        names = [*MAIN_CONDITIONS, *(given if isinstance(given, list) else []),
                 *self.families, *(s.name for s in self.sites)]
        rank = {name: i for i, name in reversed(list(enumerate(names)))}
        for name in _ORDERED_TABLES:
            table = getattr(self, name)
            if isinstance(table, dict):  # sorted() is stable: unknown keys keep file order
                setattr(self, name, dict(sorted(table.items(),
                                                key=lambda kv: rank.get(kv[0], len(rank)))))

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
        frontier point, with the origin of each rule omitted)."""
        try:
            import pandas as pd
        except ImportError as exc:
            raise FcauditError("to_frame() needs pandas: pip install pandas") from exc
        rows = _TABLES.get(table)
        if rows is None:
            raise FcauditError(f"to_frame(table={table!r}): choose one of {', '.join(_TABLES)}")
        return pd.DataFrame(rows(self))

    def _repr_html_(self) -> str:
        """What a notebook shows for a result: the three answers and the conditions."""
        esc = html.escape
        answers = "".join(f"<li><b>{name}</b>: {esc(text)}</li>" for name, text in (
            ("Variation", self.verdict.variation), ("Dependence", self.verdict.dependence),
            ("Execution", self.verdict.execution)))
        cells = "".join(
            f"<tr><td>{esc(r['condition'])}</td><td>{r['nll']:.4f}</td>"
            f"<td>{r['delta']:+.4f}</td><td>[{r['ci_low']:+.4f}, {r['ci_high']:+.4f}]</td></tr>"
            for r in _condition_rows(self))
        return (f"<div><p><b>fcaudit audit</b> of {esc(str(self.model.spec))} "
                f"({esc(self.model.class_)}, {len(self.sites)} sites)</p><ul>{answers}</ul>"
                "<table><thead><tr><th>condition</th><th>NLL</th><th>&Delta; vs correct</th>"
                f"<th>95% CI</th></tr></thead><tbody>{cells}</tbody></table></div>")


# AuditResult tables keyed by condition, family or site (see AuditResult._in_audit_order)
_ORDERED_TABLES = ("conditions", "per_layer", "retention", "variance", "variation", "profiles",
                   "custom_conditions", "routing", "expert_importance", "frontier",
                   "not_applicable")


def _accuracy(r: AuditResult, c: ConditionResult) -> dict[str, Any]:
    """The accuracy column of a classification audit (none for other objectives)."""
    scored = any(x.accuracy is not None for x in r.conditions.values())
    return {"accuracy": c.accuracy} if scored else {}


def _condition_rows(r: AuditResult) -> list[dict[str, Any]]:
    items = [*r.conditions.items(), *(r.custom_conditions or {}).items()]
    return [{"condition": name, "custom": name not in r.conditions, "nll": c.nll,
             "delta": c.delta, "ci_low": c.ci95[0], "ci_high": c.ci95[1],
             "repeats": len(c.repeats), **_accuracy(r, c)} for name, c in items]


def _per_layer_rows(r: AuditResult) -> list[dict[str, Any]]:
    return [{"condition": name, "site": c.site, "family": c.family, "layer": c.layer,
             "nll": c.nll, "delta": c.delta, "ci_low": c.ci95[0], "ci_high": c.ci95[1],
             **_accuracy(r, c)}
            for name, layers in r.per_layer.items() for c in layers]


def _retention_rows(r: AuditResult) -> list[dict[str, Any]]:
    return [{"profile": name, "retention_pct": ret.value,
             "ci_low": ret.ci95[0] if ret.ci95 else None,
             "ci_high": ret.ci95[1] if ret.ci95 else None, "gap": ret.gap,
             "defined": ret.defined} for name, ret in r.retention.items()]


def _routing_rows(r: AuditResult) -> list[dict[str, Any]]:
    return [{"family": family, "site": layer.site, "layer": layer.layer, "expert": e,
             "load": share, "entropy_normalized": layer.entropy_normalized}
            for family, summary in (r.routing or {}).items() for layer in summary.per_layer
            for e, share in enumerate(layer.load)]


def _expert_rows(r: AuditResult) -> list[dict[str, Any]]:
    return [{"family": family, "site": layer.site, "layer": layer.layer, "expert": x.expert,
             "delta": x.delta, "ci_low": x.ci95[0] if x.ci95 else None,
             "ci_high": x.ci95[1] if x.ci95 else None, "load": x.load,
             "selected_after": x.selected_after}
            for family, summary in (r.expert_importance or {}).items()
            for layer in summary.per_layer for x in layer.experts]


def _frontier_rows(r: AuditResult) -> list[dict[str, Any]]:
    return [{"family": family, "kind": f.kind, "rule": p.rule, "level": p.level,
             "threshold": p.threshold, "skipped_fraction": p.skipped_fraction,
             "flops_saved_per_token": p.flops_saved_per_token,
             "flops_saved_fraction": p.flops_saved_fraction, "nll": p.nll, "delta": p.delta,
             "ci_low": p.ci95[0], "ci_high": p.ci95[1]}
            for family, f in (r.frontier or {}).items() for p in f.points]


_TABLES = {"conditions": _condition_rows, "per_layer": _per_layer_rows,
           "retention": _retention_rows, "routing": _routing_rows, "experts": _expert_rows,
           "frontier": _frontier_rows}


def _json_name(f: dataclasses.Field) -> str:
    return f.metadata.get("json", f.name)


def _dump(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {}
        omitted = value.omitted() if hasattr(value, "omitted") else set()
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            if f.name in omitted or (item is None and f.metadata.get("omit_none")):
                continue
            out[_json_name(f)] = _dump(item)
        return out
    if isinstance(value, dict):
        return {str(k): _dump(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_dump(v) for v in value]
    return value


def _why_invalid(written: object) -> str:
    """What to do about a result that does not parse: another fcaudit version wrote it, or
    it was changed since."""
    if isinstance(written, str) and written != __version__:
        return (f"it was written by fcaudit {written} (this is {__version__}): read it with "
                "that version, or rerun the audit")
    return "it was edited or damaged since fcaudit wrote it: rerun the audit or restore the file"


_DEFINED = {"conditions": MAIN_CONDITIONS, "per_layer": PER_LAYER_CONDITIONS,
            "retention": RETENTION_PROFILES}  # the names each of these sections may hold


def _check_conditions(r: AuditResult) -> None:
    """What the types cannot say: every main condition is measured or declared not
    applicable (never both; original and correct always measured), every static profile
    has its retention, no section names a condition the schema does not define, and the
    interaction is there exactly when shuffle was measured."""
    skipped = r.not_applicable or {}
    for name in MAIN_CONDITIONS:
        if name in skipped and name in ("original", "correct"):  # the reference: always run
            raise SchemaError(f"not_applicable.{name}", "names a condition every audit runs")
        if (name in r.conditions) == (name in skipped):
            raise SchemaError(f"conditions.{name}", "is measured, yet not_applicable lists it"
                              if name in skipped else "is missing (and not_applicable does "
                              "not list it)")
    for key, known in _DEFINED.items():
        unknown = [n for n in getattr(r, key) if n not in known]
        if unknown:
            raise SchemaError(f"{key}.{unknown[0]}", "is not a condition this schema defines")
    missing = [n for n in RETENTION_PROFILES if n not in r.retention]
    if missing:
        raise SchemaError(f"retention.{missing[0]}", "is missing")
    if ("shuffle" in r.conditions) != (r.interaction is not None):
        raise SchemaError("interaction", "is missing, yet shuffle was measured"
                          if r.interaction is None else "is given, yet shuffle was not run")


def dumps(result: AuditResult) -> str:
    """Deterministic JSON text of a result (sorted keys, fixed indent)."""
    return json.dumps(result.to_json(), indent=2, sort_keys=True, allow_nan=False) + "\n"
