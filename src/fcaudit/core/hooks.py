"""One lifetime for every hook fcaudit puts on a model: registered for a ``with`` block,
removed again whatever happens (also when registering a later one fails)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

from torch import nn

KINDS = ("forward", "pre")


@contextlib.contextmanager
def hooks(model: nn.Module | None, fns: Mapping[str | nn.Module, Callable[..., object]],
          kind: str = "forward", with_kwargs: bool = False) -> Iterator[None]:
    """``fns``: module path in ``model`` (or the module itself) -> its hook, registered in
    the mapping's order as forward hooks (``kind="forward"``) or forward pre-hooks
    (``kind="pre"``), with the call's keyword arguments when ``with_kwargs``."""
    if kind not in KINDS:
        raise ValueError(f"hook kind {kind!r}: choose one of {', '.join(KINDS)}")
    handles = []
    try:
        for key, fn in fns.items():
            module = key if isinstance(key, nn.Module) else _module(model, key)
            register = module.register_forward_pre_hook if kind == "pre" else \
                module.register_forward_hook
            handles.append(register(fn, with_kwargs=with_kwargs))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _module(model: nn.Module | None, path: str) -> nn.Module:
    assert model is not None, "a module path needs the model it is in"
    return model.get_submodule(path)
