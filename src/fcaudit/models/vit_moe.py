"""ViT-MoE: the tiny ViT with every MLP replaced by top-2-of-8 experts (V-MoE style).

Each block is the language MoE's block (:class:`fcaudit.models.moe.MoEBlock`) with
unmasked attention: the router ``blocks.{l}.router`` (a linear layer without bias over
``LN_2(h)``) gives logits ``[B, P, E]`` per patch token, the ``top_k`` largest pick the
experts and a softmax over those weights them, and each expert runs only on the patch
tokens routed to it (the language MoE's gather, run, weighted scatter-add). The
routers are the controller sites (family ``vit-moe``, axes example x patch), so the
audit's shuffle permutes router logits across the patches of one image.

Expert width ``4 * n_embd / top_k`` with one shared output bias, as in the language
MoE: a patch token's active MLP parameters equal the dense ViT's MLP, so the dense
twin (:class:`fcaudit.models.vit.ViT` of the same size) has the active parameters of
this model without its routers. Training adds the load-balancing loss
(:func:`fcaudit.models.moe.load_balance`), weighted by ``aux_loss_coef``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fcaudit.models.moe import Experts, MoEBlock, Routed
from fcaudit.models.vit import Attention, ViT, ViTConfig


@dataclass(frozen=True)
class ViTMoEConfig(Experts, ViTConfig):
    twin: ClassVar[str] = "dense"


PRESETS: dict[str, ViTMoEConfig] = {"tiny": ViTMoEConfig()}


class ViTMoEBlock(MoEBlock):
    """Unmasked attention, then the routed expert mixture; ``[B, P, C] -> [B, P, C]``."""

    attention = Attention


class ViTMoE(Routed, ViT):
    """``images [B, C, H, W] -> logits [B, num_classes]`` with routed expert MLPs."""

    block_class = ViTMoEBlock
    site_family = "vit-moe"
    site_axes = ("example", "patch")
