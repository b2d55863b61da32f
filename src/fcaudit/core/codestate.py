"""A callable's code and the state it reads, as one SHA-256: what a cached result computed
by a user's code (an objective, a model's classes) may be reused under.

A name or the bytecode alone does not tell two callables apart: a closure over another
label-smoothing value, a changed default argument or module-level constant, an edited
helper it calls, or a loss object holding other class weights compute other numbers with
the same code. So the digest follows what the callable can read: its bytecode and
constants, its defaults, closure cells and the globals its code names (recursively,
through nested functions, methods, ``functools.partial``, classes and the objects' own
attributes), tensors and arrays by their bits. Library code (the standard library and
installed packages) enters by its qualified name; the top-level packages met are
returned beside the digest (:func:`read_state`), so their installed versions can enter
the identity. A user's module enters by its file's SHA-256.

A C object without ``__dict__`` or ``__slots__`` enters by what pickling would save of it
(a compiled pattern, a random generator's state). Anything whose state cannot be read as
bits (a lock, a tensor without data) makes the digest *unreadable*: then nothing cached
can be proven to be that callable's, and the caller must not reuse it.
"""

from __future__ import annotations

import copyreg
import functools
import hashlib
import os
import site
import sys
import sysconfig
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

_PLAIN = (type(None), bool, int, float, complex, str, bytes, bytearray, range, slice,
          type(Ellipsis), torch.dtype, torch.device, torch.Size, np.dtype, np.generic)
_BUILTIN_CALLABLES = (types.BuiltinFunctionType, types.BuiltinMethodType,
                      types.MethodWrapperType, types.WrapperDescriptorType,
                      types.MethodDescriptorType, types.ClassMethodDescriptorType,
                      types.GetSetDescriptorType, types.MemberDescriptorType)
_MAX_DEPTH = 64
# class members that say nothing about what its code computes (``_abc_impl``: isinstance
# caches of abstract base classes; ``__annotations__``: type hints, which Python creates
# empty the first time anything asks a class for them)
# class members that are no behaviour: ``__slotnames__`` is the cache copy and pickle add to
# a class the first time one of its instances is copied, which must not change its code
_NOT_BEHAVIOUR = ("__dict__", "__weakref__", "__doc__", "__module__", "_abc_impl",
                  "__annotations__", "__slotnames__")
# where the standard library and installed packages live (a distribution's own package
# folders, e.g. Debian's dist-packages, and the user's site-packages too)
_LIBRARY_ROOTS = tuple({os.path.join(Path(p).resolve(), "") for p in (
    *(sysconfig.get_paths().get(key) for key in ("stdlib", "platstdlib", "purelib",
                                                   "platlib")),
    *getattr(site, "getsitepackages", list)(),
    getattr(site, "getusersitepackages", str)()) if p})


class Unreadable(Exception):
    """Raised inside the digest: the state of this object cannot be read as bits."""


@functools.lru_cache(maxsize=512)
def _library_module(name: str) -> bool:
    """True for the standard library, built-in modules and installed packages."""
    module = sys.modules.get(name.partition(".")[0])
    file = getattr(module, "__file__", None)
    if module is None or file is None:
        return module is not None or name in sys.builtin_module_names
    return str(Path(file).resolve()).startswith(_LIBRARY_ROOTS)


def _is_library(obj: Any) -> bool:
    module = getattr(obj, "__module__", None)
    return isinstance(module, str) and module != "__main__" and _library_module(module)


def _names(code: types.CodeType) -> set[str]:
    """Every global name the code and the functions defined in it can read."""
    found = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found |= _names(const)
    return found


