"""Record: run the live model and keep every controller's coefficients.

Forward hooks leave the model unchanged. For each site call the hook takes the
coefficient tensor out of the module's output with the site's adapter, keeps a
detached *clone* (so an in-place operation the model applies to the output later
cannot change what was cached), and checks that the adapter rebuilds the output
from it bit for bit. A site that runs more than once in one forward pass, or never,
is an error: one coefficient tensor per site and pass is what replay can feed back.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fcaudit.core.adapters import AutoAdapter, describe, infer_adapter, same_bits
from fcaudit.core.arrays import blamed_on_inputs, model_input
from fcaudit.core.contract import ControllerAdapter, Site, SiteCall
from fcaudit.core.errors import FcauditError, ModelError, UsageError
from fcaudit.core.hooks import hooks
from fcaudit.core.sites import SiteSpec, find_sites


def _site_error(site: Site, module: nn.Module, message: str) -> FcauditError:
    return FcauditError(f"site {site.name} ({type(module).__name__}, adapter "
                        f"{getattr(site.adapter, 'name', type(site.adapter).__name__)}): {message}")


def capture(site: Site, module: nn.Module, call: SiteCall, output: Any) -> Tensor:
    """The coefficient tensor of one call: extracted, checked, detached and cloned."""
    try:
        coefficients = site.adapter.extract(output, call)
    except FcauditError as exc:
        raise _site_error(site, module, str(exc)) from exc
    if not isinstance(coefficients, Tensor):
        raise _site_error(site, module, f"the adapter's extract returned "
                                        f"{describe(coefficients)}, not a tensor")
    if not coefficients.is_floating_point():
        raise _site_error(site, module, (
            f"coefficients are {str(coefficients.dtype).removeprefix('torch.')}, not floating "
            "point; coefficients must be real numbers (a gate's value, a router's logits): "
            "name the module that produces the scores, not the decision"))
    positions = call.seq_len if site.positions in (None, (1,)) else None  # else a layout's
    if coefficients.dim() < 2 or coefficients.shape[0] != call.batch or (
            positions is not None and coefficients.shape[1] != positions):
        raise _site_error(site, module, f"coefficients have shape {list(coefficients.shape)}, "
                                        f"expected [batch={call.batch}, "
                                        f"positions={positions or 'P'}, ...]")
    kept = coefficients.detach().clone()
    rebuilt = site.adapter.rebuild(kept.clone(), call)
    if not same_bits(rebuilt, output):
        raise _site_error(site, module, (
            f"rebuilding the output from its coefficients does not reproduce it bit for bit "
            f"(output {describe(output)}, rebuilt {describe(rebuilt)}); the adapter does not "
            "fit this module: replay would feed the model something else"))
    return kept


def _positions_of(args: tuple[Any, ...], batch: int) -> int | None:
    """For inputs that are not token ids: the positions of a site whose first input is a
    sequence of vectors ``[batch, P, C]`` (patch tokens), else None (unknown)."""
    first = args[0] if args else None
    if isinstance(first, Tensor) and first.dim() == 3 and first.shape[0] == batch:
        return int(first.shape[1])
    return None


@contextlib.contextmanager
def recording(model: nn.Module, sites: Sequence[Site], batch: int, seq_len: int | None,
              adapters: dict[str, ControllerAdapter] | None = None
              ) -> Iterator[dict[str, Tensor]]:
    """Hook every site for one forward pass; the yielded dict fills with coefficients
    (and ``adapters``, when given, with the adapter each site's output fits: what
    :data:`~fcaudit.core.adapters.AUTO` resolves to, else the site's own).

    On leaving, every site must have run exactly once.
    """
    captured: dict[str, Tensor] = {}
    fitted = adapters if adapters is not None else {}
    calls = dict.fromkeys((s.name for s in sites), 0)

    def hook_for(site: Site) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 output: Any) -> None:
            calls[site.name] += 1
            if calls[site.name] > 1:
                raise _site_error(site, module, (
                    "it ran twice in one forward pass; fcaudit records one coefficient tensor "
                    "per site and pass, and a second call would overwrite the first: name a "
                    "module that runs once per forward (one per layer)"))
            call = SiteCall(module, args, kwargs, batch,
                            seq_len if seq_len is not None else _positions_of(args, batch))
            captured[site.name] = capture(site, module, call, output)
            fitted[site.name] = infer_adapter(output, call) \
                if isinstance(site.adapter, AutoAdapter) else site.adapter
        return hook

    with hooks(model, {s.path: hook_for(s) for s in sites}, with_kwargs=True):
        yield captured
    missing = [name for name, n in calls.items() if n == 0]
    if missing:
        raise ModelError(f"controller sites never ran during the forward pass: "
                         f"{', '.join(missing)}; name modules the model actually calls",
                         site=missing[0])


class Recording(Mapping[str, Tensor]):
    """What :func:`fcaudit.record` returns: a read-only mapping ``{site name:
    coefficients [B, T, ...]}`` in layer order (use it wherever a dict of coefficients
    goes), plus what replaying it needs and what it came from.

    ``sites``: the resolved :class:`~fcaudit.Site` objects, each with the adapter its
    output was found to fit (so :func:`fcaudit.replay` needs no globs and no memory of
    an earlier call); ``output``: the model's output on the recorded pass (None for
    coefficients derived with :meth:`with_coefficients`); ``logits``: its logits;
    ``input_ids``: the token ids ``[B, T]`` it was recorded at (kept by derived
    coefficients: they are fed to the same tokens), which ``static-layer-token`` reads.
    """

    def __init__(self, coefficients: Mapping[str, Tensor], sites: Sequence[Site],
                 output: Any = None, input_ids: Tensor | None = None) -> None:
        names = [s.name for s in sites]
        unknown = [k for k in coefficients if k not in names]
        if unknown:
            raise UsageError(f"no site named {unknown[0]!r} in this recording; its sites "
                             f"are {', '.join(names) or 'none'}")
        self._coefficients = {n: coefficients[n] for n in names if n in coefficients}
        self.sites = tuple(s for s in sites if s.name in self._coefficients)
        self.output = output
        self.input_ids = input_ids

    def __getitem__(self, name: str) -> Tensor:
        return self._coefficients[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._coefficients)

    def __len__(self) -> int:
        return len(self._coefficients)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k!r}: {list(v.shape)}" for k, v in self._coefficients.items())
        return f"Recording({{{shapes}}})"

    @property
    def logits(self) -> Tensor:
        """The recorded pass's logits ``[B, T, V]`` (``.logits`` of a Hugging Face output)."""
        from fcaudit.core.nll import logits_of
        if self.output is None:
            raise UsageError("these coefficients were derived, not recorded: they have no "
                             "model output; use the Recording fcaudit.record returned")
        return logits_of(self.output)

    def with_coefficients(self, coefficients: Mapping[str, Tensor]) -> Recording:
        """The same sites fed other coefficients (some or all of them), e.g. an
        intervention's; replay uses these sites as for the original recording."""
        return Recording(coefficients, self.sites, input_ids=self.input_ids)


