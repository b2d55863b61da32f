"""Every array a user hands fcaudit, checked in one place before any model sees it.

Token ids (``--tokens``, ``AuditData.eval_ids``, ``record``'s ids, ``static``'s ids),
other inputs and targets (``--inputs``, ``--targets``, ``AuditData.inputs``), and the
inputs a run folder's model is known to take (:class:`InputSpec`) each have one rule
here, so every entry point refuses the same mistake with the same line: the array by
its name, what it holds (``float64 [16, 64]``), and what to give instead. An unsigned
value above int64 is quoted as it is, never cast to a negative number first.

A model raising on inputs fcaudit cannot vouch for (a factory's, a Hugging Face
model's) is the inputs' fault or the model's, never fcaudit's: :func:`blamed_on_inputs`
says so in one line, naming the inputs, after proving that a plain forward pass without
fcaudit's hooks raises too.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fcaudit.core.errors import DataError, FcauditError

INT64_MAX = int(np.iinfo(np.int64).max)
# unsigned widths torch cannot reduce or index with (min, max, one_hot, embedding)
# (torch 2.3 added them; torch 2.2, the oldest supported, reads such numpy arrays not at all)
_WIDE_UNSIGNED = tuple(getattr(torch, f"uint{bits}") for bits in (16, 32, 64)
                       if hasattr(torch, f"uint{bits}"))
# every device's (torch.OutOfMemoryError is this class under another name since torch 2.5)
_OUT_OF_MEMORY = (MemoryError, torch.cuda.OutOfMemoryError)


def dtype_name(dtype: Any) -> str:
    """``float64`` for a numpy or torch dtype alike."""
    return str(dtype).removeprefix("torch.")


def describe(value: Any) -> str:
    """``float64 [16, 64]`` for an array or tensor, ``a dict {name: ...}`` of them, else
    the type's name: how a message shows what was given."""
    if isinstance(value, (np.ndarray, Tensor)):
        return f"{dtype_name(value.dtype)} {list(value.shape)}"
    if isinstance(value, Mapping):
        return "a dict {" + ", ".join(f"{k!r}: {describe(v)}" for k, v in value.items()) + "}"
    inputs = getattr(value, "inputs", None)  # a batch of examples
    return describe(inputs) if inputs is not None else f"a {type(value).__name__}"


def as_numpy(value: Any) -> np.ndarray:
    """A CPU numpy view of an array or tensor (unsigned widths kept, unlike a cast;
    bfloat16, which numpy lacks, as float32)."""
    if not isinstance(value, Tensor):
        return np.asarray(value)
    value = value.detach().cpu()
    return (value.float() if value.dtype == torch.bfloat16 else value).numpy()


def no_wrap(value: Any, where: str, ids: bool = False) -> None:
    """Refuse unsigned entries above int64, quoting the true value: a cast to int64, which
    every later step makes, would turn them into negative numbers."""
    arr = as_numpy(value)
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > INT64_MAX:
        held, advice = ("token id", "any vocabulary (ids must be below 2**63); tokenize with "
                        "the model's tokenizer") if ids else \
            ("the value", "int64 (values must be below 2**63); give class indices or other "
             "values that fit np.int64")
        raise DataError(f"{where} holds {held} {int(arr.max())}, beyond {advice}")


def token_ids(value: Any, where: str) -> np.ndarray:
    """Token ids as an int64 array ``[N, T]`` with ``T >= 2``, or one line naming
    ``where``: not an array, not integers, another shape, ids beyond int64."""
    if not isinstance(value, np.ndarray):
        hint = " (use tensor.cpu().numpy())" if isinstance(value, Tensor) else ""
        raise DataError(f"{where} is a {type(value).__name__}, not a numpy integer array "
                        f"[N, T]{hint}")
    if value.dtype.kind not in "iu":
        raise DataError(f"{where} has dtype {value.dtype}; token ids must be integers "
                        "(np.int64)")
    if value.ndim != 2 or value.shape[1] < 2:
        raise DataError(f"{where} has shape {list(value.shape)}; expected [N, T] (sequences "
                        f"x tokens) with T >= 2{_ids_hint(value.shape)}")
    no_wrap(value, where, ids=True)
    return value.astype(np.int64, copy=False)


def _ids_hint(shape: tuple[int, ...]) -> str:
    if len(shape) == 1:
        return " (one sequence: ids[None])"
    if len(shape) == 3 and shape[-1] == 1:
        return " (drop the trailing axis of length 1: ids[..., 0])"
    if len(shape) == 2:
        return ": next-token NLL scores each token from those before it"
    return ""


def id_tensor(value: Any, shape: tuple[int, ...] | None, where: str) -> Tensor:
    """Token ids (of exactly ``shape``, when given) as an int64 CPU tensor, with no
    unsigned wrap-around."""
    arr = as_numpy(value)
    if arr.dtype.kind not in "iu" or (shape is not None and arr.shape != shape):
        wanted = f" of shape {list(shape)}" if shape is not None else ""
        raise DataError(f"{where}: ids must be integer token ids{wanted}, got "
                        f"{describe(arr)}")
    no_wrap(arr, where, ids=True)
    return torch.from_numpy(arr.astype(np.int64))


