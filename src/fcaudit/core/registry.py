"""One registry type for every named kind of thing fcaudit knows (conditions, objectives,
arches, discovery rules): entries keyed by name with optional aliases, in registration
order, frozen once their module has defined them (a late registration would change what
an audit means depending on import order), and an unknown name refused in one line that
lists the choices and suggests the closest."""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Generic, TypeVar

from fcaudit.core.errors import UsageError

T = TypeVar("T")


def refusal(said: str, given: object, choices: Sequence[str], *, option: str | None = None,
            also: str = "") -> UsageError:
    """``SAID: choose one of A, B, C[ALSO][; did you mean B?]`` as a usage error: the one
    line for any name that is not among ``choices``."""
    close = difflib.get_close_matches(given, choices, n=1) if isinstance(given, str) else []
    hint = f"; did you mean {close[0]}?" if close else ""
    return UsageError(f"{said}: choose one of {', '.join(choices)}{also}{hint}", option=option)


class Registry(Mapping[str, T], Generic[T]):
    """Named entries of one ``kind``, read as a mapping name -> entry (aliases resolve to
    their entry but are not listed). ``frozen``: no entry may be added after construction;
    an open registry is frozen by :meth:`freeze` where its module finishes defining it."""

    def __init__(self, kind: str, entries: Iterable[T] = (), *,
                 name: Callable[[T], str] = lambda entry: entry.name,  # type: ignore[attr-defined]
                 option: str | None = None, frozen: bool = True) -> None:
        self.kind, self.option, self._name = kind, option, name
        self._entries: dict[str, T] = {}
        self._aliases: dict[str, str] = {}
        self._frozen = False
        for entry in entries:
            self.register(entry)
        self._frozen = frozen

    def register(self, entry: T, aliases: Iterable[str] = ()) -> T:
        """Add ``entry`` under its name and ``aliases``; returns it (usable as a decorator)."""
        if self._frozen:
            raise RuntimeError(f"the {self.kind} registry is frozen: register where the "
                               f"{self.kind} is defined")
        key = self._name(entry)
        for name in (key, *aliases):
            if name in self._entries or name in self._aliases:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._entries[key] = entry
        self._aliases.update(dict.fromkeys(aliases, key))
        return entry

    def freeze(self) -> Registry[T]:
        self._frozen = True
        return self

    @contextlib.contextmanager
    def added(self, entry: T, aliases: Iterable[str] = ()) -> Iterator[T]:
        """``entry`` registered for a ``with`` block only, frozen or not: how a test shows
        what one new entry takes, leaving the registry as it found it."""
        frozen, self._frozen = self._frozen, False
        try:
            self.register(entry, aliases)
        finally:
            self._frozen = frozen
        key = self._name(entry)
        try:
            yield entry
        finally:
            del self._entries[key]
            self._aliases = {a: k for a, k in self._aliases.items() if k != key}

    def __getitem__(self, name: str) -> T:
        return self._entries[self._aliases.get(name, name)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._aliases

    def lookup(self, name: str, said: str | None = None, also: str = "") -> T:
        """The entry called ``name``, or a :func:`refusal` (``said`` defaults to
        ``unknown KIND 'NAME'``)."""
        if name in self:
            return self[name]
        raise refusal(said or f"unknown {self.kind} {name!r}", name, list(self),
                      option=self.option, also=also)
