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
optional); :func:`declared_sites`, :func:`declared_blocks` and :func:`dense_twin` are
the only places the engine asks. Models map ``input_ids [B, T]`` to logits
``[B, T, V]`` (or an object with ``.logits``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

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
    seq_len: int


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


def _default_adapter() -> ControllerAdapter:
    from fcaudit.core.adapters import TENSOR
    return TENSOR


@dataclass(frozen=True)
class Site:
    """One controller inside a model.

    ``name`` is stable and shown in reports; ``path`` finds the module
    (``model.get_submodule(path)``); ``family`` groups sites of the same kind across
    layers; ``layer`` is the site's index within its family; ``adapter`` maps the
    module's output to the coefficient tensor and back (default: the output *is*
    the coefficient tensor ``[B, T, ...]``).
    """

    name: str
    path: str
    family: str
    layer: int
    adapter: ControllerAdapter = field(default_factory=_default_adapter, compare=False)


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


class AuditableModel(DeclaresSites, DeclaresBlocks, HasDenseCounterpart, DeclaresExperts,
                     Protocol):
    """A model that declares everything the audit needs (each part is optional)."""


def _discovered(model: nn.Module, what: str) -> list[Any] | None:
    """For a model that declares nothing: what fcaudit's structural rules find (the routers
    and experts of Mixture-of-Experts blocks, the layer stack of a transformers model)."""
    from fcaudit.io import hf
    found = getattr(hf, f"discover_{what}")(model)
    return list(found) if found else None


def declared_sites(model: nn.Module) -> list[Site] | None:
    """The model's own site declaration, else the routers fcaudit finds, else None."""
    if isinstance(model, DeclaresSites):
        return list(model.controller_sites())
    return _discovered(model, "sites")


def declared_blocks(model: nn.Module) -> list[str] | None:
    """The model's own execution blocks, else those fcaudit finds, else None."""
    if isinstance(model, DeclaresBlocks):
        return list(model.execution_blocks())
    return _discovered(model, "blocks")


def declared_experts(model: nn.Module) -> list[ExpertLayer] | None:
    """The model's routed layers, else those fcaudit finds, else None (no experts)."""
    if isinstance(model, DeclaresExperts):
        return list(model.expert_layers())
    return _discovered(model, "experts")


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
        twin = twin.to(dtype=param.dtype, device=param.device)
    return twin.eval()
