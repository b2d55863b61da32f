"""MoE: a Mixtral-style Mixture-of-Experts decoder built from FeatureGate's pieces.

Every block is FeatureGate's Dense block (pre-LayerNorm attention, then the MLP
sub-layer) with the MLP replaced by ``num_experts`` experts of which ``top_k`` run
per token. The router ``blocks.{l}.router`` is a linear layer (no bias) over the
block's normalised hidden state ``x = LN_2(h)``; its output, the router logits
``[B, T, E]``, is the controller site (family ``moe``). The block then applies a
fixed rule to whatever logits it receives: the ``top_k`` largest logits pick the
experts and a softmax over those ``top_k`` logits weights them (Mixtral's
renormalised top-k probabilities), so a replayed or intervened logits tensor
changes which experts run exactly as live routing would. Each expert
``blocks.{l}.experts.{e}`` runs only on the tokens routed to it (gather, run,
weighted scatter-add); no expert computes anything for a token it was not chosen for.

Expert width: ``4 * n_embd / top_k``, with one output bias per layer shared by the
experts (the mixture weights sum to 1, so a shared bias is what ``top_k`` equal
per-expert biases would add). A token's active MLP parameters are then
``top_k * (2 * n_embd * hidden + hidden) + n_embd``, exactly the Dense MLP's
``8 * n_embd**2 + 5 * n_embd``: with the router counted as the controller (as
FeatureGate's gate is), the active network *is* the Dense twin's size, so the Dense
twin of the same preset is the fair dense counterpart, as for FeatureGate. The
MoE holds ``num_experts / top_k`` times the Dense MLP parameters in total.

A *folded* MoE (``fixed``, written by ``fcaudit fold``) has no router: each block reads
its router logits from fixed values (:class:`~fcaudit.models.featuregate.FixedValues`),
one row per position or token id (the latter a token-id routing table, a hash-routed MoE
without the router's matrix product), and routes them by the same rule. With one row per
block every token takes the same ``top_k`` experts with the same weights, so they merge
into one MLP: their first layers side by side, their second layers scaled by the weights
side by side, ``top_k * expert_hidden`` wide, which is the Dense twin's MLP width, so the
folded model is the Dense architecture (:meth:`MoEGPT.folded`).

Training adds the Switch/Mixtral load-balancing loss ``E * sum_e f_e * P_e`` (see
:func:`load_balance`), averaged over layers and weighted by ``aux_loss_coef``; the
model exposes it as :attr:`MoEGPT.aux_loss` after a training-mode forward pass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from fcaudit.core.contract import ExpertLayer, Site
from fcaudit.core.errors import FcauditError, check_sizes
from fcaudit.core.routers import TopKLogits
from fcaudit.models.featuregate import GPT, MLP, CausalSelfAttention, FixedValues, GPTConfig
from fcaudit.models.featuregate import PRESETS as GPT_PRESETS


@dataclass(frozen=True)
class Experts:
    """The expert fields of a routed config (the tiny MoE's, ViT-MoE's), after its base's;
    the active experts' width must equal the ``twin``'s MLP width."""

    if TYPE_CHECKING:
        n_embd: int  # the base config's
    twin: ClassVar[str] = "Dense"
    num_experts: int = 8
    top_k: int = 2
    aux_loss_coef: float = 0.01  # weight of the load-balancing loss in training

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[misc]  # the base config's checks
        check_sizes(self, ("num_experts", "top_k"))
        if not 1 <= self.top_k <= self.num_experts:
            raise FcauditError(f"top_k={self.top_k} must be in 1..num_experts={self.num_experts}")
        if 4 * self.n_embd % self.top_k:
            raise FcauditError(f"4 * n_embd={4 * self.n_embd} must divide by top_k={self.top_k} "
                               f"for the active experts to match the {self.twin} MLP's width")

    @property
    def expert_hidden(self) -> int:
        return 4 * self.n_embd // self.top_k


@dataclass(frozen=True)
class MoEConfig(Experts, GPTConfig):
    """``gated`` is inherited and ignored: the routers are the controllers."""


PRESETS: dict[str, MoEConfig] = {
    name: MoEConfig(**dataclasses.asdict(cfg)) for name, cfg in GPT_PRESETS.items()}


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing rule: ``(weights, experts)``, both ``[..., top_k]``: the experts with
    the largest logits and a softmax over their logits (renormalised top-k)."""
    top, experts = logits.topk(top_k, dim=-1)
    return top.softmax(dim=-1), experts


