"""How numbers look in every report: fixed digits, signed penalties, intervals, shares
and percentages, with non-finite values shown as such (never as a wrong number)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any


def fmt_finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def fmt_num(x: float | None, digits: int = 4, sign: bool = False) -> str:
    """Fixed decimals for ordinary values, scientific notation for tiny or huge ones."""
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:+,}" if sign else f"{x:,}"
    if not fmt_finite(x):
        return "n/a"
    plus = "+" if sign else ""
    if x != 0 and not 10.0 ** -digits <= abs(x) < 1e6:
        return f"{x:{plus}.3e}"
    return f"{x:{plus}.{digits}f}"


def fmt_count(x: float | None) -> str:
    """A count that can be large (FLOPs per token): whole, with thousands separators, up to
    a million, scientific from there (``19,840``, ``2.360e+06``), never ``19840.0000``."""
    if fmt_finite(x) and 1000 <= abs(x) < 1e6:
        return f"{x:,.0f}"
    return fmt_num(x)


def fmt_ci(ci: Sequence[float] | None, digits: int = 4, sign: bool = False) -> str:
    if ci is None or not all(fmt_finite(v) for v in ci):
        return "n/a"
    return f"[{fmt_num(ci[0], digits, sign)}, {fmt_num(ci[1], digits, sign)}]"


def fmt_with_ci(x: float | None, ci: Sequence[float] | None, digits: int = 4,
             sign: bool = True) -> str:
    if not ci:
        return fmt_num(x, digits, sign)
    return f"{fmt_num(x, digits, sign)} {fmt_ci(ci, digits, sign)}"


def fmt_share(x: float | None) -> str:
    """An eta-squared fraction as a percentage."""
    return f"{100 * x:.1f}%" if fmt_finite(x) else "n/a"


def fmt_pct(x: float | None) -> str:
    return fmt_num(x, 2) + "%" if fmt_finite(x) else "n/a"


def fmt_pct_with_ci(x: float | None, ci: Sequence[float] | None) -> str:
    """A percentage with its interval, ``12.34% [5.00, 20.00]``: the interval's own
    brackets, never a second pair around them."""
    return f"{fmt_pct(x)} {fmt_ci(ci, 2)}"


def fmt_seq(values: Sequence[Any], fmt: Callable[[Any], str] = fmt_num, limit: int = 8) -> str:
    """A comma-separated list, cut after ``limit`` items so a table cell stays short."""
    shown = ", ".join(fmt(v) for v in values[:limit])
    return shown + (f", … ({len(values)} in all)" if len(values) > limit else "")
