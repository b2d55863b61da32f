"""The contract between models and the audit engine.

The engine never looks inside a model. A model (or the user, through ``--sites`` and
``--blocks``) tells it:

* its controller **sites** (:class:`Site`): modules whose output carries the
  coefficients, each with a :class:`ControllerAdapter` that says how to take the
  coefficient tensor ``[batch, positions, *trailing]`` out of the module's output and
  how to rebuild that output from a (possibly intervened) coefficient tensor;
* its **blocks**: module paths whose executions are counted;
* its **dense counterpart**: the same architecture without controllers.

Models that declare these implement :class:`AuditableModel` (every method is
optional); :func:`fcaudit.core.discovery.declared_sites` (and ``_blocks``, ``_experts``) and
:func:`dense_twin` are the only places the engine asks. Models map ``input_ids [B, T]`` to logits
``[B, T, V]`` (or an object with ``.logits``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from fcaudit.core.errors import FcauditError

if TYPE_CHECKING:  # torch is imported lazily so that `fcaudit --help` stays instant
    from torch import Tensor, nn


@dataclass(frozen=True, eq=False)
class SiteCall:
    """One call of a controller module, as an adapter sees it.

    At record time ``module`` is the live controller; at replay it is the original
    controller, which the adapter may read (a routing rule's ``top_k``, a bias
    buffer) but whose learned computation it must not run.
    """

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    batch: int
    # positions on axis 1 when the engine knows them (token ids, or a [B, P, C] input to
    # the site); None for inputs that are not token sequences (images, per-example sites)
    seq_len: int | None


class ControllerAdapter(Protocol):
    """How a controller's output maps to its coefficient tensor and back.

    ``rebuild(extract(output), call)`` must reproduce ``output`` bit for bit: the
    engine checks this on every recorded call and stops, naming the site, if not.
    """

    name: str

    def extract(self, output: Any, call: SiteCall) -> Tensor:
        """The coefficient tensor ``[batch, positions, *trailing]`` inside ``output``."""
        ...

    def rebuild(self, coefficients: Tensor, call: SiteCall) -> Any:
        """The module output that ``coefficients`` stand for (the controller is not run)."""
        ...


@runtime_checkable
class RoutingAdapter(Protocol):
    """An adapter for a router: it can also say which experts a rebuilt output selects."""

    name: str

    def extract(self, output: Any, call: SiteCall) -> Tensor: ...

    def rebuild(self, coefficients: Tensor, call: SiteCall) -> Any: ...

    def selected_experts(self, output: Any, call: SiteCall) -> Tensor:
        """Expert indices ``[batch, positions, k]`` chosen by ``output`` (int64)."""
        ...


ADAPTER_API = ("give the site an adapter: Site(..., adapter=fcaudit.RouterAdapter()) for a "
               "router whose logits come from one linear projection, fcaudit.TupleAdapter("
               "index, derive) for another tuple, or your own object with "
               "extract(output, call) and rebuild(coefficients, call), declared by the model's "
               "controller_sites() or passed as sites=[Site(...)] to fcaudit.record, replay or "
               "audit; see docs/method.md, section Adapters")


def describe(value: Any) -> str:
    """A short description of a module output: type, dtype and shape, tuple elements too."""
    from torch import Tensor
    if isinstance(value, Tensor):
        return f"Tensor{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(describe(v) for v in value[:6])
        more = ", ..." if len(value) > 6 else ""
        return f"{type(value).__name__}({inner}{more})"
    return type(value).__name__


@dataclass(frozen=True)
class TensorAdapter:
    """The output is the coefficient tensor ``[B, T, *trailing]`` itself."""

    name: str = "tensor"

    def extract(self, output: Any, call: SiteCall) -> Tensor:
        from torch import Tensor
        if not isinstance(output, Tensor):
            raise FcauditError(f"output is {describe(output)}, not a tensor; {ADAPTER_API}")
        if call.seq_len is None:  # no position count to check: the examples must match
            if output.dim() < 1 or output.shape[0] != call.batch:
                raise FcauditError(f"output has shape {list(output.shape)}, expected "
                                   f"[batch={call.batch}, ...]; {ADAPTER_API}")
            return output
        if output.dim() < 2 or output.shape[0] != call.batch or output.shape[1] != call.seq_len:
            raise FcauditError(
                f"output has shape {list(output.shape)}, expected [batch={call.batch}, "
                f"positions={call.seq_len}, ...]; name per-token coefficient modules or "
                f"{ADAPTER_API}")
        return output

    def rebuild(self, coefficients: Tensor, call: SiteCall) -> Tensor:
        return coefficients


TENSOR = TensorAdapter()


@dataclass(frozen=True)
class Gate:
    """A soft gate's role: ``off`` is the coefficient value that switches it off (0 for
    ``h + g F(h)``, 1 for ``h + (1 - g) F(h)``, ``-inf`` for a pre-sigmoid logit such as
    Qwen2-MoE's shared-expert gate); ``gated`` the module whose update it scales (its FLOPs
    are what switching the gate off saves; None: the dense counterpart's blocks say)."""

    off: float = 0.0
    gated: str | None = None


