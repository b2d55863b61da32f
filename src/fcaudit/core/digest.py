"""One SHA-256 of named tensors, for every place that proves two sets of tensors equal
(cached replays, the first batch across ranks, example sets): one definition, so two
digests of the same bits can never disagree by how they were taken."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
from torch import Tensor


def digest_tensors(named: Iterable[tuple[str, Tensor]], head: bytes = b"") -> bytes:
    """SHA-256 over ``head`` and each tensor's name, dtype, shape and bytes, in order: two
    digests are equal only for bitwise equal tensors (short of a SHA-256 collision)."""
    hasher = hashlib.sha256(head)
    for name, tensor in named:
        t = tensor.detach().to("cpu").contiguous()
        hasher.update(repr((name, str(t.dtype), tuple(t.shape))).encode())
        hasher.update(t.reshape(-1).view(torch.uint8).numpy())
    return hasher.digest()
