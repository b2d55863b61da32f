"""Objectives: the per-unit loss every pass of the audit scores (docs/method.md, Objectives).

``token-nll`` (the default) is next-token NLL over positions 1..T-1 of token ids, as it
always was (:func:`fcaudit.core.nll.token_nll`, unchanged); ``classification`` is the
cross-entropy of logits ``[B, C]`` against integer targets ``[B]``, one unit per example,
with accuracy beside it; a callable ``(model_output, batch) -> losses [B] or [B, T]``
is the user's own. Penalties, retention and the bootstrap (over examples) read the mean
of each example's units, whichever objective made them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from fcaudit.core.codestate import Unreadable, digest_state
from fcaudit.core.errors import FcauditError, arg
from fcaudit.core.nll import logits_of, token_nll
from fcaudit.engine.options import OBJECTIVES
from fcaudit.io.examples import ExampleBatch

UNREADABLE = "state not readable as bits"
ObjectiveFn = Callable[[Any, ExampleBatch], Tensor]


def _batch(x: Any) -> ExampleBatch:
    """Token ids as a batch whose inputs and targets are the ids (a callable sees both)."""
    return x if isinstance(x, ExampleBatch) else ExampleBatch(x, x)


def output_tensors(output: Any) -> Any:
    """What identity replay compares: the logits when the output has them, else itself."""
    return getattr(output, "logits", output)


@dataclass(frozen=True)
class Objective:
    """One objective: ``units(output, x)`` per-unit losses ``[B, U]`` float32 and, where
    defined, ``hits(output, x)`` 1.0 per correctly classified example ``[B]``."""

    name: str
    fn: ObjectiveFn | None = None  # a user callable
    state: str = ""  # a callable's code and state digest, or why it is unreadable

    @property
    def provable(self) -> bool:
        """False when a callable reads state fcaudit cannot digest: then no cached result
        can be proven to be its."""
        return not self.state.startswith(UNREADABLE)

    @property
    def tokens(self) -> bool:
        return self.name == "token-nll"

    @property
    def accuracy(self) -> bool:
        return self.name == "classification"

    @property
    def unit(self) -> str:
        """What one of its losses scores."""
        return "token" if self.tokens else "example" if self.accuracy else "unit"

    def describe(self) -> str:
        """The losses in words with their verb, naming the objective (a callable by its
        qualified name)."""
        if self.fn is not None:
            return f"objective {self.name}: the losses it returned are"
        what = "next-token NLL" if self.tokens else "cross-entropy of its logits"
        return f"objective {self.name!r}: the model's {what} is"

    @property
    def fix(self) -> str:
        """What to check when its losses are not finite."""
        if self.fn is not None:
            return "fix the objective, or the model output it reads"
        return "check the model's weights and dtype (try float32)"

    def logits(self, output: Any) -> Any:
        """The tensor(s) the identity replay compares bit for bit."""
        return logits_of(output) if self.tokens else output_tensors(output)

    def units(self, output: Any, x: Any) -> Tensor:
        if self.tokens:
            return token_nll(logits_of(output), x)
        if self.accuracy:
            logits, targets = _classes(output, _batch(x))
            return F.cross_entropy(logits.float(), targets, reduction="none").unsqueeze(1)
        assert self.fn is not None
        batch = _batch(x)
        try:
            losses = self.fn(output, batch)
        except FcauditError:
            raise
        except Exception as exc:  # the user's own code: theirs to fix, not fcaudit's bug
            raise FcauditError(f"objective {self.name} raised {type(exc).__name__}: "
                               f"{' '.join(str(exc).split())}; it is called as fn(model_output, "
                               "batch) with batch.inputs and batch.targets, and must return "
                               "per-unit losses [B] or [B, T]") from exc
        return _user_units(losses, len(batch), self.name)

    def hits(self, output: Any, x: Any) -> Tensor | None:
        if not self.accuracy:
            return None
        logits, targets = _classes(output, _batch(x))
        return (logits.argmax(-1) == targets).to(torch.float64)

    def identity(self) -> str:
        """The objective in the cache's identity: a callable by its code and the state it
        reads (:mod:`fcaudit.core.codestate`), not by its name."""
        return self.name if self.fn is None else f"{self.name} {self.state}"


def _classes(output: Any, batch: ExampleBatch) -> tuple[Tensor, Tensor]:
    logits = output_tensors(output)
    if not isinstance(logits, Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise FcauditError("objective 'classification' needs logits [batch, classes] (or an "
                           f"object with .logits); the model returned {type(logits).__name__}"
                           f"{list(logits.shape) if isinstance(logits, Tensor) else ''}")
    if batch.targets is None:  # checked with the data first (check_targets)
        raise FcauditError("objective 'classification' needs targets")
    return logits, batch.targets.long()


def _user_units(value: Any, batch: int, name: str) -> Tensor:
    """A callable's losses as ``[B, U]`` float32, or one line naming the objective: not a
    float tensor, another shape, or a meta tensor (one without values)."""
    if not isinstance(value, Tensor) or not value.is_floating_point() or \
            value.dim() not in (1, 2) or value.shape[0] != batch or value.numel() == 0 or \
            value.is_meta:
        got = f"{'a meta tensor (no values) ' if value.is_meta else ''}" \
              f"{str(value.dtype).removeprefix('torch.')} {list(value.shape)}" \
            if isinstance(value, Tensor) else type(value).__name__
        raise FcauditError(f"objective {name} must return per-unit losses, a float tensor [B] "
                           f"or [B, T] with B={batch} examples; it returned {got}")
    return (value.unsqueeze(1) if value.dim() == 1 else value).detach().to(torch.float32)


def resolve(objective: Any) -> Objective:
    """``AuditOptions.objective`` as an :class:`Objective`, or a one-line error."""
    if callable(objective) and not isinstance(objective, str):
        name = getattr(objective, "__qualname__", type(objective).__name__)
        try:
            state = digest_state(objective)
        except Unreadable as exc:
            state = f"{UNREADABLE}: {exc}"
        return Objective(f"callable:{getattr(objective, '__module__', '?')}.{name}", objective,
                         state)
    if objective not in OBJECTIVES:
        raise FcauditError(f"{arg('objective', objective, owner='AuditOptions')}: choose one "
                           f"of {', '.join(OBJECTIVES)}, or pass a callable (model_output, "
                           "batch) -> per-unit losses [B] or [B, T]")
    return Objective(objective)


def check_targets(objective: Objective, logits: Any, targets: Any, where: str) -> None:
    """Classification targets must be integer class indices ``[N]`` within the logits'
    classes (read off the first batch's logits), before any heavy work."""
    if not objective.accuracy:
        return
    _classes(logits, ExampleBatch(None, targets))
    if targets is None:
        raise FcauditError(f"objective 'classification' needs targets: pass {where} targets "
                           f"({arg('targets', py='AuditData(targets=...)')})")
    if targets.is_floating_point() or targets.dtype == torch.bool or targets.dim() != 1:
        raise FcauditError(f"{where} targets are {str(targets.dtype).removeprefix('torch.')} "
                           f"{list(targets.shape)}; classification needs integer class "
                           "indices [N] (np.int64)")
    classes = int(logits.shape[-1])
    lo, hi = int(targets.min()), int(targets.max())
    if lo < 0 or hi >= classes:
        raise FcauditError(f"{where} targets span [{lo}, {hi}] but the model's logits have "
                           f"{classes} classes; targets must be class indices in [0, "
                           f"{classes})")
