"""TokenPrune: the tiny ViT dropping its lowest-scoring patch tokens (DynamicViT style).

After block ``prune_after`` a scorer (``scorer``: LayerNorm, then a linear layer to
one number per token) gives a keep-score per patch token, ``[B, P]``: the controller
site (family ``tokenprune``, axes example x patch). The ``ceil(keep_ratio * P)``
highest-scoring tokens of each image are gathered (in their patch order) and the
later blocks run on those only, so they really compute fewer tokens; the class
logits average the kept tokens. Replayed or intervened scores change which tokens
are kept exactly as live scores would, since the block applies the fixed rule
"keep the top scores" to whatever scores it receives.

Training: the selection is a hard top-k, as at inference, so the trained network is
the one evaluated. Two things make the scores learn through it:

* **Straight-through score weights**: each kept token is multiplied by
  ``1 + (s - stop_grad(s))``, exactly 1 in value (the forward pass is the inference
  pass bit for bit) with gradient ``dL/ds = (dL/dh) . h``, the first-order change of
  the loss when the token is scaled up (and, with the sign flipped, dropped).
* **Gumbel top-k exploration**: the selection ranks ``s + Gumbel noise``, a sample
  of tokens without replacement with probabilities ``softmax(s)``, so tokens that a
  noiseless top-k would drop are kept now and then and receive gradient too.

The scorer reads the hidden states detached (the same values): the scores learn from
the straight-through weights alone and send no gradient of their own into the
backbone. With that gradient, training collapsed (seed 0 of the ``tiny`` preset: eval
accuracy 0.40 against 0.82 without it, the dense twin 0.85).

We chose these over DynamicViT's soft attention masks because a soft mask trains a
network that sees every token, while the audited model drops them; here training
and inference compute the same kind of pass. Evaluation ranks the scores alone.
The dense twin is :class:`fcaudit.models.vit.ViT` of the same size (no scorer,
nothing dropped): this model's parameters less the controller's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fcaudit.core.contract import Site
from fcaudit.core.errors import FcauditError
from fcaudit.models.featuregate import Gate
from fcaudit.models.vit import ViT, ViTConfig


@dataclass(frozen=True)
class TokenPruneConfig(ViTConfig):
    prune_after: int = 1  # index of the block after which tokens are dropped
    keep_ratio: float = 0.5  # share of the patch tokens kept (rounded up)

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.prune_after, bool) or not isinstance(self.prune_after, int) \
                or not 0 <= self.prune_after < self.n_layer - 1:
            raise FcauditError(f"prune_after={self.prune_after!r} must be an integer in "
                               f"0..{self.n_layer - 2} (a block with a block after it)")
        if isinstance(self.keep_ratio, bool) or not isinstance(self.keep_ratio, (int, float)) \
                or not 0 < self.keep_ratio <= 1:
            raise FcauditError(f"keep_ratio={self.keep_ratio!r} must be a number in (0, 1]")

    @property
    def kept_tokens(self) -> int:
        return math.ceil(self.keep_ratio * self.num_patches)


PRESETS: dict[str, TokenPruneConfig] = {"tiny": TokenPruneConfig()}


class Scorer(Gate):
    """The controller: FeatureGate's gate without its sigmoid, ``[B, P, C] -> [B, P]``."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(self.ln(h)).squeeze(-1)


def keep(h: torch.Tensor, scores: torch.Tensor, k: int, explore: bool) -> torch.Tensor:
    """The ``k`` highest-scoring tokens of each row of ``h [B, P, C]``, in patch order,
    as ``[B, k, C]`` (straight-through weighted; Gumbel-ranked when ``explore``)."""
    rank = scores
    if explore:
        uniform = torch.rand_like(scores).clamp_(min=torch.finfo(scores.dtype).tiny)
        rank = scores.detach() - torch.log(-torch.log(uniform))
    index = rank.topk(k, dim=1).indices.sort(dim=1).values  # [B, k]
    kept = h.gather(1, index[..., None].expand(-1, -1, h.shape[-1]))
    if not explore:
        return kept
    s = scores.gather(1, index)[..., None]
    return kept * (1 + (s - s.detach()))  # exactly 1: (1 + s) - s would round


class TokenPruneViT(ViT):
    """``images [B, C, H, W] -> logits [B, num_classes]``, later blocks on kept tokens."""

    def __init__(self, cfg: TokenPruneConfig) -> None:
        super().__init__(cfg)
        self.scorer = Scorer(cfg)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        h = self.embed(images)
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i == cfg.prune_after:  # the scorer reads a detached copy (docstring)
                h = keep(h, self.scorer(h.detach()), cfg.kept_tokens, explore=self.training)
        return self.classify(h)

    def controller_sites(self) -> list[Site]:
        return [Site(name="scorer", path="scorer", family="tokenprune", layer=0,
                     axes=("example", "patch"), positions=(1,))]
