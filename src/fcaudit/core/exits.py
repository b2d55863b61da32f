"""Exit controllers (docs/method.md, Early exit): where a token stops, read and fed.

An exit site (``Site.role = Exit(go, stop)``) carries a halting or confidence score that
the model's own threshold rule reads. A token's **exit layer** ``k`` is the index of the
exit site after which it stops (sites in layer order); ``k = n`` (the number of exit
sites) means it ran to full depth. Its executed depth is ``k + 1`` layers.

* :func:`own_exits`: the model's exits, read by hooks on its rule modules
  (:class:`~fcaudit.core.contract.DeclaresExits` ``exit_rules()``);
* :func:`oracle_layers`: per token, the earliest layer whose exit head predicts what the
  last head predicts (from a ``full_depth`` pass, :func:`head_predictions`);
* :func:`fixed_layer`: the layer whose depth is closest to a mean executed depth;
* :func:`exit_scores`: the scores that make every token exit at given layers, built from
  the sites' ``(continue, exit)`` values, so the model's own rule carries the exits out;
* :class:`ExitHead`, :class:`Confidence` and :class:`Halt`: the exit modules fcaudit's own
  exit families and the LayerSkip-style wrapper of a Hugging Face model share.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fcaudit.core.conditions import FIXED_EXIT, FIXED_EXIT_POSITION, ORACLE_EXIT
from fcaudit.core.contract import DeclaresExits, Site
from fcaudit.core.errors import ModelError, UsageError
from fcaudit.core.hooks import hooks
from fcaudit.core.registry import refusal


def exit_sites(sites: Sequence[Site]) -> list[Site]:
    """The exit sites among ``sites``, in layer order."""
    return sorted((s for s in sites if s.exit is not None), key=lambda s: s.layer)


EXAMPLE = "example"  # what exits where the exit sites have no position axis
# the compute mode (a model's ``execution_mode``) of exits that are counted, not realised:
# the execution answer then reads the depths as what a deployment would run, not as FLOPs
MASKED = ("masked early exit: every layer runs on every token and an exited token's update "
          "is discarded, so the FLOPs its exits save are counted, not realised")


class ExitHead(nn.Module):
    """Layer ``l``'s prediction, a module so that hooks read each layer's logits: through
    the shared head passed in (its weights stored once) or, given ``proj``, through a
    classifier of its own over the flattened features, as ``[B, 1, classes]``."""

    def __init__(self, proj: nn.Module | None = None) -> None:
        super().__init__()
        self.proj = proj

    def forward(self, h: Tensor, head: Any = None) -> Tensor:
        return head(h) if self.proj is None else self.proj(h.flatten(1)).unsqueeze(1)


class Confidence(nn.Module):
    """A controller site: the maximum softmax probability of an exit head's logits,
    ``[..., V] -> [..., 1]``; given ``rows`` and ``last``, of those rows of the batch only,
    the others keeping ``last`` (an example that has left keeps the score it left with)."""

    def forward(self, logits: Tensor, rows: Tensor | None = None,
                last: Tensor | None = None) -> Tensor:
        conf = logits.float().softmax(-1).amax(-1, keepdim=True)
        return conf if last is None else last.index_put((rows,), conf.to(last.dtype))


class Halt(nn.Module):
    """The exit rule, a module so that hooks see each layer's exits: True where the score
    reaches the threshold."""

    def __init__(self, threshold: float) -> None:
        super().__init__()
        self.threshold = threshold

    def forward(self, score: Tensor) -> Tensor:
        return score >= self.threshold


def exit_unit(sites: Sequence[Site]) -> str:
    """What one exit decision stops, in the sites' own words: their position axis's name (a
    token, a patch; "position" where no axis is named), or an example where the exit sites
    have no position axis (Branchy's per-image scores)."""
    found = exit_sites(sites)
    site = next((s for s in found if s.positions), None)
    if site is None:
        return EXAMPLE
    assert site.positions is not None
    return site.axes[site.positions[0]] if site.axes else "position"


def plural(unit: str) -> str:
    """``unit`` in the plural, as English spells it (tokens, patches, examples, entries):
    an exit unit is any name a model gives its position axis."""
    if unit.endswith(("s", "x", "z", "ch", "sh")):
        return unit + "es"
    if unit.endswith("y") and unit[-2:-1] not in ("a", "e", "i", "o", "u"):
        return unit[:-1] + "ies"
    return unit + "s"


def exit_model(model: Any, sites: Sequence[Site]) -> DeclaresExits:
    """The model as an exit model, or a one-line refusal naming what it lacks: exit sites
    and ``exit_heads()`` / ``exit_rules()`` / ``full_depth`` agreeing with them."""
    found = exit_sites(sites)
    if not found:
        raise ModelError("the model has no exit sites (Site(..., role=Exit(go, stop))): "
                         "the exit conditions apply only to early-exit models")
    same = [s for s in found if s.exit is not None and s.exit.go == s.exit.stop]
    if same:
        raise ModelError(f"exit site {same[0].name}: {same[0].exit!r} gives one value "
                         "for continue and exit; give Exit(go=a score that makes a token go "
                         "on, stop=one that makes it stop at this layer)", site=same[0].name)
    if not isinstance(model, DeclaresExits):
        raise ModelError(f"exit site {found[0].name}: the model declares no exit_heads(), "
                         "exit_rules() and full_depth (fcaudit.core.contract.DeclaresExits), "
                         "which the exit conditions read", site=found[0].name)
    rules, heads = model.exit_rules(), model.exit_heads()
    if len(rules) != len(found) or len(heads) != len(found) + 1:
        raise ModelError(f"exit site {found[0].name}: the model has {len(found)} exit sites, "
                         f"{len(rules)} exit_rules() and {len(heads)} exit_heads(); give one "
                         "rule per exit site and one head per layer (sites + 1)",
                         site=found[0].name)
    return model


@contextlib.contextmanager
def full_depth(model: Any) -> Iterator[None]:
    """The model runs every layer and every exit head on every token, meanwhile."""
    before = model.full_depth
    model.full_depth = True
    try:
        yield
    finally:
        model.full_depth = before


@torch.no_grad()
def head_predictions(model: Any, run: Any) -> Tensor:
    """``[L, B, T]`` argmax of every exit head in a full-depth pass; ``run()`` calls the
    model on one batch."""
    heads: list[Tensor] = []

    def keep(module: nn.Module, args: Any, out: Tensor) -> None:
        heads.append(out.argmax(-1))

    paths = model.exit_heads()
    with full_depth(model), hooks(model, {p: keep for p in paths}):
        run()
    if len(heads) != len(paths):
        raise ModelError(f"exit heads: {len(heads)} of the {len(paths)} declared heads ran in "
                         "a full_depth pass; every head must run on every token there")
    return torch.stack(heads)


def oracle_layers(predictions: Tensor) -> Tensor:
    """``[B, T]``: per token, the earliest layer whose prediction equals the last layer's
    (``predictions [L, B, T]``); ``L - 1`` where only the last one makes it."""
    agree = predictions == predictions[-1]
    return agree.int().argmax(0)  # the first True; the last layer always agrees


@torch.no_grad()
def own_exits(model: Any, run: Any) -> Tensor:
    """``[B, T]``: the exit layer the model's own rule gives each token in an ordinary
    pass (``run()`` calls the model on one batch); ``n`` (the rules' count) for none."""
    stops: list[Tensor] = []

    def keep(module: nn.Module, args: Any, out: Tensor) -> None:
        stops.append(out.bool())

    paths = model.exit_rules()
    with hooks(model, {p: keep for p in paths}):
        run()
    if len(stops) != len(paths):
        raise ModelError(f"exit rules: {len(stops)} of the {len(paths)} declared rules ran; "
                         "each must run once per forward pass")
    return exit_layers(torch.stack(stops))


def exit_layers(stops: Tensor) -> Tensor:
    """``[B, T]`` exit layer from per-layer stop decisions ``[n, B, T]`` (the first True; a
    token that never stops gets ``n``)."""
    never = torch.ones_like(stops[:1])
    return torch.cat([stops, never]).int().argmax(0)


def fixed_layer(mean_depth: float, layers: int) -> int:
    """The exit layer ``k`` (depth ``k + 1``, of ``layers``) closest to ``mean_depth``; a tie
    goes to the deeper one, so fixed exit is never given less compute than matched."""
    return min(range(layers), key=lambda k: (abs(k + 1 - mean_depth), -k))


@dataclass(frozen=True)
class ExitDepth:
    """Calibration depth of the model's own exits: sums over tokens, by position."""

    depth_sum: Tensor  # [T] float64: sum of executed depths at each position
    count: int  # sequences
    layers: int  # exit sites + 1

    @property
    def mean(self) -> float:
        return float(self.depth_sum.sum()) / (self.count * self.depth_sum.numel())

    def fixed(self) -> int:
        """Fixed exit's layer: the one whose depth is closest to the mean executed depth."""
        return fixed_layer(self.mean, self.layers)

    def fixed_per_position(self) -> Tensor:
        """``[T]``: per position, the layer closest to that position's mean depth."""
        means = (self.depth_sum / self.count).tolist()
        return torch.tensor([fixed_layer(m, self.layers) for m in means])


def exit_depth(exits: Sequence[Tensor], layers: int) -> ExitDepth:
    """:class:`ExitDepth` of exit layers ``[B, T]`` of several batches."""
    total = sum(((e + 1).to(torch.float64).sum(0) for e in exits), torch.zeros(()))
    return ExitDepth(total, sum(len(e) for e in exits), layers)


def exit_scores(sites: Sequence[Site], layers: Tensor,
                like: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The scores that stop every token after exit site ``layers[b, t]`` (``n``: none): the
    ``continue`` value before that site, the ``exit`` value from it on; each shaped and
    typed like ``like[name]`` (``[B, T]`` or ``[B, T, 1]``)."""
    out = {}
    for k, site in enumerate(exit_sites(sites)):
        assert site.exit is not None
        ref = like[site.name]
        go, stop = site.exit.go, site.exit.stop
        stopped = (layers.to(ref.device) <= k).view(*layers.shape, *[1] * (ref.dim() - 2))
        out[site.name] = torch.where(stopped, torch.tensor(stop, dtype=ref.dtype),
                                     torch.tensor(go, dtype=ref.dtype)).expand_as(ref).clone()
    return out


@dataclass(frozen=True)
class ExitPlan:
    """The exit references' layers: fixed exit's from the model's own depth on calibration
    (overall and per position), the oracle's per evaluation token; and the model's own
    exits on evaluation, for its reported depth."""

    calibration: ExitDepth
    oracle: Tensor  # [N, T] the oracle exit layer of every evaluation token
    own: Tensor  # [N, T] the model's own exit layer of every evaluation token
    unit: str = "token"  # what exits (exit_unit): a token, a patch, or an example
    threshold: float | None = None  # the rules' own threshold (None: not one number)
    # the threshold sweep: the model's own rule at other thresholds, (threshold, [N, T]
    # exit layers of every evaluation token), measured by real passes
    sweep: tuple[tuple[float, Tensor], ...] = ()

    @property
    def positions(self) -> bool:
        """Whether the exit sites have a position axis (Branchy's have none)."""
        return self.unit != EXAMPLE

    def swept(self, threshold: float | None, depth: int | None, rows: range,
              shape: tuple[int, int]) -> Tensor:
        """``[B, T]``: the exit layers of the threshold sweep's point at ``threshold``, or
        of fixed exit at ``depth`` layers (the savings frontier's exit rules)."""
        if depth is not None:
            return torch.full(shape, depth - 1)
        layers = dict(self.sweep)[threshold]
        return layers[rows.start:rows.stop]

    def layers(self, condition: str, rows: range, shape: tuple[int, int]) -> Tensor:
        """``[B, T]``: the exit layer ``condition`` gives the evaluation rows ``rows``."""
        if condition == FIXED_EXIT:
            return torch.full(shape, self.calibration.fixed())
        if condition == FIXED_EXIT_POSITION:
            per = self.calibration.fixed_per_position()
            if len(per) != shape[1]:
                raise UsageError(f"{condition}: calibration has {len(per)} positions, the "
                                 f"evaluation batch {shape[1]}; use windows of one length")
            return per.unsqueeze(0).expand(shape)
        if condition == ORACLE_EXIT:
            return self.oracle[rows.start:rows.stop]
        raise refusal(f"{condition!r} is no exit condition", condition,
                      [FIXED_EXIT, FIXED_EXIT_POSITION, ORACLE_EXIT])