def example_tensor(value: Any, where: str) -> Tensor:
    """Inputs or targets ``[N, ...]`` as a fresh real CPU tensor; unsigned integers wider
    than 8 bits become int64 (torch cannot reduce them), refused first if beyond it."""
    if isinstance(value, Tensor) and value.dtype in _WIDE_UNSIGNED:
        value = as_numpy(value)
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject or value.dtype.kind not in "biuf":
            raise DataError(f"{where} has dtype {value.dtype}; give numeric arrays (float "
                            "or integer), not objects or strings")
        if value.dtype.kind == "u" and value.dtype.itemsize > 1:
            no_wrap(value, where)
            value = value.astype(np.int64)
        tensor = torch.from_numpy(value)
    elif isinstance(value, Tensor):
        tensor = value.detach().to("cpu")
    else:
        raise DataError(f"{where} is a {type(value).__name__}; give a numpy array or torch "
                        "tensor [N, ...] (or a dict of them)")
    if tensor.dim() < 1 or tensor.is_complex():
        raise DataError(f"{where} has shape {list(tensor.shape)} ({dtype_name(tensor.dtype)});"
                        " give real arrays with the examples on the first axis [N, ...]")
    # a fresh row-major copy: numpy views may carry 0 strides, and the caller's array may
    # change after the audit read it
    return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)


def model_input(value: Any, where: str) -> Tensor:
    """A batch for one forward pass (``record``'s ``input_ids``): a tensor with examples
    on its first axis; token ids of shape ``[B, T, 1]`` are refused (the trailing axis
    would be read as positions); unsigned ids wider than 8 bits become int64, unwrapped."""
    if not isinstance(value, Tensor):
        hint = " (torch.from_numpy(ids))" if isinstance(value, np.ndarray) else ""
        raise DataError(f"{where} is a {type(value).__name__}; give a torch tensor with the "
                        f"examples on the first axis, token ids [B, T]{hint}")
    if value.dim() == 0 or value.shape[0] == 0:
        raise DataError(f"{where} holds {describe(value)}: no examples; give a batch with "
                        "the examples on the first axis, token ids [B, T]")
    integer = not value.is_floating_point() and not value.is_complex() \
        and value.dtype != torch.bool
    if integer and value.dim() == 3 and value.shape[-1] == 1:
        raise DataError(f"{where} holds {describe(value)}; token ids are [B, T]: drop the "
                        "trailing axis of length 1 (ids[..., 0])")
    if value.dtype in _WIDE_UNSIGNED:
        no_wrap(value, where, ids=True)
        return value.to(torch.int64)
    return value


@dataclass(frozen=True)
class InputSpec:
    """What a model takes per example, where fcaudit knows it (a run folder's arch):
    ``shape`` per example (None: token ids of any length) and ``dtype`` (None: any
    integer); ``model`` names it and ``how`` says where such inputs are given."""

    model: str
    kind: str
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    how: str = ""

    def wanted(self) -> str:
        if self.shape is None:
            return f"{self.kind}, integers [N, T]"
        return f"{self.kind} {dtype_name(self.dtype)} [N, {', '.join(map(str, self.shape))}]"

    def check(self, inputs: Any, where: str) -> None:
        """Refuse ``inputs`` (a tensor, or a dict of them) the model cannot take."""
        if isinstance(inputs, Mapping):
            raise DataError(f"{where} is {describe(inputs)}, but {self.model} takes one "
                            f"array: {self.wanted()}{self.how}")
        if not self._fits(inputs):
            raise DataError(f"{where} holds {describe(inputs)}, but {self.model} takes "
                            f"{self.wanted()}{self._hint(inputs)}{self.how}")

    def _fits(self, x: Tensor) -> bool:
        if self.shape is None:
            return x.dim() == 2 and not x.is_floating_point() and x.dtype != torch.bool
        return tuple(x.shape[1:]) == self.shape and x.dtype == self.dtype

    def _hint(self, x: Tensor) -> str:
        if self.shape is None:
            return ""
        hints = []
        if x.dtype != self.dtype:
            name = dtype_name(self.dtype)
            hints.append(f"cast: x.astype(np.{name})" if hasattr(np, name) else
                         f"cast to {name}")
        if tuple(x.shape[1:]) != self.shape:
            if x.dim() >= 1 and math.prod(x.shape[1:]) == math.prod(self.shape):
                hints.append(f"reshape: x.reshape(-1, {', '.join(map(str, self.shape))})")
            else:
                hints.append(f"each example must be {list(self.shape)}")
        return f" ({', '.join(hints)})"


def _input_hint(x: Any) -> str:
    """What a model's error on ``x`` most likely means, from ``x`` alone."""
    if not isinstance(x, Tensor):
        return ""
    if x.dim() == 3 and x.shape[-1] == 1 and not x.is_floating_point():
        return "; token ids are [B, T]: drop the trailing axis (ids[..., 0])"
    if x.dtype == torch.float64:
        return "; float64 inputs: cast them to the dtype of the model's weights (float32, usually)"
    if x.dim() == 2 and x.is_floating_point():
        return "; if these are token ids, they must be integers (int64)"
    if x.dim() <= 1:
        return "; one example? give a batch with the examples on the first axis: x[None]"
    return ""


@contextlib.contextmanager
def blamed_on_inputs(plain: Callable[[], Any], x: Any, what: str) -> Iterator[None]:
    """An error raised inside the block is the inputs' (or the model's) fault when
    ``plain()``, the same forward pass without fcaudit's hooks, raises too: then it is
    one :class:`FcauditError` naming ``what`` and ``x``'s dtype and shape; otherwise
    the original error propagates. Out-of-memory errors always propagate."""
    try:
        yield
    except (FcauditError, *_OUT_OF_MEMORY):
        raise
    except Exception as exc:
        try:
            with torch.no_grad():
                plain()
        except Exception:
            first = " ".join(str(exc).split()).rstrip(".") or type(exc).__name__
            raise DataError(f"the model raised {type(exc).__name__} on {what} "
                            f"({describe(x)}): {first}; give inputs of the shape and "
                            f"dtype the model takes{_input_hint(_tensor_of(x))}") from exc
        raise


def _tensor_of(x: Any) -> Any:
    inputs = getattr(x, "inputs", x)
    return inputs if isinstance(inputs, Tensor) else None