def load_balance(logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Switch/Mixtral load-balancing loss of one layer, ``E * sum_e f_e * P_e``.

    ``f_e``: share of the token-to-expert assignments (all ``top_k`` slots) that go to
    expert ``e`` (not differentiable); ``P_e``: mean router probability of ``e`` (softmax
    over all ``E`` logits), which carries the gradient away from overloaded experts.
    It is 1 when both are uniform and ``E`` when every assignment and all probability
    go to one expert; it is at least 1 whenever ``f = P`` (Cauchy-Schwarz), though not
    in general (tokens routed against the mean probabilities can bring it below 1).
    """
    num = logits.shape[-1]
    f = torch.bincount(experts.flatten(), minlength=num).to(logits.dtype) / experts.numel()
    p = logits.softmax(dim=-1).reshape(-1, num).mean(dim=0)
    return num * (f * p).sum()


class RoutedBlock(nn.Module):
    """Attention, then routed experts, ``h [B, T, C] -> [B, T, C]``: the forward pass that
    the MoE's and the Mixtral's blocks share. A subclass builds ``ln_1``, ``attn``,
    ``ln_2``, ``router`` or (folded) ``fixed``, ``experts`` and ``top_k``, and names its
    routing ``rule`` (logits to weights and experts) and :meth:`mixture`."""

    rule = staticmethod(route)
    top_k: int
    ln_1: nn.Module
    attn: nn.Module
    ln_2: nn.Module
    router: nn.Module | None
    fixed: nn.Module | None
    experts: nn.ModuleList

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = h + self.attn(self.ln_1(h))
        x = self.ln_2(h)
        if self.fixed is not None:  # folded: the fixed logits of these tokens
            assert input_ids is not None, "fixed router logits are read for the token ids"
            logits = self.fixed(input_ids).expand(*x.shape[:2], -1)
        else:  # [B, T, E]; a replay stub may stand in for the router
            assert self.router is not None
            logits = self.router(x)
        weights, experts = self.rule(logits, self.top_k)
        self.balance = load_balance(logits, experts) if self.training else None
        return h + self.mixture(x, weights, experts)

    def mixture(self, x: torch.Tensor, weights: torch.Tensor,
                experts: torch.Tensor) -> torch.Tensor:
        """The experts' mixture (:func:`mixture`)."""
        return mixture(x, weights, experts, self.experts)


class MoEBlock(RoutedBlock):
    """The MoE's block. ``cfg`` needs ``n_embd``, ``n_head``, ``num_experts``, ``top_k``
    and ``expert_hidden``; the vision MoE swaps in unmasked attention."""

    attention: type[nn.Module] = CausalSelfAttention

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = self.attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        # a folded MoE reads fixed logits instead (the vision MoE's config has no such key:
        # it does not fold); registered either way, so an unfolded model shows no None
        fixed = getattr(cfg, "fixed", "")
        self.register_module("router", None if fixed else
                             nn.Linear(cfg.n_embd, cfg.num_experts, bias=False))
        self.register_module("fixed", FixedValues(cfg, cfg.num_experts) if fixed else None)
        self.experts = nn.ModuleList(MLP(cfg, hidden=cfg.expert_hidden, out_bias=False)
                                     for _ in range(cfg.num_experts))
        self.expert_bias = nn.Parameter(torch.zeros(cfg.n_embd))
        self.balance: torch.Tensor | None = None  # load_balance of the last training pass

    def mixture(self, x: torch.Tensor, weights: torch.Tensor,
                experts: torch.Tensor) -> torch.Tensor:
        """The experts' mixture plus the layer's shared output bias."""
        return super().mixture(x, weights, experts) + self.expert_bias


def mixture(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
            modules: nn.ModuleList) -> torch.Tensor:
    """``sum_j weights[..., j] * modules[experts[..., j]](x)``, each expert run on its own
    tokens only, in ascending expert order. Assignments are grouped by expert with one sort,
    so the host waits once per layer (for the group sizes), not once per expert."""
    flat = x.reshape(-1, x.shape[-1])
    top_k = experts.shape[-1]
    assignment = experts.flatten()  # token n's slot j sits at n * top_k + j
    order = assignment.argsort(stable=True)
    sizes = torch.bincount(assignment, minlength=len(modules)).tolist()
    out = torch.zeros_like(flat)
    for expert, group in zip(modules, order.split(sizes), strict=True):
        if group.numel():
            tokens = group // top_k
            mixed = weights.flatten()[group, None] * expert(flat[tokens])
            out.index_add_(0, tokens, mixed.to(out.dtype))
    return out.view_as(x)


class Routed:
    """What a network of :class:`MoEBlock` s (``self.blocks``, ``self.config.top_k``)
    declares: its training term, router sites and expert layers. ``site_axes`` names
    the router logits' leading axes (the language MoE's tokens, the vision MoE's patches)."""

    site_family = "moe"
    site_axes: tuple[str, ...] = ("example", "token")
    blocks: nn.ModuleList
    config: MoEConfig

    @property
    def aux_loss(self) -> torch.Tensor | float:
        """``aux_loss_coef`` times the layers' mean :func:`load_balance` of the last
        training-mode forward pass (0 after an eval pass): the training loop adds it to
        the language-model loss without knowing what it is."""
        values = [b.balance for b in self.blocks if b.balance is not None]
        return self.config.aux_loss_coef * torch.stack(values).mean() if values else 0.0

    def controller_sites(self) -> list[Site]:
        if getattr(self.config, "fixed", ""):
            return []  # folded: no router computes anything
        adapter = TopKLogits(self.config.top_k)  # the block picks the top-k of these logits
        return [Site(name=f"blocks.{i}.router", path=f"blocks.{i}.router",
                     family=self.site_family, layer=i, adapter=adapter, axes=self.site_axes,
                     positions=(1,)) for i in range(len(self.blocks))]

    def expert_layers(self) -> list[ExpertLayer]:
        return [ExpertLayer(name=f"blocks.{i}.router",
                            experts=tuple(f"blocks.{i}.experts.{e}"
                                          for e in range(len(b.experts))),
                            num_experts=len(b.experts), top_k=b.top_k)
                for i, b in enumerate(self.blocks)]


class MoEGPT(Routed, GPT):
    """FeatureGate's network with :class:`MoEBlock`; ``input_ids [B, T] -> logits [B, T, V]``."""

    block_class = MoEBlock
    folded_settings: ClassVar[dict[str, object]] = {}  # folded, it stays an MoE

    def folded(self, key: str, values: list[torch.Tensor]) -> GPT:
        """:meth:`GPT.folded`, except one row of logits per block (``key`` ``"layer"``):
        each block's ``top_k`` experts and weights are then the same for every token, and
        merge into the Dense twin's MLP (the module docstring)."""
        if key != "layer":
            return super().folded(key, values)
        with torch.device("meta"):
            dense = self.dense_counterpart()
        state = {k: v for k, v in self.state_dict().items()
                 if k.split(".")[0] != "blocks"}
        for i, (block, logits) in enumerate(zip(self.blocks, values, strict=True)):
            weights, chosen = route(logits.reshape(1, -1).float(), self.config.top_k)
            experts = [block.experts[int(e)] for e in chosen[0]]
            parts = {**{f"{n}.weight": getattr(block, n).weight for n in ("ln_1", "ln_2")},
                     **{f"{n}.bias": getattr(block, n).bias for n in ("ln_1", "ln_2")},
                     **{f"attn.{k}": v for k, v in block.attn.state_dict().items()},
                     "mlp.fc.weight": torch.cat([e.fc.weight for e in experts]),
                     "mlp.fc.bias": torch.cat([e.fc.bias for e in experts]),
                     "mlp.proj.weight": torch.cat(
                         [w * e.proj.weight for w, e in zip(weights[0], experts, strict=True)],
                         dim=1),
                     "mlp.proj.bias": block.expert_bias}
            state.update({f"blocks.{i}.body.{k}": v.detach().clone() for k, v in parts.items()})
        dense.load_state_dict(state, assign=True)
        return dense.eval()
