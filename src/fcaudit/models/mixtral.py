"""Mixtral: a Mistral-style decoder whose MLPs are routed SwiGLU experts, in fcaudit's code.

Every block is pre-RMSNorm attention (rotary positions, grouped-query heads, an optional
sliding window) then the routed experts, computed as Hugging Face's Mixtral computes them:
the router ``blocks.{l}.router`` (a linear layer, no bias) gives the logits ``[B, T, E]``
(the controller site, family ``moe``); a softmax over all ``E`` in float32, the ``top_k``
largest probabilities renormalised to sum to 1 weight the chosen experts
(:func:`route`); each expert ``silu(x W_gate) * (x W_up) W_down`` runs on its own tokens only.

Why a Mixtral of our own: a *folded* Mixtral (``fcaudit fold`` of a Hugging Face Mixtral
folder at ``static-layer-token`` or ``static-layer-position``) routes by a table, one row
of logits per token id (a hash-routed MoE: no router matrix product) or per position, and
no transformers class does that. :func:`from_hf` takes a transformers Mixtral's weights
(and its config: rotary base, window, norms) into this model, with the table in place of
the routers; the fold's exactness check then proves it computes the audit's condition.
Trained from a preset (``fcaudit train --arch mixtral``) it is an MoE family like ours.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fcaudit.core.errors import FcauditError, ModelError, check_sizes
from fcaudit.models.featuregate import FIXED_KEYS, FixedValues
from fcaudit.models.featuregate import PRESETS as GPT_PRESETS
from fcaudit.models.moe import Routed, RoutedBlock


@dataclass(frozen=True)
class MixtralConfig:
    vocab_size: int = 2048
    block_size: int = 128  # maximum context (the rotary table's, a position table's rows)
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 2  # grouped-query attention: key/value heads shared by n_head / n_kv_head
    n_embd: int = 128
    head_dim: int = 0  # 0: n_embd // n_head
    expert_hidden: int = 256  # one expert's SwiGLU width
    num_experts: int = 8
    top_k: int = 2
    rms_eps: float = 1e-5
    rope_theta: float = 1e6
    sliding_window: int = 0  # 0: every earlier token is seen
    aux_loss_coef: float = 0.01  # weight of the load-balancing loss in training
    # a folded model: its routers' logits fixed, keyed by one of FIXED_KEYS; "": routed
    fixed: str = ""

    def __post_init__(self) -> None:
        check_sizes(self, ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head",
                           "n_embd", "expert_hidden", "num_experts", "top_k"))
        if self.n_head % self.n_kv_head:
            raise FcauditError(f"n_kv_head={self.n_kv_head} does not divide n_head={self.n_head}")
        if not self.head_dim and self.n_embd % self.n_head:
            raise FcauditError(f"n_head={self.n_head} does not divide n_embd={self.n_embd}")
        if not 1 <= self.top_k <= self.num_experts:
            raise FcauditError(f"top_k={self.top_k} must be in 1..num_experts={self.num_experts}")
        if self.fixed and self.fixed not in FIXED_KEYS:
            raise FcauditError(f"fixed={self.fixed!r}: one of {', '.join(FIXED_KEYS)}")

    @property
    def head_size(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


# FeatureGate's sizes, half as many key/value heads, experts twice as wide as the model
PRESETS: dict[str, MixtralConfig] = {
    name: MixtralConfig(vocab_size=c.vocab_size, block_size=c.block_size, n_layer=c.n_layer,
                        n_head=c.n_head, n_kv_head=max(c.n_head // 2, 1), n_embd=c.n_embd,
                        expert_hidden=2 * c.n_embd)
    for name, c in GPT_PRESETS.items()}


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's routing rule: ``(weights, experts)``, both ``[..., top_k]``: the softmax
    over all experts in float32, its ``top_k`` largest renormalised to sum to 1."""
    probs = logits.float().softmax(dim=-1)
    top, experts = probs.topk(top_k, dim=-1)
    return top / top.sum(dim=-1, keepdim=True), experts


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and scaled in the input's dtype."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions: each head's two halves turned by the position's angles."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Attention(nn.Module):
    """Grouped-query causal attention with rotary positions, through the fused kernel. The
    rotary frequencies are a buffer, saved with the weights: a fold keeps the ones the
    source model held (transformers keeps them in float32, or in the dtype a model was
    cast to), so the angles are the source's to the bit."""

    def __init__(self, cfg: MixtralConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv, self.d = cfg.n_head, cfg.n_kv_head, cfg.head_size
        self.window = cfg.sliding_window
        self.q = nn.Linear(cfg.n_embd, self.n_head * self.d, bias=False)
        self.k = nn.Linear(cfg.n_embd, self.n_kv * self.d, bias=False)
        self.v = nn.Linear(cfg.n_embd, self.n_kv * self.d, bias=False)
        self.o = nn.Linear(self.n_head * self.d, cfg.n_embd, bias=False)
        self.register_buffer("inv_freq", 1.0 / (cfg.rope_theta ** (
            torch.arange(0, self.d, 2, dtype=torch.float) / self.d)))

    def angles(self, T: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.arange(T, device=x.device)[:, None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (proj(x).view(B, T, -1, self.d).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        cos, sin = self.angles(T, x)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        mask = None
        if self.window and self.window < T:  # a token sees the window's last tokens only
            i = torch.arange(T, device=x.device)
            mask = (i[:, None] >= i[None]) & (i[:, None] - i[None] < self.window)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=self.n_kv != self.n_head)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class Expert(nn.Module):
    """One SwiGLU expert: ``(silu(x W_gate) * x W_up) W_down``."""

    def __init__(self, cfg: MixtralConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(cfg.n_embd, 2 * cfg.expert_hidden, bias=False)
        self.down = nn.Linear(cfg.expert_hidden, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class MixtralBlock(RoutedBlock):
    """Attention, then the routed experts (Mixtral's :func:`route`); ``h [B, T, C] ->
    [B, T, C]``."""

    rule = staticmethod(route)

    def __init__(self, cfg: MixtralConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.ln_1 = RMSNorm(cfg.n_embd, cfg.rms_eps)
        self.attn = Attention(cfg)
        self.ln_2 = RMSNorm(cfg.n_embd, cfg.rms_eps)
        # folded: the logits read from a table (registered either way: no None attribute)
        self.register_module("router", None if cfg.fixed else
                             nn.Linear(cfg.n_embd, cfg.num_experts, bias=False))
        self.register_module("fixed", FixedValues(cfg, cfg.num_experts) if cfg.fixed else None)
        self.experts = nn.ModuleList(Expert(cfg) for _ in range(cfg.num_experts))
        self.balance: torch.Tensor | None = None  # load_balance of the last training pass

    def mixture(self, x: torch.Tensor, weights: torch.Tensor,
                experts: torch.Tensor) -> torch.Tensor:
        """Each token's chosen experts, each run on its own tokens only, their outputs scaled
        by the (float32) weights and summed over the token's ``top_k`` slots in float32, then
        cast: transformers' default experts kernel, whose sum order and precision this
        keeps (in bfloat16 an in-place sum would round after every expert)."""
        flat, k = x.reshape(-1, x.shape[-1]), experts.shape[-1]
        slots = experts.reshape(-1)  # token n's slot j sits at n * k + j
        order = slots.argsort(stable=True)
        sizes = torch.bincount(slots, minlength=len(self.experts)).tolist()
        out = flat.new_zeros(slots.numel(), flat.shape[-1], dtype=weights.dtype)
        for expert, group in zip(self.experts, order.split(sizes), strict=True):
            if group.numel():
                out[group] = expert(flat[group // k]) * weights.reshape(-1)[group, None]
        return out.view(-1, k, flat.shape[-1]).sum(dim=1).to(x.dtype).view_as(x)


class Mixtral(Routed, nn.Module):
    """``input_ids [B, T] -> logits [B, T, V]``; routers are the controller sites."""

    def __init__(self, cfg: MixtralConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(MixtralBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = RMSNorm(cfg.n_embd, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(input_ids)
        for block in self.blocks:
            h = block(h, input_ids)
        return self.lm_head(self.ln_f(h))

    def execution_blocks(self) -> list[str]:
        return [f"blocks.{i}" for i in range(len(self.blocks))]

    def folded(self, key: str, values: list[torch.Tensor]) -> Mixtral:
        """This model with each router replaced by its fixed logits keyed by ``key`` (one of
        :data:`FIXED_KEYS`; ``values[l]``: layer ``l``'s rows ``[rows, E]``)."""
        return _built(self.config, self.state_dict(), key, values)


def _built(config: MixtralConfig, state: dict[str, torch.Tensor], key: str,
           values: list[torch.Tensor]) -> Mixtral:
    """A Mixtral of ``config``'s sizes from ``state``: routed (``key`` ""), or folded (its
    routers dropped, their fixed rows ``values`` keyed by ``key``)."""
    if key and key not in FIXED_KEYS:
        raise FcauditError(f"fixed values keyed by {key!r}: one of {', '.join(FIXED_KEYS)}")
    with torch.device("meta"):
        model = Mixtral(dataclasses.replace(config, fixed=key))
    given = {f"blocks.{i}.fixed.value": v for i, v in enumerate(values)}
    want = {k: tuple(v.shape) for k, v in model.state_dict().items() if ".fixed." in k}
    if {k: tuple(v.shape) for k, v in given.items()} != want:
        raise FcauditError(f"fixed values keyed by {key!r}: expected {want}, got "
                           f"{ {k: tuple(v.shape) for k, v in given.items()} }")
    # copies: the source's experts may be views of one stacked tensor, and the folded
    # model must share no storage with the source (it is trained when healed, and saved)
    kept = {k: v for k, v in state.items() if not key or ".router." not in k}
    model.load_state_dict({k: v.detach().clone() for k, v in {**kept, **given}.items()},
                          assign=True)
    return model.eval()


def from_hf(model: nn.Module, key: str = "", values: list[torch.Tensor] | None = None
            ) -> Mixtral:
    """A transformers Mixtral's weights in this model: with its routers (``key`` ""), or
    with them replaced by fixed logits ``values`` keyed by ``key``. A configuration this
    model does not compute (another rotary scheme or activation) is refused, so a fold
    never rests on a guess."""
    cfg = model.config
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", None))
    unsupported = [what for what, bad in (
        (f"rotary type {rope.get('rope_type')!r}", rope.get("rope_type", "default") != "default"),
        (f"rope scaling {getattr(cfg, 'rope_scaling', None)!r}",
         bool(getattr(cfg, "rope_scaling", None)) and not rope),
        (f"activation {cfg.hidden_act!r}", cfg.hidden_act != "silu"),
        ("no rotary base", theta is None)) if bad]
    if unsupported:
        raise ModelError(f"this Mixtral's {', '.join(unsupported)} is not what fcaudit's Mixtral "
                         "computes; it does not fold per token or position")
    config = MixtralConfig(
        vocab_size=cfg.vocab_size, block_size=cfg.max_position_embeddings,
        n_layer=cfg.num_hidden_layers, n_head=cfg.num_attention_heads,
        n_kv_head=cfg.num_key_value_heads, n_embd=cfg.hidden_size,
        head_dim=getattr(cfg, "head_dim", None) or 0, expert_hidden=cfg.intermediate_size,
        num_experts=cfg.num_local_experts, top_k=cfg.num_experts_per_tok,
        rms_eps=cfg.rms_norm_eps, rope_theta=float(theta),
        sliding_window=getattr(cfg, "sliding_window", None) or 0)
    rotary = model.get_submodule("model.rotary_emb").inv_freq  # not in its state dict
    return _built(config, _renamed(model.state_dict(), config, rotary), key, values or [])


def _renamed(hf: dict[str, Any], cfg: MixtralConfig, inv_freq: torch.Tensor
             ) -> dict[str, torch.Tensor]:
    """A transformers Mixtral's state dict in this model's names (experts split out of the
    stacked tensors; routers kept under their names, dropped by the fold). Tied input and
    output embeddings become two equal tensors (a run folder's safetensors holds no shared
    storage)."""
    embed = hf["model.embed_tokens.weight"]
    state = {"wte.weight": embed, "ln_f.weight": hf["model.norm.weight"],
             "lm_head.weight": hf.get("lm_head.weight", embed)}
    for i in range(cfg.n_layer):
        src, dst = f"model.layers.{i}.", f"blocks.{i}."
        state[dst + "ln_1.weight"] = hf[src + "input_layernorm.weight"]
        state[dst + "ln_2.weight"] = hf[src + "post_attention_layernorm.weight"]
        for name in "qkvo":
            state[f"{dst}attn.{name}.weight"] = hf[f"{src}self_attn.{name}_proj.weight"]
        state[dst + "attn.inv_freq"] = inv_freq
        state[dst + "router.weight"] = hf[src + "mlp.gate.weight"]
        for e in range(cfg.num_experts):
            state[f"{dst}experts.{e}.gate_up.weight"] = hf[src + "mlp.experts.gate_up_proj"][e]
            state[f"{dst}experts.{e}.down.weight"] = hf[src + "mlp.experts.down_proj"][e]
    return state


__all__ = ["PRESETS", "Mixtral", "MixtralConfig", "from_hf", "route"]