@dataclass(frozen=True)
class Selection:
    """A selection parameter of a recurrence (an SSM's step, its B and C, a decay or an
    input gate): a static profile there is a time-invariant (LTI) recurrence, and reports
    say so. ``space`` names the space its values are in (e.g. ``"dt before softplus"``);
    ``parts`` names coefficients laid side by side along the last axis, each ``(name,
    width)`` in order (a Mamba-2 ``in_proj`` slice holds ``dt``, ``B`` and ``C``), so that
    the variance decomposition reports each; ``()``: one coefficient, named by its family."""

    space: str
    parts: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Exit:
    """An exit controller's role: the coefficient is a halting or confidence score ``[B,
    T]`` (or ``[B, T, 1]``) that the model's own threshold rule reads to decide where a
    token stops computing; ``go`` is a score value that makes a token continue and
    ``stop`` one that makes it stop at this site's layer. The exit conditions (fixed exit,
    oracle exit) feed these values, so the model's own rule carries the decision out: the
    engine needs to know neither the rule nor its threshold."""

    go: float = 0.0
    stop: float = 1.0


Role = Gate | Selection | Exit | None
PLAIN_GATE = Gate()  # what a site that declares no gate is switched off as: h + g F(h)


@dataclass(frozen=True)
class Site:
    """One controller inside a model.

    ``name`` is stable and shown in reports; ``path`` finds the module
    (``model.get_submodule(path)``); ``family`` groups sites of the same kind across
    layers; ``layer`` is the site's index within its family; ``adapter`` maps the
    module's output to the coefficient tensor and back (default: the output *is*
    the coefficient tensor ``[B, T, ...]``). ``axes`` names the coefficient tensor's
    leading axes in the model's words (the first is always the examples axis) and
    ``positions`` says which of them are position axes (tokens, patches, pixels), the
    axes that shuffle and per-position profiles act on: ``()`` for a per-example
    coefficient ``[B, K]`` such as CondConv's kernel mixing weights. Left at None (as
    for sites named by globs), the audit reads the layout off the first batch and
    accepts a position axis only where it is proven (see :mod:`fcaudit.core.layout`):
    ``[B, T, ...]`` on token ids; on other inputs an axis as long as the module input's
    patches or cells, else one value set per example. ``role`` is what the site is for
    beyond its coefficients: a :class:`Gate`, a :class:`Selection` or an :class:`Exit`
    (None: none of these; a router is told by its adapter).
    """

    name: str
    path: str
    family: str
    layer: int
    adapter: ControllerAdapter = field(default=TENSOR, compare=False)
    axes: tuple[str, ...] | None = field(default=None, compare=False)
    positions: tuple[int, ...] | None = field(default=None, compare=False)
    role: Role = field(default=None, compare=False)

    @property
    def gate(self) -> Gate:
        """The gate the site declares, else a plain one (off at 0, its blocks by the twin)."""
        return self.role if isinstance(self.role, Gate) else PLAIN_GATE

    @property
    def selection(self) -> Selection | None:
        return self.role if isinstance(self.role, Selection) else None

    @property
    def exit(self) -> Exit | None:
        return self.role if isinstance(self.role, Exit) else None


