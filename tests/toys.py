"""Hand-made models with known audit answers (importable as ``toys:FACTORY``).

Sequences hold random tokens at even positions, each followed by its successor
``(x + 1) % V``: the next token is predictable from even positions only. Each model
predicts it only through its gates, in a way that fixes the expected audit result:

* ``content``: the gate carries the current token (one-hot) -> reassign and shuffle
  destroy the prediction, static profiles keep nothing (retention ~0%).
* ``constant``: gates are per-layer constants -> no penalty, retention ~100%.
* ``position``: gates depend on the position only -> shuffle hurts, reassign does not,
  static-layer-position keeps ~100%.

Two routers (:class:`ToyRouterModel`, sites with the ``TopKLogits(1)`` adapter) route
each token to one of ``V`` experts, expert ``e`` predicting ``e + 1 - offset``:

* ``token_router``: the logits are ``4 * one_hot(x_t)``, a pure function of the token
  id (offset 0) -> static-layer-token keeps 100% of the gap when calibration saw every
  evaluation id, and the token id explains all of the within-layer variance;
* ``context_router``: the logits are ``4 * one_hot((x_t + x_{t-1}) % V)`` (offset
  ``x_{t-1}``, ``x_{-1} = 0``): at even positions the expert depends on the previous
  token, so a profile per token id keeps little.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fcaudit.core.contract import Gate, Site
from fcaudit.core.routers import TopKLogits

V = 64


class ToyGate(nn.Module):
    def __init__(self, mode: str, layer: int) -> None:
        super().__init__()
        self.mode, self.layer = mode, layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        B, T = ids.shape
        if self.mode == "content":
            return F.one_hot(ids, V).float()  # [B, T, V]
        if self.mode == "constant":
            return torch.full((B, T, 1), 0.9 if self.layer == 0 else 0.1)
        pos = (torch.arange(T) % 2 == 0).float()  # position: 1 on even positions
        value = pos if self.layer == 0 else torch.zeros(T)
        return value.view(1, T, 1).expand(B, T, 1).clone()


class ToyModel(nn.Module):
    def __init__(self, mode: str, n_layer: int = 2) -> None:
        super().__init__()
        self.mode = mode
        self.gates = nn.ModuleList(ToyGate(mode, i) for i in range(n_layer))
        self.scale = nn.Parameter(torch.tensor(8.0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        _maybe_die()
        even = (torch.arange(ids.shape[1]) % 2 == 0).float().view(1, -1, 1)
        g = [gate(ids) for gate in self.gates]
        if self.mode == "content":
            predicted = torch.roll(sum(g) / len(g), shifts=1, dims=-1)  # one-hot of x + 1
            return self.scale * predicted * even
        target = F.one_hot((ids + 1) % V, V).float()
        return self.scale * target * (g[0] - g[1]) * even


class ToyRouter(nn.Module):
    """Router logits ``[B, T, V]``: ``4 * one_hot(key)`` with ``key`` the token id, or for
    ``context`` the token id plus the previous one."""

    def __init__(self, context: bool) -> None:
        super().__init__()
        self.context = context

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return 4.0 * F.one_hot((ids + previous(ids) * self.context) % V, V).float()


def previous(ids: torch.Tensor) -> torch.Tensor:
    """``x_{t-1}`` at every position (0 before the first)."""
    return torch.cat([torch.zeros_like(ids[:, :1]), ids[:, :-1]], dim=1)


class ToyRouterModel(nn.Module):
    """Two routed layers; the top-1 expert ``e`` of each predicts ``e + 1 - offset``,
    which is ``x_t + 1`` under the model's own routing (even positions only)."""

    def __init__(self, context: bool) -> None:
        super().__init__()
        self.context = context
        self.routers = nn.ModuleList(ToyRouter(context) for _ in range(2))
        self.scale = nn.Parameter(torch.tensor(8.0))

    def controller_sites(self) -> list[Site]:
        return [Site(f"routers.{i}", f"routers.{i}", "router", i, adapter=TopKLogits(1))
                for i in range(len(self.routers))]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        even = (torch.arange(ids.shape[1]) % 2 == 0).float().view(1, -1, 1)
        offset = previous(ids) * self.context
        votes = [F.one_hot((r(ids).topk(1, dim=-1).indices[..., 0] + 1 - offset) % V, V)
                 for r in self.routers]
        return self.scale * (sum(votes) / len(votes)).float() * even


def token_router_model() -> nn.Module:
    return ToyRouterModel(context=False)


def context_router_model() -> nn.Module:
    return ToyRouterModel(context=True)


_CALLS = [0]


