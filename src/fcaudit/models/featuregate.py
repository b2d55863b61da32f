"""FeatureGate: a decoder-only transformer with a soft scalar gate on every block.

Block ``l`` computes its full update ``F_l(h) = Block_l(h) - h`` (attention, then
MLP, pre-LayerNorm) and a per-token gate ``g_l = sigmoid(w_l . LN(h) + b_l)`` from
the block input; the block returns ``h + g_l * F_l(h)``. The Dense twin is the
same code with no gate (``g = 1`` and no gate parameters), so a FeatureGate whose
gates are forced to 1 computes exactly what the Dense twin computes.

Positions use learned absolute embeddings (as GPT-2): stable absolute-position
effects are then possible, which is what the ``static-layer-position`` condition
of the audit is designed to capture.

A *folded* FeatureGate (``fixed``, written by ``fcaudit fold``) is the Dense twin with
each block's update scaled by fixed values in place of the gate network: one value per
block (``"layer"``), per position (``"layer_position"``) or per token id
(``"layer_token"``), the static profiles of an audit (:class:`FixedValues`). The scale
multiplies the block's update as the gate did, so the folded model computes what the
audit's static condition computed, at the Dense twin's cost plus one multiply per block.
(The scale cannot go into the output projections' weights: the MLP reads the attention's
unscaled output.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from fcaudit.core.contract import Site
from fcaudit.core.errors import FcauditError, check_sizes


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 2048
    block_size: int = 128  # maximum context length
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    gated: bool = True  # FeatureGate (True) or its Dense twin (False)
    gate_bias_init: float = 1.0  # sigmoid(1) ~ 0.73: gates start open but not saturated
    # a folded model: its controllers' outputs fixed, keyed by one of FIXED_KEYS; "": none
    fixed: str = ""

    def __post_init__(self) -> None:
        check_sizes(self, ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"))
        if self.n_embd % self.n_head:
            raise FcauditError(f"n_head={self.n_head} does not divide n_embd={self.n_embd}")
        if self.fixed and self.fixed not in FIXED_KEYS:
            raise FcauditError(f"fixed={self.fixed!r}: one of {', '.join(FIXED_KEYS)}")


# what a folded model's fixed values are keyed by -> how many rows (the config's)
FIXED_KEYS = {"layer": lambda cfg: 1, "layer_position": lambda cfg: cfg.block_size,
              "layer_token": lambda cfg: cfg.vocab_size}


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=2048, block_size=128, n_layer=4, n_head=4, n_embd=128),
    # the trend study's size between tiny and small (geometric middle of their parameters):
    # tiny's depth, vocabulary and context at twice its width
    "mid": GPTConfig(vocab_size=2048, block_size=128, n_layer=4, n_head=4, n_embd=256),
    "small": GPTConfig(vocab_size=4096, block_size=256, n_layer=6, n_head=6, n_embd=384),
    "76m": GPTConfig(vocab_size=12288, block_size=1024, n_layer=12, n_head=10, n_embd=640),
    "504m": GPTConfig(vocab_size=16384, block_size=1024, n_layer=24, n_head=20, n_embd=1280),
}


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention through PyTorch's fused kernel, each token seeing the ones
    before it; a subclass with ``causal = False`` lets every token see all (a ViT's)."""

    causal = True

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    """GPT-2's MLP (``hidden`` = 4 * n_embd by default). Mixture-of-Experts experts are
    narrower and leave their output bias to the layer, which shares one for the mixture."""

    def __init__(self, cfg: GPTConfig, hidden: int | None = None, out_bias: bool = True) -> None:
        super().__init__()
        hidden = hidden or 4 * cfg.n_embd
        self.fc = nn.Linear(cfg.n_embd, hidden)
        self.proj = nn.Linear(hidden, cfg.n_embd, bias=out_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Gate(nn.Module):
    """The controller: one coefficient per token, ``[B, T, 1]``, read from the block input."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.proj(self.ln(h)))


class FixedValues(nn.Module):
    """A controller's fixed outputs (``value [rows, width]``: one row per block, position
    or token id, as the config's ``fixed`` keys them), read for the tokens ``[B, T]``:
    ``[1, 1, width]``, ``[1, T, width]`` or ``[B, T, width]``; nothing computed."""

    def __init__(self, cfg: GPTConfig, width: int) -> None:
        super().__init__()
        self.key = cfg.fixed
        self.register_buffer("value", torch.ones(FIXED_KEYS[cfg.fixed](cfg), width))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.key == "layer":
            return self.value[None]
        if self.key == "layer_position":
            return self.value[None, :input_ids.shape[1]]
        return self.value[input_ids]


class Update(nn.Module):
    """``F(h) = Block(h) - h`` (attention, then MLP), computed as the sum of the two
    sub-layer outputs so that ``h + 1 * F(h)`` is exactly what the Dense twin computes."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        a = self.attn(self.ln_1(h))
        return a + self.mlp(self.ln_2(h + a))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.body = Update(cfg)
        self.gate = Gate(cfg) if cfg.gated else None
        # registered even when absent: a plain None attribute would enter the weights'
        # fingerprint (loading.state_fingerprint) of every unfolded model
        self.register_module("fixed", FixedValues(cfg, 1) if cfg.fixed else None)

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.fixed is not None:
            assert input_ids is not None, "a fixed gate reads the token ids"
            return h + self.fixed(input_ids) * self.body(h)
        if self.gate is None:
            return h + self.body(h)
        g = self.gate(h)
        return h + g * self.body(h)


class GPT(nn.Module):
    """FeatureGate (``cfg.gated``) or its Dense twin; ``input_ids [B, T] -> logits [B, T, V]``."""

    block_class: type[nn.Module] = Block  # subclasses (skipgate) swap in their own block

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(self.block_class(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.init_weights(cfg)

    def init_weights(self, cfg: GPTConfig) -> None:
        """GPT-2's initialisation, gates opened to ``gate_bias_init`` (subclasses reuse it)."""
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") and ".gate." not in name:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))  # GPT-2 residual scaling
        for block in self.blocks:
            if getattr(block, "gate", None) is not None:  # subclasses' blocks may have none
                nn.init.constant_(block.gate.proj.bias, cfg.gate_bias_init)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[1]
        pos = torch.arange(T, device=input_ids.device)
        h = self.wte(input_ids) + self.wpe(pos)
        for block in self.blocks:
            h = block(h, input_ids) if self.config.fixed else block(h)
        return self.lm_head(self.ln_f(h))

    def controller_sites(self) -> list[Site]:
        return [Site(name=f"blocks.{i}.gate", path=f"blocks.{i}.gate", family="featuregate",
                     layer=i, axes=("example", "token"), positions=(1,))
                for i, b in enumerate(self.blocks) if b.gate is not None]

    def execution_blocks(self) -> list[str]:
        return [f"blocks.{i}" for i in range(len(self.blocks))]

    def folded(self, key: str, values: list[torch.Tensor]) -> GPT:
        """This model with each controller replaced by fixed values keyed by ``key`` (one of
        :data:`FIXED_KEYS`): ``values[l]`` holds site ``l``'s rows ``[rows, *trailing]``
        (one, one per position of the context, one per token id). The weights are this
        model's, the controllers' dropped: a FeatureGate becomes its Dense twin with fixed
        gate values (a subclass folds its own controllers likewise)."""
        if key not in FIXED_KEYS:
            raise FcauditError(f"fixed values keyed by {key!r}: one of {', '.join(FIXED_KEYS)}")
        sites = self.controller_sites()
        if not sites:
            raise FcauditError("this model has no controller to fold")
        config = replace(self.config, fixed=key, **self.folded_settings)
        with torch.device("meta"):
            folded = type(self)(config)
        state = {k: v for k, v in self.state_dict().items()
                 if not any(k.startswith(s.path + ".") for s in sites)}
        expected = {k: v.shape for k, v in folded.state_dict().items() if k not in state}
        given = {f"{s.path.rsplit('.', 1)[0]}.fixed.value": v for s, v in
                 zip(sites, values, strict=True)}
        if {k: tuple(v.shape) for k, v in given.items()} != \
                {k: tuple(v) for k, v in expected.items()}:
            raise FcauditError(f"fixed values keyed by {key!r}: expected "
                               f"{ {k: list(v) for k, v in expected.items()} }, got "
                               f"{ {k: list(v.shape) for k, v in given.items()} }")
        folded.load_state_dict({**state, **{k: v.clone() for k, v in given.items()}},
                               assign=True)
        return folded.eval()

    # the config a folded model keeps beside ``fixed`` (a FeatureGate: no gate network)
    folded_settings: ClassVar[dict[str, object]] = {"gated": False}

    def dense_counterpart(self) -> GPT:
        """The Dense twin of this preset; a subclass's extra config fields are dropped."""
        shared = {f.name: getattr(self.config, f.name) for f in fields(GPTConfig)}
        return GPT(GPTConfig(**{**shared, "gated": False}))
