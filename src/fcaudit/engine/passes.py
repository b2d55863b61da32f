"""One forward pass over one batch: recorded (controllers live) or replayed (stubs).

Every pass of the audit goes through :func:`record_batch` or :func:`replay_batch`, so the
checks live here: a site that runs twice, a stub the model does not call, non-finite
values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fcaudit.core.contract import Site
from fcaudit.core.errors import FcauditError
from fcaudit.core.nll import logits_of, token_nll
from fcaudit.core.recording import recording
from fcaudit.core.replaying import BlockTrace, OutputStub, replaying, selecting, swapped, tracing


def batches(ids: np.ndarray, batch_size: int, device: torch.device,
            only: Sequence[int] | None = None) -> Iterator[tuple[int, Tensor]]:
    for b, start in enumerate(range(0, len(ids), batch_size)):
        if only is None or b in only:
            chunk = np.ascontiguousarray(ids[start:start + batch_size])
            yield b, torch.from_numpy(chunk).to(device)


@torch.no_grad()
def record_batch(model: nn.Module, sites: Sequence[Site], x: Tensor
                 ) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """One unperturbed pass: logits, every site's coefficients, per-token NLL."""
    with recording(model, sites, *x.shape) as captured:
        logits = logits_of(model(x))
    return logits, {s.name: captured[s.name] for s in sites}, token_nll(logits, x)


@dataclass
class Replayed:
    """One replay pass: logits, the block trace (if asked) and the routers' choices."""

    logits: Tensor
    trace: BlockTrace | None = None
    chosen: dict[str, Tensor] = field(default_factory=dict)


@torch.no_grad()
def replay_batch(model: nn.Module, x: Tensor, fed: Mapping[Site, Tensor], *,
                 known: Mapping[str, Any] | None = None, trace: Sequence[str] | None = None,
                 select: bool = False) -> Replayed:
    """One pass with the given sites fed; each stub must run exactly once.

    ``known``: block outputs to stand in for those blocks (prefix reuse); sites inside
    them do not run. ``trace``: block paths whose call order and outputs to record.
    ``select``: also return the experts each router site selects.
    """
    known = known or {}
    observed = tracing(model, trace, [s.path for s in fed]) if trace else \
        contextlib.nullcontext()
    with replaying(model, fed) as stubs, \
            swapped(model, {p: OutputStub(out) for p, out in known.items()}), \
            observed as traced, \
            selecting(stubs) if select else contextlib.nullcontext({}) as chosen:
        logits = logits_of(model(x))
    skipped = {s.name for s in fed
               if any(s.path == p or s.path.startswith(p + ".") for p in known)}
    wrong = {n: s.calls for n, s in stubs.items() if s.calls != (0 if n in skipped else 1)}
    if wrong:
        name, calls = next(iter(wrong.items()))
        raise FcauditError(f"site {name} ran {calls} times during replay (once when recorded); "
                           "the model takes another path when its controller is replaced: "
                           "name a module the model calls exactly once per forward pass")
    return Replayed(logits, traced, chosen)


def check_finite(values: Mapping[str, Tensor], where: str) -> None:
    bad = {k: int((~torch.isfinite(v)).sum()) for k, v in values.items()
           if not torch.isfinite(v).all()}
    if bad:
        listing = ", ".join(f"{k} ({n} values)" for k, n in bad.items())
        raise FcauditError(f"non-finite (NaN or inf) coefficients recorded on {where} at "
                           f"{listing}; no dependence metric is computed on them: fix the "
                           "model or its weights (try float32)")


def check_finite_nll(nll: Tensor, where: str) -> None:
    if not torch.isfinite(nll).all():
        raise FcauditError(f"the model's NLL is not finite (NaN or inf) in {where} "
                           f"({int((~torch.isfinite(nll)).sum())} tokens); no metric can be "
                           "computed: check the model's weights and dtype (try float32)")
