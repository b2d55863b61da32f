"""What an audit result's numbers say of each other, checked when a result is read.

A well-typed ``audit.json`` can still be one fcaudit never wrote: a penalty edited by hand
keeps its type. These invariants hold in every result fcaudit builds, by construction
(:mod:`fcaudit.engine.summary`, :mod:`fcaudit.engine.metrics`), up to float rounding, so a
file that breaks one was edited or damaged:

* a condition's penalty is its NLL minus ``correct``'s (``delta = nll - correct.nll``), its
  NLL the mean of its repeats and each repeat's penalty that repeat minus ``correct``
  (per layer and for custom conditions alike);
* a retention's gap is ``global-mean``'s NLL minus ``correct``'s; it has a value (and an
  interval) exactly when it is ``defined``, which needs its gap's interval above 0, and the
  value is ``100 (G - P) / (G - C)`` of the conditions' NLLs (on accuracy: of their
  accuracies);
* the interaction is ``Delta(reassign+shuffle) - Delta(reassign) - Delta(shuffle)``;
* every estimate lies inside its own 95% interval (penalties, gaps, shares, the exit and
  savings frontiers; the timing ratio of ``execution`` is not one of these: its interval
  is over timing pairs, measured and not rebuilt).

The first broken invariant is raised as a :class:`~fcaudit.io.typedjson.SchemaError` at the
field's dotted path, as a type error is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from fcaudit.core.conditions import CORRECT, GLOBAL_MEAN, REASSIGN, REASSIGN_SHUFFLE, SHUFFLE
from fcaudit.io.typedjson import SchemaError

REL = 1e-9  # float rounding between a mean of differences and a difference of means
POINTS = (("value", "ci95"), ("delta", "ci95"), ("gap", "gap_ci95"))  # estimate, interval
NOT_REBUILT = ("execution", "runtime")  # measured sections whose intervals are not built here


def check_consistent(result: Any) -> None:
    """Raise :class:`SchemaError` at the first invariant ``result`` (an AuditResult)
    breaks (see the module docstring)."""
    correct = result.conditions[CORRECT]
    for path, cond in _conditions(result):
        _condition(path, cond, correct.nll)
    for name, ret in result.retention.items():
        _retention(f"retention.{name}", ret, result.conditions, name, "nll")
        if ret.accuracy is not None:
            _retention(f"retention.{name}.accuracy", ret.accuracy, result.conditions, name,
                       "accuracy")
    parts = [result.conditions.get(n) for n in (REASSIGN_SHUFFLE, REASSIGN, SHUFFLE)]
    if result.interaction is not None and None not in parts:
        both, reassign, shuffle = parts
        _same("interaction.value", result.interaction.value,
              both.delta - reassign.delta - shuffle.delta, "the interaction is "
              "Delta(reassign+shuffle) - Delta(reassign) - Delta(shuffle)",
              both.nll, reassign.nll, shuffle.nll)
    for path, node in _dataclasses(result, ""):
        _inside(path, node)


def _conditions(result: Any) -> Iterator[tuple[str, Any]]:
    for name, cond in result.conditions.items():
        yield f"conditions.{name}", cond
    for name, conds in result.per_layer.items():
        for i, cond in enumerate(conds):
            yield f"per_layer.{name}[{i}]", cond
    for name, cond in (result.custom_conditions or {}).items():
        yield f"custom_conditions.{name}", cond


def _condition(path: str, cond: Any, correct: float) -> None:
    _same(f"{path}.delta", cond.delta, cond.nll - correct, "the penalty is nll - correct.nll",
          cond.nll, correct)
    if len(cond.repeats) != len(cond.repeat_deltas) or not cond.repeats:
        raise SchemaError(f"{path}.repeat_deltas", f"holds {len(cond.repeat_deltas)} values for "
                                                   f"{len(cond.repeats)} repeats")
    _same(f"{path}.nll", cond.nll, sum(cond.repeats) / len(cond.repeats),
          "the NLL is the mean of its repeats", *cond.repeats)
    for i, (nll, delta) in enumerate(zip(cond.repeats, cond.repeat_deltas, strict=True)):
        _same(f"{path}.repeat_deltas[{i}]", delta, nll - correct,
              "a repeat's penalty is its NLL minus correct.nll", nll, correct)


def _retention(path: str, ret: Any, conditions: dict[str, Any], profile: str,
               measure: str) -> None:
    """``measure``: the conditions' field the retention reads (``nll``, ``accuracy``; the
    accuracy gap is correct's minus global-mean's, the loss gap the other way round)."""
    if (ret.value is None) != (ret.ci95 is None) or ret.defined != (ret.value is not None):
        raise SchemaError(f"{path}.defined", f"is {str(ret.defined).lower()}, yet the value "
                                             f"is {ret.value} with interval {ret.ci95}")
    if ret.defined and not ret.gap_ci95[0] > 0:
        raise SchemaError(f"{path}.value", f"is given, yet the gap's interval {ret.gap_ci95} "
                                           "is not above 0 (no share of noise is reported)")
    sign = -1.0 if measure == "accuracy" else 1.0
    top, floor = (getattr(conditions.get(n), measure, None) for n in (CORRECT, GLOBAL_MEAN))
    if top is None or floor is None:
        return
    _same(f"{path}.gap", ret.gap, sign * (floor - top), f"the gap is {GLOBAL_MEAN} minus "
          f"{CORRECT} ({measure})", floor, top)
    kept = getattr(conditions.get(profile), measure, None)
    if ret.value is not None and kept is not None:
        expected = 100.0 * sign * (floor - kept) / ret.gap
        scale = 100.0 * max(1.0, abs(floor), abs(kept), abs(top)) / abs(ret.gap)
        _same(f"{path}.value", ret.value, expected, f"the share is 100 ({GLOBAL_MEAN} - "
              f"{profile}) / gap ({measure})", scale)


def _same(path: str, found: float, expected: float, why: str, *scale: float) -> None:
    """``found`` equals ``expected`` within float rounding of numbers of size ``scale``."""
    size = max([1.0, abs(expected), *(abs(s) for s in scale)])
    if abs(found - expected) > REL * size:
        raise SchemaError(path, f"is {found!r}, but {why}: {expected!r}")


def _dataclasses(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    """Every dataclass in the result with its dotted path, the sections in
    :data:`NOT_REBUILT` left out."""
    if dataclasses.is_dataclass(node):
        yield path, node
        for f in dataclasses.fields(node):
            if not (path == "" and f.name in NOT_REBUILT):
                yield from _dataclasses(getattr(node, f.name),
                                        f"{path}.{f.name}" if path else f.name)
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _dataclasses(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _dataclasses(value, f"{path}[{i}]")


def _inside(path: str, node: Any) -> None:
    """Each estimate of ``node`` inside its own interval (fcaudit widens an interval to
    hold its estimate: :func:`fcaudit.engine.metrics.interval`)."""
    for point, bounds in POINTS:
        value, ci = getattr(node, point, None), getattr(node, bounds, None)
        if isinstance(value, float) and isinstance(ci, list) and not ci[0] <= value <= ci[1]:
            raise SchemaError(f"{path}.{point}", f"is {value!r}, outside its own interval "
                                                 f"{bounds} {ci}")
