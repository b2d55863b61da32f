"""FLOP counting, as the execution audit and ``fcaudit fold`` count: torch's
``FlopCounterMode`` with formulas for the matrix work it leaves out, and a record of every
operator a pass ran, so that matrix work no formula counts is named, never silently
missing from a ratio.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count


def _cpu_sdpa_flops(query_shape: torch.Size, key_shape: torch.Size, value_shape: torch.Size,
                    *_args: object, **_kwargs: object) -> int:
    """CPU fused attention, which torch's counter leaves out; counted like the CUDA kernels."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _grouped_mm_flops(a_shape: torch.Size, b_shape: torch.Size, *_args: object,
                      out_shape: torch.Size | None = None, **_kwargs: object) -> int:
    """``torch._grouped_mm`` (the default expert kernel of Hugging Face MoE models), which
    torch's counter counts as 0: every output element contracts one row of ``a``."""
    if len(a_shape) == 2 and len(b_shape) == 2:  # groups split the contraction dimension
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    assert out_shape is not None
    return 2 * math.prod(out_shape) * a_shape[-1]


EXTRA_FLOP_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops,
                       torch.ops.aten._grouped_mm: _grouped_mm_flops}
# aten operators that do matrix work: one the counter has no formula for would make the
# FLOPs ratio silently wrong, so it is reported and the FLOPs verdict refused
_HEAVY_OP = re.compile(r"(^|_)(mm|bmm|addmm|baddbmm|addbmm|mv|addmv|dot|vdot|matmul|"
                       r"convolution|conv\w*|\w*attention\w*|grouped_mm|scaled_mm|int_mm)$")


class OpRecorder(TorchDispatchMode):
    """Notes every aten operator a pass runs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[Any] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        self.ops.add(func._overloadpacket)
        return func(*args, **(kwargs or {}))


def flop_counter() -> FlopCounterMode:
    """A counter with :data:`EXTRA_FLOP_FORMULAS` (read when called)."""
    return FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS)


def uncounted_operators(ops: Iterable[Any], counter: FlopCounterMode) -> list[str]:
    """Matrix-work operators among ``ops`` that ``counter`` has no FLOP formula for."""
    return sorted(str(op) for op in ops
                  if _HEAVY_OP.search(op.__name__) and op not in counter.flop_registry)
