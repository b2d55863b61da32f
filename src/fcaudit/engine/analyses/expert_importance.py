"""Expert importance: each routed expert removed from every token's choice in its layer
alone (its router logit pushed below the others: the routing rule picks the next expert),
one replay each; its penalty beside its load, and how often the rule still picked it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fcaudit.core.conditions import EXPERT_ABLATION
from fcaudit.core.contract import RoutingAdapter, Site
from fcaudit.core.errors import ModelError, arg
from fcaudit.engine.analyses.base import Analysis, RunStage, Target, picking_rows
from fcaudit.engine.result_parts import ExpertImportance, ImportanceSummary, LayerImportance

if TYPE_CHECKING:
    from torch import Tensor

# one replay per layer and expert: on by default up to this many experts per routed layer
# (a 4-layer, 64-expert model: 256 more replays), else opt-in (AuditOptions.expert_ablation)
AUTO_ABLATION_MAX_EXPERTS = 64


@dataclass(frozen=True)
class ExpertAblation(Target):
    """``expert`` of the router ``site`` never picked (its logit pushed below the rest)."""

    site: Site
    expert: int
    condition = EXPERT_ABLATION
    counts_picks = True  # does the family's own rule still pick it, on the ablated logits?
    stage = RunStage("expert ablation", ("expert_ablation", "AuditOptions(expert_ablation=False)",
                                         "--no-expert-ablation"))

    @property
    def only_site(self) -> Site | None:
        return self.site

    def key(self, condition: str) -> str:  # user interventions may not take it
        return f"{EXPERT_ABLATION}:{self.expert}@{self.site.name}"

    def identity(self) -> tuple[str | None, bool, int | None, str | None]:
        return (self.site.name, False, self.expert, None)

    def feed(self, run: Any, b: int, inputs: Any,
             correct: dict[Site, Tensor]) -> Mapping[Site, Tensor]:
        from fcaudit.core.routers import ablate_expert  # torch: not on reading an audit.json
        return {self.site: ablate_expert(correct[self.site], self.expert)}

    def picks(self, chosen: Mapping[str, Tensor]) -> int:
        return int((chosen[self.site.name] == self.expert).sum())


def ablation_experts(sites: Sequence[Site], options: Any,
                     experts: Mapping[str, int]) -> dict[Site, int]:
    """The routing sites whose experts are ablated, with their number of experts
    (``options``: the :class:`~fcaudit.engine.options.AuditOptions`; ``experts``: site name
    -> the last axis of its recorded logits, for sites whose
    coefficients are ``[B, T, ..., E]``). Auto (``expert_ablation`` None): every such site
    when none has more than ``AUTO_ABLATION_MAX_EXPERTS`` experts, else none."""
    routed = {s: experts[s.name] for s in sites
              if isinstance(s.adapter, RoutingAdapter) and s.name in experts}
    if options.expert_ablation is None:
        return routed if max(routed.values(), default=0) <= AUTO_ABLATION_MAX_EXPERTS else {}
    return routed if options.expert_ablation else {}


def plan(setup: Any, first: Any) -> list[ExpertAblation]:
    """One run per ablated expert (the expert counts: the last axis of the probe's logits
    ``[B, T, ..., E]``); an explicit ``expert_ablation`` with no such site is refused."""
    experts = {name: int(c.shape[-1]) for name, c in first.coefficients.items() if c.dim() >= 3}
    ablated = ablation_experts(setup.sites, setup.options, experts)
    if setup.options.expert_ablation and not ablated:
        raise ModelError(f"{arg('expert_ablation', py='AuditOptions(expert_ablation=True)')}"
                         ": the audited sites have no router with per-expert logits [batch, "
                         "positions, experts] (a routing adapter's site); drop the option, "
                         "or audit the model's router sites")
    return [ExpertAblation(site, e) for site, n in ablated.items() for e in range(n)]


def ablation_rows(runs: Sequence[Any]) -> list[int]:
    """Plan indices of the expert-ablation runs, in order."""
    return [i for i, r in enumerate(runs) if isinstance(r.target, ExpertAblation)]


def summarise(measured: Any, analysis: Analysis) -> dict[str, ImportanceSummary] | None:
    """Per router family, every ablated layer and expert: the penalty of its ablation run
    with a paired interval, its load, and the token-slots that still chose it (the replays
    count them, one per ablation run in plan order); an expert still chosen gets none."""
    from fcaudit.core.routers import ABLATION_MARGIN  # torch: not on reading an audit.json
    ablated = ablation_rows(measured.runs)
    if not ablated:
        return None
    still = measured.replays.still_selected
    assert still is not None  # every replay shard of an audit with ablations counts them
    picked = dict(zip(picking_rows(measured.runs), still.tolist(), strict=True))
    per_site: dict[Site, list[ExpertImportance]] = {}
    for i in ablated:
        target = measured.runs[i].target
        counts = measured.replays.route_load[target.site.name].double()
        share = float(counts[target.expert] / max(float(counts.sum()), 1.0))
        picks = int(picked[i])
        if picks:
            item = ExpertImportance(target.expert, None, None, share, picks, reason=(
                f"the routing rule still picked it for {picks} token-slots with its logit at "
                f"least {ABLATION_MARGIN:g} below every other expert's (a score bias in the "
                "rule, or top-k as large as the number of experts), so no removal was measured"))
        else:
            removed = measured.condition(target.key(""))
            item = ExpertImportance(target.expert, removed.delta, removed.ci95, share, 0)
        per_site.setdefault(target.site, []).append(item)
    note = ("each expert removed from every token's choice in its layer alone (its router "
            f"logit set at least {ABLATION_MARGIN:g} below the token's other logits; the "
            "routing rule picks the next expert and weights the chosen ones as the family "
            "does); delta = NLL of that replay minus the correct replay's, 95% paired "
            "bootstrap interval over sequences")
    out = {}
    for family in dict.fromkeys(s.family for s in per_site):
        members = [(s, items) for s, items in per_site.items() if s.family == family]
        out[family] = ImportanceSummary(
            num_experts=max(len(items) for _, items in members),
            per_layer=[LayerImportance(s.name, s.layer, items) for s, items in members],
            replays=sum(len(items) for _, items in members), note=note)
    return out


def settings(measured: Any, sections: Mapping[str, Any]) -> dict[str, Any]:
    """Whether experts were ablated, and in how many runs (audit.json's ``settings``)."""
    runs = len(ablation_rows(measured.runs))
    return {"expert_ablation": bool(runs), "expert_ablation_runs": runs}


ANALYSIS = Analysis("expert_importance", plan=plan, summarise=summarise,
                    section_type=dict[str, ImportanceSummary], settings=settings)
