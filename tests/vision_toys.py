"""Hand-made models for inputs that are not token ids, with known audit answers
(importable as ``vision_toys:FACTORY``).

* ``class_mixer``: a CondConv-like per-example mixing vector ``[B, K]`` that is the
  one-hot class of the example (read off the input), and logits ``4 * weights``: the
  prediction lives in the coefficients alone -> reassign hurts whenever the donor's class
  differs; on a class-balanced calibration set the static-layer vector is uniform, exactly
  the global mean, so static-layer keeps 0% of the gap.
* ``constant_mixer``: the mixing vector is a per-layer constant ``[0.9, 0.1]`` and the
  logits ``4 * (w0 - w1) * one_hot(class)``: reassign feeds the same bits (penalty exactly
  0) and static-layer is that constant (retention exactly 100%); global-mean (0.5 each)
  erases the prediction, so the gap is clear.
* ``patch_gate``: an image ``[B, 1, 8, 8]`` cut into 16 patches of 2x2; a gate per patch
  ``[B, P]`` that is 1 on patch 0 alone (position only) selects the patch the class is
  read from -> shuffle hurts, reassign is exactly 0, static-layer-position keeps 100%.
* ``spatial_mask``: the same idea on a spatial map ``[B, C=2, H=4, W=4]`` (positions:
  rows and columns), channel 0 the mask, channel 1 its complement.

Every model classifies two classes (``spatial_mask``, ``patch_gate``) or ``C`` classes
(the mixers) and declares its sites with their axes.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fcaudit.core.contract import Site

C = 4  # classes of the mixers


class ClassWeights(nn.Module):
    """The mixing vector of one example: its one-hot class (first ``C`` features)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.one_hot(x[:, :C].argmax(-1), C).float()  # [B, K=C]


