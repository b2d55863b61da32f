"""What kind of coefficient a site carries, judged once, from what one pass shows.

A coefficient that multiplies another branch is not always a controller's: in a gated MLP
(SwiGLU) the SiLU of ``gate_proj`` multiplies ``up_proj``, and that product *is* the MLP's
computation. Auditing it is legitimate, but what its answers mean differs: dependence on
an activation says the MLP needs its activations, not that a controller decides anything,
and no dense model without it exists to price its execution against. So every site gets
one :class:`Kind` before the work, from what is observable in one pass
(:class:`Evidence`): what the site declares (a router's adapter, a selection parameter,
an exit score), the coefficient's shape against what the module reads and the branch it
scales (:class:`~fcaudit.core.candidates.ScalingWatch`), the nonlinearity taken of it and
its value range. ``fcaudit sites`` lists candidates with it, the audit states it before
the work and keeps it in ``audit.json`` (``sites[i].kind``), the report says it beside
the answers, and the execution answer says what a dense twin would be by it.

Each kind is defined here once; its name is the value ``audit.json`` holds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from fcaudit.core.candidates import Scaling
from fcaudit.core.contract import RoutingAdapter, Site


@dataclass(frozen=True)
class Kind:
    """One kind of coefficient: its name, what it is (one line), what a dense counterpart
    would be (``twin``; None where no model without it exists, ``no_twin`` says why) and,
    where a dependence on it means something else than a controller's, what it means."""

    name: str
    meaning: str
    twin: str | None
    no_twin: str = ""
    dependence: str = ""

    def line(self) -> str:
        """The kind as one line: its name and meaning."""
        return f"{self.name}: {self.meaning}"


_GATE_TWIN = "the same model with its gates fixed open or removed"

SCALAR_GATE = Kind(
    "scalar gate", "one coefficient per token or example ([B, T, 1] or [B, T]) scaling a "
    "branch, so it can turn a whole update up, down or off", _GATE_TWIN)
FEATURE_GATE = Kind(
    "feature-wise gate", "one coefficient per feature, in [0, 1] (a sigmoid or a threshold) "
    "or from a gating branch of its own, scaling another branch feature by feature",
    _GATE_TWIN)
ACTIVATION = Kind(
    "activation", "an elementwise nonlinearity of what it reads (a gated MLP's SiLU or GELU, "
    "as in SwiGLU) multiplying the MLP's other branch: the MLP's own computation, no "
    "separate controller", None,
    no_twin="the coefficients are the MLPs' own activations, so there is no model without "
            "them to compare",
    dependence="the MLPs' own activations, not a separate controller: a dependence on them "
               "says the MLP needs its activations, not that a controller computes "
               "dynamically")
ROUTER = Kind(
    "router", "weights over experts: which experts each token runs and how much each counts",
    "none needed: the experts each token runs are counted against running every expert")
MIXING = Kind(
    "mixing weights", "a few weights per token or example over a small set of streams, "
    "sources or kernels (MUDD's dynamic dense connections, CondConv's kernels, a soft "
    "mixture), often a softmax", "a plain residual model (or one with static mixing weights, "
    "a DenseFormer)")
SELECTION = Kind(
    "selection parameter", "a selection parameter of a recurrence (an SSM's step, B and C, a "
    "decay or an input gate): what makes the recurrence depend on its input",
    "an LTI twin: the same recurrence with fixed parameters (S4D-like)")
EXIT_SCORE = Kind(
    "exit score", "a halting or confidence score that a threshold rule reads to stop a unit "
    "early", "the same model run to full depth, which the exit audit measures against")
HIDDEN = Kind(
    "hidden states", "a block's output, of the shape of the hidden states it reads and not "
    "confined to [0, 1], not a controller's coefficients: a glob that matches whole blocks (an "
    "MLP, an attention, a layer) audits their outputs; name the gate or router inside (`fcaudit "
    "sites --model SPEC --all` marks likely controllers)", None,
    no_twin="the coefficients are blocks' outputs, so there is no model without them to "
            "compare",
    dependence="blocks' outputs, not a controller's coefficients: a dependence on them says "
               "the model needs what its blocks compute")
UNCLASSIFIED = Kind(
    "unclassified", "coefficients that one pass does not show scaling a branch as a gate, "
    "mixing weights or an activation do, nor declared a router, selection parameter or exit "
    "score", "the same model without this mechanism")

KINDS: dict[str, Kind] = {k.name: k for k in (
    SCALAR_GATE, FEATURE_GATE, ACTIVATION, ROUTER, MIXING, SELECTION, EXIT_SCORE, HIDDEN,
    UNCLASSIFIED)}

_GATE_WORDS = {"sigmoid", "hardsigmoid", "threshold", "unit"}  # in [0, 1]: a gate
_MIX_WORDS = {"softmax"}  # weights that sum to one over a set
# any other nonlinearity (silu, swish, gelu, tanh, softplus, an "...Activation" class)
# is not confined to [0, 1]: an activation, the GLU family's


