"""Exit models in the audit (docs/method.md, Early exit): the references' layers, measured
before the replays, the checks an exit model passes before any of them, and the exit
frontier's threshold sweep (real passes; the section of audit.json is the exits analysis's,
:mod:`fcaudit.engine.analyses.exits`).

The layers come from real passes: the model's own exits (hooks on its exit rules) on the
calibration windows, for fixed exit, and on the evaluation windows, for the depth it
reports; the oracle's from one full-depth pass per evaluation batch (hooks on its exit
heads). They are recomputed by every audit that runs an exit condition (no cache: a pass
per batch, the price of a reference that is never stale).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from fcaudit.core.conditions import needing
from fcaudit.core.contract import Exit
from fcaudit.core.errors import ModelError, arg
from fcaudit.core.exits import (
    EXAMPLE,
    ExitDepth,
    ExitPlan,
    exit_depth,
    exit_model,
    exit_scores,
    exit_sites,
    exit_unit,
    head_predictions,
    oracle_layers,
    own_exits,
    plural,
)
from fcaudit.core.hooks import hooks
from fcaudit.core.nll import device_of
from fcaudit.core.replaying import replaying
from fcaudit.engine.analyses.exits import asked, own_threshold, sweep_thresholds
from fcaudit.engine.options import Progress
from fcaudit.engine.passes import batches
from fcaudit.io.examples import call_model

PROBE_ROWS = 2  # sequences (or examples) the exit rule is checked on


def check_passes(n_sites: int, units: int) -> int:
    """The passes :func:`check_follows` makes on its probe when the rule follows: the
    model's own exits, the record, the recorded scores replayed, every unit stopping at
    the first and at no exit site, and the mixed patterns that stop each unit after an
    exit site of its own until every site has been asked."""
    return 5 + -(-(n_sites + 1) // max(units, 1))


@torch.no_grad()
def exit_plan(setup: Any, tick: Progress) -> ExitPlan | None:
    """The references' layers for this audit, or None when it runs no exit condition;
    ``tick`` once per batch of each stage (the plan counts these passes)."""
    if not asked(setup):
        return None
    from fcaudit.engine.execution import inference
    net = exit_model(setup.model, setup.sites)
    size, device = setup.options.batch_size, device_of(setup.model)
    oracle, own = [], []
    with inference(setup.model):
        check_follows(setup, net, next(batches(setup.eval_source, PROBE_ROWS, device))[1])
        calibration = calibration_depth(setup, net, tick)
        n_eval = -(-setup.inputs.n_eval // size)
        for done, (_, x) in enumerate(batches(setup.eval_source, size, device), start=1):
            own.append(own_exits(net, lambda x=x: call_model(setup.model, x)).cpu())
            preds = head_predictions(net, lambda x=x: call_model(setup.model, x))
            oracle.append(oracle_layers(preds).cpu())
            tick("exit references: evaluation and oracle", done, n_eval, "")
    return ExitPlan(calibration, torch.cat(oracle), torch.cat(own), exit_unit(setup.sites),
                    own_threshold(net))


@torch.no_grad()
def calibration_depth(setup: Any, net: Any, tick: Progress) -> ExitDepth:
    """The model's own exits on the calibration data (one pass a batch): what fixed exit's
    depth is chosen from (``fcaudit fold`` recomputes it with this too)."""
    from fcaudit.engine.execution import inference
    size, device = setup.options.batch_size, device_of(setup.model)
    n_calib, calib = -(-setup.inputs.n_calib // size), []
    with inference(setup.model):
        for done, (_, x) in enumerate(batches(setup.calib_source, size, device), start=1):
            calib.append(own_exits(net, lambda x=x: call_model(setup.model, x)).cpu())
            tick("exit references: calibration", done, n_calib, "")
    return exit_depth(calib, len(exit_sites(setup.sites)) + 1)


def check_follows(setup: Any, net: Any, x: Any) -> None:
    """Refuse, naming the site and the cause, an exit rule that does not follow its site's
    output, on a probe of :data:`PROBE_ROWS` rows (the exit conditions and every replayed
    score rest on it; a rule is one rule, so a few rows prove it at a fraction of one
    batch's cost): a replay of the recorded scores must reproduce the model's own exits bit
    for bit, scores that stop every unit (token, patch, example) at the first exit site,
    or at none, must do so, and scores that stop each unit after an exit site of its own
    (unit ``u`` after site ``u mod (n + 1)``, so every site is asked) must stop each one
    there. Where they do not, every site is asked alone and the cause told apart
    (:func:`_misdeclared`): its :class:`~fcaudit.core.contract.Exit` reversed, or a
    threshold its values never or always reach; else a rule reading something other than
    the site's output."""
    sites, run = exit_sites(setup.sites), lambda: call_model(setup.model, x)
    unit, n = exit_unit(sites), len(sites)
    own = own_exits(net, run)
    _, coefficients, _ = setup.executor.record(x, None)

    def exits(k: Any, values: Any = None) -> torch.Tensor:
        """The exits under the recorded scores (``k`` None), or under scores stopping each
        unit after site ``k`` (a layer for all, or a tensor of one per unit), from
        the sites' Exit or ``values(site)`` in its place."""
        declared = [dataclasses.replace(s, role=values(s)) for s in sites] if values else sites
        layers = k if isinstance(k, torch.Tensor) else torch.full_like(own, int(k or 0))
        scores = coefficients if k is None else exit_scores(declared, layers, coefficients)
        with replaying(setup.model, {s: scores[s.name] for s in sites}):
            return own_exits(net, run)

    got = exits(None)
    if not torch.equal(got, own):
        raise _refusal(sites, "replaying the recorded scores", got, own, unit)
    units = torch.arange(own.numel()).view_as(own)
    patterns = [torch.full_like(own, 0), torch.full_like(own, n)] + [
        (units + shift) % (n + 1) for shift in range(0, n + 1, max(own.numel(), 1))]
    for layers in patterns:
        got = exits(layers)
        if not torch.equal(got, layers):
            _diagnose(sites, exits, own, unit, got, layers)


def _diagnose(sites: Sequence[Any], exits: Any, own: torch.Tensor, unit: str,
              got_mixed: torch.Tensor, mixed: torch.Tensor) -> None:
    """Every exit site asked alone (scores stopping every unit after it), the first that
    fails refused with its cause; reached only when the rule did not follow (``mixed``:
    the pattern that failed, ``got_mixed`` the exits it gave)."""
    n = len(sites)
    fed = {k: exits(k) for k in range(n + 1)}
    for k, got in fed.items():
        if not torch.equal(got, torch.full_like(own, k)):
            cause = _misdeclared(sites, fed, k, exits, unit)
            if cause is not None:
                raise ModelError(f"exit site {cause[0].name}: {cause[1]}", site=cause[0].name)
            raise _refusal(sites, f"feeding scores that stop every {unit} after exit layer {k}",
                           got, torch.full_like(own, k), unit)
    raise _refusal(sites, f"feeding scores that stop each {unit} after an exit layer of its "
                   "own", got_mixed, mixed, unit)


_FAR = 1000.0  # a value this many (stop - go) steps beyond one of an Exit's values


def _misdeclared(sites: Sequence[Any], fed: dict[int, torch.Tensor], k: int, exits: Any,
                 unit: str) -> tuple[Any, str] | None:
    """The site and the cause where scores stopping every ``unit`` after site ``k``
    (``fed[k]``, exit layers) did not, when the site's Exit is at fault: reversed (its exit
    value stops no unit, its continue value every one), or a threshold the exit value
    never reaches (a value far beyond it does stop every unit) or the continue value
    always reaches (a value far below it does not); None otherwise."""
    n = len(sites)
    if bool((fed[0] == n).all()) and bool((fed[n] == 0).all()):
        go, stop = sites[0].exit.go, sites[0].exit.stop
        return sites[0], (f"{sites[0].exit!r} is reversed: the model's rule stops every "
                          f"{unit} on the continue value {go!r} and none on the exit value "
                          f"{stop!r}; declare {Exit(stop, go)!r}")
    expected = torch.full_like(fed[k], k)
    if bool((fed[k] > k).all()) and torch.equal(exits(k, lambda s: Exit(
            s.exit.go, s.exit.stop + _FAR * (s.exit.stop - s.exit.go))), expected):
        go, stop = sites[k].exit.go, sites[k].exit.stop
        return sites[k], (f"its exit value {stop!r} ({sites[k].exit!r}) stops no "
                          f"{unit}, a value {stop + _FAR * (stop - go):g} does: the rule's "
                          "threshold is never reached by the declared exit value; declare "
                          "one that reaches it")
    if bool((fed[k] < k).all()) and torch.equal(exits(k, lambda s: Exit(
            s.exit.go - _FAR * (s.exit.stop - s.exit.go), s.exit.stop)), expected):
        site = sites[int(fed[k].min())]
        go, stop = site.exit.go, site.exit.stop
        return site, (f"its continue value {go!r} ({site.exit!r}) stops every "
                      f"{unit}, a value {go - _FAR * (stop - go):g} does not: the rule's "
                      "threshold is always reached, even by the declared continue value; "
                      "declare one that does not reach it")
    return None


def _refusal(sites: Sequence[Any], what: str, got: torch.Tensor, expected: torch.Tensor,
             unit: str) -> ModelError:
    """A rule that does not follow its site's output, naming the first site where ``got``
    and ``expected`` exit layers part."""
    wrong = got != expected
    site = sites[min(int(torch.minimum(got, expected)[wrong].min()), len(sites) - 1)]
    return ModelError(f"exit site {site.name}: {what}, the model's exit rule stops "
                      f"{int(wrong.sum())} of {wrong.numel()} {plural(unit)} at another layer; its "
                      "exit decision must read the site's output and nothing else (no "
                      "recomputed score, no state kept between calls)", site=site.name)


def with_exit_conditions(conditions: tuple[str, ...], sites: Any, model: Any) -> tuple[str, ...]:
    """``conditions`` with the exit conditions added for a model with exit sites (checked
    now, before any pass): an exit model is always placed between fixed exit and the
    oracle (other models are left alone)."""
    if not exit_sites(sites):
        return conditions
    exit_model(model, sites)
    return (*conditions, *(n for n in needing("exits") if n not in conditions))


Shapes = dict[str, tuple[tuple[int, ...], ...]]  # block path -> its (input, output) shapes


@torch.no_grad()
def check_twin(setup: Any) -> None:
    """Refuse a dense twin of another depth or width than an exit model: executed depth
    and FLOPs are read against it, so the twin must be the same network at full depth.
    Depth: the blocks each declares; width: the shape of what each block reads and
    returns per unit that exits, on the first evaluation window (the blocks that ran there:
    one ordinary pass, as changing the rule would be a call the audit's own checks do not
    expect). A unit is an example where the exit sites have no
    position axis (``[C, H, W]`` for a convolution: the last axis alone is its image
    width, not its channels), else a token (the last axis: an exit model's blocks see the
    running tokens packed)."""
    sites = exit_sites(setup.sites)
    if setup.dense is None or not sites or setup.blocks is None:
        return
    from fcaudit.engine.inputs import resolve_block_paths
    twin_blocks = resolve_block_paths(setup.dense, setup.blocks_glob) or []
    _, x = next(batches(setup.eval_source, 1, device_of(setup.model), [0]))
    unit = exit_unit(sites)
    axes = 1 if unit != EXAMPLE else None
    mine = block_shapes(setup.model, setup.blocks, x, axes)
    twin = block_shapes(setup.dense, twin_blocks, x, axes)
    differs = _first_difference(setup.blocks, twin_blocks, mine, twin, unit)
    if differs is not None:
        raise ModelError(
            f"exit site {sites[0].name}: the dense twin is not the model's network at full "
            f"depth: {differs}; executed depth and FLOPs are read against the twin, so give "
            f"the same network run to full depth ({arg('dense')})", site=sites[0].name)


def _first_difference(blocks: Sequence[str], twin_blocks: Sequence[str], mine: Shapes,
                      twin: Shapes, unit: str) -> str | None:
    """Where a twin departs from the model, in words: another number of blocks, or the
    first block (of those the model ran) whose per-unit input or output shape differs,
    with both sides' shapes; None where it is the same network."""
    if len(blocks) != len(twin_blocks):
        return f"it has {len(twin_blocks)} blocks, the model {len(blocks)}"
    for i, (path, other) in enumerate(zip(blocks, twin_blocks, strict=True)):
        if path in mine and mine[path] != twin.get(other):
            theirs = _shapes(twin[other]) if other in twin else "did not run on the first " \
                "evaluation window"
            return (f"block {i} maps per-{unit} shapes {_shapes(mine[path])} in the model "
                    f"({path}), {theirs} in the twin ({other})")
    return None


def block_shapes(net: Any, paths: Sequence[str], x: Any, axes: int | None) -> Shapes:
    """Per block that ran, in order: the shapes of its first input and first output tensor, the last
    ``axes`` axes (None: all but the batch axis)."""
    from fcaudit.engine.execution import inference
    seen: Shapes = {}

    def unit(t: Any) -> tuple[int, ...]:
        return tuple(t.shape[-axes:] if axes else t.shape[1:])

    def keep(path: str) -> Any:
        def hook(_m: Any, args: Any, out: Any) -> None:
            first = out[0] if isinstance(out, (tuple, list)) else out
            seen.setdefault(path, (unit(args[0]), unit(first)))
        return hook

    with inference(net), hooks(net, {p: keep(p) for p in paths}):
        call_model(net, x)
    return {p: seen[p] for p in paths if p in seen}


def _shapes(shapes: tuple[tuple[int, ...], ...]) -> str:
    """A block's first input and output shapes: ``[16, 8, 8] -> [32, 4, 4]``."""
    return " -> ".join(str(list(shape)) for shape in shapes)


@contextlib.contextmanager
def threshold_set(net: Any, value: float) -> Iterator[None]:
    """Every exit rule reads ``value`` meanwhile (its own threshold is put back)."""
    rules = [net.get_submodule(p) for p in net.exit_rules()]
    before = [r.threshold for r in rules]
    for r in rules:
        r.threshold = value
    try:
        yield
    finally:
        for r, b in zip(rules, before, strict=True):
            r.threshold = b


def sweep(setup: Any, own: Tensor, tick: Progress) -> tuple[tuple[float, Tensor], ...]:
    """The threshold sweep of the exit frontier (:mod:`fcaudit.engine.analyses.exits`):
    :func:`sweep_layers` of the audited model, run for inference."""
    from fcaudit.engine.execution import inference
    with inference(setup.model):
        return sweep_layers(setup, exit_model(setup.model, setup.sites), own, tick)


@torch.no_grad()
def sweep_layers(setup: Any, net: Any, own: Tensor,
                 tick: Progress) -> tuple[tuple[float, Tensor], ...]:
    """Each sweep threshold with the exit layers ``[N, T]`` the moved rule gives the
    evaluation tokens (real passes; ``tick(stage, done, total, info)`` once per
    threshold); thresholds that repeat ``own`` or an earlier one's exits are dropped."""
    start = own_threshold(net)
    if start is None:
        return ()
    size, device = setup.options.batch_size, device_of(setup.model)
    out: list[tuple[float, Tensor]] = []
    thresholds = sweep_thresholds(start, setup.options.frontier_points)
    for done, tau in enumerate(thresholds, start=1):
        with threshold_set(net, tau):
            layers = torch.cat([own_exits(net, lambda x=x: call_model(setup.model, x)).cpu()
                                for _, x in batches(setup.eval_source, size, device)])
        tick("exit frontier references: threshold sweep", done, len(thresholds), f"{tau:.3g}")
        if not any(torch.equal(layers, seen) for seen in [own, *(t for _, t in out)]):
            out.append((tau, layers))
    return tuple(out)
