"""Which modules behave like controllers, judged by what their output does in one pass.

A name says little: ``mlp.gate_proj`` of a gated MLP is a linear pre-activation, and the
tensor that actually multiplies the other branch is the output of ``mlp.act_fn``. So the
probe pass watches every torch call (a ``TorchFunctionMode``): a module whose output, or
an activation of it (sigmoid, softmax, SiLU, GELU, tanh) or a threshold of it (a hard
mask ``score > 0``), is an operand of an elementwise
product or an einsum with another tensor *scales another branch*; when that output is
controller-like (an activation module's, one in [0, 1], or the activation taken of it),
the module is a likely controller. Tensors are followed by their storage, so the views a
gate takes before multiplying (``g[..., None]``, a slice per expert) still count, and
through the copies that keep its values (a dtype cast, ``clone``, ``contiguous``, an
indexed pick, ``topk``'s values): a router's weights cast to the hidden dtype still scale.

What it records of each (:class:`Scaling`: the activation's word, the shape of the branch
scaled) is the evidence :mod:`fcaudit.core.kinds` judges a coefficient's kind from.

The watch only looks: an error in its own bookkeeping (a tensor subclass whose ``min``
raises) stops the watching, never the pass, and :attr:`ScalingWatch.broken` says why, so
the caller falls back to names.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

_ACTIVATION_CLASS = re.compile(r"sigmoid|softmax|silu|swish|gelu|tanh|activation", re.I)
_ACTIVATIONS = {"sigmoid", "sigmoid_", "softmax", "silu", "gelu", "tanh", "tanh_",
                "hardsigmoid", "softplus", "swish"}
_THRESHOLDS = {"gt", "ge", "lt", "le", "__gt__", "__ge__", "__lt__", "__le__",
               "heaviside"}  # a hard gate: a mask kept where the score passes a threshold
_COPIES = {"to", "float", "half", "bfloat16", "double", "type", "type_as", "clone",
           "contiguous", "detach", "__getitem__", "index_select", "gather", "topk", "repeat",
           "repeat_interleave", "masked_fill"}  # a new tensor holding (some of) the same values
_PRODUCTS = {"mul", "mul_", "__mul__", "__rmul__", "__imul__", "multiply", "einsum",
             "addcmul"}


class Look(NamedTuple):
    """How a module's output (or what was taken of it) looks like a coefficient: the words
    said to a person, and the nonlinearity's name (``silu``, ``sigmoid``, ``softmax``, ...),
    ``threshold`` for a hard mask, ``unit`` for a plain output in [0, 1]."""

    how: str
    word: str


class Scaling(NamedTuple):
    """What of a module's output scales another branch: how it looks, the shape of the
    view of it that multiplies (``g[..., None]``, a slice per expert) and of that branch."""

    how: str
    word: str
    operand: tuple[int, ...]
    branch: tuple[int, ...]


def _storage(t: Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr() if t.numel() else None
    except (RuntimeError, NotImplementedError):  # meta or tensor subclasses without storage
        return None


def _tensors(values: Any) -> list[Tensor]:
    if isinstance(values, Tensor):
        return [values]
    if isinstance(values, (list, tuple)):
        return [t for v in values for t in _tensors(v)]
    return []


def _controller_like(module: nn.Module, out: Tensor) -> Look | None:
    """How the output looks like a coefficient by itself, or None (a linear output)."""
    name = type(module).__name__
    if found := _ACTIVATION_CLASS.search(name):
        return Look(f"a {name} output", found.group(0).lower())
    if out.is_floating_point() and bool(out.min() >= 0) and bool(out.max() <= 1):
        return Look("a [0, 1] output", "unit")
    return None


class ScalingWatch(TorchFunctionMode):
    """Records, during one forward pass, which modules' outputs scale another branch:
    register :meth:`output` as every module's forward hook and run the pass inside."""

    def __init__(self) -> None:
        super().__init__()
        self.owner: dict[int, tuple[str, Look | None]] = {}  # storage -> module, its look
        self.modules_out: set[int] = set()  # storages some module returned
        self.kept: list[Tensor] = []  # alive during the pass, so no storage is reused
        self.scales: dict[str, Scaling] = {}  # module -> what of it scales another branch
        self.broken: str | None = None  # the watch's own error, when it had one

    def output(self, name: str, module: nn.Module, out: Any) -> None:
        """A module's forward hook: remember which module returned this storage."""
        if self.broken is None:
            self._guarded(self._output, name, module, out)

    def _guarded(self, step: Any, *args: Any) -> None:
        """Run one bookkeeping step; its error ends the watching, not the model's pass."""
        try:
            step(*args)
        except Exception as exc:  # noqa: BLE001 - any error of the watch degrades to names
            self.broken = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]

    def _output(self, name: str, module: nn.Module, out: Any) -> None:
        if isinstance(out, Tensor) and (ptr := _storage(out)) is not None:
            if ptr not in self.modules_out:  # the innermost module that returned it
                self.owner[ptr] = (name, _controller_like(module, out))  # over an activation
                self.modules_out.add(ptr)  # taken inside it (nn.SiLU's F.silu of gate_proj)
            self.kept.append(out)

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if self.broken is None:
            self._guarded(self._follow, getattr(func, "__name__", ""), args, kwargs, result)
        return result

    def _follow(self, word: str, args: Any, kwargs: Any, result: Any) -> None:
        operands = _tensors(list(args) + list((kwargs or {}).values()))
        if word in _PRODUCTS and len(operands) >= 2:
            return self._product(operands)
        source = self.owner.get(_storage(operands[0]) or -1) if operands else None
        first = _tensors(result)[:1]  # topk: (values, indices)
        if source is None or not first or (ptr := _storage(first[0])) is None:
            return None
        if word in _ACTIVATIONS:  # in place (sigmoid_) the storage is the same: overwrite
            name = word.rstrip("_")
            self.owner[ptr] = (source[0], Look(f"a {name} of its output", name))
        elif word in _THRESHOLDS:
            self.owner[ptr] = (source[0], Look("a threshold of its output", "threshold"))
        elif word in _COPIES:
            self.owner.setdefault(ptr, source)
        else:
            return None
        self.kept.append(first[0])
        return None

    def _product(self, operands: list[Tensor]) -> None:
        ptrs = [_storage(t) for t in operands]
        for operand, ptr in zip(operands, ptrs, strict=True):
            source = self.owner.get(ptr or -1)
            other = next((o for o, p in zip(operands, ptrs, strict=True)
                          if p != ptr and o.numel() > 1), None)
            if source is not None and source[1] is not None and other is not None:
                self.scales.setdefault(source[0], Scaling(*source[1], tuple(operand.shape),
                                                          tuple(other.shape)))
