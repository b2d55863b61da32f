"""Numbers over seeds, written one way in every study table: a mean over the seeds with
the span of the seeds' 95% intervals (the lowest low to the highest high), so a reader sees
both the typical value and how far any one seed's interval reaches."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def group_mean(group: Mapping[str, Any], key: str) -> float | None:
    """A metric's mean over the group's seeds (None where no seed has it)."""
    return (group["aggregate"].get(key) or {}).get("mean")


def spanned(values: Sequence[float], cis: Sequence[Sequence[float]], spec: str,
            unit: str = "") -> str:
    """``mean<unit> [lowest low, highest high]`` of the seeds' values and intervals."""
    return (f"{float(np.mean(values)):{spec}}{unit} [{min(c[0] for c in cis):{spec}}, "
            f"{max(c[1] for c in cis):{spec}}]")


def penalty(audits: Sequence[Any], condition: str, absent: str = "not run") -> str:
    """A condition's penalty over seeds, or ``absent`` where a seed did not run it."""
    if not all(condition in a.conditions for a in audits):
        return absent
    found = [a.conditions[condition] for a in audits]
    return spanned([c.delta for c in found], [c.ci95 for c in found], "+.3f")


def shares(values: Sequence[Any], undefined: str, missing: str) -> str:
    """Shares in percent (a retention, a gap closed) over the seeds where each is defined;
    ``missing`` (with ``{n}`` the seeds without one, ``{s}`` a plural s and ``{of}`` the
    seeds in all) said after them when some are not."""
    defined = [s for s in values if s.value is not None]
    if not defined:
        return undefined
    n = len(values) - len(defined)
    return spanned([s.value for s in defined], [s.ci95 for s in defined], ".1f", "%") + \
        (missing.format(n=n, s="s" * (n > 1), of=len(values)) if n else "")
