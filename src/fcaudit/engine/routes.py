"""A serving engine's routing trace against fcaudit's own recording of the same tokens
(``fcaudit routes``, :func:`route_agreement`).

The trace (:mod:`fcaudit.io.traces`) gives the expert ids each token took; fcaudit runs
the model once on the same tokens, reads each router's logits and the experts its adapter
says it selects (the family's own rule; for a served model, the engine's), and counts the
(token, layer) expert sets that agree. Disagreements are expected at near-ties, where two
engines' arithmetic may order two experts either way, so the count is split by the
margin between the k-th and (k+1)-th router logit: a disagreement at a clear margin is a
real difference (another model, other tokens, another routing rule), one at a near-tie
is arithmetic. For a bias-corrected router the margin is still its logits', not its
biased scores': its buckets say less.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fcaudit.core.contract import Site, SiteCall
from fcaudit.core.errors import ModelError
from fcaudit.core.hooks import hooks
from fcaudit.engine.analyses.routing import routing_sites
from fcaudit.io.examples import call_model

MARGIN_EDGES = (1e-4, 1e-2)  # near-tie, close, clear
MARGIN_DEFINITION = ("the k-th largest router logit minus the (k+1)-th, per token and "
                     "layer (for a bias-corrected router: of its logits, not its biased "
                     "scores)")


@dataclass
class MarginBucket:
    """(token, layer) rows whose margin lies in ``[low, high)`` (``high`` None: no bound)."""

    low: float
    high: float | None
    compared: int
    equal: int


@dataclass
class RouteAgreement:
    """How often a trace's expert sets equal fcaudit's recording of the same tokens."""

    layers: list[str]  # the router sites, in the trace's layer order
    top_k: int
    compared: int  # (token, layer) rows the trace filled
    equal: int
    missing: int  # rows holding a sentinel (a negative id): not compared
    equal_per_layer: list[float | None]  # share equal per layer (None: none compared)
    by_margin: list[MarginBucket]
    margin_definition: str = MARGIN_DEFINITION


def _reading(sites: Sequence[Site], seen: dict[str, list[tuple[Tensor, Tensor]]],
             shape: list[tuple[int, int]]) -> dict[str | nn.Module, Callable[..., None]]:
    """Hooks keeping each router's (logits [B, T, E], selected experts [B, T, k]) on the
    batch of ``shape[0]`` (batch, positions)."""
    def hook_for(site: Site) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 out: Any) -> None:
            batch, seq_len = shape[0]
            call = SiteCall(module, args, kwargs, batch, seq_len)
            logits = site.adapter.extract(out, call).reshape(batch, seq_len, -1)
            chosen = site.adapter.selected_experts(out, call).reshape(batch, seq_len, -1)
            seen[site.name].append((logits.float().cpu(), chosen.cpu()))
        return hook
    return {s.path: hook_for(s) for s in sites}


def recorded_routes(model: nn.Module, sites: Sequence[Site], ids: Tensor, batch_size: int
                    ) -> tuple[list[Site], Tensor, Tensor]:
    """(the router sites, logits ``[N, T, L, E]``, selected experts ``[N, T, L, k]``) of
    the model's own pass over ``ids [N, T]``, in batches of ``batch_size``."""
    routers = routing_sites(sites)
    if not routers:
        raise ModelError("the model has no router site whose experts fcaudit can read (a "
                         "routing adapter's): nothing to compare a routing trace with")
    seen: dict[str, list[tuple[Tensor, Tensor]]] = {s.name: [] for s in routers}
    shape: list[tuple[int, int]] = [(0, 0)]
    batches = range(0, ids.shape[0], batch_size)
    with torch.no_grad(), hooks(model, _reading(routers, seen, shape), with_kwargs=True):
        for start in batches:
            x = ids[start:start + batch_size]
            shape[0] = (int(x.shape[0]), int(x.shape[1]))
            call_model(model, x)
    for site in routers:
        if len(seen[site.name]) != len(batches):
            raise ModelError(f"router {site.name} ran {len(seen[site.name])} time(s) in "
                             f"{len(batches)} batch(es), not once each: a kernel path that "
                             "bypasses it records nothing, one that calls it twice is "
                             "ambiguous")
    logits = torch.stack([torch.cat([p[0] for p in seen[s.name]]) for s in routers], dim=2)
    chosen = torch.stack([torch.cat([p[1] for p in seen[s.name]]) for s in routers], dim=2)
    return routers, logits, chosen


def agreement(logits: Tensor, chosen: Tensor, trace: np.ndarray, layers: Sequence[str],
              edges: Sequence[float] = MARGIN_EDGES) -> RouteAgreement:
    """The trace ``[N, T, L, k]`` against the recorded ``chosen`` experts (same shape) and
    router ``logits [N, T, L, E]``, split by the top-k margin at ``edges``."""
    traced = torch.from_numpy(trace)
    if traced.shape != chosen.shape:
        raise ModelError(f"the routing trace's rows {list(traced.shape)} and fcaudit's "
                         f"recording {list(chosen.shape)} differ (tokens, layers, top-k): a "
                         "trace of another model or another routing width")
    k = chosen.shape[-1]
    filled = (traced >= 0).all(-1)
    same = (traced.sort(-1).values == chosen.long().sort(-1).values).all(-1) & filled
    top = logits.topk(min(k + 1, logits.shape[-1]), dim=-1).values
    margin = top[..., k - 1] - top[..., k] if top.shape[-1] > k else \
        torch.full(filled.shape, math.inf)
    bounds = (0.0, *edges, math.inf)
    buckets = []
    for low, high in zip(bounds, bounds[1:], strict=False):
        inside = filled & (margin >= low) & (margin < high)
        buckets.append(MarginBucket(low, None if math.isinf(high) else high,
                                    int(inside.sum()), int((same & inside).sum())))
    per_layer = [int(same[..., j].sum()) / n if (n := int(filled[..., j].sum())) else None
                 for j in range(len(layers))]
    return RouteAgreement(list(layers), k, int(filled.sum()), int(same.sum()),
                          int((~filled).sum()), per_layer, buckets)


def route_agreement(model: nn.Module, sites: Sequence[Site], ids: Tensor, trace: np.ndarray,
                    batch_size: int = 8, prompt_start: int = 0) -> RouteAgreement:
    """A routing trace (:func:`fcaudit.io.traces.read_trace`) against the model's own
    pass over the token ids ``ids [N, T]`` it was recorded on."""
    from fcaudit.io.traces import prompt_rows
    routers, logits, chosen = recorded_routes(model, sites, ids, batch_size)
    rows = prompt_rows(trace, tuple(ids.shape), [decoder_layer(s.path) for s in routers],
                       logits.shape[-1], prompt_start)
    return agreement(logits, chosen, rows, [s.name for s in routers])


def decoder_layer(path: str) -> int | None:
    """The decoder layer a router's module path names (its first numeric part:
    ``model.layers.3.mlp.gate`` -> 3), or None."""
    return next((int(part) for part in path.split(".") if part.isdigit()), None)
