"""token_nll: the chunked 2-D cross-entropy against the formula it replaced.

The old formula cross-entropied a transposed float copy of all logits. The new one must
give the same numbers to float32 rounding. Differences are relative, in units of float32
epsilon (one unit is one to two ulps): within 6 of the old formula where the vocabulary
is small (and within 1 of a float64 reference), and closer to the float64 reference
than the old one where it is large (3; the old strided reduction summed 50k terms one
after another and drifted by ~50).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from fcaudit.core import nll
from fcaudit.core.nll import token_nll

EPS = torch.finfo(torch.float32).eps


def old_token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")


def reference(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The exact value (float64), rounded once to float32."""
    exact = F.cross_entropy(logits[:, :-1].double().transpose(1, 2), ids[:, 1:], reduction="none")
    return exact.float()


def batch(shape: tuple[int, int, int], dtype: torch.dtype, seed: int = 0,
          scale: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(shape, generator=gen)).to(dtype)
    return logits, torch.randint(0, shape[2], shape[:2], generator=gen)


def rel_eps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest relative difference of ``a`` from ``b``, in units of float32 epsilon."""
    return float(((a - b).abs() / (EPS * b.abs())).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_old_formula(dtype: torch.dtype) -> None:
    logits, ids = batch((4, 64, 2048), dtype)
    new = token_nll(logits, ids)
    assert new.dtype == torch.float32 and new.shape == (4, 63) and new.is_contiguous()
    assert rel_eps(new, old_token_nll(logits, ids)) <= 6
    assert rel_eps(new, reference(logits, ids)) <= 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_vocabulary_is_chunked_and_accurate(dtype: torch.dtype) -> None:
    logits, ids = batch((2, 16, 50304), dtype)  # 32 rows, 20 per chunk on a CPU
    assert nll.CHUNK_ELEMENTS_CPU // 50304 < 32
    new = token_nll(logits, ids)
    assert rel_eps(new, reference(logits, ids)) <= 4
    torch.testing.assert_close(new, old_token_nll(logits, ids), rtol=1e-5, atol=0)


class LargestFloat(TorchFunctionMode):
    """Records the most elements of any float32 tensor a torch function returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func: Callable[..., Any], types: Any,
                           args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32:
            self.largest = max(self.largest, out.numel())
        return out


def test_half_logits_are_upcast_one_chunk_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nll, "CHUNK_ELEMENTS_CPU", 1 << 16)
    logits, ids = batch((2, 128, 4096), torch.bfloat16)  # 2^20 elements: 16 chunks
    with LargestFloat() as seen:
        token_nll(logits, ids)
    assert seen.largest == 1 << 16


def test_chunking_changes_no_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    logits, ids = batch((3, 40, 1000), torch.float32)
    monkeypatch.setattr(nll, "CHUNK_ELEMENTS_CPU", 1 << 30)
    whole = token_nll(logits, ids)  # one chunk
    monkeypatch.setattr(nll, "CHUNK_ELEMENTS_CPU", 7 * 1000)  # chunks cross sequences
    chunked = token_nll(logits, ids)
    assert torch.equal(chunked, whole) and torch.equal(token_nll(logits, ids), chunked)


def test_layouts_and_edges() -> None:
    logits, ids = batch((2, 16, 50), torch.float32)
    strided = logits.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    assert torch.equal(token_nll(strided, ids), token_nll(logits, ids))
    assert token_nll(logits[:, :1], ids[:, :1]).shape == (2, 0)
    assert torch.equal(token_nll(logits, ids.int()), token_nll(logits, ids))