def _maybe_die() -> None:
    """Test hook: with TOYS_DIE_RANK=r and TOYS_DIE_AFTER=n, the process of torchrun rank r
    dies outright (no cleanup) at its n-th forward pass, as a crashed worker would."""
    rank, after = os.environ.get("TOYS_DIE_RANK"), os.environ.get("TOYS_DIE_AFTER")
    if rank is not None and after is not None and os.environ.get("RANK") == rank:
        _CALLS[0] += 1
        if _CALLS[0] >= int(after):
            os._exit(9)


class SpareModel(ToyModel):
    """The content toy holding two modules its forward never calls (``spare.0``, ``.1``)."""

    def __init__(self) -> None:
        super().__init__("content")
        self.spare = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))


def spare_model() -> nn.Module:
    return SpareModel()


def content_model() -> nn.Module:
    return ToyModel("content")


def self_containing_model() -> nn.Module:
    """``content_model`` whose first gate holds the model itself as a submodule (a
    back-reference kept in the module tree): a tree that contains itself."""
    model = ToyModel("content")
    model.gates[0].owner = model
    return model


def constant_model() -> nn.Module:
    return ToyModel("constant")


def position_model() -> nn.Module:
    return ToyModel("position")


def pair_sequences(n: int, seq_len: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).integers(0, V, size=(n, seq_len))
    x[:, 1::2] = (x[:, 0:-1:2] + 1) % V
    return x


class RankSkewed(ToyModel):
    """``content`` on every process but the torchrun rank named by ``TOYS_SKEW_RANK``, whose
    logits are scaled by 1.001: the same code and weights everywhere, another forward."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = super().forward(ids)
        skewed = os.environ.get("RANK") == os.environ.get("TOYS_SKEW_RANK", "none")
        return logits * 1.001 if skewed else logits


def rank_skewed_model() -> nn.Module:
    return RankSkewed("content")


# ---- a routed toy with planted expert importance (tests/test_expert_ablation.py) ----

TOY_EXPERTS, TOY_TOP_K = 4, 2
TOY_LOGITS = (-1.0, 3.0, 2.0, 1.0)  # every token ranks 1 > 2 > 3 > 0: top-2 is {1, 2}
TOY_BIAS = (0.0, 0.0, 0.0, 5.0)  # the biased rule always picks 3, whatever its logit


class ToyExpert(nn.Module):
    """Expert 1 (critical) predicts the successor of a token below V / 2 at even
    positions; the others output zeros."""

    def __init__(self, critical: bool, scale: float = 8.0) -> None:
        super().__init__()
        self.critical, self.scale = critical, scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.critical:
            return torch.zeros(*ids.shape, V)
        even = (torch.arange(ids.shape[1]) % 2 == 0).view(1, -1, 1)
        low = (ids < V // 2).unsqueeze(-1)
        return self.scale * F.one_hot((ids + 1) % V, V).float() * even * low


class ToyLogitRouter(nn.Module):
    """Returns the same logits ``TOY_LOGITS`` for every token; the block picks the top-2
    and softmaxes over them (Mixtral-style renormalised top-k)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.new_tensor(TOY_LOGITS).expand(*h.shape[:2], TOY_EXPERTS).clone()