class ConstantWeights(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tensor([0.9, 0.1]).expand(x.shape[0], 2).clone()  # [B, K=2]


class Mixer(nn.Module):
    def __init__(self, constant: bool) -> None:
        super().__init__()
        self.constant = constant
        self.mix = ConstantWeights() if constant else ClassWeights()
        self.scale = nn.Parameter(torch.tensor(4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.mix(x)
        if not self.constant:
            return self.scale * w
        onehot = F.one_hot(x[:, :C].argmax(-1), C).float()
        return self.scale * (w[:, :1] - w[:, 1:]) * onehot

    def controller_sites(self) -> list[Site]:
        return [Site("mix", "mix", "mixing", 0, axes=("example", "kernel"), positions=())]


def class_mixer() -> Mixer:
    return Mixer(constant=False).eval()


def constant_mixer() -> Mixer:
    return Mixer(constant=True).eval()


def mixer_data(n: int, seed: int, balanced: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Inputs ``[n, C + 1]`` (a one-hot class signal plus a distinct noise feature, so no
    two examples are equal) and their classes (``balanced``: each class ``n / C`` times)."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % C if balanced else rng.integers(0, C, n)
    x = np.concatenate([np.eye(C)[y] * 2.0, rng.normal(size=(n, 1))], axis=1)
    return x.astype(np.float32), y.astype(np.int64)


class PatchGate(nn.Module):
    """1 on patch 0, 0 elsewhere: ``[B, P]`` from patches ``[B, P, D]``."""

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        gate = torch.zeros(patches.shape[:2])
        gate[:, 0] = 1.0
        return gate


class PatchModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = PatchGate()
        self.scale = nn.Parameter(torch.tensor(6.0))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        patches = F.unfold(images, 2, stride=2).transpose(1, 2)  # [B, 16, 4]
        g = self.gate(patches)
        read = (g.unsqueeze(-1) * patches).sum(1).mean(-1)  # the gated patches' mean
        return torch.stack([-self.scale * read, self.scale * read], dim=1)

    def controller_sites(self) -> list[Site]:
        return [Site("gate", "gate", "patch-gate", 0, axes=("example", "patch"))]


class SpatialMask(nn.Module):
    """Channel 0: 1 on the top-left cell of a 4x4 grid; channel 1: its complement."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(images.shape[0], 2, 4, 4)
        mask[:, 0, 0, 0] = 1.0
        mask[:, 1] = 1.0 - mask[:, 0]
        return mask


class SpatialModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mask = SpatialMask()
        self.scale = nn.Parameter(torch.tensor(6.0))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        cells = F.avg_pool2d(images, 2)[:, 0]  # [B, 4, 4]
        m = self.mask(images)
        read = (m[:, 0] * cells).sum((1, 2)) - 0.01 * (m[:, 1] * cells).sum((1, 2))
        return torch.stack([-self.scale * read, self.scale * read], dim=1)

    def controller_sites(self) -> list[Site]:
        return [Site("mask", "mask", "spatial", 0, axes=("example", "channel", "row", "column"),
                     positions=(2, 3))]


def patch_model() -> PatchModel:
    return PatchModel().eval()


def spatial_model() -> SpatialModel:
    return SpatialModel().eval()


def image_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Images ``[n, 1, 8, 8]`` of noise whose top-left 2x2 patch holds the class sign:
    class 1 when positive, class 0 when negative (balanced)."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 2
    x = rng.normal(scale=0.5, size=(n, 1, 8, 8))
    x[:, 0, :2, :2] = (2 * y - 1)[:, None, None] * (1.0 + rng.random((n, 1, 1)))
    return x.astype(np.float32), y.astype(np.int64)


K, D, CLASSES = 3, 64, 10  # kernels, pixels of an 8x8 image, classes of tiny_condconv


class Route(nn.Module):
    """Per-example kernel mixing weights ``[B, K]`` (CondConv's routing function)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.proj(x), dim=-1)


class MixedLinear(nn.Module):
    """One mixed kernel per example: ``W_b = sum_k w_bk W_k``, then ``x_b W_b``."""

    def __init__(self, kernels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(kernels, D, CLASSES) / 8)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        mixed = torch.einsum("bk,kdc->bdc", w, self.weight)
        return torch.einsum("bd,bdc->bc", x, mixed)


class TinyCondConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.route = Route()
        self.body = MixedLinear(K)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.flatten(1)
        return self.body(x, self.route(x))

    def controller_sites(self) -> list[Site]:
        return [Site("route", "route", "mixing", 0, axes=("example", "kernel"), positions=())]

    def execution_blocks(self) -> list[str]:
        return ["body"]

    def dense_counterpart(self) -> nn.Module:
        return TinyDense()


class TinyDense(nn.Module):
    """The dense twin: one fixed kernel ``[D, CLASSES]``, no routing."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(D, CLASSES, bias=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.body(images.flatten(1))

    def execution_blocks(self) -> list[str]:
        return ["body"]


def tiny_condconv() -> TinyCondConv:
    torch.manual_seed(0)
    return TinyCondConv().eval()


def tiny_dense() -> TinyDense:
    """TinyCondConv's dense twin as a factory (``--dense vision_toys:tiny_dense``)."""
    torch.manual_seed(1)
    return TinyDense().eval()


class DictMixer(nn.Module):
    """``class_mixer`` fed a dict: ``model(features=..., offset=...)``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Mixer(constant=False)

    def forward(self, features: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        return self.inner(features + 0 * offset)

    def controller_sites(self) -> list[Site]:
        return [Site("mix", "inner.mix", "mixing", 0, axes=("example", "kernel"),
                     positions=())]


class NoisyMixer(Mixer):
    """``class_mixer`` with noise in its forward pass: no replay can be exact."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 1e-3 * torch.rand(x.shape[0], C)


class SEGate(nn.Module):
    """Squeeze-and-excitation without the squeeze's learning: one weight per channel of a
    map ``[B, C, H, W]`` -> ``[B, C]``, ``sigmoid(8)`` ~ 1 on channel 0 and ``sigmoid(-8)``
    ~ 0 elsewhere, whatever the input (the channel mean enters at weight 0, so the gate is
    computed from the map as a real one is)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        bias = torch.full((channels,), -8.0)
        bias[0] = 8.0
        self.fc = nn.Linear(channels, channels)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.bias.copy_(bias)

    def forward(self, fmap: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.fc(fmap.mean((2, 3))))


class SEBlock(nn.Module):
    """Map ``[B, C_in, 8, 8]`` -> ``[B, C, 8, 8]``: channel 0 copies the input's channel 0,
    every other channel its negative; then each channel scaled by its gate."""

    def __init__(self, c_in: int, channels: int) -> None:
        super().__init__()
        self.gate = SEGate(channels)
        sign = -torch.ones(channels, 1)
        sign[0] = 1.0
        self.register_buffer("mix", sign * F.one_hot(torch.tensor(0), c_in).float())

    def forward(self, fmap: torch.Tensor) -> torch.Tensor:
        mapped = torch.einsum("oc,bchw->bohw", self.mix, fmap)
        return mapped * self.gate(mapped)[:, :, None, None]


class SEModel(nn.Module):
    """Blocks of per-example channel gates ``[B, C]`` (no position axis) on 8x8 maps; the
    class is the sign of the top-left 2x2 of the last map, summed over channels: with the
    gate open on channel 0 alone it is the image's sign, a gate moved to another channel
    reads its negative."""

    def __init__(self, widths: tuple[int, ...]) -> None:
        super().__init__()
        ins = (1, *widths[:-1])
        self.blocks = nn.ModuleList(SEBlock(i, w) for i, w in zip(ins, widths, strict=True))
        self.scale = nn.Parameter(torch.tensor(6.0))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        fmap = images
        for block in self.blocks:
            fmap = block(fmap)
        read = fmap[:, :, :2, :2].mean((2, 3)).sum(1)
        return torch.stack([-self.scale * read, self.scale * read], dim=1)


def se_equal() -> SEModel:
    return SEModel((4, 4)).eval()


def se_unequal() -> SEModel:
    return SEModel((4, 6)).eval()
