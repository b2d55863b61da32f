"""Examples that are not token ids: image tensors, dicts of tensors, a torch Dataset.

:class:`Examples` holds every example's input (one tensor ``[N, ...]`` or a dict of such
tensors, fed as ``model(x)`` or ``model(**x)``) and its target, materialised once on the
CPU so that batching, sharding, caching and resume see exactly the same bits on every
pass. An :class:`ExampleBatch` is one slice of it, what a model and an objective receive.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fcaudit.core.arrays import example_tensor
from fcaudit.core.digest import digest_tensors
from fcaudit.core.errors import DataError, arg
from fcaudit.io.fileio import read_npy

# inputs other than token ids, named for either reader of a message
OTHER_INPUTS = arg("inputs", py="AuditData(inputs=..., targets=..., calib_inputs=...)",
                   cli="--inputs, --targets and --calib-inputs")

Inputs = Tensor | dict[str, Tensor]
# the keywords a Hugging Face model takes its token ids [B, T] and token vectors by
TOKEN_IDS_KEY, TOKEN_VECTORS_KEY = "input_ids", "inputs_embeds"
# inputs that mark padded positions, by name: a keep mask (attention_mask, pixel_mask,
# encoder_/decoder_attention_mask: 0 is padding) or a padding mask (key_padding_mask,
# src_key_padding_mask, padding_mask: nonzero is padding), as transformers and torch name them
KEEP_MASK = re.compile(r"(^|_)(attention|pixel)_mask$")
PAD_MASK = re.compile(r"(^|_)padding_mask$")


@dataclass
class ExampleBatch:
    """One batch: ``inputs`` (a tensor ``[B, ...]`` or a dict of them) and ``targets``
    (``[B, ...]`` or None), what a model and a user objective receive."""

    inputs: Any
    targets: Tensor | None

    def __len__(self) -> int:
        return int(next(iter(_tensors(self.inputs))).shape[0])

    @property
    def device(self) -> torch.device:
        return next(iter(_tensors(self.inputs))).device

    @property
    def positions(self) -> int | None:
        """Token positions ``T`` when the inputs are token ids ``[B, T]`` (alone, or a
        dict's ``input_ids`` as Hugging Face models take them) or a dict's token vectors
        ``inputs_embeds [B, T, C]``, so that sites with one row per token (a router's
        flattened logits) read as with token data; None otherwise."""
        x = self.inputs
        ids = x.get(TOKEN_IDS_KEY) if isinstance(x, dict) else x
        if is_token_ids(ids):
            return int(ids.shape[1])
        vectors = x.get(TOKEN_VECTORS_KEY) if isinstance(x, dict) else None
        if isinstance(vectors, Tensor) and vectors.dim() == 3:
            return int(vectors.shape[1])
        return None

    def shorter(self) -> ExampleBatch:
        """The batch one position shorter (token inputs: every tensor whose axis 1 is the
        positions, ids, mask or vectors alike), to see which coefficient axes follow it."""
        n = self.positions

        def cut(t: Tensor) -> Tensor:
            return t[:, :-1] if n is not None and t.dim() >= 2 and t.shape[1] == n else t
        inputs = {k: cut(v) for k, v in self.inputs.items()} \
            if isinstance(self.inputs, dict) else cut(self.inputs)
        return ExampleBatch(inputs, None if self.targets is None else cut(self.targets))

    def to(self, device: torch.device) -> ExampleBatch:
        moved = {k: v.to(device) for k, v in self.inputs.items()} \
            if isinstance(self.inputs, dict) else self.inputs.to(device)
        return ExampleBatch(moved, None if self.targets is None else self.targets.to(device))


def is_token_ids(x: Any) -> bool:
    """True for integer ids ``[N, T]`` (any integer dtype, not bool): token ids, however
    they are scored."""
    return isinstance(x, Tensor) and x.dim() == 2 and not x.is_floating_point() \
        and not x.is_complex() and x.dtype != torch.bool


def _tensors(inputs: Any) -> Iterator[Tensor]:
    yield from (inputs.values() if isinstance(inputs, dict) else (inputs,))


def call_model(model: Any, x: Any) -> Any:
    """``model(**inputs)`` for a dict batch, else ``model(inputs)`` (token ids alike)."""
    if isinstance(x, ExampleBatch):
        return model(**x.inputs) if isinstance(x.inputs, dict) else model(x.inputs)
    return model(x)


def as_inputs(value: Any, where: str) -> Inputs:
    """One tensor, or a dict name -> tensor with the same number of examples."""
    if isinstance(value, Mapping):
        if not value or not all(isinstance(k, str) for k in value):
            raise DataError(f"{where} is a dict: give a non-empty dict of input name -> "
                            "array [N, ...]")
        out = {k: example_tensor(v, f"{where}[{k!r}]") for k, v in value.items()}
        counts = {k: int(v.shape[0]) for k, v in out.items()}
        if len(set(counts.values())) != 1:
            raise DataError(f"{where}: its arrays hold different numbers of examples "
                            f"{counts}; give one row per example in every array")
        return out
    return example_tensor(value, where)


def check_unpadded(inputs: Inputs, where: str) -> None:
    """Refuse inputs that mark padded positions (:data:`KEEP_MASK`, :data:`PAD_MASK`): the
    audit counts every position as a token, in calibration profiles, donors, shuffles,
    variance shares and the loss, so a padded one would enter them all unmarked. A mask
    that marks nothing (all ones; a padding mask of all zeros) is only fed to the model."""
    for key, mask in (inputs.items() if isinstance(inputs, dict) else ()):
        padded = (mask == 0) if KEEP_MASK.search(key) else \
            (mask != 0) if PAD_MASK.search(key) else None
        if padded is None or not bool(padded.any()):
            continue
        rows = int(padded.reshape(len(mask), -1).any(1).sum())
        raise DataError(
            f"{where}[{key!r}] marks {int(padded.sum())} of {padded.numel()} positions as "
            f"padding, in {rows} of {len(mask)} examples: the audit counts every position as "
            "a token (calibration profiles, donors, shuffles, variance shares, the loss), so "
            "padded ones would enter them all; give examples of one length without padding "
            "(cut the token stream into full windows, as AuditData(eval_ids=..., "
            "calib_ids=...) takes them) and a mask that masks nothing, or none")


def _stack(items: list[Any], where: str) -> Any:
    first = items[0]
    if isinstance(first, Mapping):
        return {k: _stack([it[k] for it in items], f"{where}[{k!r}]") for k in first}
    try:
        return torch.stack([torch.as_tensor(np.asarray(it) if not isinstance(it, Tensor)
                                            else it) for it in items])
    except (RuntimeError, TypeError, ValueError) as exc:
        raise DataError(f"{where}: its items cannot be stacked into one batch ({exc}); "
                        "every item must have the same shape") from exc


def from_dataset(dataset: Any, where: str) -> tuple[Any, Any]:
    """A map-style torch Dataset of ``(inputs, target)`` pairs, read once into arrays."""
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise DataError(f"{where} is a {type(dataset).__name__}; give a map-style torch "
                        "Dataset (len() and [i]) of (inputs, target) pairs")
    items = [dataset[i] for i in range(len(dataset))]
    if not items:
        raise DataError(f"{where} holds no examples; give at least 2")
    if not all(isinstance(it, (tuple, list)) and len(it) == 2 for it in items):
        raise DataError(f"{where}: every item must be an (inputs, target) pair")
    return _stack([it[0] for it in items], where), _stack([it[1] for it in items],
                                                          f"{where} targets")


@dataclass
class Examples:
    """Every example's inputs and targets, as CPU tensors with the examples first."""

    inputs: Inputs
    targets: Tensor | None

    @classmethod
    def of(cls, inputs: Any, targets: Any, where: str) -> Examples:
        """``where``: "" (evaluation) or "calib_", naming the fields in errors."""
        named_x, named_y = (arg(f"{where}{f}", py=f"AuditData.{where}{f}")
                            for f in ("inputs", "targets"))
        x = as_inputs(inputs, named_x)
        y = None if targets is None else example_tensor(targets, named_y)
        examples = cls(x, y)
        if y is not None and len(y) != len(examples):
            raise DataError(f"{named_x} holds {len(examples)} examples but {named_y} "
                            f"{len(y)}; give one target per example")
        return examples

    def __len__(self) -> int:
        return int(next(iter(_tensors(self.inputs))).shape[0])

    def rows(self, start: int, stop: int) -> ExampleBatch:
        inputs = {k: v[start:stop] for k, v in self.inputs.items()} \
            if isinstance(self.inputs, dict) else self.inputs[start:stop]
        return ExampleBatch(inputs, None if self.targets is None else self.targets[start:stop])

    def layout(self) -> dict[str, list[Any]]:
        """Each input's per-example shape and dtype (what must match between the sets)."""
        named = self.inputs.items() if isinstance(self.inputs, dict) else [("inputs",
                                                                             self.inputs)]
        return {k: [list(v.shape[1:]), str(v.dtype).removeprefix("torch.")] for k, v in named}

    def named(self, start: int = 0, stop: int | None = None) -> list[tuple[str, Tensor]]:
        """Every tensor of rows ``start:stop`` by name, targets last (for digests)."""
        batch = self.rows(start, len(self) if stop is None else stop)
        named = sorted(batch.inputs.items()) if isinstance(batch.inputs, dict) else \
            [("inputs", batch.inputs)]
        return named + ([("targets", batch.targets)] if batch.targets is not None else [])

    def example_hashes(self) -> list[str]:
        """SHA-256 of each example's input bits, to prove two sets share no example."""
        return [digest_tensors(self.named(i, i + 1)[:-1] if self.targets is not None
                        else self.named(i, i + 1)).hex() for i in range(len(self))]

    def fingerprint(self) -> str:
        return digest_tensors(self.named()).hex()


def load_npy(path: str | Path, what: str) -> np.ndarray:
    """A numeric ``.npy`` array, loaded without pickle; anything else in one line."""
    arr = read_npy(path, what, "one numeric array [N, ...]", "values")
    if arr.dtype.kind not in "biuf":
        raise DataError(f"{what} {path} has dtype {arr.dtype}; give a numeric array",
                        path=str(path))
    return arr
