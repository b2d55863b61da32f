"""Controller sites: find them, record their outputs, replay supplied coefficients.

Recording uses forward hooks, so the live model runs unchanged. Replay swaps each
controller module for a :class:`CoefficientStub` that returns a supplied tensor,
so the controller's own computation never runs and cannot react to perturbed
hidden states.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn

from .errors import FcauditError
from .models import Site


def declared_sites(model: nn.Module) -> list[Site] | None:
    """The model's own site declaration, or None for a model that has none."""
    declare = getattr(model, "controller_sites", None)
    return list(declare()) if callable(declare) else None


def match_modules(model: nn.Module, pattern: str, option: str, example: str) -> list[str]:
    """Module paths matching a glob, outermost matches only, in module order."""
    names = [name for name, _ in model.named_modules() if name]
    hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
    # a glob like "blocks.*" would also match children; keep outermost matches
    hits = [n for n in hits if not any(n.startswith(h + ".") for h in hits if h != n)]
    if not hits:
        raise FcauditError(
            f"{option} {pattern!r} matched no module of {type(model).__name__}; list module "
            f"paths with `fcaudit sites --model SPEC --all` and pass a glob such as {example!r}")
    return hits


def resolve_sites(model: nn.Module, patterns: Sequence[str] | None = None) -> list[Site]:
    """Sites to audit: matched by ``patterns`` (module-path globs) or as declared.

    Each glob defines one family (named by the glob); its matches, in module
    order, are that family's layers 0, 1, ...
    """
    if patterns:
        sites: list[Site] = []
        for pattern in patterns:
            hits = match_modules(model, pattern, "--sites", "blocks.*.gate")
            sites += [Site(name=n, path=n, family=pattern, layer=i) for i, n in enumerate(hits)]
        return sites
    sites_declared = declared_sites(model)
    if not sites_declared:
        raise FcauditError(
            f"{type(model).__name__} declares no controller sites; name them with --sites "
            "(a module-path glob such as 'blocks.*.gate')")
    return sites_declared


def _check_coefficients(site: Site, out: object, batch: int, seq_len: int) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise FcauditError(
            f"site {site.name} returned {type(out).__name__}, not a tensor; --sites must name "
            "modules whose output is the coefficient tensor [batch, positions, ...]")
    if out.dim() < 2 or out.shape[0] != batch or out.shape[1] != seq_len:
        raise FcauditError(
            f"site {site.name} returned shape {tuple(out.shape)}, expected [batch={batch}, "
            f"positions={seq_len}, ...]; --sites must name per-token coefficient modules")
    return out


@contextlib.contextmanager
def recording(model: nn.Module, sites: Sequence[Site], batch: int,
              seq_len: int) -> Iterator[dict[str, torch.Tensor]]:
    """Hook every site; the yielded dict fills with each site's detached output."""
    captured: dict[str, torch.Tensor] = {}
    handles = []
    for site in sites:
        def hook(_module: nn.Module, _args: object, out: object, site: Site = site) -> None:
            captured[site.name] = _check_coefficients(site, out, batch, seq_len).detach()
        handles.append(model.get_submodule(site.path).register_forward_hook(hook))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()
    missing = [s.name for s in sites if s.name not in captured]
    if missing:
        raise FcauditError(f"controller sites never ran during the forward pass: "
                           f"{', '.join(missing)}; name modules the model actually calls")


@torch.no_grad()
def record(model: nn.Module, input_ids: torch.Tensor,
           sites: Sequence[Site] | None = None) -> dict[str, torch.Tensor]:
    """One unperturbed pass: site name -> coefficients ``[B, T, *trailing]``, layer order."""
    sites = list(sites) if sites is not None else resolve_sites(model)
    with recording(model, sites, *input_ids.shape[:2]) as captured:
        model(input_ids)
    return {s.name: captured[s.name] for s in sites}


class CoefficientStub(nn.Module):
    """Stands in for a controller: ignores its inputs, returns the supplied tensor."""

    def __init__(self, site: Site, coefficients: torch.Tensor) -> None:
        super().__init__()
        self.site = site
        self.coefficients = coefficients

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        return self.coefficients


def _swap(model: nn.Module, path: str, module: nn.Module) -> nn.Module:
    parent_path, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    old = parent._modules[child]
    parent._modules[child] = module
    return old


@contextlib.contextmanager
def replaying(model: nn.Module, coefficients: Mapping[Site, torch.Tensor]) -> Iterator[None]:
    """Replace each named site by a stub returning the given coefficients.

    Sites not in ``coefficients`` keep their live controller.
    """
    originals: list[tuple[str, nn.Module]] = []
    try:
        for site, tensor in coefficients.items():
            originals.append((site.path, _swap(model, site.path, CoefficientStub(site, tensor))))
        yield
    finally:
        for path, module in reversed(originals):
            _swap(model, path, module)
