"""CondConv: a small CNN whose convolutions mix K kernels per example, and its dense twin.

Layer ``l`` (``layers.{l}``) holds ``num_kernels`` kernels ``W_1..W_K`` (and biases)
of one ``3x3`` convolution. Its router ``layers.{l}.router`` pools the layer's input
over space and maps it to ``K`` mixing weights, ``r = sigmoid(A . mean_hw(x) + a)``
(CondConv; ``routing="softmax"`` gives dynamic convolution's weights summing to 1):
``[B, K]``, one vector per example, the controller site (family ``condconv``, axes
example x kernel, no position axis). The layer then convolves example ``b`` with the
one mixed kernel ``sum_k r[b, k] W_k`` (and mixed bias), all examples at once as a
grouped convolution (groups = batch). Execution is therefore dense: every example
runs one full convolution per layer whatever the weights are, plus the small cost
of mixing the kernels, and the audit should say so.

Layout: one convolution and ReLU per entry of ``widths`` (its output channels), with
the matching entry of ``strides``; then a linear classifier over the flattened last
feature map (a tiny network needs to know where its strokes are; global pooling lost
that). The dense twin (:class:`CNN`, ``condconv=False``) is the same network
with one plain kernel per layer and no routers: the active parameters of CondConv
(one mixed kernel per layer) without its controllers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fcaudit.core.contract import Site
from fcaudit.core.errors import FcauditError, check_sizes


@dataclass(frozen=True)
class CNNConfig:
    image_size: int = 8
    channels: int = 1
    num_classes: int = 10
    widths: tuple[int, ...] = (16, 32, 32)
    strides: tuple[int, ...] = (1, 2, 1)
    kernel_size: int = 3
    condconv: bool = True  # CondConv (True) or its dense twin (False)
    num_kernels: int = 4
    routing: str = "sigmoid"  # "sigmoid" (CondConv) or "softmax" (dynamic convolution)

    def __post_init__(self) -> None:
        for name in ("widths", "strides"):  # JSON gives lists back
            object.__setattr__(self, name, tuple(getattr(self, name)))
        check_sizes(self, ("image_size", "channels", "num_classes", "kernel_size", "num_kernels"))
        for value in (*self.widths, *self.strides):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise FcauditError(f"widths={list(self.widths)} and strides="
                                   f"{list(self.strides)} must hold positive integers")
        if not self.widths or len(self.widths) != len(self.strides):
            raise FcauditError(f"widths={list(self.widths)} and strides={list(self.strides)} "
                               "must be non-empty and of the same length")
        if self.routing not in ("sigmoid", "softmax"):
            raise FcauditError(f"routing={self.routing!r} must be 'sigmoid' or 'softmax'")

    @property
    def n_layer(self) -> int:
        return len(self.widths)

    @property
    def final_size(self) -> int:
        """Side of the last feature map (each padded convolution: ``ceil(size / stride)``)."""
        size = self.image_size
        for stride in self.strides:
            size = -(-size // stride)
        return size


PRESETS: dict[str, CNNConfig] = {"tiny": CNNConfig()}


class Router(nn.Module):
    """The controller: ``x [B, C, H, W] -> mixing weights [B, K]`` from pooled features."""

    def __init__(self, c_in: int, cfg: CNNConfig) -> None:
        super().__init__()
        self.routing = cfg.routing
        self.proj = nn.Linear(c_in, cfg.num_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.proj(x.mean(dim=(2, 3)))
        return logits.sigmoid() if self.routing == "sigmoid" else logits.softmax(dim=-1)


class CondConv2d(nn.Module):
    """``K`` kernels mixed per example by the router, run as one grouped convolution."""

    def __init__(self, c_in: int, c_out: int, stride: int, cfg: CNNConfig) -> None:
        super().__init__()
        k = cfg.kernel_size
        self.stride, self.padding = stride, k // 2
        self.router = Router(c_in, cfg)
        self.weight = nn.Parameter(torch.empty(cfg.num_kernels, c_out, c_in, k, k))
        self.bias = nn.Parameter(torch.zeros(cfg.num_kernels, c_out))
        for w in self.weight:
            nn.init.kaiming_uniform_(w, a=5 ** 0.5)  # nn.Conv2d's own initialisation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        r = self.router(x)  # [B, K]; a replay stub may stand in for the router
        weight = torch.einsum("bk,koihw->boihw", r, self.weight)  # one kernel per example
        bias = r @ self.bias  # [B, c_out]
        out = F.conv2d(x.reshape(1, B * C, H, W), weight.reshape(-1, *weight.shape[2:]),
                       bias.reshape(-1), stride=self.stride, padding=self.padding, groups=B)
        return out.view(B, -1, *out.shape[2:])


class ConvLayer(nn.Module):
    """One convolution (CondConv or plain) and a ReLU; its module path is a block."""

    def __init__(self, c_in: int, c_out: int, stride: int, cfg: CNNConfig) -> None:
        super().__init__()
        k = cfg.kernel_size
        self.conv = CondConv2d(c_in, c_out, stride, cfg) if cfg.condconv else \
            nn.Conv2d(c_in, c_out, k, stride=stride, padding=k // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class CNN(nn.Module):
    """CondConv (``cfg.condconv``) or its dense twin; ``images [B, C, H, W] -> [B, classes]``."""

    def __init__(self, cfg: CNNConfig) -> None:
        super().__init__()
        self.config = cfg
        ins = (cfg.channels, *cfg.widths[:-1])
        self.layers = nn.ModuleList(
            ConvLayer(c_in, c_out, s, cfg)
            for c_in, c_out, s in zip(ins, cfg.widths, cfg.strides, strict=True))
        self.head = nn.Linear(cfg.widths[-1] * cfg.final_size ** 2, cfg.num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = images
        for layer in self.layers:
            h = layer(h)
        return self.head(h.flatten(1))

    def controller_sites(self) -> list[Site]:
        if not self.config.condconv:
            return []
        return [Site(name=f"layers.{i}.router", path=f"layers.{i}.conv.router",
                     family="condconv", layer=i, axes=("example", "kernel"), positions=())
                for i in range(len(self.layers))]

    def execution_blocks(self) -> list[str]:
        return [f"layers.{i}" for i in range(len(self.layers))]

    def dense_counterpart(self) -> CNN:
        return CNN(dataclasses.replace(self.config, condconv=False))
