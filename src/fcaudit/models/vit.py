"""ViT: the tiny Vision Transformer shared by the vision families, and their dense twin.

An image ``[B, C, H, W]`` is cut into non-overlapping ``patch_size`` squares, each
flattened and projected to ``n_embd`` (one linear layer), plus a learned position
embedding per patch. ``n_layer`` pre-LayerNorm blocks (bidirectional attention
through ``F.scaled_dot_product_attention``, then GPT-2's MLP) follow; the class logits
``[B, num_classes]`` come from the mean of the final tokens (no class token, so every
token is a patch and a pruned model simply averages the patches it kept).

Used as it is, this is the dense twin of ``vit-moe`` (same width; its MLP is the
active width of the experts) and of ``tokenprune`` (no token is ever dropped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import nn

from fcaudit.core.errors import FcauditError, check_sizes
from fcaudit.models.featuregate import GPT, MLP, CausalSelfAttention


@dataclass(frozen=True)
class ViTConfig:
    image_size: int = 8
    patch_size: int = 2
    channels: int = 1
    num_classes: int = 10
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 32

    def __post_init__(self) -> None:
        check_sizes(self, ("image_size", "patch_size", "channels", "num_classes", "n_layer",
                           "n_head", "n_embd"))
        if self.image_size % self.patch_size:
            raise FcauditError(f"patch_size={self.patch_size} does not divide "
                               f"image_size={self.image_size}")
        if self.n_embd % self.n_head:
            raise FcauditError(f"n_head={self.n_head} does not divide n_embd={self.n_embd}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


PRESETS: dict[str, ViTConfig] = {"tiny": ViTConfig()}


class Attention(CausalSelfAttention):
    """Multi-head self-attention over all tokens (no mask: a ViT sees the whole image)."""

    causal = False


class Block(nn.Module):
    """``h + attn(LN(h))``, then ``+ mlp(LN(.))``; ``[B, T, C] -> [B, T, C]``."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.ln_1(h))
        return h + self.mlp(self.ln_2(h))


class ViT(nn.Module):
    """``images [B, C, H, W] -> logits [B, num_classes]``; subclasses swap the block."""

    block_class: type[nn.Module] = Block

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch = nn.Linear(cfg.channels * cfg.patch_size ** 2, cfg.n_embd)
        self.pos = nn.Parameter(torch.zeros(cfg.num_patches, cfg.n_embd))
        self.blocks = nn.ModuleList(self.block_class(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.num_classes)
        self.apply(GPT._init_weights)  # no embeddings here: only the Linear layers'
        nn.init.normal_(self.pos, std=0.02)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))  # GPT-2 residual scaling

    def patches(self, images: torch.Tensor) -> torch.Tensor:
        """``[B, C, H, W] -> [B, P, C * p * p]``, patches in row-major order."""
        p = self.config.patch_size
        B, C, H, W = images.shape
        x = images.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(B, (H // p) * (W // p), C * p * p)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        return self.patch(self.patches(images)) + self.pos

    def classify(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(h).mean(dim=1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = self.embed(images)
        for block in self.blocks:
            h = block(h)
        return self.classify(h)

    def execution_blocks(self) -> list[str]:
        return [f"blocks.{i}" for i in range(len(self.blocks))]

    def dense_counterpart(self) -> ViT:
        """The plain ViT of the same size (for a subclass: its dense twin)."""
        return ViT(ViTConfig(**{f.name: getattr(self.config, f.name) for f in fields(ViTConfig)}))
