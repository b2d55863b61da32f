"""Replay: run the frozen model with supplied coefficients, controllers replaced.

Each site module is swapped for a :class:`CoefficientStub` whose forward ignores its
inputs' values and returns the site adapter's rebuild of the supplied tensor. The
controller's learned computation never runs, so it cannot react to perturbed hidden
states. The stub hands the model a fresh copy on each call: a model that edits the
controller's output in place cannot corrupt the tensors being fed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from torch import Tensor, nn

from .contract import Site, SiteCall
from .errors import FcauditError
from .sites import SiteSpec, find_sites


class CoefficientStub(nn.Module):
    """Stands in for a controller: returns the output its coefficients stand for."""

    def __init__(self, site: Site, original: nn.Module, coefficients: Tensor) -> None:
        super().__init__()
        self.site = site
        self.coefficients = coefficients
        self._original = (original,)  # in a tuple: not registered as a child module
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
    """Modules swapped in at the given paths for the duration of the block."""
    originals: list[tuple[str, nn.Module]] = []
    try:
        for path, module in replacements.items():
            originals.append((path, swap_module(model, path, module)))
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
    """``with fcaudit.replay(model, coeffs): model(ids)`` runs ``model`` with each named
    controller replaced by the given coefficients ``[B, T, *trailing]`` (keyed by site
    name, as :func:`fcaudit.record` returns them, or by :class:`~fcaudit.Site`).

    ``sites`` resolves names as in :func:`fcaudit.record` (globs, Sites or the model's
    declaration); sites left out keep their live controller.
    """
    by_name = {s.name: s for s in find_sites(model, sites)}
    fed: dict[Site, Tensor] = {}
    for key, tensor in coefficients.items():
        site = key if isinstance(key, Site) else by_name.get(key)
        if site is None:
            raise FcauditError(f"no site named {key!r}; the sites are "
                               f"{', '.join(by_name) or 'none'}")
        fed[site] = tensor
    with replaying(model, fed):
        yield
