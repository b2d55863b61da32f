"""RouterAdapter on hand-made routers, routing metrics against brute force, expert counts.

No transformers here: the routers mimic the layouts of the transformers 5 families
(flattened tuple output, logits-only output, probabilities in place of logits).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fcaudit.core.adapters import ADAPTER_API
from fcaudit.core.contract import ExpertLayer, Site, SiteCall
from fcaudit.core.errors import FcauditError
from fcaudit.core.recording import record
from fcaudit.core.replaying import replay, replaying
from fcaudit.core.routers import (
    RouterAdapter,
    counting_experts,
    expert_counts,
    load_entropy,
    selection_change,
)

C, E, K = 8, 6, 2


class TupleRouter(nn.Module):
    """Mixtral layout: F.linear on flattened states, (logits, weights, indices)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, C))
        self.top_k = K

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = F.linear(hidden.reshape(-1, C), self.weight)
        top, index = torch.softmax(logits.float(), dim=-1).topk(self.top_k, dim=-1)
        return logits, top / top.sum(dim=-1, keepdim=True), index


class ProbabilityRouter(nn.Module):
    """Gemma 4 layout: a matmul with the weight, returns probabilities, not logits."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, C))
        self.top_k = K

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        probs = torch.softmax(hidden.reshape(-1, C) @ self.weight.T, dim=-1)
        weights, index = probs.topk(self.top_k, dim=-1)
        return probs, weights, index


class LogitsRouter(nn.Module):
    """DBRX layout: an nn.Linear child, logits only, [B, T, E]; the caller takes the top-k."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(C, E, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layer(hidden)


class InPlaceRouter(TupleRouter):
    """Edits its logits in place after the projection (a soft cap written with ``div_``)."""

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = F.linear(hidden.reshape(-1, C), self.weight).div_(2.0)
        weights, index = logits.softmax(dim=-1).topk(self.top_k, dim=-1)
        return logits, weights, index


class EinsumRouter(TupleRouter):
    """Projection by ``einsum`` with its operands in a list."""

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = torch.einsum("nc,ec->ne", [hidden.reshape(-1, C), self.weight])
        weights, index = logits.softmax(dim=-1).topk(self.top_k, dim=-1)
        return logits, weights, index


class TwoProjectionRouter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down, self.up = nn.Linear(C, 4), nn.Linear(4, E)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(hidden))


class FusedExperts(nn.Module):
    """transformers 5 layout: one module, called with (states, top-k indices, weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(E, C, C) / C)

    def forward(self, hidden: torch.Tensor, index: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e in index.unique().tolist():
            token, slot = torch.where(index == e)
            out.index_add_(0, token, (hidden[token] @ self.w[e]) * weights[token, slot, None])
        return out


class Sink(nn.Module):
    def forward(self, hidden: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
        return hidden


class MoE(nn.Module):
    def __init__(self, router: nn.Module, per_expert: bool = False) -> None:
        super().__init__()
        self.gate = router
        self.per_expert = per_expert
        self.experts = (nn.ModuleList(nn.Linear(C, C) for _ in range(E)) if per_expert
                        else FusedExperts())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, C)
        out = self.gate(flat)
        if isinstance(out, torch.Tensor):  # logits only: route like DBRX
            weights, index = torch.softmax(out, dim=-1).topk(K, dim=-1)
        else:
            _, weights, index = out
        weights = weights.to(flat.dtype)
        if not self.per_expert:
            return self.experts(flat, index, weights).reshape(hidden.shape)
        mixed = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(index == e)
            if len(token):
                mixed.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        return mixed.reshape(hidden.shape)


class Model(nn.Module):
    def __init__(self, router: type[nn.Module], layers: int = 2, per_expert: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, C)
        self.blocks = nn.ModuleList(MoE(router(), per_expert) for _ in range(layers))
        self.head = nn.Linear(C, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)

    def sites(self, adapter: RouterAdapter | None = None) -> list[Site]:
        return [Site(f"blocks.{i}.gate", f"blocks.{i}.gate", "router", i,
                     adapter or RouterAdapter()) for i in range(len(self.blocks))]

    def expert_layers(self) -> list[ExpertLayer]:
        def paths(i: int) -> tuple[str, ...]:
            experts = self.blocks[i].experts
            if isinstance(experts, nn.ModuleList):
                return tuple(f"blocks.{i}.experts.{e}" for e in range(E))
            return (f"blocks.{i}.experts",)
        return [ExpertLayer(f"blocks.{i}.gate", paths(i), E, K) for i in range(len(self.blocks))]


def ids(batch: int = 3, seq_len: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 50, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def selections(model: Model, sites: list[Site], coefficients: dict[str, torch.Tensor],
               x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Replay ``coefficients``; the logits and each router's selected experts [B, T, k]."""
    routers = {s.name: model.get_submodule(s.path) for s in sites}
    chosen: dict[str, torch.Tensor] = {}
    fed = {s: coefficients[s.name] for s in sites}
    with torch.no_grad(), replaying(model, fed) as stubs:
        for site in sites:
            def hook(stub: nn.Module, args: tuple, kwargs: dict, output: object,
                     site: Site = site) -> None:
                call = SiteCall(routers[site.name], args, kwargs, *x.shape)
                chosen[site.name] = site.adapter.selected_experts(output, call)
            stubs[site.name].register_forward_hook(hook, with_kwargs=True)
        logits = model(x)
    return logits, chosen


