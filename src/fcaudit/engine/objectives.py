"""Objectives: the per-unit loss every pass of the audit scores (docs/method.md, Objectives).

``token-nll`` (the default) is next-token NLL over positions 1..T-1 of token ids, as it
always was (:func:`fcaudit.core.nll.token_nll`, unchanged); ``classification`` is the
cross-entropy of logits ``[B, C]`` against integer targets ``[B]``, one unit per example,
with accuracy beside it; ``selective-copy`` is the cross-entropy of token logits
``[B, T, V]`` at the last ``K`` positions against answer tokens ``[B, K]``, one unit per
answer, an example a hit when all ``K`` are right (the selective-copying task of
:mod:`fcaudit.io.selective_copy`, which ``fcaudit train --task`` trains on); a callable
``(model_output, batch) -> losses [B] or [B, T]`` is the user's own. Penalties,
retention and the bootstrap (over examples) read the mean of each example's units,
whichever objective made them.

The built-in objectives are defined once, in :data:`REGISTRY`: each entry's name, words
and the functions of :mod:`fcaudit.engine.losses` it scores with, named here and resolved
on first use (as the condition registry names its feeds), so this module imports no
torch: ``--objective``'s choices and help are read off it. Adding a built-in objective is
one :class:`BuiltinObjective` entry below plus its functions in ``engine/losses.py`` (and
its tests); the rest of the engine asks :class:`Objective`, never a name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fcaudit.core.errors import UsageError, arg
from fcaudit.core.registry import Registry

if TYPE_CHECKING:
    from torch import Tensor

    from fcaudit.io.examples import ExampleBatch

UNREADABLE = "state not readable as bits"
ObjectiveFn = Callable[[Any, "ExampleBatch"], "Tensor"]
LOSSES = "fcaudit.engine.losses"  # the module whose functions the entries name
LOSS = "loss"  # what losses are called where the objective names none (a user's callable)


@dataclass(frozen=True)
class BuiltinObjective:
    """One built-in objective. The functions are names in :mod:`fcaudit.engine.losses`:
    ``losses(output, batch)`` per-unit losses ``[B, U]`` float32 (``batch`` an
    :class:`~fcaudit.io.examples.ExampleBatch`, as a user callable gets; token ids are
    its inputs); ``compared(output)`` the tensor(s) the identity replay compares bit for
    bit; ``hits(output, batch)`` 1.0 per correctly scored example ``[B]``, or None: no
    accuracy; ``check(logits, targets, where)`` refuses targets it cannot score before
    any heavy work (``logits``: the first batch's), or None: any targets."""

    name: str
    unit: str  # what one of its losses scores ("token", "example")
    what: str  # its losses in words: "the model's {what} is"
    help: str  # its phrase in ``--objective``'s help
    losses: str
    compared: str = "output_tensors"
    loss: str = LOSS  # what its losses are called in tables ("NLL", "answer loss"; nats)
    hits: str | None = None
    check: str | None = None
    tokens: bool = False  # it scores token ids (else other inputs, AuditData(inputs=...))
    default: bool = False  # the default objective for its kind of inputs
    # the module generating its synthetic task (``fcaudit train --task NAME`` trains on
    # it, an audit of such a run reads that task's data and is scored by this objective)
    task: str | None = None

    def call(self, role: str, *args: Any) -> Any:
        """Its function for ``role`` ("losses", "compared", "hits", "check") applied."""
        fn: Callable[..., Any] = getattr(importlib.import_module(LOSSES), getattr(self, role))
        return fn(*args)


SELECTIVE_COPY = "selective-copy"  # the selective-copying task's objective (a name studies use)

REGISTRY: tuple[BuiltinObjective, ...] = (
    BuiltinObjective("token-nll", "token", "next-token NLL",
                     "token-nll (token ids, the default)", losses="token_units", loss="NLL",
                     compared="logits_of", tokens=True, default=True),
    BuiltinObjective("classification", "example", "cross-entropy of its logits",
                     "classification (cross-entropy and accuracy of [N, C] logits; the "
                     "default with --inputs)", losses="class_units", loss="cross-entropy",
                     hits="class_hits", check="class_targets", default=True),
    BuiltinObjective(SELECTIVE_COPY, "answer token", "cross-entropy at its answer positions",
                     "selective-copy (cross-entropy of token logits [N, T, V] at the last K "
                     "positions against answer tokens [N, K]; accuracy: all K right; the "
                     "default for a run of the task)",
                     losses="answer_units", loss="answer loss", hits="answer_hits",
                     check="answer_targets", task="fcaudit.io.selective_copy"),
)
OBJECTIVES: Registry[BuiltinObjective] = Registry("objective", REGISTRY, option="objective")


def default_for(tokens: bool) -> str:
    """The objective an audit scores token ids (or other inputs) with unless told."""
    (name,) = (o.name for o in OBJECTIVES.values() if o.default and o.tokens == tokens)
    return name


TOKEN_NLL, CLASSIFICATION = default_for(True), default_for(False)


def loss_name(objective: str | None, per_unit: bool = False) -> str:
    """What an audit's losses are called, from its ``settings.objective``: the registry's
    name for a built-in objective (None, a result written before objectives: the
    next-token NLL), "loss" for the user's callable; ``per_unit``: with what one of them
    scores ("per-token NLL", "per-example cross-entropy")."""
    entry = OBJECTIVES.get(TOKEN_NLL if objective is None else objective)
    name, unit = (LOSS, "unit") if entry is None else (entry.loss, entry.unit)
    return f"per-{unit.replace(' ', '-')} {name}" if per_unit else name


TASKS: Registry[BuiltinObjective] = Registry(
    "task", (o for o in REGISTRY if o.task is not None), option="task")


def run_task(run_config: dict[str, Any] | None) -> BuiltinObjective | None:
    """The synthetic task a run folder trained on (its ``config.json`` ``task``), whose
    data and objective an audit of it uses; None for a run of the corpus or the digits."""
    name = (run_config or {}).get("task")
    if name is None:
        return None
    if name not in TASKS:
        raise UsageError(f"the run trained on task {name!r}, which this fcaudit does not "
                         f"know (it knows {', '.join(TASKS)}); audit it with the fcaudit "
                         "version that trained it", option="model")
    return TASKS[name]


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
    def builtin(self) -> BuiltinObjective | None:
        """Its registry entry (None: a user callable)."""
        return None if self.fn is not None else OBJECTIVES.get(self.name)

    @property
    def provable(self) -> bool:
        """False when a callable reads state fcaudit cannot digest: then no cached result
        can be proven to be its."""
        return not self.state.startswith(UNREADABLE)

    @property
    def tokens(self) -> bool:
        return self.builtin is not None and self.builtin.tokens

    @property
    def accuracy(self) -> bool:
        return self.builtin is not None and self.builtin.hits is not None

    @property
    def checks_targets(self) -> bool:
        """Whether targets are checked against the model's output before any score."""
        return self.builtin is not None and self.builtin.check is not None

    @property
    def unit(self) -> str:
        """What one of its losses scores."""
        return "unit" if self.builtin is None else self.builtin.unit

    def describe(self) -> str:
        """The losses in words with their verb, naming the objective (a callable by its
        qualified name)."""
        if self.builtin is None:
            return f"objective {self.name}: the losses it returned are"
        return f"objective {self.name!r}: the model's {self.builtin.what} is"

    @property
    def fix(self) -> str:
        """What to check when its losses are not finite."""
        if self.builtin is None:
            return "fix the objective, or the model output it reads"
        return "check the model's weights and dtype (try float32)"

    def logits(self, output: Any) -> Any:
        """The tensor(s) the identity replay compares bit for bit."""
        return output_tensors(output) if self.builtin is None \
            else self.builtin.call("compared", output)

    def units(self, output: Any, x: Any) -> Tensor:
        losses = importlib.import_module(LOSSES)
        batch = losses.as_batch(x)
        if self.builtin is None:
            assert self.fn is not None
            return losses.user_units(self.fn, self.name, output, batch)
        return self.builtin.call("losses", output, batch)

    def hits(self, output: Any, x: Any) -> Tensor | None:
        if not self.accuracy:
            return None
        assert self.builtin is not None
        return self.builtin.call("hits", output, importlib.import_module(LOSSES).as_batch(x))

    def identity(self) -> str:
        """The objective in the cache's identity: a callable by its code and the state it
        reads (:mod:`fcaudit.core.codestate`), not by its name."""
        return self.name if self.fn is None else f"{self.name} {self.state}"


def resolve(objective: Any) -> Objective:
    """``AuditOptions.objective`` as an :class:`Objective`, or a one-line error."""
    if callable(objective) and not isinstance(objective, str):
        from fcaudit.core.codestate import Unreadable, digest_state
        name = getattr(objective, "__qualname__", type(objective).__name__)
        try:
            state = digest_state(objective)
        except Unreadable as exc:
            state = f"{UNREADABLE}: {exc}"
        return Objective(f"callable:{getattr(objective, '__module__', '?')}.{name}", objective,
                         state)
    OBJECTIVES.lookup(objective, arg("objective", objective, owner="AuditOptions"),
                      ", or pass a callable (model_output, batch) -> per-unit losses [B] "
                      "or [B, T]")
    return Objective(objective)


def check_targets(objective: Objective, logits: Any, targets: Any, where: str) -> None:
    """The targets must be ones the objective can score (classification: integer class
    indices ``[N]`` within the logits' classes, read off the first batch's logits),
    before any heavy work."""
    if objective.checks_targets:
        assert objective.builtin is not None
        objective.builtin.call("check", logits, targets, where)