class ToyBiasedRouter(nn.Module):
    """DeepSeek-V3-style: one projection to logits, sigmoid scores plus a bias pick the
    top-2, weights are the unbiased sigmoid scores (not renormalised)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(TOY_LOGITS).view(-1, 1).expand(-1, V).clone())
        self.register_buffer("bias", torch.tensor(TOY_BIAS))

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(h, self.weight)
        scores = logits.sigmoid()
        experts = (scores + self.bias).topk(TOY_TOP_K, dim=-1).indices
        return logits, scores.gather(-1, experts), experts


class PlantedMoE(nn.Module):
    """One routed layer over one-hot tokens: known answers for expert ablation."""

    def __init__(self, biased: bool = False) -> None:
        super().__init__()
        self.biased = biased
        self.router = ToyBiasedRouter() if biased else ToyLogitRouter()
        self.experts = nn.ModuleList(ToyExpert(e == 1) for e in range(TOY_EXPERTS))
        self.anchor = nn.Parameter(torch.zeros(()))  # a parameter: dtype and device

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.router(F.one_hot(ids, V).float())
        if self.biased:
            _, weights, experts = out
        else:
            top, experts = out.topk(TOY_TOP_K, dim=-1)
            weights = top.softmax(dim=-1)
        mixed = torch.zeros(*ids.shape, V)
        for e, expert in enumerate(self.experts):
            share = (weights * (experts == e)).sum(dim=-1, keepdim=True)
            if bool((experts == e).any()):
                mixed = mixed + share * expert(ids)
        return mixed + self.anchor

    def controller_sites(self) -> list:
        from fcaudit.core.contract import Site
        from fcaudit.core.routers import RouterAdapter, TopKLogits
        adapter = RouterAdapter() if self.biased else TopKLogits(TOY_TOP_K)
        return [Site("router", "router", "toy", 0, adapter)]


def planted_moe() -> nn.Module:
    return PlantedMoE()


def biased_moe() -> nn.Module:
    return PlantedMoE(biased=True)


# ---- gated blocks with real FLOPs: known savings frontiers (tests/test_frontier.py) ----

TOY_GATE_LAYERS = 4
TOY_GATE_CONSTANTS = (0.9, 0.3, 0.7, 0.5)  # per layer; lowest mean first: 1, 3, 2, 0
TOY_UPDATE = 1.0  # each block adds this times its gate to the logit of x + 1 (4 blocks:
# at most 4 < log(V - 1), below the best constant logit, so removing any update costs)


class ToyBlockGate(nn.Module):
    """``[B, T, 1]`` from the block input ``h``: ``constant``, the layer's constant;
    ``informative``, 1 where the current token is below V / 2, exactly 0 elsewhere."""

    def __init__(self, mode: str, layer: int) -> None:
        super().__init__()
        self.mode, self.layer = mode, layer

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.mode == "constant":
            return torch.full((*h.shape[:2], 1), TOY_GATE_CONSTANTS[self.layer])
        return h[..., : V // 2].sum(-1, keepdim=True)


class ToyGatedBlock(nn.Module):
    """``h + g * body(h)``; ``h [B, T, 2V]`` holds the token one-hot, then the logits.
    ``body`` is one ``2V x 2V`` matmul (``8 V^2`` FLOPs per token) writing ``TOY_UPDATE`` to
    the logit of ``x + 1``."""

    def __init__(self, mode: str | None, layer: int) -> None:
        super().__init__()
        self.gate = ToyBlockGate(mode, layer) if mode else None
        self.body = nn.Linear(2 * V, 2 * V, bias=False)
        weight = torch.zeros(2 * V, 2 * V)
        weight[V + (torch.arange(V) + 1) % V, torch.arange(V)] = TOY_UPDATE
        self.body.weight.data.copy_(weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        update = self.body(h)
        return h + update if self.gate is None else h + self.gate(h) * update


class ToyGatedModel(nn.Module):
    """Four gated blocks over the one-hot input; the logits are the second half of ``h``.
    Its dense counterpart is the same network with every gate 1."""

    def __init__(self, mode: str | None) -> None:
        super().__init__()
        self.mode = mode
        self.blocks = nn.ModuleList(ToyGatedBlock(mode, i) for i in range(TOY_GATE_LAYERS))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.cat([F.one_hot(ids, V).float(), torch.zeros(*ids.shape, V)], dim=-1)
        for block in self.blocks:
            h = block(h)
        return h[..., V:]

    def controller_sites(self) -> list[Site]:
        return [Site(f"blocks.{i}.gate", f"blocks.{i}.gate", "toygate", i)
                for i in range(TOY_GATE_LAYERS)] if self.mode else []

    def execution_blocks(self) -> list[str]:
        return [f"blocks.{i}" for i in range(TOY_GATE_LAYERS)]

    def dense_counterpart(self) -> nn.Module:
        return ToyGatedModel(None)


class InvertedGatedBlock(ToyGatedBlock):
    """``h + (1 - g) * body(h)``: the gate switches its update off at ``g = 1``."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        assert self.gate is not None
        return h + (1 - self.gate(h)) * self.body(h)


class InvertedGatedModel(ToyGatedModel):
    """The constant-gate toy with inverted gates, declared ``Gate(off=1.0)``: layer ``l``
    writes ``TOY_UPDATE * (1 - TOY_GATE_CONSTANTS[l])``, so its largest gate (0.9, layer 0)
    scales the smallest update."""

    def __init__(self) -> None:
        super().__init__("constant")
        self.blocks = nn.ModuleList(InvertedGatedBlock("constant", i)
                                    for i in range(TOY_GATE_LAYERS))

    def controller_sites(self) -> list[Site]:
        return [Site(f"blocks.{i}.gate", f"blocks.{i}.gate", "toygate", i, role=Gate(off=1.0))
                for i in range(TOY_GATE_LAYERS)]


def inverted_gated_model() -> nn.Module:
    return InvertedGatedModel()


def constant_gated_model() -> nn.Module:
    return ToyGatedModel("constant")


def informative_gated_model() -> nn.Module:
    return ToyGatedModel("informative")


def dense_gated_model() -> nn.Module:
    """The gated toys' dense counterpart as a factory (``--dense toys:dense_gated_model``)."""
    return ToyGatedModel(None)