@pytest.mark.parametrize("router", [TupleRouter, ProbabilityRouter, LogitsRouter, InPlaceRouter,
                                    EinsumRouter])
def test_identity_replay_is_bitwise_and_never_computes_the_projection(router):
    torch.manual_seed(0)
    model, x = Model(router).eval(), ids()
    sites = model.sites(RouterAdapter(top_k=K))
    with torch.no_grad():
        expected = model(x)
        coefficients = record(model, x, sites)
        for p in model.parameters():  # a projection computed in replay would now give NaN
            if p.dim() == 2 and p.shape[0] == E:
                p.fill_(float("nan"))
        with replay(model, coefficients, sites):
            assert torch.equal(model(x), expected)
    assert all(c.shape == (3, 7, E) for c in coefficients.values())


def test_coefficients_are_the_projection_not_what_the_router_returns():
    torch.manual_seed(0)
    model, x = Model(ProbabilityRouter).eval(), ids()
    coefficients = record(model, x, model.sites())
    router = model.blocks[0].gate
    with torch.no_grad():
        h = model.embed(x)
        assert torch.equal(coefficients["blocks.0.gate"],
                           (h.reshape(-1, C) @ router.weight.T).reshape(3, 7, E))


@pytest.mark.parametrize("router", [TupleRouter, LogitsRouter])
def test_reassigned_logits_route_exactly_like_the_donor(router):
    torch.manual_seed(0)
    model, x = Model(router).eval(), ids(batch=4)
    sites = model.sites(RouterAdapter(top_k=K))
    coefficients = record(model, x, sites)
    _, own = selections(model, sites, coefficients, x)
    donors = torch.tensor([1, 2, 3, 0])
    _, given = selections(model, sites, {k: v[donors] for k, v in coefficients.items()}, x)
    for name in own:
        assert torch.equal(given[name], own[name][donors])
        assert selection_change(given[name], own[name]) > 0


def test_supplied_logits_take_the_projection_dtype():
    """Static profiles may come in float64; the router sees its own logits dtype."""
    model, x = Model(TupleRouter).eval(), ids()
    coefficients = record(model, x, model.sites())
    wide = {k: v.double() for k, v in coefficients.items()}
    _, own = selections(model, model.sites(), coefficients, x)
    _, cast = selections(model, model.sites(), wide, x)
    assert all(torch.equal(own[name], cast[name]) for name in own)


def test_selection_without_top_k_is_refused():
    model, x = Model(LogitsRouter).eval(), ids()
    coefficients = record(model, x, model.sites())
    with pytest.raises(FcauditError, match=r"RouterAdapter\(top_k=\.\.\.\)"):
        selections(model, model.sites(), coefficients, x)