class _Digest:
    def __init__(self) -> None:
        self.hasher = hashlib.sha256()
        self.seen: set[int] = set()
        self.kept: list[Any] = []  # alive while digesting, so no id in seen is reused
        self.libraries: set[str] = set()  # top-level library packages whose code was met

    def library(self, module: Any) -> None:
        if isinstance(module, str):
            self.libraries.add(module.partition(".")[0])

    def tag(self, *parts: Any) -> None:
        self.hasher.update(repr(parts).encode())

    def feed(self, value: Any, depth: int = 0) -> None:
        if depth > _MAX_DEPTH:
            raise Unreadable(f"objects nested deeper than {_MAX_DEPTH} levels")
        if isinstance(value, _PLAIN):
            self.tag(type(value).__name__, value)
            return
        if isinstance(value, torch.Tensor):
            self._tensor(value)
            return
        if isinstance(value, np.ndarray) and not value.dtype.hasobject:
            self.tag("ndarray", str(value.dtype), value.shape)
            self.hasher.update(np.ascontiguousarray(value).view(np.uint8).reshape(-1).data)
            return
        if id(value) in self.seen:  # a cycle, or an object met before: already in the digest
            self.tag("seen", type(value).__qualname__)
            return
        self.seen.add(id(value))
        self.kept.append(value)
        self._object(value, depth + 1)

    def _tensor(self, t: torch.Tensor) -> None:
        t = t.detach()
        if t.device.type == "meta" or t.is_sparse or t.is_quantized:
            raise Unreadable(f"a {t.device.type} {'sparse ' if t.is_sparse else ''}tensor")
        t = t.to("cpu").contiguous()
        self.tag("tensor", str(t.dtype), tuple(t.shape))
        self.hasher.update(t.reshape(-1).view(torch.uint8).numpy().data)

    def _object(self, value: Any, depth: int) -> None:
        if isinstance(value, (list, tuple)):
            self.tag(type(value).__name__, len(value))
            for item in value:
                self.feed(item, depth)
        elif isinstance(value, (set, frozenset)):
            parts = sorted(digest_state(item, depth) for item in value)
            self.tag(type(value).__name__, parts)
        elif isinstance(value, (dict, types.MappingProxyType)):
            self.tag("dict", len(value))
            for key, item in value.items():
                self.feed(key, depth)
                self.feed(item, depth)
        elif isinstance(value, types.ModuleType):
            self._module(value)
        elif isinstance(value, types.FunctionType):
            self._function(value, depth)
        elif isinstance(value, types.MethodType):
            self.tag("method")
            self.feed(value.__func__, depth)
            self.feed(value.__self__, depth)
        elif isinstance(value, functools.partial):
            self.tag("partial")
            for part in (value.func, value.args, value.keywords):
                self.feed(part, depth)
        elif isinstance(value, (staticmethod, classmethod)):
            self.feed(value.__func__, depth)
        elif isinstance(value, property):
            for part in (value.fget, value.fset, value.fdel):
                self.feed(part, depth)
        elif isinstance(value, _BUILTIN_CALLABLES):
            owner = getattr(value, "__self__", None)
            self.tag("builtin", getattr(value, "__module__", None), value.__qualname__)
            self.library(getattr(value, "__module__", None))
            if owner is not None and not isinstance(owner, (types.ModuleType, type)):
                self.feed(owner, depth)
        elif isinstance(value, types.CodeType):
            self._code(value, depth)
        elif isinstance(value, type):
            self._class(value, depth)
        else:
            self._instance(value, depth)

    def _module(self, module: types.ModuleType) -> None:
        file = getattr(module, "__file__", None)
        if _library_module(module.__name__) or file is None:
            self.tag("module", module.__name__)
            self.library(module.__name__)
            return
        self.tag("module", module.__name__, hashlib.sha256(Path(file).read_bytes()).hexdigest())

    def _code(self, code: types.CodeType, depth: int) -> None:
        self.tag("code", code.co_name, code.co_names, code.co_varnames)
        self.hasher.update(code.co_code)
        for const in code.co_consts:
            self.feed(const, depth)

    def _function(self, fn: types.FunctionType, depth: int) -> None:
        if _is_library(fn):
            self.tag("function", fn.__module__, fn.__qualname__)
            self.library(fn.__module__)
            return
        self._code(fn.__code__, depth)
        self.feed(fn.__defaults__, depth)
        self.feed(fn.__kwdefaults__, depth)
        for cell in fn.__closure__ or ():
            try:
                content = cell.cell_contents
            except ValueError:  # a cell not yet filled
                content = "<empty cell>"
            self.feed(content, depth)
        scope = fn.__globals__
        for name in sorted(_names(fn.__code__)):
            if name in scope:
                self.tag("global", name)
                self.feed(scope[name], depth)

    def _class(self, cls: type, depth: int) -> None:
        self.tag("class", cls.__module__, cls.__qualname__)
        if _is_library(cls):
            self.library(cls.__module__)
            return
        for base in cls.__bases__:
            self.feed(base, depth)
        for name, member in vars(cls).items():
            if name not in _NOT_BEHAVIOUR:
                self.tag("member", name)
                self.feed(member, depth)

    def _instance(self, value: Any, depth: int) -> None:
        cls = type(value)
        self.feed(cls, depth)
        state = getattr(value, "__dict__", None)
        slots = [s for klass in cls.__mro__ for s in getattr(klass, "__slots__", ())
                 if isinstance(s, str) and s not in ("__dict__", "__weakref__")]
        if state is None and not slots:  # a C type: what pickling would save, if it can
            self._reduced(value, depth)
            return
        if state is not None:
            self.feed(dict(state), depth)
        for slot in slots:
            self.tag("slot", slot)
            self.feed(getattr(value, slot, "<unset>"), depth)


    def _reduced(self, value: Any, depth: int) -> None:
        cls = type(value)
        try:  # as pickle would: a reducer registered with copyreg (re.Pattern) first
            reducer = copyreg.dispatch_table.get(cls)
            reduced = reducer(value) if reducer else value.__reduce_ex__(4)
        except Exception as exc:  # e.g. a lock, a generator: no state to save
            raise Unreadable(f"a {cls.__module__}.{cls.__qualname__}") from exc
        if isinstance(reduced, str):  # a module-level singleton, by name
            self.tag("global", reduced)
            return
        parts = list(reduced[:3]) + [list(it) if it is not None else None
                                     for it in reduced[3:5]]
        self.tag("reduced", len(parts))
        for part in parts:
            self.feed(part, depth)


def read_state(value: Any, depth: int = 0) -> tuple[str, frozenset[str]]:
    """SHA-256 hex digest of ``value``'s code and state (see the module docstring) and the
    top-level library packages its code reached (their versions are not in the digest:
    the caller adds them); raises :class:`Unreadable` naming what could not be read (also
    when reading it failed: an error here must mean "do not reuse", never a crash)."""
    digest = _Digest()
    try:
        digest.feed(value, depth)
    except Unreadable:
        raise
    except (Exception, RecursionError) as exc:
        raise Unreadable(f"something whose reading failed ({type(exc).__name__}: "
                         f"{str(exc)[:80]})") from exc
    return digest.hasher.hexdigest(), frozenset(digest.libraries)


def digest_state(value: Any, depth: int = 0) -> str:
    """The digest of :func:`read_state` alone."""
    return read_state(value, depth)[0]
