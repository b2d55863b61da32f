"""Replay: run the frozen model with supplied coefficients, controllers replaced.

Each site module is swapped for a :class:`CoefficientStub` whose forward ignores its
inputs' values and returns the site adapter's rebuild of the supplied tensor. The
controller's learned computation never runs, so it cannot react to perturbed hidden
states. The stub hands the model a fresh copy on each call: a model that edits the
controller's output in place cannot corrupt the tensors being fed.

Prefix reuse: when one site alone is intervened, every block that ended before that
site started computes exactly what it computed in the correct replay; :func:`tracing`
records those blocks' outputs once per batch and :class:`OutputStub` returns them, so
only the suffix of the model is recomputed.

Both stubs are :class:`StandIn` modules: any attribute the model reads of the module
they replace (a hybrid's ``layer.block_type``, a router's ``num_experts``) is read from
that module, so only its call is replaced.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from fcaudit.core.contract import Site, SiteCall
from fcaudit.core.errors import UsageError
from fcaudit.core.hooks import hooks
from fcaudit.core.sites import SiteSpec, check_sites, find_sites


class StandIn(nn.Module):
    """Stands in for ``original`` at its path: its call is replaced, nothing else. An
    attribute the stand-in lacks is read from ``original``, since models read attributes
    of the modules they call (a hybrid's layer kind, a router's expert count) beside
    calling them; without this a stub the forward reads crashes the pass."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self._original = (original,)  # in a tuple: not registered as a child module

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            held = self.__dict__.get("_original")
            if held is None:  # not built yet: nothing to read from
                raise
            return getattr(held[0], name)


class CoefficientStub(StandIn):
    """Stands in for a controller: returns the output its coefficients stand for."""

    def __init__(self, site: Site, original: nn.Module, coefficients: Tensor) -> None:
        super().__init__(original)
        self.site = site
        self.coefficients = coefficients
        self.calls = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        batch, seq_len = self.coefficients.shape[:2]
        call = SiteCall(self._original[0], args, kwargs, batch, seq_len)
        return self.site.adapter.rebuild(self.coefficients.clone(), call)


def swap_module(model: nn.Module, path: str, module: nn.Module) -> nn.Module:
    """Put ``module`` at ``path``; return what was there."""
    parent_path, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    old = parent._modules[child]
    parent._modules[child] = module
    return old


@contextlib.contextmanager
def swapped(model: nn.Module, replacements: Mapping[str, nn.Module]) -> Iterator[None]:
    """Modules swapped in at the given paths for the duration of the block. A module the
    model also holds under other paths is swapped at each: a call through any of them is
    the controller's (vLLM's MoE runner calls the router its block also holds)."""
    ids = {path: id(model.get_submodule(path)) for path in replacements}
    held: dict[int, list[str]] = {i: [] for i in ids.values()}
    for name, found in model.named_modules(remove_duplicate=False):
        if name and id(found) in held:
            held[id(found)].append(name)
    originals: list[tuple[str, nn.Module]] = []
    try:
        for path, module in replacements.items():
            for alias in held[ids[path]] or [path]:
                originals.append((alias, swap_module(model, alias, module)))
        yield
    finally:
        for path, module in reversed(originals):
            swap_module(model, path, module)


@contextlib.contextmanager
def replaying(model: nn.Module,
              coefficients: Mapping[Site, Tensor]) -> Iterator[dict[str, CoefficientStub]]:
    """Replace each given site by a stub feeding its tensor; yields the stubs by site name.

    Sites not in ``coefficients`` keep their live controller.
    """
    stubs = {site.name: CoefficientStub(site, model.get_submodule(site.path), tensor)
             for site, tensor in coefficients.items()}
    paths = {site.path: stubs[site.name] for site in coefficients}
    with swapped(model, paths):
        yield stubs


