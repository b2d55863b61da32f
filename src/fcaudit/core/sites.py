"""Controller sites: find them in a model, by the model's declaration or by module-path globs.

Each glob defines one family (named by the glob); its matches, in module order, are
that family's layers 0, 1, ...; their adapter is the one the model's declaration or
fcaudit's discovery gives that module (a Hugging Face MoE router gets
:class:`~fcaudit.core.routers.RouterAdapter`), else :data:`~fcaudit.core.adapters.AUTO` (plain
``[B, T, ...]`` or flattened ``[B*T, ...]`` outputs). A site list is refused
when it names a module twice (duplicate globs, overlapping globs) or names a module
together with one of its own children: their outputs would be recorded and replaced
twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from fcaudit.core.adapters import AUTO
from fcaudit.core.candidates import Scaling, ScalingWatch
from fcaudit.core.contract import Site
from fcaudit.core.discovery import declared_sites
from fcaudit.core.errors import ModelError, UsageError, arg
from fcaudit.core.hooks import hooks
from fcaudit.core.kinds import Evidence, Kind, classify, in_unit_range, read_shape, trailing_axes

SiteSpec = Sequence[str] | Sequence[Site] | None


def match_modules(model: nn.Module, pattern: str, option: str, example: str) -> list[str]:
    """Module paths matching a glob, outermost matches only, in module order (``option``:
    the argument that gave the glob, named in the caller's words on failure)."""
    hits = glob_hits([name for name, _ in model.named_modules() if name], pattern)
    if not hits:
        raise ModelError(
            f"{arg(option, pattern)} matched no module of {type(model).__name__}; list module "
            f"paths with `fcaudit sites --model SPEC --all` and pass a glob such as {example!r}",
            site=pattern if option == "sites" else None)
    return hits


def glob_hits(names: Sequence[str], pattern: str) -> list[str]:
    """The paths a ``--sites`` glob names: its matches, outermost only (a glob like
    ``blocks.*`` also matches the blocks' children)."""
    hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
    return [n for n in hits if not any(n.startswith(h + ".") for h in hits if h != n)]


SITES_OPTION = arg("sites")  # sites= for a Python caller, --sites on the command line


def _from_globs(model: nn.Module, patterns: Sequence[str]) -> list[Site]:
    """One family per glob. A matched module the model declares as a site, or that
    fcaudit discovers (a Hugging Face MoE router), keeps what that site declares: its
    adapter (e.g. :class:`~fcaudit.core.routers.RouterAdapter`), its layout (``axes``,
    ``positions``: a declared layout wins over any guess) and its role (a gate's ``off``
    and ``gated``); the glob gives only the name, family and layer. Any other module gets
    :data:`AUTO` and a layout the audit decides from the first batch."""
    repeated = sorted({p for p in patterns if list(patterns).count(p) > 1})
    if repeated:
        raise UsageError(f"{arg('sites', repeated[0])} is given more than once; give each "
                         "glob once (each glob is one family)", option="sites")
    known = {s.path: s for s in declared_sites(model) or []}
    sites: list[Site] = []
    for pattern in patterns:
        hits = match_modules(model, pattern, "sites", "blocks.*.gate")
        sites += [dataclasses.replace(known[n], name=n, family=pattern, layer=i) if n in known
                  else Site(name=n, path=n, family=pattern, layer=i, adapter=AUTO)
                  for i, n in enumerate(hits)]
    return sites


def check_sites(model: nn.Module, sites: Sequence[Site]) -> list[Site]:
    """Refuse site lists that would record or replace a module twice; check every path."""
    seen: dict[str, Site] = {}
    for site in sites:
        try:
            module = model.get_submodule(site.path)
        except AttributeError as exc:
            raise ModelError(f"site {site.name}: {site.path!r} is not a module of "
                             f"{type(model).__name__}; list module paths with "
                             "`fcaudit sites --model SPEC --all`", site=site.name) from exc
        if isinstance(module, torch.jit.ScriptModule):  # hooks record and replace a site
            raise ModelError(f"site {site.name} is a TorchScript module "
                             f"({type(module).__name__}), which takes no hooks: build the "
                             "model without torch.jit.script for the audit", site=site.name)
        if site.path in seen:
            other = seen[site.path]
            raise ModelError(
                f"module {site.path} is named twice (families {other.family!r} and "
                f"{site.family!r}); each controller module may belong to one site only",
                site=site.name)
        seen[site.path] = site
    names = [s.name for s in sites]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ModelError(f"site name {twice[0]!r} is used twice; site names must be unique",
                         site=twice[0])
    paths = sorted(seen)
    for outer in paths:
        inner = next((p for p in paths if p.startswith(outer + ".")), None)
        if inner is not None:
            raise ModelError(
                f"site {inner} lies inside site {outer}: a controller and its own child cannot "
                "both be sites (the outer one's replacement would hide the inner one); "
                "name one of them", site=inner)
    return list(sites)


def check_module_tree(model: nn.Module) -> None:
    """Refuse a model whose module tree contains itself (``block.parent = model``): torch's
    recursive walks (``eval()``, ``to()``, ``state_dict()``) never end on it. A module
    reached twice without a cycle (tied or shared submodules) is fine."""
    stack: list[tuple[str, nn.Module, Any]] = [("", model, iter(model._modules.items()))]
    open_ids = {id(model): ""}  # the path from the root to the module being walked
    done: set[int] = set()
    while stack:
        path, module, children = stack[-1]
        child_name, child = next(children, (None, None))
        if child_name is None:
            stack.pop()
            del open_ids[id(module)]
            done.add(id(module))
            continue
        if child is None or id(child) in done:
            continue
        where = f"{path}.{child_name}" if path else child_name
        if id(child) in open_ids:
            owner = open_ids[id(child)] or "the model itself"
            raise ModelError(f"{type(model).__name__}'s module tree contains itself: {where} "
                             f"is {owner}, so walking its submodules never ends; keep such "
                             "a back-reference out of the tree (a weakref, or "
                             "object.__setattr__(module, name, value))")
        open_ids[id(child)] = where
        stack.append((where, child, iter(child._modules.items())))


def find_sites(model: nn.Module, sites: SiteSpec = None) -> list[Site]:
    """The sites to audit: ``sites`` as module-path globs or :class:`Site` objects, or
    the model's own declaration when None."""
    check_module_tree(model)
    if sites:
        items = list(sites)
        if all(isinstance(s, Site) for s in items):
            return check_sites(model, items)  # type: ignore[arg-type]
        if all(isinstance(s, str) for s in items):
            return check_sites(model, _from_globs(model, items))  # type: ignore[arg-type]
        raise UsageError("sites must be module-path globs (str) or fcaudit.Site objects, "
                         "not a mix", option="sites")
    declared = declared_sites(model)
    if not declared:
        raise ModelError(
            f"{type(model).__name__} declares no controller sites; name them with "
            f"{SITES_OPTION}: module-path globs such as ['blocks.*.gate'] (list modules with "
            "`fcaudit sites --model SPEC --all`)")
    return check_sites(model, declared)


def families(sites: Sequence[Site]) -> list[str]:
    """Family names in the order their first site appears."""
    return list(dict.fromkeys(s.family for s in sites))


_CONTROLLER_NAME = re.compile(r"gate|router|rout|mix|dense|controller|halt|select", re.I)


NOT_CALLED = "not called by the forward pass (a container, or unused)"
PROBE_TOKENS = 7  # odd, so a width of 8 (experts, kernels, heads) is never read as positions


class ModuleRow(NamedTuple):
    """One module as ``fcaudit sites`` lists it: its path, class, output, the hint (a
    likely controller, a site, or "") and, for a likely controller, its kind."""

    path: str
    cls: str
    output: str
    hint: str
    kind: Kind | None = None


@torch.no_grad()
def describe_modules(model: nn.Module, sites: set[str], example: Any = None
                     ) -> list[ModuleRow]:
    """Every module's row (path, class, output, hint, kind) from one small forward pass, to
    help choose ``--sites``: per-token (or, with ``example``, per-example) outputs with a
    controller-like name are marked as likely controllers, each with the kind of
    coefficient it is (:mod:`fcaudit.core.kinds`). ``example``: two inputs to
    probe with (a tensor ``[2, ...]``, or a dict of them passed as ``model(**x)``) for a
    model that does not take token ids; default two random token windows.

    The hooks only look (they return None, so no module's output is replaced). When the
    pass fails, the module that raised and the modules around it say so on their own
    lines, and the modules that never ran say where the pass stopped."""
    from fcaudit.core.adapters import describe
    from fcaudit.core.nll import device_of, model_limits
    batch, seq_len = 2, None if example is not None else PROBE_TOKENS
    if example is None:
        vocab, _ = model_limits(model)
        example = torch.randint(0, vocab or 2, (batch, seq_len), device=device_of(model))
    outputs: dict[str, str] = {}
    facts: dict[str, tuple[Any, ...]] = {}  # read shape, every value in [0, 1]
    entered: list[str] = []
    watch = ScalingWatch()

    def seen(m: nn.Module, args: Any, out: Any, name: str) -> None:
        outputs.setdefault(name, describe(out))
        if isinstance(out, torch.Tensor) and name not in facts:
            with contextlib.suppress(Exception):  # a tensor that cannot say its values
                facts[name] = (read_shape(args, {}, batch), in_unit_range(out))  # not judged
        watch.output(name, m, out)

    modules = [(name, module) for name, module in model.named_modules() if name]
    for name, module in modules:
        if isinstance(module, torch.jit.ScriptModule):  # takes no hooks: say so, go on
            outputs[name] = "not watched: a TorchScript module takes no hooks"
    watched = [(n, m) for n, m in modules if not isinstance(m, torch.jit.ScriptModule)]
    try:
        with hooks(model, {m: lambda _m, _a, n=n: entered.append(n) for n, m in watched},
                   kind="pre"), \
                hooks(model, {m: lambda m, _a, out, n=n: seen(m, _a, out, n)
                              for n, m in watched}), watch:
            model.eval()(**example) if isinstance(example, dict) else model.eval()(example)
    except Exception as exc:  # a model that needs other inputs: list modules anyway
        _mark_failure(outputs, entered, [n for n, _ in modules], exc, type(model).__name__)
    scales = {} if watch.broken else watch.scales  # a watch that failed proves nothing
    by_name = not scales  # no module scales another branch: names are all to go by
    rows = []
    for name, module in modules:
        out, scaling = outputs.get(name, NOT_CALLED), scales.get(name)
        hint = "site" if name in sites else _hint(name, out, scaling and scaling.how,
                                                  by_name, batch, seq_len)
        kind = _kind(out, facts.get(name), scaling, batch, seq_len) \
            if hint.startswith("likely") and "router" not in hint else None
        rows.append(ModuleRow(name, type(module).__name__, out, hint, kind))
    return rows


def _kind(output: str, facts: tuple[Any, ...] | None, scaling: Scaling | None, batch: int,
          seq_len: int | None) -> Kind:
    """A likely controller's kind, from the same evidence the audit judges a site named by
    a glob from (its output is the coefficient): the positions are the probe's tokens
    (``[B, T, ...]``, or rows ``[B*T, ...]``), else one value set per example; an
    example's output of more axes has positions the audit decides."""
    dims = _dims(output)
    if facts is None or not dims:
        return classify(None)
    if seq_len is not None and dims[:2] == [batch, seq_len]:
        positions: tuple[int, ...] | None = (1,)
    else:
        positions = () if seq_len is not None or len(dims) == 2 else None
    read, unit = facts
    flat = seq_len is not None and dims[0] == batch * seq_len
    return classify(Evidence(tuple(dims), trailing_axes(dims, positions),
                             None if flat else read, unit, scaling))


def _dims(output: str) -> list[int]:
    """The shape of a described tensor output (``Tensor[2, 7, 64] float32``), or []."""
    found = re.match(r"Tensor\[([\d, ]+)\]", output)
    return [int(d) for d in found.group(1).split(",")] if found else []


def probe_failure(rows: Sequence[ModuleRow]) -> str | None:
    """A line for the short listing when the probe pass of :func:`describe_modules` did
    not finish: "0 likely controllers" alone would read as a model without any."""
    stop = next((r for r in rows if r[2].startswith("failed: ")), None) or \
        next((r for r in rows if r[2].startswith("not run: ")), None)
    if stop is None:
        return None
    return (f"the probe pass did not finish ({stop[0]}: {stop[2]}), so the modules it did "
            "not reach were not judged; give two inputs the model takes with --inputs X.npy "
            "(--all shows every module)")


def _mark_failure(outputs: dict[str, str], entered: list[str], names: list[str],
                  exc: Exception, root: str) -> None:
    """Fill in what a failed pass left open: the innermost unfinished module raised, the
    ones enclosing it failed with it, and every module not yet run never ran."""
    first = (str(exc).strip().splitlines() or [""])[0][:160]
    error = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    unfinished = [n for n in dict.fromkeys(entered) if n not in outputs]
    culprit = unfinished[-1] if unfinished else None
    for name in unfinished:
        outputs[name] = (f"failed: {error}" if name == culprit
                         else f"failed (inside it, {culprit} raised)")
    where = culprit or f"{root}'s own forward, outside any submodule"
    for name in names:
        outputs.setdefault(name, f"not run: the forward pass stopped in {where} ({error})")


def _hint(name: str, output: str, scales: str | None, by_name: bool, batch: int,
          seq_len: int | None) -> str:
    """``scales``: what of the module's output scales another branch in the probe pass
    (:mod:`fcaudit.core.candidates`); a name alone marks a module only when nothing in
    the model does (a toy whose gates are combined by sums, a router's tuple output)."""
    named = bool(_CONTROLLER_NAME.search(name))
    if output.startswith("tuple(Tensor") and named:
        return "likely router (tuple output: needs an adapter, see docs/method.md)"
    if not scales and not (by_name and named):
        return ""
    why = f"; {scales} that scales another branch" if scales else ""
    dims = _dims(output)
    if len(dims) < 2:
        return ""
    if seq_len is None:  # examples, not token windows: the positions axis is the model's own
        return (f"likely controller ([B, ...] output{why}: name its axes with --site-axes "
                "or a Site, see docs/method.md)" if dims[0] == batch else "")
    if dims[1:].count(seq_len) > 1:  # [B, T, T], [B, H, T, T]: weights over token pairs
        return ""  # (attention), not one coefficient set per token
    if dims[:2] == [batch, seq_len]:
        return f"likely controller ([B, T, ...] output{why})"
    if dims[0] == batch * seq_len:
        return f"likely controller (flattened [B*T, ...] output{why})"
    if dims[0] == batch and scales and seq_len not in dims:  # an SE gate [B, C]
        return (f"likely per-example controller ([B, ...] output{why}; token ids are "
                "scored per token: audit it on --inputs, --targets and --calib-inputs)")
    return ""


def suggested_globs(paths: Sequence[str], names: Sequence[str]) -> list[str]:
    """``--sites`` globs for candidate paths (in the order first seen): a layer index
    becomes ``*`` so one glob names a family of sites across layers, but only where the
    glob then names candidates alone among every module path in ``names`` (the ``1`` of
    a ``scorer.1`` in a ``Sequential(Linear, Sigmoid)`` stays, or the glob would audit
    the linear ``scorer.0`` too)."""
    wanted = set(paths)
    globs = []
    for path in paths:
        glob = path
        for index in reversed(list(re.finditer(r"(?<=\.)\d+(?=\.|$)", path))):
            wider = glob[:index.start()] + "*" + glob[index.end():]
            if set(glob_hits(names, wider)) <= wanted:
                glob = wider
        globs.append(glob)
    return list(dict.fromkeys(globs))