def test_router_with_two_projections_is_refused_with_the_adapter_api():
    model, x = Model(TwoProjectionRouter).eval(), ids()
    with pytest.raises(FcauditError) as err:
        record(model, x, model.sites())
    message = str(err.value)
    assert "blocks.0.gate" in message and "TwoProjectionRouter" in message
    assert "2 linear projections" in message and ADAPTER_API in message


def test_logits_of_another_shape_are_refused():
    model, x = Model(TupleRouter).eval(), ids()
    coefficients = record(model, x, model.sites())
    wrong = {k: v[..., :-1] for k, v in coefficients.items()}
    with pytest.raises(FcauditError, match="does not hold the supplied logits"), \
            replay(model, wrong, model.sites()):
        model(x)


@pytest.mark.parametrize("per_expert", [False, True])
def test_expert_counts_equal_the_router_selection(per_expert):
    torch.manual_seed(0)
    model, x = Model(TupleRouter, per_expert=per_expert).eval(), ids()
    sites = model.sites()
    coefficients = record(model, x, sites)
    with counting_experts(model, model.expert_layers()) as counts:
        _, chosen = selections(model, sites, coefficients, x)
    for layer in model.expert_layers():
        count = counts[layer.name]
        assert count.experts_per_token(x.numel()) == K
        assert count.matches(chosen[layer.name])
        assert not count.matches(torch.zeros_like(chosen[layer.name]))
        if not per_expert:
            assert torch.equal(count.executed(), torch.full((x.numel(),), K))


def test_fused_count_skips_out_of_range_experts():
    """LongCat-style zero-computation experts (index >= E) run nothing."""
    layer = ExpertLayer("l", ("experts",), 4, 2)
    model = nn.Module()
    model.experts = Sink()
    index = torch.tensor([[0, 4], [1, 2], [5, 3]])
    with counting_experts(model, [layer]) as counts:
        model.experts(torch.zeros(3, 8), index)
    assert counts["l"].per_expert.tolist() == [1, 1, 1, 1]
    assert counts["l"].executed().tolist() == [1, 2, 1]
    assert counts["l"].matches(index)


# ---- metrics against brute force ----

def test_load_entropy_matches_brute_force():
    g = torch.Generator().manual_seed(1)
    for experts in (2, 5, 8):
        index = torch.randint(0, experts, (4, 9, 2), generator=g)
        load = expert_counts(index, experts).double() / index.numel()
        slots = [int(i) for i in index.flatten()]
        brute = [slots.count(e) / len(slots) for e in range(experts)]
        assert load.tolist() == pytest.approx(brute)
        nats, normalised = load_entropy(load)
        h = -sum(p * math.log(p) for p in brute if p > 0)
        assert nats == pytest.approx(h) and normalised == pytest.approx(h / math.log(experts))
    assert load_entropy(torch.tensor([1.0, 0.0, 0.0])) == (0.0, 0.0)
    assert load_entropy(torch.full((4,), 0.25))[1] == pytest.approx(1.0)


def test_selection_change_matches_brute_force():
    g = torch.Generator().manual_seed(2)
    a = torch.randint(0, 4, (3, 2, 5, 2), generator=g)  # [layer, batch, position, k]
    b = a.clone()
    b[0, 1, 2] = b[0, 1, 2].flip(0)  # same set, other order: no change
    b[1, 0, 4] = torch.tensor([3, 3])
    b[2, 1, 0] = (b[2, 1, 0] + 1) % 4
    rows = list(itertools.product(range(3), range(2), range(5)))
    differ = sum(sorted(a[r].tolist()) != sorted(b[r].tolist()) for r in rows)
    assert selection_change(a, b) == pytest.approx(differ / len(rows))
    assert selection_change(a, a) == 0.0
    with pytest.raises(FcauditError, match="shapes"):
        selection_change(a, b[..., :1])