def _fitted(site: Site, adapter: ControllerAdapter) -> Site:
    return site if adapter is site.adapter else dataclasses.replace(site, adapter=adapter)


@torch.no_grad()
def record(model: nn.Module, input_ids: Tensor, sites: SiteSpec = None) -> Recording:
    """One unperturbed pass: a :class:`Recording`, site name -> coefficients
    ``[B, T, *trailing]`` in layer order, with the resolved sites and the model output.

    ``sites``: module-path globs (a glob naming routers fcaudit knows gets their router
    adapter), :class:`~fcaudit.Site` objects, or None for the model's own declaration.
    """
    site_list = find_sites(model, sites)
    input_ids = model_input(input_ids, "record(input_ids=...)")
    adapters: dict[str, ControllerAdapter] = {}
    tokens = input_ids.dim() == 2 and not input_ids.is_floating_point()
    seq_len = int(input_ids.shape[1]) if tokens else None  # images: each site's own layout
    with blamed_on_inputs(lambda: model(input_ids), input_ids, "record(input_ids=...)"), \
            recording(model, site_list, int(input_ids.shape[0]), seq_len,
                      adapters=adapters) as captured:
        output = model(input_ids)
    return Recording({s.name: captured[s.name] for s in site_list},
                     [_fitted(s, adapters[s.name]) for s in site_list], output,
                     input_ids.detach().clone())
