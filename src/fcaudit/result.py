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
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import FcauditError

SCHEMA = "fcaudit.audit/1"

# SPEC section 4: every condition the audit replays, in report order.
MAIN_CONDITIONS = ("original", "correct", "reassign", "shuffle", "reassign+shuffle",
                   "static-layer", "static-layer-position", "global-mean")
RANDOM_CONDITIONS = ("reassign", "shuffle", "reassign+shuffle")
STATIC_CONDITIONS = ("static-layer", "static-layer-position", "global-mean")
PER_LAYER_CONDITIONS = ("reassign", "static-layer")  # one site intervened, others correct
RETENTION_PROFILES = ("static-layer", "static-layer-position")
ETA2_KEYS = ("eta2_layer", "eta2_position", "eta2_layer_position", "eta2_component",
             "eta2_residual")

# Dotted paths of audit.json that may differ between two runs of the same model, data,
# seeds and settings; everything else is byte-identical (docs/reliability.md).
NONDETERMINISTIC_KEYS = ("runtime", "command", "execution.timing",
                         "execution.speed_ratio_vs_dense")
TIMED_VERDICT_KEY = "verdict.execution"  # listed too when the verdict quotes timing

Interval = list[float]  # a 95% interval [lo, hi]


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
    num_experts: list[int]
    top_k: list[int]
    experts_per_token_per_layer: list[float]  # experts that ran per token, mean over tokens
    experts_per_token: float  # summed over layers
    experts_present: int  # summed over layers
    matches_routing: bool  # the experts that ran are exactly the routers' top-k choices
    active_expert_flops_per_token: float | None
    all_expert_flops_per_token: float | None  # had every token run every expert
    routing_changes_computation: bool


@dataclass
class Execution:
    """SPEC section 6. When ``measured`` is false only ``reason`` is set."""

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
    conditional_execution: bool | None = _omit_none()
    speed_ratio_vs_dense: float | None = None
    timing: Timing | None = None
    experts: ExpertExecution | None = _omit_none()

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


@dataclass
class SiteInfo:
    name: str
    family: str
    layer: int
    trailing_shape: list[int]
    adapter: str | None = _omit_none()


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


@dataclass
class AuditResult:
    """Everything an audit produced; :meth:`to_json` is ``audit.json``."""

    schema: str
    fcaudit_version: str
    model: ModelInfo
    data: dict[str, Any]
    sites: list[SiteInfo]
    identity_replay_max_abs_diff: float
    conditions: dict[str, ConditionResult]
    per_layer: dict[str, list[LayerConditionResult]]
    retention: dict[str, Retention]
    interaction: Estimate
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

    def to_json(self) -> dict[str, Any]:
        """The ``audit.json`` content (plain JSON types)."""
        return _dump(self)

    @classmethod
    def from_json(cls, data: Any, source: str = "audit.json") -> AuditResult:
        """Parse ``audit.json`` content; a wrong schema or a missing key is one clear error."""
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            found = data.get("schema") if isinstance(data, dict) else type(data).__name__
            raise FcauditError(f"{source} has schema {found!r}, expected {SCHEMA!r}; rerun the "
                               "audit with this fcaudit version")
        try:
            return _load(cls, data)
        except (KeyError, TypeError, ValueError) as exc:
            raise FcauditError(f"{source} is not a complete {SCHEMA} result ({exc}); rerun "
                               "the audit") from exc

    @classmethod
    def read(cls, path: str | Path) -> AuditResult:
        from .fileio import read_json
        return cls.from_json(read_json(path, "audit result"), str(path))

    @property
    def families(self) -> list[str]:
        return list(dict.fromkeys(s.family for s in self.sites))


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


def _load(tp: Any, data: Any) -> Any:
    """Build ``tp`` (a dataclass, list[X], dict[str, X], X | None or a plain type)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if data is None:
            return None
        return _load(options[0], data) if len(options) == 1 else data
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(data, list):
            raise TypeError(f"expected a list, got {type(data).__name__}")
        return [_load(item, v) for v in data]
    if origin is dict:
        _, item = typing.get_args(tp)
        if not isinstance(data, dict):
            raise TypeError(f"expected an object, got {type(data).__name__}")
        return {k: _load(item, v) for k, v in data.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(data, dict):
            raise TypeError(f"expected an object for {tp.__name__}, got {type(data).__name__}")
        hints = typing.get_type_hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            key = _json_name(f)
            if key in data:
                kwargs[f.name] = _load(hints[f.name], data[key])
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise KeyError(f"{tp.__name__}.{key}")
        return tp(**kwargs)
    return data


def dumps(result: AuditResult) -> str:
    """Deterministic JSON text of a result (sorted keys, fixed indent)."""
    return json.dumps(result.to_json(), indent=2, sort_keys=True, allow_nan=False) + "\n"