@contextlib.contextmanager
def replay(model: nn.Module, coefficients: Mapping[str, Tensor] | Mapping[Site, Tensor],
           sites: SiteSpec = None) -> Iterator[None]:
    """``with fcaudit.replay(model, recording): model(ids)`` runs ``model`` with each
    named controller replaced by the given coefficients ``[B, T, *trailing]``.

    ``coefficients``: the :class:`~fcaudit.core.recording.Recording` that
    :func:`fcaudit.record` returned, or one derived from it (an intervention's result):
    replayed at its own resolved sites, so globs need not be repeated. Or any mapping
    keyed by site name or :class:`~fcaudit.Site`, whose names ``sites`` resolves as in
    :func:`fcaudit.record` (globs, Sites or the model's declaration). Sites left out
    keep their live controller.
    """
    from fcaudit.core.recording import Recording
    if sites is None and isinstance(coefficients, Recording):
        by_name = {s.name: s for s in check_sites(model, coefficients.sites)}
    else:
        by_name = {s.name: s for s in find_sites(model, sites)}
    fed: dict[Site, Tensor] = {}
    for key, tensor in coefficients.items():
        site = key if isinstance(key, Site) else by_name.get(key)
        if site is None:
            raise UsageError(
                f"no site named {key!r}; the sites are {', '.join(by_name) or 'none'} (replay "
                "the Recording fcaudit.record returned, or pass the same sites= as to record)")
        fed[site] = tensor
    with replaying(model, fed):
        yield


# ------------------------------------------------------------------ prefix reuse


def clone_tree(value: Any) -> Any:
    """A copy of a module output: tensors cloned, tuples, lists and dicts rebuilt."""
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(clone_tree(v) for v in value)
    if isinstance(value, dict):
        return {k: clone_tree(v) for k, v in value.items()}
    return value


class OutputStub(StandIn):
    """Stands in for a block whose output on this batch is already known."""

    def __init__(self, original: nn.Module, output: Any) -> None:
        super().__init__(original)
        self._output = (output,)  # in a tuple: tensors here are not buffers of the model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return clone_tree(self._output[0])


@dataclass
class BlockTrace:
    """When each block and site ran in one pass, and each block's output.

    A block that ended before a site started computed nothing that depends on that
    site; fed the same coefficients everywhere else, it computes the same output again,
    so a replay that intervenes on that site alone may take it from here.
    """

    outputs: dict[str, Any] = field(default_factory=dict)
    ends: dict[str, int] = field(default_factory=dict)
    starts: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def prefix(self, site_path: str) -> list[str]:
        """Blocks that ran exactly once and ended before ``site_path`` started."""
        start = self.starts.get(site_path)
        if start is None:
            return []
        return [p for p, end in self.ends.items() if self.calls[p] == 1 and end < start]


@contextlib.contextmanager
def tracing(model: nn.Module, blocks: Sequence[str],
            site_paths: Sequence[str]) -> Iterator[BlockTrace]:
    """Record the call order of ``blocks`` and sites, and the blocks' outputs, for one pass."""
    trace = BlockTrace()
    clock = itertools.count()

    def site_start(path: str) -> Callable[..., None]:
        def start(_m: nn.Module, _a: Any) -> None:  # returns None: the inputs stay as given
            trace.starts.setdefault(path, next(clock))
        return start

    def block_end(path: str) -> Callable[..., None]:
        def end(_m: nn.Module, _a: Any, out: Any) -> None:
            trace.calls[path] = trace.calls.get(path, 0) + 1
            trace.ends[path] = next(clock)
            trace.outputs[path] = clone_tree(out)
        return end
    with hooks(model, {p: site_start(p) for p in site_paths}, kind="pre"), \
            hooks(model, {p: block_end(p) for p in blocks}):
        yield trace


@contextlib.contextmanager
def selecting(stubs: Mapping[str, CoefficientStub]) -> Iterator[dict[str, Tensor]]:
    """The experts every routing site's rebuilt output selects in one pass
    (``{site name: [B, T, k]}``), for sites whose adapter is a router's."""
    from fcaudit.core.contract import RoutingAdapter
    chosen: dict[str, Tensor] = {}
    watched: dict[str | nn.Module, Callable[..., None]] = {}
    for name, stub in stubs.items():
        adapter = stub.site.adapter
        if not isinstance(adapter, RoutingAdapter):
            continue

        def hook(module: CoefficientStub, args: tuple[Any, ...], kwargs: dict[str, Any],
                 output: Any, name: str = name, adapter: Any = adapter) -> None:
            batch, seq_len = module.coefficients.shape[:2]
            call = SiteCall(module._original[0], args, kwargs, batch, seq_len)
            chosen[name] = adapter.selected_experts(output, call).cpu()
        watched[stub] = hook
    with hooks(None, watched, with_kwargs=True):
        yield chosen
