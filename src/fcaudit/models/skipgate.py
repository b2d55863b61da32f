"""SkipGate: FeatureGate with real conditional execution (Mixture-of-Depths style).

Each block reads the FeatureGate gate ``g = sigmoid(w . LN(h) + b)`` per token from
its input. Tokens with ``g >= threshold`` are gathered and the block runs on them
only: attention among the selected tokens of the same sequence (causal by original
position), the MLP on the selected tokens. Their results are scattered back as
``h + g * F(h)``; every other token passes ``h`` unchanged, and no arithmetic is
spent on it. The reference model for the execution audit: its savings are real.

Training rule (a capacity rule, as in Mixture-of-Depths): in training mode each
block runs on the ``capacity`` fraction of the batch's tokens with the highest
gates, so compute is fixed and no auxiliary loss is needed. The gate learns
through the product ``g * F(h)`` on the tokens it runs, exactly as the MoD router
weight does. The batch threshold is tracked by a running average (one buffer per
block, saved with the weights) that serves as the fixed threshold at inference,
where the rule is per token and causal (in training the batch threshold is one
scalar shared by the batch's tokens, a negligible look-ahead that evaluation never
has). The buffer starts at ``sigmoid(gate_bias_init)``, the median of the initial
gates, so an untrained model already skips about half of its tokens. Trained,
the gates spread far apart: the tokens a block must run keep large gates, while
the marginal ones it is forced to run by the capacity get gates near the
threshold, i.e. a small weight.

Layout: the block's update is a child module, ``blocks.{l}.body``, called with
the selected tokens packed as ``[N, C]``; a forward hook there sees exactly the
tokens that run. Attention needs whole sequences, so the body lays the selected
tokens of each sequence out in order in ``[B, K, C]`` (``K`` = most tokens any
sequence selected), padding at the end: causal attention never lets a real token
see padding, and padded rows are dropped again. That padding is real work for
attention and its projections, and the FLOP counter counts it as such.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from fcaudit.core.contract import Site
from fcaudit.models.featuregate import GPT, Gate, GPTConfig, Update
from fcaudit.models.featuregate import PRESETS as GPT_PRESETS


@dataclass(frozen=True)
class SkipGateConfig(GPTConfig):
    # ``gated`` is inherited and ignored: every SkipGate block has a gate.
    capacity: float = 0.5  # fraction of tokens each block runs on in training
    threshold_momentum: float = 0.05  # running average of the training threshold


PRESETS: dict[str, SkipGateConfig] = {
    name: SkipGateConfig(**dataclasses.asdict(cfg)) for name, cfg in GPT_PRESETS.items()}


@dataclass
class Route:
    """Which tokens a block runs on, and where each sits in the padded layout."""

    seq: torch.Tensor  # [N] sequence of each selected token (row-major order)
    pos: torch.Tensor  # [N] its original position
    slot: torch.Tensor  # [N] its rank among its sequence's selected tokens
    batch: int
    width: int  # K: the most tokens any one sequence selected

    @classmethod
    def from_mask(cls, run: torch.Tensor) -> Route:
        """``run [B, T]`` bool; keeps each sequence's tokens in position order."""
        seq, pos = run.nonzero(as_tuple=True)
        slot = (run.cumsum(1) - 1)[seq, pos]
        return cls(seq, pos, slot, run.shape[0], int(run.sum(1).max()))

    def gather(self, h: torch.Tensor) -> torch.Tensor:
        return h[self.seq, self.pos]

    def scatter_add(self, h: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        return h.index_put((self.seq, self.pos), update, accumulate=True)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Packed ``[N, C]`` -> ``[B, K, C]``, each sequence's tokens first, zeros after."""
        out = x.new_zeros(self.batch, self.width, x.shape[-1])
        return out.index_put((self.seq, self.slot), x)

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        return y[self.seq, self.slot]


class RoutedUpdate(Update):
    """``F(h)`` of a FeatureGate block, computed on the selected tokens only."""

    def forward(self, x: torch.Tensor, route: Route) -> torch.Tensor:  # type: ignore[override]
        """``x [N, C]``: the selected tokens, packed; returns their updates ``[N, C]``."""
        a = route.unpad(self.attn(route.pad(self.ln_1(x))))
        return a + self.mlp(self.ln_2(x + a))


class SkipBlock(nn.Module):
    def __init__(self, cfg: SkipGateConfig) -> None:
        super().__init__()
        self.capacity = cfg.capacity
        self.momentum = cfg.threshold_momentum
        self.gate = Gate(cfg)
        self.body = RoutedUpdate(cfg)
        start = 1 / (1 + math.exp(-cfg.gate_bias_init))
        self.register_buffer("threshold", torch.tensor(start))

    def select(self, g: torch.Tensor) -> torch.Tensor:
        """Tokens to run, ``[B, T]`` bool: top ``capacity`` of the batch in training."""
        if not self.training:
            return g >= self.threshold
        k = max(1, round(self.capacity * g.numel()))
        batch_threshold = g.detach().flatten().topk(k).values[-1]
        self.threshold.lerp_(batch_threshold, self.momentum)
        return g >= batch_threshold

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        g = self.gate(h)  # [B, T, 1]; a replay stub may stand in for the gate
        run = self.select(g[..., 0])
        if not run.any():
            return h
        route = Route.from_mask(run)
        return route.scatter_add(h, route.gather(g) * self.body(route.gather(h), route))


class SkipGateGPT(GPT):
    """FeatureGate's network with :class:`SkipBlock`; ``input_ids [B, T] -> logits [B, T, V]``."""

    block_class = SkipBlock

    def controller_sites(self) -> list[Site]:
        return [dataclasses.replace(s, family="skipgate") for s in super().controller_sites()]

    def execution_blocks(self) -> list[str]:
        return [f"blocks.{i}.body" for i in range(len(self.blocks))]
