"""Routing: each router's expert load on the correct replay and the share of (token,
layer) top-k sets each main condition changes. No runs of its own: the replay stage
counts both on every batch of an audit with router sites."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fcaudit.core.contract import RoutingAdapter, Site
from fcaudit.engine.analyses.base import Analysis
from fcaudit.engine.result_parts import LayerRouting, RoutingSummary

NOTE = ("static-layer feeds every token of a layer the same logits, so all of them select "
        "the same experts (one ranking per layer); static-layer-token, one ranking per layer "
        "and token id; global-mean gives every expert the same logit, so the routing rule's "
        "tie-break (torch.topk) picks the experts")


def routing_sites(sites: Sequence[Site]) -> list[Site]:
    """Sites whose adapter can say which experts a router selects."""
    return [s for s in sites if isinstance(s.adapter, RoutingAdapter)]


def summarise(measured: Any, analysis: Analysis) -> dict[str, RoutingSummary] | None:
    """Per router family: each layer's expert load and its entropy under the original
    routing, and the share of tokens whose top-k set each main condition changes (random
    conditions averaged over their repeats); its units are the tokens (patches) each
    router routes."""
    from fcaudit.core.routers import load_entropy  # torch: not on reading an audit.json
    sites = routing_sites(measured.setup.sites)
    if not sites:
        return None
    replays, changed = measured.replays, measured.replays.route_changed
    tokens = measured.setup.inputs.routed_units(lambda: int(measured.shapes[sites[0].name][1]))
    by_condition: dict[str, list[int]] = {}  # changed[i, j]: run i's re-routed tokens at site j
    for i, run in enumerate(measured.tracked_runs()):
        by_condition.setdefault(run.condition, []).append(i)
    out = {}
    for family in dict.fromkeys(s.family for s in sites):
        layers, totals = [], {c: 0.0 for c in by_condition}
        members = [(j, s) for j, s in enumerate(sites) if s.family == family]
        for j, site in members:
            counts = replays.route_load[site.name]
            share = counts.double() / max(int(counts.sum()), 1)
            nats, normalized = load_entropy(share)
            frac = {}
            for condition, rows in by_condition.items():
                moved = float(changed[rows, j].sum()) if changed is not None else 0.0
                frac[condition] = moved / (len(rows) * tokens)
                totals[condition] += frac[condition]
            layers.append(LayerRouting(site.name, site.layer, share.tolist(), nats, normalized,
                                       frac))
        out[family] = RoutingSummary(
            num_experts=max(len(x.load) for x in layers), tokens=tokens, per_layer=layers,
            changed={c: v / len(members) for c, v in totals.items()}, note=NOTE)
    return out


ANALYSIS = Analysis("routing", plan=lambda setup, probe: [], summarise=summarise,
                    section_type=dict[str, RoutingSummary])
