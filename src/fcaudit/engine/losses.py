"""The built-in objectives' functions, named by their entries in
:data:`fcaudit.engine.objectives.REGISTRY`, and a user callable's losses checked: torch
lives here so that the registry stays light to import.

Every ``losses`` function takes ``(model_output, batch)`` as a user callable does and
returns per-unit losses ``[B, U]`` float32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from fcaudit.core.errors import DataError, FcauditError, ModelError, UsageError, arg
from fcaudit.core.nll import logits_of, token_nll
from fcaudit.engine.objectives import ObjectiveFn, output_tensors
from fcaudit.io.examples import ExampleBatch

__all__ = ["answer_hits", "answer_targets", "answer_units", "as_batch", "class_hits",
           "class_targets", "class_units", "logits_of", "output_tensors", "token_units",
           "user_units"]


def as_batch(x: Any) -> ExampleBatch:
    """Token ids as a batch whose inputs and targets are the ids (a callable sees both)."""
    return x if isinstance(x, ExampleBatch) else ExampleBatch(x, x)


# token-nll: next-token NLL of the token ids (the inputs)
def token_units(output: Any, batch: ExampleBatch) -> Tensor:
    return token_nll(logits_of(output), batch.inputs)


# classification: cross-entropy of logits [B, C] against integer targets [B]
def class_units(output: Any, batch: ExampleBatch) -> Tensor:
    logits, targets = _classes(output, batch)
    return F.cross_entropy(logits.float(), targets, reduction="none").unsqueeze(1)


def class_hits(output: Any, batch: ExampleBatch) -> Tensor:
    logits, targets = _classes(output, batch)
    return (logits.argmax(-1) == targets).to(torch.float64)


def class_targets(logits: Any, targets: Any, where: str) -> None:
    """Integer class indices ``[N]`` within the logits' classes."""
    _classes(logits, ExampleBatch(None, targets))
    if targets is None:
        raise DataError(f"objective 'classification' needs targets: pass {where} targets "
                        f"({arg('targets', py='AuditData(targets=...)')})")
    if targets.is_floating_point() or targets.dtype == torch.bool or targets.dim() != 1:
        raise DataError(f"{where} targets are {str(targets.dtype).removeprefix('torch.')} "
                        f"{list(targets.shape)}; classification needs integer class "
                        "indices [N] (np.int64)")
    _within(targets, int(logits.shape[-1]), where, "classes", "class indices")


def _within(targets: Tensor, classes: int, where: str, what: str, kind: str) -> None:
    """Every target an index of the logits' last axis (``classes`` entries)."""
    lo, hi = int(targets.min()), int(targets.max())
    if lo < 0 or hi >= classes:
        raise DataError(f"{where} targets span [{lo}, {hi}] but the model's logits have "
                        f"{classes} {what}; targets must be {kind} in [0, {classes})")


def _classes(output: Any, batch: ExampleBatch) -> tuple[Tensor, Tensor]:
    logits = output_tensors(output)
    if not isinstance(logits, Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise ModelError("objective 'classification' needs logits [batch, classes] (or an "
                         f"object with .logits); the model returned {type(logits).__name__}"
                         f"{list(logits.shape) if isinstance(logits, Tensor) else ''}")
    if batch.targets is None:  # checked with the data first (class_targets)
        raise DataError("objective 'classification' needs targets")
    return logits, batch.targets.long()


# selective-copy: cross-entropy of token logits [B, T, V] at the last K positions against
# answer tokens [B, K]; a hit is an example with all K answers right
def answer_units(output: Any, batch: ExampleBatch) -> Tensor:
    logits, targets = _answers(output, batch)
    return F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")


def answer_hits(output: Any, batch: ExampleBatch) -> Tensor:
    logits, targets = _answers(output, batch)
    return (logits.argmax(-1) == targets).all(-1).to(torch.float64)


def answer_targets(logits: Any, targets: Any, where: str) -> None:
    """Integer answer tokens ``[N, K]``, ``K`` within the sequence, ids within the
    vocabulary of the logits ``[B, T, V]``."""
    positions = int(_token_logits(logits).shape[1])
    if targets is None:
        raise DataError(f"objective 'selective-copy' needs targets: pass {where} targets "
                        f"({arg('targets', py='AuditData(targets=...)')}), the answer tokens "
                        "[N, K] predicted at the last K positions")
    if targets.is_floating_point() or targets.dtype == torch.bool or targets.dim() != 2 \
            or not 1 <= targets.shape[1] <= positions:
        raise DataError(f"{where} targets are {str(targets.dtype).removeprefix('torch.')} "
                        f"{list(targets.shape)}; selective-copy needs integer answer tokens "
                        f"[N, K] (np.int64) with 1 <= K <= {positions}, the sequence length")
    _within(targets, int(logits.shape[-1]), where, "token ids", "token ids")


def _token_logits(output: Any) -> Tensor:
    logits = output_tensors(output)
    if not isinstance(logits, Tensor) or logits.dim() != 3 or not logits.is_floating_point():
        raise ModelError("objective 'selective-copy' needs token logits [batch, tokens, "
                         "vocabulary] (or an object with .logits); the model returned "
                         f"{type(logits).__name__}"
                         f"{list(logits.shape) if isinstance(logits, Tensor) else ''}")
    return logits


def _answers(output: Any, batch: ExampleBatch) -> tuple[Tensor, Tensor]:
    """The logits at the last ``K`` positions ``[B, K, V]`` and the answers ``[B, K]``."""
    logits = _token_logits(output)
    if batch.targets is None:  # checked with the data first (answer_targets)
        raise DataError("objective 'selective-copy' needs targets")
    targets = batch.targets.long()
    return logits[:, logits.shape[1] - targets.shape[1]:], targets


def user_units(fn: ObjectiveFn, name: str, output: Any, batch: ExampleBatch) -> Tensor:
    """A user callable's losses as ``[B, U]`` float32, or one line naming the objective
    (it raised; or returned no float tensor, another shape, or a meta tensor, one
    without values)."""
    try:
        value = fn(output, batch)
    except FcauditError:
        raise
    except Exception as exc:  # the user's own code: theirs to fix, not fcaudit's bug
        raise UsageError(f"objective {name} raised {type(exc).__name__}: "
                         f"{' '.join(str(exc).split())}; it is called as fn(model_output, "
                         "batch) with batch.inputs and batch.targets, and must return "
                         "per-unit losses [B] or [B, T]", option="objective") from exc
    if not isinstance(value, Tensor) or not value.is_floating_point() or \
            value.dim() not in (1, 2) or value.shape[0] != len(batch) or value.numel() == 0 or \
            value.is_meta:
        got = f"{'a meta tensor (no values) ' if value.is_meta else ''}" \
              f"{str(value.dtype).removeprefix('torch.')} {list(value.shape)}" \
            if isinstance(value, Tensor) else type(value).__name__
        raise UsageError(f"objective {name} must return per-unit losses, a float tensor [B] "
                         f"or [B, T] with B={len(batch)} examples; it returned {got}",
                         option="objective")
    return (value.unsqueeze(1) if value.dim() == 1 else value).detach().to(torch.float32)
