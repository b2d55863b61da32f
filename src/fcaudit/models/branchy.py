"""Branchy: a digits CNN whose examples stop computing at a block of their own (BranchyNet).

The network is CondConv's dense twin (:class:`~fcaudit.models.condconv.CNN` with
``condconv=False``: the same convolution layers ``layers.{l}`` and final classifier) with
an **exit classifier after every block**: ``heads.{l}`` is a linear classifier over the
flattened feature map after block ``l``; the last one is the twin's own ``head``.
Training is BranchyNet's weighted sum, every example running every block: the final
head's cross-entropy on the labels plus the earlier heads' cross-entropies (weight
``(l + 1) / L`` times ``exit_loss_scale``) against the final head's detached distribution
(the trainer holds the labels; an exit should give the final head's answer).

The **controller** is BranchyNet's confidence: after block ``l`` (every block but the
last) the score ``c_l`` of an example is the maximum softmax probability of head ``l``
(``layers.{l}.score``, ``[B, 1]``: one value per example, no position axis). We chose the
head's own confidence over a learned classifier because the head must run anyway, so an
exiting example has its prediction: the score costs a softmax over 10 classes. An example
that has already left keeps the score it left with (nothing is computed for it).

**Inference** (eval mode): an example whose ``c_l >= exit_threshold`` stops after block
``l`` (``layers.{l}.halt``, a module so that hooks see each block's exits ``[B, 1]``);
later blocks run on the remaining examples only (their batch shrinks, so the execution
audit's hooks count exactly them), and its logits are head ``l``'s. The exit decision
reads the site's output and nothing else, so a replay that feeds scores moves the exits.

Exit heads answer ``[B, 1, classes]``: the exit contract
(:class:`~fcaudit.core.contract.DeclaresExits`) reads predictions ``[B, T, V]`` and
decisions ``[B, T]``, and one prediction per example is its token axis of length 1.
``full_depth``: every example runs every block and every head. The dense twin is CondConv's
dense CNN of the same widths and strides: the same blocks always run to full depth.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from fcaudit.core.contract import Exit, Site
from fcaudit.core.errors import FcauditError
from fcaudit.core.exits import Confidence, ExitHead, Halt
from fcaudit.models.condconv import CNN, CNNConfig, ConvLayer


@dataclass(frozen=True)
class BranchyConfig(CNNConfig):
    # ``condconv``, ``num_kernels`` and ``routing`` are inherited and ignored: the blocks
    # are plain convolutions (the dense CNN's)
    condconv: bool = False
    exit_threshold: float = 0.9  # an example exits where its confidence reaches this
    exit_loss_scale: float = 1.0  # weight of the earlier heads' losses (BranchyNet)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.exit_threshold <= 1.0:
            raise FcauditError(f"exit_threshold={self.exit_threshold} must be in (0, 1]: the "
                               "confidence is a probability, and 1.0 must make an example exit")

    def sizes(self) -> list[int]:
        """Side of the feature map after each block (padded convolutions)."""
        out, size = [], self.image_size
        for stride in self.strides:
            size = -(-size // stride)
            out.append(size)
        return out


PRESETS: dict[str, BranchyConfig] = {"tiny": BranchyConfig()}


class BranchyCNN(nn.Module):
    """``images [B, C, H, W] -> logits [B, classes]``; each example's from its exit head."""

    def __init__(self, cfg: BranchyConfig) -> None:
        super().__init__()
        self.config = cfg
        self.full_depth = False
        self.aux_loss: torch.Tensor | float = 0.0
        ins = (cfg.channels, *cfg.widths[:-1])
        self.layers = nn.ModuleList(
            ConvLayer(c_in, c_out, s, cfg)
            for c_in, c_out, s in zip(ins, cfg.widths, cfg.strides, strict=True))
        self.heads = nn.ModuleList(ExitHead(nn.Linear(w * s * s, cfg.num_classes))
                                   for w, s in zip(cfg.widths, cfg.sizes(), strict=True))
        L = len(self.layers)
        self.scores = nn.ModuleList(Confidence() for _ in range(L - 1))
        self.halts = nn.ModuleList(Halt(cfg.exit_threshold) for _ in range(L - 1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.training or self.full_depth:
            return self._full_depth(images)
        B, L = images.shape[0], len(self.layers)
        rows = torch.arange(B, device=images.device)
        conf = images.new_zeros(B, 1)
        logits = images.new_zeros(B, self.config.num_classes)
        h = images
        for i, layer in enumerate(self.layers):
            h = layer(h)
            out = self.heads[i](h)
            if i == L - 1:
                logits[rows] = out[:, 0]
                break
            conf = self.scores[i](out[:, 0], rows, conf)
            stop = self.halts[i](conf)[rows, 0]  # the running examples that stop here
            logits[rows[stop]] = out[stop, 0]
            rows, h = rows[~stop], h[~stop]
        return logits

    def _full_depth(self, images: torch.Tensor) -> torch.Tensor:
        """Every block and every exit head on every example; in training, the earlier
        heads' losses go to ``aux_loss`` (the final head's loss is the trainer's)."""
        h, logits = images, []
        for layer, head in zip(self.layers, self.heads, strict=True):
            h = layer(h)
            logits.append(head(h)[:, 0])
        if self.training:
            self.aux_loss = self._exit_losses(logits)
        return logits[-1]

    def _exit_losses(self, logits: list[torch.Tensor]) -> torch.Tensor:
        """Heads ``0..L-2``: cross-entropy against the final head's detached distribution,
        weighted ``(l + 1) / L``. The model never sees the labels (the trainer adds this
        term to its own loss), so the earlier heads learn the final head's answer, which
        is what an exit should give (self-distillation in BranchyNet's weighted sum)."""
        L, target = len(logits), logits[-1].detach().softmax(-1)
        total = torch.zeros((), device=target.device)
        for i in range(L - 1):
            ce = -(target * logits[i].log_softmax(-1)).sum(-1).mean()
            total = total + self.config.exit_loss_scale * (i + 1) / L * ce
        return total

    def controller_sites(self) -> list[Site]:
        return [Site(name=f"layers.{i}.score", path=f"scores.{i}", family="exit", layer=i,
                     axes=("example",), positions=(), role=Exit())
                for i in range(len(self.scores))]

    def execution_blocks(self) -> list[str]:
        return [f"layers.{i}" for i in range(len(self.layers))]

    def exit_heads(self) -> list[str]:
        return [f"heads.{i}" for i in range(len(self.heads))]

    def exit_rules(self) -> list[str]:
        return [f"halts.{i}" for i in range(len(self.halts))]

    def dense_counterpart(self) -> CNN:
        """CondConv's dense CNN of the same widths and strides: every block on every example."""
        shared = {f.name: getattr(self.config, f.name) for f in dataclasses.fields(CNNConfig)}
        return CNN(CNNConfig(**{**shared, "condconv": False}))