@dataclass(frozen=True)
class ExpertLayer:
    """One routed layer, for the execution audit of Mixture-of-Experts models.

    ``experts`` are module paths: one per expert (the tokens entering each are
    counted), or a single fused module that runs every expert (the int64
    ``[tokens, k]`` expert-index tensor among its inputs is counted instead).
    """

    name: str  # e.g. the router site's name
    experts: tuple[str, ...]
    num_experts: int
    top_k: int


@runtime_checkable
class DeclaresSites(Protocol):
    def controller_sites(self) -> list[Site]: ...


@runtime_checkable
class DeclaresBlocks(Protocol):
    def execution_blocks(self) -> list[str]: ...


@runtime_checkable
class HasDenseCounterpart(Protocol):
    def dense_counterpart(self) -> nn.Module: ...


@runtime_checkable
class DeclaresExperts(Protocol):
    def expert_layers(self) -> list[ExpertLayer]: ...


@runtime_checkable
class DeclaresExits(Protocol):
    """A model with per-layer exit heads and an exit rule (early exit, adaptive depth).

    ``exit_heads()``: module paths whose outputs are the per-layer predictions (logits
    ``[B, T, V]``), in layer order. They need not run in an ordinary pass (a token's
    prediction comes from its exit layer's head alone, which is the point), so the model
    has a ``full_depth`` attribute: while it is True, every token runs every layer and
    every head runs on every token. The oracle exit reads them there, as the full-depth
    prediction and the earliest layer that already makes it are only known from a pass
    that computes them all.

    ``exit_rules()``: module paths, one per exit site in layer order, whose outputs are the
    threshold rule's decisions ``[B, T]`` bool (True: the token stops after this layer).
    The score alone does not say where a token stopped (the rule and its threshold are the
    model's: a CALM threshold, a PonderNet cumulative halting probability), so hooks read
    the model's own exits here: its depth per token and per position, which fixed exit
    matches, and the exits a replay produces, which must be the model's own. Rule modules
    that carry one float ``threshold`` attribute (all the same) get the exit frontier's
    threshold sweep: the audit moves it for a few passes and puts it back.
    """

    full_depth: bool

    def exit_heads(self) -> list[str]: ...

    def exit_rules(self) -> list[str]: ...


class AuditableModel(DeclaresSites, DeclaresBlocks, HasDenseCounterpart, DeclaresExperts,
                     Protocol):
    """A model that declares everything the audit needs (each part is optional)."""


EXECUTION_MODE = "execution_mode"


def execution_mode(model: Any) -> str | None:
    """The compute mode a model says it runs: its optional ``execution_mode`` attribute
    (a string, e.g. ``"recurrent scan"``, or ``"fft convolution"`` for an LTI twin), which
    the execution audit reports beside its timing, as a time-invariant twin may be timed
    in a faster mode than its selective model can use. None when it declares none."""
    mode = getattr(model, EXECUTION_MODE, None)
    if mode is None:
        return None
    if not isinstance(mode, str) or not mode.strip():
        from fcaudit.core.errors import ModelError
        raise ModelError(f"{type(model).__name__}.{EXECUTION_MODE} is {mode!r}: make it a "
                         "string naming the compute mode the forward pass runs (e.g. "
                         "\"recurrent scan\"), or remove it")
    return mode.strip()


def dense_twin(model: nn.Module, seed: int) -> nn.Module | None:
    """The model's dense counterpart with fresh seeded weights (its dtype and device),
    or None for a model that knows none."""
    if not isinstance(model, HasDenseCounterpart):
        return None
    import torch
    torch.manual_seed(seed)
    twin = model.dense_counterpart()
    param = next(model.parameters(), None)
    if param is not None:
        from fcaudit.core.nll import device_of  # not param.device: meta when offloaded
        twin = twin.to(dtype=param.dtype, device=device_of(model))
    return twin.eval()
