"""Strict reading of result files: JSON into typed dataclasses, every value checked.

A result file (``audit.json``) is read by walking the dataclasses that define it and
their type hints, so every field of every nested object is checked with no hand-kept
list: the JSON type (a number where ``float`` is declared, never a string or a bool), a
finite number (``NaN``/``Infinity`` never come out of fcaudit, which writes with
``allow_nan=False``), no missing and no unknown field, and :class:`Length` where a
hint carries it (an interval is two numbers), :class:`Ordered` (its lower bound first); a
TypedDict types the keys it declares
and leaves the others free-form. The first problem is raised as
:class:`SchemaError` with the dotted path of the field (``conditions.reassign.delta``),
so the caller can refuse the file in one line that names the file and the field.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any

_PLAIN_KEY = re.compile(r"[A-Za-z0-9_+\-]+")  # shown as .key; any other key as ['key']


@dataclass(frozen=True)
class Length:
    """``Annotated[list[X], Length(n)]``: the list holds exactly ``n`` items."""

    n: int


@dataclass(frozen=True)
class Ordered:
    """``Annotated[list[X], Ordered()]``: the items never decrease (an interval's lower
    bound is never above its upper one)."""


class SchemaError(ValueError):
    """A value that does not match its declared type, at ``path`` inside the file."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path or 'the top level'} {problem}")
        self.path = path
        self.problem = problem


def load(tp: Any, data: Any, path: str = "") -> Any:
    """``data`` (parsed JSON) as ``tp``: a dataclass, a TypedDict, ``list[X]``,
    ``dict[str, X]``, ``X | None``, ``Annotated[X, Length(n)]``, ``float``, ``int``,
    ``str``, ``bool`` or ``Any`` (any JSON value, numbers finite). Raises
    :class:`SchemaError` at the first mismatch."""
    if typing.get_origin(tp) is typing.Annotated:
        inner, *extras = typing.get_args(tp)
        value = load(inner, data, path)
        for extra in extras:
            if isinstance(extra, Length) and len(value) != extra.n:
                raise SchemaError(path, f"holds {len(value)} values, expected {extra.n}")
            if isinstance(extra, Ordered) and any(a > b for a, b in itertools.pairwise(value)):
                raise SchemaError(path, f"is {value}, whose bounds are reversed (the lower "
                                        "one must not exceed the upper one)")
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _union(typing.get_args(tp), data, path)
    if origin is list:
        (item,) = typing.get_args(tp)
        _expect(isinstance(data, list), data, path, "a list")
        return [load(item, v, f"{path}[{i}]") for i, v in enumerate(data)]
    if origin is dict:
        _, item = typing.get_args(tp)
        _expect(isinstance(data, dict), data, path, "an object")
        return {k: load(item, v, _key(path, k)) for k, v in data.items()}
    if dataclasses.is_dataclass(tp):
        return _dataclass(tp, data, path)
    if typing.is_typeddict(tp):
        return _typeddict(tp, data, path)
    return _plain(tp, data, path)


def _union(options: tuple[Any, ...], data: Any, path: str) -> Any:
    if data is None and type(None) in options:
        return None
    options = tuple(o for o in options if o is not type(None))
    if len(options) == 1:
        return load(options[0], data, path)
    failed = []
    for option in options:
        try:
            return load(option, data, path)
        except SchemaError as exc:
            failed.append((option, exc))
    # an object whose keys only one of the schemas holds (a measured execution section,
    # or one not measured) is refused with that schema's own reason
    fitting = [exc for option, exc in failed if isinstance(data, dict)
               and dataclasses.is_dataclass(option) and set(data) <= _json_keys(option)]
    if len(fitting) == 1:
        raise fitting[0]
    raise SchemaError(path, f"is {_shown(data)}, which matches none of its types")


def _json_keys(tp: Any) -> set[str]:
    return {f.metadata.get("json", f.name) for f in dataclasses.fields(tp)}


def _dataclass(tp: Any, data: Any, path: str) -> Any:
    _expect(isinstance(data, dict), data, path, "an object")
    hints = _hints(tp)
    fields = {f.metadata.get("json", f.name): f for f in dataclasses.fields(tp)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise SchemaError(_key(path, unknown[0]), "is not a field of this schema")
    kwargs = {}
    for key, f in fields.items():
        if key in data:
            kwargs[f.name] = load(hints[f.name], data[key], _key(path, key))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise SchemaError(_key(path, key), "is missing")
    return tp(**kwargs)


def _typeddict(tp: Any, data: Any, path: str) -> dict[str, Any]:
    """An object whose declared keys are typed (and required when the TypedDict says so);
    its other keys are free-form (``Any``)."""
    _expect(isinstance(data, dict), data, path, "an object")
    hints = _hints(tp)
    missing = sorted(tp.__required_keys__ - set(data))
    if missing:
        raise SchemaError(_key(path, missing[0]), "is missing")
    return {k: load(hints.get(k, Any), v, _key(path, k)) for k, v in data.items()}


@functools.cache
def _hints(tp: Any) -> dict[str, Any]:
    """A class's resolved type hints (resolving them is most of the cost of a read)."""
    return typing.get_type_hints(tp, include_extras=True)


def _plain(tp: Any, data: Any, path: str) -> Any:
    if tp is Any:
        _check_finite(data, path)
        return data
    if tp is float:
        _expect(isinstance(data, (int, float)) and not isinstance(data, bool), data, path,
                "a number")
        _check_finite(data, path)
        return float(data)
    if tp is int:
        _expect(isinstance(data, int) and not isinstance(data, bool), data, path,
                "a whole number")
        _check_finite(data, path)
        return data
    if tp is str:  # a str subclass too (torch's version string is one)
        _expect(isinstance(data, str), data, path, "a string")
        return data
    if tp is bool:
        _expect(isinstance(data, bool), data, path, "true or false")
        return data
    raise TypeError(f"{path}: no reader for the type {tp!r}")  # a schema without a reader


def _check_finite(data: Any, path: str) -> None:
    """Any JSON value, but no NaN, infinity or integer beyond the float range anywhere
    (every number may become a float: ``float(10**400)`` raises)."""
    if isinstance(data, float) and not math.isfinite(data):
        raise SchemaError(path, f"is {data}, expected a finite number")
    if isinstance(data, int) and not isinstance(data, bool) and abs(data) > sys.float_info.max:
        raise SchemaError(path, f"is an integer of {data.bit_length()} bits, beyond the range "
                                "of a float")
    if isinstance(data, dict):
        for k, v in data.items():
            _check_finite(v, _key(path, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            _check_finite(v, f"{path}[{i}]")


def _expect(ok: bool, data: Any, path: str, what: str) -> None:
    if not ok:
        raise SchemaError(path, f"is {_shown(data)}, expected {what}")


def _shown(data: Any) -> str:
    """A value as a problem names it: its JSON kind, and the value when it is short."""
    if data is None or isinstance(data, bool):
        return {None: "null", True: "true", False: "false"}[data]
    if isinstance(data, (dict, list)):
        return "an object" if isinstance(data, dict) else "a list"
    text = repr(data) if isinstance(data, str) else str(data)
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"the {'string' if isinstance(data, str) else 'number'} {text}"


def _key(path: str, key: Any) -> str:
    key = str(key)
    if _PLAIN_KEY.fullmatch(key):
        return f"{path}.{key}" if path else key
    return f"{path}[{key!r}]"
