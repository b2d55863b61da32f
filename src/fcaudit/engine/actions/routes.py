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

Beside the agreement, the model is run once more with the trace's expert ids fixed and
their weights recomputed by its own routers from their live logits
(:data:`IDS_FIXED`, :func:`ids_fixed`): the contract of the trainers that replay routes
(R3 in Megatron, NeMo RL, prime-rl, MaxText). It lets the router back in (its logits,
computed from the replayed pass's hidden states, weight the fixed experts), so it is a
condition of its own, never the frozen-controller ``correct``.
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
from fcaudit.core.nll import logits_of, token_nll
from fcaudit.core.routers import FixedTopK
from fcaudit.engine.analyses.routing import routing_sites
from fcaudit.engine.metrics import Bootstrap, interval
from fcaudit.io.examples import call_model

MARGIN_EDGES = (1e-4, 1e-2)  # near-tie, close, clear
IDS_FIXED = "ids fixed, weights recomputed"
IDS_FIXED_CONTRACT = ("the trace's expert ids, weighted by the routers' own live logits at "
                      "them (the trainers' route-replay contract): the router computes again, "
                      "so this is not the frozen-controller correct replay")
BOOTSTRAP = 1000  # resamples of the windows for the interval of the difference
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
class TraceReplay:
    """The model's per-token NLL with the trace's expert ids fixed and their weights
    recomputed (:data:`IDS_FIXED`), against its own pass over the same prompts."""

    nll_own: float
    nll_ids_fixed: float
    delta: float  # ids fixed minus own, mean over windows
    delta_ci: list[float]  # 95% bootstrap interval over windows
    windows: int
    condition: str = IDS_FIXED
    contract: str = IDS_FIXED_CONTRACT


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
    ids_fixed: TraceReplay | None = None
    ids_fixed_not_run: str | None = None  # why not (None: it ran)


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
    pass over the token ids ``ids [N, T]`` it was recorded on, and the model's NLL with
    the trace's ids fixed (:func:`ids_fixed`) where its routers select in this process."""
    from fcaudit.io.traces import prompt_rows
    routers, logits, chosen = recorded_routes(model, sites, ids, batch_size)
    rows = prompt_rows(trace, tuple(ids.shape), [decoder_layer(s.path) for s in routers],
                       logits.shape[-1], prompt_start)
    found = agreement(logits, chosen, rows, [s.name for s in routers])
    elsewhere = getattr(model, "execution_note", None)
    if elsewhere is not None:
        found.ids_fixed_not_run = (f"{IDS_FIXED} runs the routers' own code in this process; "
                                   f"this model is {elsewhere.split(':')[0]}, which selects "
                                   "experts in its own kernels: compare on the eager model")
    else:
        found.ids_fixed = ids_fixed(model, routers, ids, rows, logits.shape[-1], batch_size)
    return found


def ids_fixed(model: nn.Module, routers: Sequence[Site], ids: Tensor, rows: np.ndarray,
              experts: int, batch_size: int, seed: int = 0) -> TraceReplay:
    """The model's per-token NLL over ``ids [N, T]`` with each router's selection fixed to
    ``rows [N, T, routers, k]`` and its weights recomputed by its own code from its live
    scores (:class:`~fcaudit.core.routers.FixedTopK`), against its own pass. Each router
    must take exactly one top-k of ``k`` over its ``experts`` scores per pass, after its
    module starts (a router with another selection, or a kernel, is refused by name)."""
    mode = FixedTopK(experts, rows.shape[-1])

    def starts(name: str) -> Callable[..., None]:
        def start(_m: nn.Module, _a: Any) -> None:  # returns None: the inputs stay as given
            mode.current = name
        return start
    own, fixed = [], []
    with torch.no_grad(), hooks(model, {s.path: starts(s.name) for s in routers}, kind="pre"):
        for start in range(0, ids.shape[0], batch_size):
            x = ids[start:start + batch_size]
            own.append(token_nll(logits_of(call_model(model, x)), x).double().mean(-1))
            mode.fixed = {s.name: torch.from_numpy(rows[start:start + batch_size, :, j])
                          for j, s in enumerate(routers)}
            mode.calls, mode.current = {}, None
            with mode:
                out = call_model(model, x)
            wrong = [s.name for s in routers if mode.calls.get(s.name, 0) != 1]
            if wrong:
                raise ModelError(
                    f"router {wrong[0]} took {mode.calls.get(wrong[0], 0)} top-k(s) of "
                    f"{mode.k} over its {experts} experts in one pass, not one: its selection "
                    f"cannot be fixed to the trace's ids ({IDS_FIXED} needs a router that "
                    "selects with one top-k after its module starts)")
            fixed.append(token_nll(logits_of(out), x).double().mean(-1))
    a, b = torch.cat(own).numpy(), torch.cat(fixed).numpy()
    delta = float((b - a).mean())
    boot = Bootstrap(len(a), BOOTSTRAP, seed)
    return TraceReplay(float(a.mean()), float(b.mean()), delta,
                       interval(boot.means(b - a), delta), len(a))


def decoder_layer(path: str) -> int | None:
    """The decoder layer a router's module path names (its first numeric part:
    ``model.layers.3.mlp.gate`` -> 3), or None."""
    return next((int(part) for part in path.split(".") if part.isdigit()), None)
