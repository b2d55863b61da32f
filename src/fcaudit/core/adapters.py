"""Built-in controller adapters (see :class:`fcaudit.core.contract.ControllerAdapter`).

* :data:`TENSOR`: the output is the coefficient tensor ``[B, T, ...]``.
* :data:`FLAT`: the output is a flattened ``[B*T, ...]`` tensor (e.g. a router or a
  gate that runs on ``hidden.view(-1, C)``).
* :class:`SliceAdapter`: the coefficients are channel slices of a tensor output; the
  other channels stay live.
* :class:`TupleAdapter`: the output is a tuple; one element is the coefficient
  tensor (plain or flattened) and ``derive`` recomputes the whole tuple from it.

:data:`AUTO` (the adapter of sites named by ``--sites`` globs) picks :data:`TENSOR` or
:data:`FLAT` from the module's output when it is first recorded, and explains what to
do when neither fits.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fcaudit.core.contract import (
    ADAPTER_API,
    TENSOR,
    ControllerAdapter,
    SiteCall,
    describe,
)
from fcaudit.core.errors import FcauditError, UsageError


@dataclass(frozen=True)
class FlatAdapter:
    """The output is ``[B*T, *trailing]``: tokens flattened batch-major."""

    name: str = "flat"

    def extract(self, output: Any, call: SiteCall) -> Tensor:
        if call.seq_len is None:
            raise FcauditError(f"a flattened output {describe(output)} needs the number of "
                               "positions per example, which these inputs do not give: "
                               f"{ADAPTER_API}")
        n = call.batch * call.seq_len
        if not isinstance(output, Tensor) or output.dim() < 1 or output.shape[0] != n:
            raise FcauditError(f"output is {describe(output)}, expected a flattened tensor "
                               f"[batch*positions={n}, ...]; {ADAPTER_API}")
        return output.view(call.batch, call.seq_len, *output.shape[1:])

    def rebuild(self, coefficients: Tensor, call: SiteCall) -> Tensor:
        return coefficients.reshape(-1, *coefficients.shape[2:])


FLAT = FlatAdapter()

Derive = Callable[[Tensor, SiteCall], tuple[Any, ...]]


@dataclass(frozen=True)
class TupleAdapter:
    """A tuple output whose element ``index`` is the coefficient tensor, ``[B, T, ...]``
    or, with ``flat``, ``[B*T, ...]``. ``derive(element, call)`` returns the whole tuple
    as the module would have, from that element alone (e.g. a router's top-k weights
    and indices from its logits); it gets the element in its own layout."""

    index: int
    derive: Derive
    flat: bool = False
    name: str = "tuple"

    def extract(self, output: Any, call: SiteCall) -> Tensor:
        if not isinstance(output, tuple) or not -len(output) <= self.index < len(output):
            raise FcauditError(f"output is {describe(output)}, expected a tuple with element "
                               f"{self.index}; {ADAPTER_API}")
        return (FLAT if self.flat else TENSOR).extract(output[self.index], call)

    def rebuild(self, coefficients: Tensor, call: SiteCall) -> tuple[Any, ...]:
        element = (FLAT if self.flat else TENSOR).rebuild(coefficients, call)
        return tuple(self.derive(element, call))


@dataclass(frozen=True)
class SliceAdapter:
    """The coefficients are channels of a tensor output ``[B, T, ..., K]``: the slices
    ``spans`` (``(start, stop)`` pairs on the last axis, in order) laid side by side. The
    other channels are not coefficients and stay live: ``rebuild`` runs the module's own
    forward and writes the supplied channels over its slices (Mamba-2's ``in_proj`` holds
    the selection parameters dt, B, C beside the input path and the output gate)."""

    spans: tuple[tuple[int, int], ...]
    name: str = "slice"

    def __post_init__(self) -> None:
        """Refuse spans that are empty, reversed or overlapping: the round trip would still
        be exact (rebuild writes back what extract read), but an overlapped channel would
        take whichever intervened value is written last."""
        spans = sorted(tuple(s) for s in self.spans)
        if not spans or any(len(s) != 2 or not 0 <= s[0] < s[1] for s in spans) or any(
                prev[1] > nxt[0] for prev, nxt in itertools.pairwise(spans)):
            raise UsageError(f"SliceAdapter spans must be (start, stop) channel pairs with "
                             f"0 <= start < stop, none overlapping; got {list(self.spans)}")

    def extract(self, output: Any, call: SiteCall) -> Tensor:
        whole = TENSOR.extract(output, call)
        if whole.shape[-1] < max(stop for _, stop in self.spans):
            raise FcauditError(f"output is {describe(output)}, narrower than the channel "
                               f"slices {list(self.spans)}; {ADAPTER_API}")
        return torch.cat([whole[..., a:b] for a, b in self.spans], dim=-1)

    def rebuild(self, coefficients: Tensor, call: SiteCall) -> Tensor:
        # forward, not __call__: hooks on the module (the recorder's own) must not fire
        live = call.module.forward(*call.args, **call.kwargs)
        out = live.clone()
        at = 0
        for a, b in self.spans:
            out[..., a:b] = coefficients[..., at:at + b - a].to(out.dtype)
            at += b - a
        return out


def infer_adapter(output: Any, call: SiteCall) -> ControllerAdapter:
    """The built-in adapter that fits an ``output``, or a one-line error."""
    if isinstance(output, Tensor):
        if output.dim() >= 2 and tuple(output.shape[:2]) == (call.batch, call.seq_len):
            return TENSOR
        if call.seq_len is None and output.dim() >= 2 and output.shape[0] == call.batch:
            return TENSOR
        if call.seq_len is not None and output.dim() >= 1 and \
                output.shape[0] == call.batch * call.seq_len:
            return FLAT
        raise FcauditError(
            f"output is {describe(output)}: neither [batch={call.batch}, "
            f"positions={call.seq_len}, ...] nor flattened "
            f"[{call.batch * (call.seq_len or 1)}, ...]; "
            "name per-token coefficient modules")
    raise FcauditError(f"output is {describe(output)}, not a coefficient tensor; fcaudit cannot "
                       f"tell which part holds the coefficients: {ADAPTER_API}")


# What AUTO learned about each module it recorded (weakly held: no model is kept alive).
_LEARNED: weakref.WeakKeyDictionary[Any, ControllerAdapter] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class AutoAdapter:
    """For sites named by a glob: :data:`TENSOR` or :data:`FLAT`, whichever fits the
    module's output, decided when the module is first recorded and remembered for its
    replay. Anything else (a tuple) needs an explicit adapter."""

    name: str = "auto"

    def extract(self, output: Any, call: SiteCall) -> Tensor:
        adapter = infer_adapter(output, call)
        _LEARNED[call.module] = adapter
        return adapter.extract(output, call)

    def rebuild(self, coefficients: Tensor, call: SiteCall) -> Any:
        return self.resolved(call.module).rebuild(coefficients, call)

    @staticmethod
    def resolved(module: Any) -> ControllerAdapter:
        adapter = _LEARNED.get(module)
        if adapter is None:
            raise FcauditError(
                f"the output layout of {type(module).__name__} is not known: sites found by "
                "globs learn it when this very module is recorded; replay the Recording that "
                "fcaudit.record returned (fcaudit.replay(model, recording)), or give the Site "
                "an explicit adapter")
        return adapter


AUTO = AutoAdapter()


def adapter_name(adapter: Any, module: Any) -> str:
    """The adapter actually in use for ``module`` (what AUTO resolved to)."""
    if isinstance(adapter, AutoAdapter):
        adapter = AutoAdapter.resolved(module)
    return getattr(adapter, "name", type(adapter).__name__)


def join_path(*parts: str) -> str:
    """A module path from its parts, empty ones (the root's "") left out."""
    return ".".join(p for p in parts if p)


def same_bits(a: Any, b: Any) -> bool:
    """True when two outputs are bitwise identical: same structure, dtypes, shapes and bits
    (NaNs compare equal to themselves)."""
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
            return False
        if a.is_floating_point() or a.is_complex():
            # reshape(-1): a 0-dim tensor (a scalar in an output or a model's state)
            # cannot be viewed as bytes
            return bool(torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                                    b.contiguous().reshape(-1).view(torch.uint8)))
        return bool(torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(
            same_bits(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return False
    return a == b