@dataclass(frozen=True)
class Evidence:
    """What one pass shows of a site's coefficients: their shape ``[B, ...]`` and the
    per-unit ``trailing`` axes (after the example and position axes; None where the
    positions are not known yet), the shape of what the module reads, whether every value
    is in [0, 1], and what of them scales another branch (None: nothing seen)."""

    shape: tuple[int, ...]
    trailing: tuple[int, ...] | None
    read: tuple[int, ...] | None
    unit_range: bool
    scaling: Scaling | None

    def reads_itself(self) -> bool:
        """The coefficients have exactly the shape of the hidden states the module reads
        (``[B, T, d]``, ``d`` > 1) and values outside [0, 1]: a block's output, or an
        activation of what it reads."""
        return self.shape == self.read and len(self.shape) >= 3 and self.shape[-1] > 1 \
            and not self.unit_range


def in_unit_range(coefficients: torch.Tensor) -> bool:
    """Whether every value of a (floating, non-empty) tensor lies in [0, 1]."""
    if not isinstance(coefficients, torch.Tensor) or not coefficients.is_floating_point() \
            or not coefficients.numel():
        return False
    return bool(coefficients.min() >= 0) and bool(coefficients.max() <= 1)


def read_shape(args: tuple[Any, ...], kwargs: dict[str, Any], batch: int
               ) -> tuple[int, ...] | None:
    """The shape of a module's first tensor input (positional, else keyword), when its
    first axis is the examples axis."""
    first = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
    if first is None or first.dim() == 0 or first.shape[0] != batch:
        return None
    return tuple(first.shape)


def trailing_axes(shape: Iterable[int], positions: Iterable[int] | None
                  ) -> tuple[int, ...] | None:
    """The axes of one unit's coefficients: every axis but the examples' and the
    positions' (None: positions not known)."""
    if positions is None:
        return None
    skip = {0, *positions}
    return tuple(d for i, d in enumerate(shape) if i not in skip)


def _role(scaling: Scaling | None) -> str | None:
    """What the nonlinearity that scales a branch makes of it: gate, mix or act."""
    if scaling is None:
        return None
    if scaling.word in _GATE_WORDS:
        return "gate"
    return "mix" if scaling.word in _MIX_WORDS else "act"


def declared_kind(site: Site) -> Kind | None:
    """The kind a site's declaration already says (an exit score, a selection parameter, a
    router's adapter), or None: its coefficients must be looked at."""
    if site.exit is not None:
        return EXIT_SCORE
    if site.selection is not None:
        return SELECTION
    inner = getattr(site.adapter, "inner", site.adapter)  # a LayoutAdapter's
    return ROUTER if isinstance(inner, RoutingAdapter) else None


def classify(evidence: Evidence | None, site: Site | None = None) -> Kind:
    """A coefficient's kind: what its site declares, else what one pass shows of it."""
    declared = declared_kind(site) if site is not None else None
    if declared is not None:
        return declared
    if evidence is None:
        return UNCLASSIFIED
    role, trailing = _role(evidence.scaling), evidence.trailing
    if evidence.reads_itself() and role in (None, "act"):  # no gate or mixture taken of it
        return ACTIVATION if role == "act" else HIDDEN
    if trailing is not None and all(d == 1 for d in trailing):
        return SCALAR_GATE
    if role == "act":
        return ACTIVATION
    if role == "mix":
        return MIXING
    scaling = evidence.scaling
    if scaling is not None:  # a gate multiplies the branch elementwise, all of it at once;
        whole = math.prod(scaling.operand) == math.prod(evidence.shape)  # weights over a
        return FEATURE_GATE if whole and _broadcasts(scaling.operand, scaling.branch) \
            else MIXING  # set are picked apart (a slice per expert) or contracted (einsum)
    if trailing is not None and len(trailing) >= 2:
        return MIXING  # a grid of weights (MUDD's streams x sources)
    return UNCLASSIFIED


def _broadcasts(operand: tuple[int, ...], branch: tuple[int, ...]) -> bool:
    """Whether ``operand`` multiplies ``branch`` elementwise by broadcasting (each axis,
    right-aligned, 1 or the branch's), not over an axis of its own."""
    if len(operand) > len(branch):
        return all(d == 1 for d in operand[:len(operand) - len(branch)]) and \
            _broadcasts(operand[len(operand) - len(branch):], branch)
    return all(a in (1, b) for a, b in zip(reversed(operand), reversed(branch), strict=False))


def twin_note(kinds: Iterable[Kind]) -> str:
    """What a dense counterpart would be for sites of these kinds (in order, each once),
    or why none exists."""
    distinct = list(dict.fromkeys(kinds))
    if distinct and all(k.twin is None for k in distinct):
        return "no dense counterpart exists: " + "; ".join(k.no_twin for k in distinct)
    offers = "; ".join(f"for {k.name} sites, {k.twin}" for k in distinct if k.twin)
    return f"no dense counterpart given ({offers}: pass it as --dense SPEC)" if offers else \
        "no dense counterpart given (pass one as --dense SPEC)"
