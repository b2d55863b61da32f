"""The parts of the audit result (``audit.json``): the dataclasses :class:`~fcaudit.engine.
result.AuditResult` nests, one per section. Their fields are the schema; import them from
:mod:`fcaudit.engine.result`, which re-exports every one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, TypedDict

from fcaudit.io.typedjson import Length, Ordered

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
    # objectives with an accuracy: the same share on accuracy (gap: accuracy of correct
    # minus global-mean's, a fraction of examples)
    accuracy: Retention | None = _omit_none()


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


# what the trailing-index share is, said where the share is first named (a reader of
# "component 62.3%" meets the word there first)
COMPONENT_WORDS = {
    "component": "; component: which entry of a coefficient vector a value is (its index on "
                 "the sites' last axes), beyond its layer and position",
    "expert": "; expert: which expert a router logit scores, beyond its layer and position"}


# VarianceShares' shares of the total, and its token-id share, chance level and share
# beyond chance (as metrics name them)
ETA2_KEYS = ("eta2_layer", "eta2_position", "eta2_layer_position", "eta2_component",
             "eta2_residual")
TOKEN_ID_KEYS = ("eta2_token_id", "eta2_token_id_chance", "epsilon2_token_id")


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
    # its chance level (k - 1) / (n - 1) with k distinct ids among n tokens, and the share
    # beyond chance (epsilon squared: (share - chance) / (1 - chance), what sentences
    # headline; None when chance is 1). Absent from results written before issue 37
    eta2_token_id_chance: float | None = _omit_none()
    epsilon2_token_id: float | None = _omit_none()

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
        token = "" if (said := self.token_id_text()) is None else f"; within layers, {said}"
        what = COMPONENT_WORDS.get(self.component_axis or "", "")
        return f"their variance splits into {parts} (total {total:.1f}%{what}){token}"

    def token_id_text(self) -> str | None:
        """The token-id share in words (:func:`token_id_words`); None without one."""
        if self.eta2_token_id is None:
            return None
        return "the current token id " + token_id_words(
            self.eta2_token_id, self.eta2_token_id_chance, self.epsilon2_token_id)


def token_id_words(share: float, chance: float | None, beyond: float | None) -> str:
    """``explains ...``: a token-id share as every sentence says it, the share beyond
    chance first, the share and its chance level beside it (``chance`` None: a result
    written before the chance level; ``beyond`` None: chance is 1)."""
    if chance is None:
        return f"explains {100 * share:.1f}% (chance level not recorded)"
    if beyond is None:
        return (f"explains no share beyond chance: every token has an id of its own, so it "
                f"explains {100 * share:.1f}% by construction (chance level {100 * chance:.1f}%)")
    said = f"{100 * beyond:.1f}% beyond chance" if beyond > 0 else \
        f"no more than chance ({100 * beyond:.1f}% beyond it)"
    return f"explains {said} ({100 * share:.1f}% against a chance level of {100 * chance:.1f}%)"


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
class ControllerCost:
    """What a model's controllers cost where the model runs (a model served by an engine,
    whose blocks and FLOPs the execution audit cannot count): one batch timed with the
    controllers computing (``own``) and with their recorded outputs supplied in their
    place (``supplied``: their computation skipped, as a static token-id table would
    feed them; the lookup, and swapping the controllers out and back, are not timed), in
    interleaved pairs. On a CPU only the
    ratio means anything."""

    ratio: Estimate  # median over pairs of own/supplied latency, bootstrap interval
    ratio_definition: str
    own: SideTiming
    supplied: SideTiming
    pairs_s: list[list[float]]
    pairs: int
    warmup: int
    device: str
    device_name: str
    batch_size: int
    seq_len: int


@dataclass
class NotMeasured:
    """The execution section of an audit that measured none: why (docs/method.md,
    Execution). ``measured`` is always false: the key readers tell the two kinds by. A
    model that runs elsewhere may still be timed against its controllers supplied
    (``controller_cost``)."""

    reason: str
    measured: bool = False
    controller_cost: ControllerCost | None = _omit_none()


@dataclass
class Execution:
    """The execution section as measured (docs/method.md, Execution): the blocks that ran,
    always; FLOPs, timing, experts and positions where they were counted."""

    measured: bool  # always true (see NotMeasured)
    blocks_executed: float
    blocks_present: int
    dense: str | None = _omit_none()
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
    # > 1% fewer blocks or FLOPs than dense, and not by a degenerate exit rule
    saves_against_dense: bool | None = _omit_none()
    # an exit rule that stops every unit at one layer (exits.note): what it runs is a
    # fixed depth's, never counted as a saving or as conditional execution
    degenerate_rule: str | None = _omit_none()
    speed_ratio_vs_dense: float | None = None
    timing: Timing | None = None
    # no dense counterpart: what one would be for the sites' kind, or why none exists
    # (the execution then counted on the model alone)
    twin_note: str | None = _omit_none()
    experts: ExpertExecution | None = _omit_none()
    # FLOPs per token that entered each block, counted on the model and the dense twin
    flops_per_block: list[float] | None = _omit_none()
    dense_flops_per_block: list[float] | None = _omit_none()
    # soft gates' gated modules (e.g. Qwen2-MoE's shared experts): FLOPs per token
    gated_flops_per_token: dict[str, float] | None = _omit_none()
    # what "per token" counts for inputs that are not token ids: "example" (blocks run per
    # example, FLOPs per example; experts per routed token); absent for token ids
    unit: str | None = _omit_none()
    # the compute mode timed (a model's or twin's ``execution_mode``, e.g. "fft
    # convolution" for an LTI twin), and the twin's class; absent when not declared
    mode: str | None = _omit_none()
    dense_mode: str | None = _omit_none()
    dense_class: str | None = _omit_none()
    # per example, the positions entering each block whose input is [B, P, C] (patch
    # tokens; None for other inputs): fewer than P where tokens are pruned
    positions_per_block: list[float | None] | None = _omit_none()
    dense_positions_per_block: list[float | None] | None = _omit_none()


# audit.json's execution section: measured, or not (with why)
ExecutionSection = Execution | NotMeasured


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


# the labels of the three answers (audit.json's verdict.<question>_label)
QUESTIONS = ("variation", "dependence", "execution")
# exit models answer a fourth question first: where do units stop, what does stopping cost,
# and does a static depth do as well (engine/verdicts.py exits_part)
EXITS = "exits"
EXIT_LABELS = ("adaptive", "static-as-good", "static-better", "degenerate")
VARIATION_LABELS = ("varies", "mixed", "constant")  # every family, some, none
DEPENDENCE_LABELS = ("strong", "weak", "partial", "none", "unresolved")
# not-compared: blocks skipped on the model alone, with no dense counterpart to show a saving
EXECUTION_LABELS = ("conditional", "unconditional", "not-measured", "counted-not-realised",
                    "not-compared")


@dataclass
class Verdict:
    """The three answers as sentences (the keys audit.json always had) and, since issue
    29, each answer's label: read labels, never words inside a sentence."""

    variation: str
    dependence: str
    execution: str
    variation_label: str | None = _omit_none()  # of VARIATION_LABELS (engine/verdicts.py)
    dependence_label: str | None = _omit_none()  # of DEPENDENCE_LABELS
    execution_label: str | None = _omit_none()  # of EXECUTION_LABELS
    # exit models: depth, the cost of exiting, learned against fixed at matched depth
    exits: str | None = _omit_none()
    exits_label: str | None = _omit_none()  # of EXIT_LABELS

    def label(self, question: str) -> str | None:
        """The label of ``question`` (variation, dependence, execution, exits); None in a
        result written before labels existed, or without that answer."""
        return getattr(self, f"{question}_label")


@dataclass(frozen=True)
class VerdictPart:
    """One answer: its label, the numbers it rests on (flat, named like
    :meth:`AuditResult.metrics`) and its sentence."""

    label: str | None
    numbers: dict[str, float | None]
    sentence: str


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
class SitePart:
    """One named coefficient of a site (:attr:`~fcaudit.core.contract.Selection.parts`): the
    next ``width`` channels of the last axis."""

    name: str
    width: int


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
    # named coefficients side by side on the last axis, in order (Selection.parts)
    parts: list[SitePart] | None = _omit_none()
    # a selection parameter of a recurrence: the space its values (and so the static
    # profiles' means) are in, e.g. "dt before softplus" (Selection.space)
    selection: str | None = _omit_none()
    # what kind of coefficient it is (a name of fcaudit.core.kinds.KINDS: "scalar gate",
    # "activation", ...), judged before the work; absent from audits written before it
    kind: str | None = _omit_none()


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
    # the cost said before the work (engine/budget.py): passes and seconds per stage, the
    # cache's size, from the probe's pace; beside timings and cache, what was measured
    plan: dict[str, Any] | None = _omit_none()


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
