"""Execution audit (docs/method.md, Execution): what a model really computes, against
its dense twin.

Three measurements, all taken on real forward passes and never read from a config:

* **Blocks executed per token.** A forward pre-hook on every block counts the
  tokens entering it (numel of its first tensor input / that tensor's last dim),
  so a block that runs on a gathered subset of tokens counts only those.
* **FLOPs per token**, counted by ``torch.utils.flop_counter.FlopCounterMode`` over
  the forward pass: matrix products and attention (``2*M*N*K`` per matmul;
  attention counted in full, as torch counts its fused kernels). Elementwise work
  (norms, activations, gathers) is not counted, for model and dense alike. Counted
  after one uncounted pass (:func:`warm_pass`): what a model computes from its weights
  alone once and then reuses (a time-invariant model's convolution kernel) is not
  per-pass work, so it is never counted, whatever ran before.
* **Latency**: model and dense timed alternately in one process after warm-up, in
  pairs whose order alternates (A B, B A, A B, ...) so that drift and any
  first-or-second-call effect cancel. The ratio is model/dense *latency* (> 1: the
  model is slower), the median of the per-pair ratios, since each pair shares the
  machine's state at that moment; its 95% interval is a seeded bootstrap over
  pairs. A difference is called only when the interval excludes 1 and the ratio
  is more than ``SPEED_TOLERANCE`` (:mod:`fcaudit.engine.verdicts`) away from it (an
  A/A run can otherwise show a sub-percent "effect").

Counts and FLOPs are deterministic; everything timing-dependent lives under
``timing`` (and the headline ``speed_ratio_vs_dense``), so the rest of the result
can be compared exactly between runs.
"""

from __future__ import annotations

import contextlib
import platform
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from fcaudit.core.contract import ExpertLayer, Site, SiteCall, execution_mode
from fcaudit.core.errors import FcauditError, ModelError, arg
from fcaudit.core.flops import OpRecorder, flop_counter, uncounted_operators
from fcaudit.core.hooks import hooks
from fcaudit.core.nll import logits_of
from fcaudit.core.recording import record
from fcaudit.core.replaying import replay
from fcaudit.core.routers import counting_experts
from fcaudit.engine.options import MIN_TIMING_PAIRS
from fcaudit.engine.result import (
    ControllerCost,
    Estimate,
    Execution,
    ExpertExecution,
    SideTiming,
    Timing,
)
from fcaudit.engine.verdicts import TOLERANCE
from fcaudit.io.examples import ExampleBatch, Examples, call_model

BOOTSTRAP_RESAMPLES = 2000
TIMING_WARMUP = 2  # passes of each side before the timed pairs


@contextlib.contextmanager
def inference(*models: nn.Module) -> Iterator[None]:
    """Eval mode and no autograd while measuring; the callers' modes come back after.

    Parameters stop requiring grad too: a model that hands a view of a weight to a module
    call (transformers' hub-kernel wrappers pass ``conv1d.weight.squeeze(1)``) would
    otherwise make the FLOP counter's module tracker hook a grad-requiring input that
    no_grad gave no gradient function, and the pass raise."""
    modes = [(m, m.training) for model in models for m in model.modules()]
    grads = [(p, p.requires_grad) for model in models for p in model.parameters()]
    for model in models:
        model.eval()
    for param, _ in grads:
        param.requires_grad_(False)
    try:
        with torch.no_grad():
            yield
    finally:
        for m, training in modes:
            m.training = training
        for param, required in grads:
            param.requires_grad_(required)


@torch.no_grad()
def check_comparable(model: nn.Module, dense: nn.Module, input_ids: torch.Tensor,
                     source: str) -> None:
    """Refuse a dense counterpart whose blocks and FLOPs cannot be compared with the
    model's: for the same input its logits must have the model's shape. A wider
    vocabulary head alone made a model whose every block runs look "0.641x Dense"."""
    model_shape = tuple(logits_of(model(input_ids)).shape)
    try:
        dense_shape = tuple(logits_of(dense(input_ids)).shape)
    except FcauditError as exc:
        raise ModelError(f"{arg('dense', source)}: {exc.raw}") from exc
    if dense_shape != model_shape:
        raise ModelError(
            f"{arg('dense', source)} is not comparable with the model: for the same "
            f"{list(input_ids.shape)} token ids it gives logits {list(dense_shape)}, the model "
            f"{list(model_shape)} (another vocabulary or sequence handling), so their blocks "
            "and FLOPs would measure different work; give a dense model with the model's "
            "tokenizer and output")


def resolve_blocks(model: nn.Module, block_paths: Sequence[str] | None) -> list[str]:
    """Block paths as given, else as the model declares them; each must name a module."""
    if block_paths is None:
        declare = getattr(model, "execution_blocks", None)
        if not callable(declare):
            raise ModelError(
                f"{type(model).__name__} declares no execution blocks; name the modules whose "
                "executions to count (module paths such as 'blocks.0', 'blocks.1', ...)")
        block_paths = declare()
    paths = list(block_paths)
    if not paths:
        raise ModelError(f"no execution blocks given for {type(model).__name__}")
    for path in paths:
        try:
            model.get_submodule(path)
        except AttributeError as exc:
            raise ModelError(f"execution block {path!r} is not a module of "
                             f"{type(model).__name__}; list module paths with "
                             "`fcaudit sites --model SPEC`") from exc
    return paths


@torch.no_grad()
def idle_blocks(net: nn.Module, paths: Sequence[str], x: Any) -> list[str]:
    """The modules among ``paths`` that one forward pass of ``net`` over ``x`` never calls."""
    calls = dict.fromkeys(paths, 0)

    def hook_for(path: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            calls[path] += 1
        return hook
    with inference(net), hooks(net, {p: hook_for(p) for p in paths}, kind="pre",
                                     with_kwargs=True):
        call_model(net, x)
    return [p for p, n in calls.items() if n == 0]


def refuse_idle_blocks(glob: str, x: Any, nets: Mapping[str, tuple[nn.Module, Sequence[str]]]
                       ) -> None:
    """Blocks named by ``glob`` must each run in one forward pass over ``x`` (the first
    batch) of every net (``who -> (net, block paths)``): a module the forward never calls
    counts 0 executions per token, and the verdict would read it as skipped."""
    for who, (net, paths) in nets.items():
        idle = idle_blocks(net, paths, x)
        if idle:
            shown = ", ".join(idle[:4]) + (f" and {len(idle) - 4} more" if len(idle) > 4 else "")
            raise ModelError(
                f"{arg('blocks', glob)}: {who}'s forward never calls {len(idle)} of the "
                f"{len(paths)} modules it names on the first batch ({shown}), so they would "
                "count as blocks skipped by every token; name the blocks the forward runs "
                "(its layers, e.g. 'layers.*'; `fcaudit sites --model SPEC --all` lists the "
                "modules)")


def _first_tensor(values: Iterable[Any]) -> torch.Tensor | None:
    """The first tensor in call arguments, looking inside tuples and lists (a block may take
    several streams, e.g. MUDD's Q, K, V, R, before other tensors such as a rotary table)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (tuple, list)):
            found = _first_tensor(value)
            if found is not None:
                return found
    return None


def _tokens_entering(path: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                     per_example: bool = False) -> int:
    """Tokens entering a block (``per_example``: examples, its first input's first axis)."""
    first = _first_tensor((*args, *kwargs.values()))
    if first is None or first.dim() == 0:
        raise ModelError(f"execution block {path!r} received no per-token tensor input; "
                         "name modules that take hidden states [..., features]")
    return int(first.shape[0]) if per_example else first.numel() // first.shape[-1]


def _positions_entering(sofar: int | None, args: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> int | None:
    """Positions entering a block whose first input is a sequence ``[B, P, C]`` (patch
    tokens: a pruned block gets fewer), added to ``sofar``; None for any other input."""
    first = _first_tensor((*args, *kwargs.values()))
    if sofar is None or first is None or first.dim() != 3:
        return None
    return sofar + int(first.shape[0]) * int(first.shape[1])


def _units(x: Any) -> int:
    """Units a batch counts for: tokens of token ids ``[B, T]``, else its examples."""
    return len(x) if isinstance(x, ExampleBatch) else x.numel()


def warm_pass(model: nn.Module, input_ids: Any) -> None:
    """One uncounted inference pass before FLOPs are counted, so that a count never
    depends on what ran before it (the module docstring)."""
    with inference(model):
        call_model(model, input_ids)


def execution_pass(model: nn.Module, block_paths: Sequence[str],
                   batches: Iterable[Any], flops: bool = True,
                   experts: Sequence[ExpertLayer] = (),
                   routers: Mapping[str, Site] | None = None,
                   gated: Sequence[str] = ()) -> dict[str, Any]:
    """Run ``batches`` of ``input_ids`` once, counting the tokens entering each block,
    (with ``flops``) the forward FLOPs, and (with ``experts``) the experts that ran and
    what the routers chose, so one pass over the data serves them all.

    Blocks executed per token is the mean over tokens of the number of blocks that
    ran on it; ``blocks_executed_per_layer`` is each block's executed fraction.
    ``gated``: module paths (soft gates' gated modules) whose FLOPs per token to report.
    """
    paths = list(block_paths)
    batches = list(batches)
    per_example = bool(batches) and isinstance(batches[0], ExampleBatch)
    if flops and batches:
        warm_pass(model, batches[0])
    counts, positions, pre_hooks = _block_counters(paths, per_example)
    counter, recorder = flop_counter(), OpRecorder()
    tokens = 0
    with hooks(model, pre_hooks, kind="pre", with_kwargs=True), inference(model), \
            counter if flops else contextlib.nullcontext(), \
            recorder if flops else contextlib.nullcontext(), \
            counting_experts(model, experts) as expert_counts, \
            watching_routers(model, [routers[e.name] for e in experts]
                             if experts and routers else []) as chosen:
        for ids in batches:
            call_model(model, ids)
            tokens += _units(ids)
    if tokens == 0:
        raise ModelError("no tokens to measure execution on; give evaluation data")
    per_layer = [c / tokens for c in counts]
    result = {"blocks_executed": sum(per_layer), "blocks_present": len(paths),
              "blocks_executed_per_layer": per_layer, "tokens": tokens, "blocks": paths}
    if per_example:
        result["positions_per_block"] = [None if p is None else p / tokens for p in positions]
    if flops:
        result.update(_flop_fields(model, counter, recorder, paths, counts, tokens, gated))
    if experts:
        flop_counts = counter.get_flop_counts() if flops else {}
        # per-example inputs: experts are still counted per token routed (a ViT's patches)
        routed = sum(c.numel() // c.shape[-1] for c in chosen.get(experts[0].name, []))
        result["experts"] = expert_execution(model, experts, expert_counts, chosen,
                                             flop_counts,
                                             routed if per_example and routed else tokens)
    return result


def _block_counters(paths: Sequence[str], per_example: bool
                    ) -> tuple[list[int], list[int | None], dict[str | nn.Module, Any]]:
    """Per block: the tokens entering it, (per example) the positions entering it, and
    the pre-hooks that count them."""
    counts = [0] * len(paths)
    positions: list[int | None] = [0] * len(paths)  # per example: tokens entering [B, P, C]
    pre_hooks: dict[str | nn.Module, Any] = {}
    for i, path in enumerate(paths):
        def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 i: int = i, path: str = path) -> None:
            counts[i] += _tokens_entering(path, args, kwargs, per_example)
            if per_example:
                positions[i] = _positions_entering(positions[i], args, kwargs)
        pre_hooks[path] = hook
    return counts, positions, pre_hooks


def _flop_fields(model: nn.Module, counter: FlopCounterMode, recorder: OpRecorder,
                 paths: Sequence[str], counts: Sequence[int], tokens: int,
                 gated: Sequence[str]) -> dict[str, Any]:
    """FLOPs per token (whole model, per block that ran, per gated module) and the
    operators no formula counted."""
    by_module = counter.get_flop_counts()
    root = type(model).__name__
    return {"flops_per_token": counter.get_total_flops() / tokens,
            "uncounted": uncounted_operators(recorder.ops, counter),
            "flops_per_block": [  # per token that entered the block (0: none did)
                sum(by_module.get(f"{root}.{path}", {}).values()) / c if c else 0.0
                for path, c in zip(paths, counts, strict=True)],
            "gated_flops_per_token": {
                path: sum(by_module.get(f"{root}.{path}", {}).values()) / tokens
                for path in gated}}


@contextlib.contextmanager
def watching_routers(model: nn.Module, sites: Sequence[Site]) -> Iterator[dict[str, list]]:
    """The experts each router site selects on the live pass (its adapter's reading)."""
    chosen: dict[str, list[torch.Tensor]] = {s.name: [] for s in sites}

    def hook_for(site: Site) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 out: Any) -> None:
            batch, seq_len = _batch_shape(_first_tensor((*args, *kwargs.values())))
            call = SiteCall(module, args, kwargs, batch, seq_len)
            chosen[site.name].append(site.adapter.selected_experts(out, call).cpu())
        return hook

    with hooks(model, {s.path: hook_for(s) for s in sites}, with_kwargs=True):
        yield chosen


def _batch_shape(first: torch.Tensor | None) -> tuple[int, int]:
    """(batch, positions) of a router call: from a ``[B, T, C]`` input, else one flattened
    sequence of all its tokens (only the set of choices matters for counting)."""
    if first is not None and first.dim() >= 3:
        return int(first.shape[0]), int(first.shape[1])
    tokens = first.numel() // first.shape[-1] if first is not None else 1
    return 1, tokens


def expert_execution(model: nn.Module, layers: Sequence[ExpertLayer],
                     counts: Mapping[str, Any], chosen: Mapping[str, list[torch.Tensor]],
                     flop_counts: Mapping[str, Mapping[Any, int]],
                     tokens: int) -> ExpertExecution:
    """Experts run per token and layer, whether that is exactly what the routers chose,
    and the FLOPs spent in experts against every expert running for every token."""
    root = type(model).__name__
    per_layer, active, full, per_slot = [], 0.0, 0.0, []
    matches = True
    for layer in layers:
        count = counts[layer.name]
        ran = count.experts_per_token(tokens)
        per_layer.append(ran)
        if chosen.get(layer.name):
            matches = matches and count.matches(torch.cat(
                [c.reshape(-1, c.shape[-1]) for c in chosen[layer.name]]))
        spent = sum(sum(flop_counts.get(f"{root}.{path}", {}).values())
                    for path in layer.experts) / tokens
        active += spent
        per_slot.append(spent / ran if ran else 0.0)
        full += spent * layer.num_experts / ran if ran else 0.0
    present = sum(layer.num_experts for layer in layers)
    return ExpertExecution(
        layers=[layer.name for layer in layers],
        num_experts_per_layer=[x.num_experts for x in layers],
        top_k_per_layer=[x.top_k for x in layers], experts_per_token_per_layer=per_layer,
        experts_per_token_mean_over_layers=sum(per_layer) / len(per_layer),
        experts_per_token_summed_over_layers=sum(per_layer),
        experts_present_summed_over_layers=present, matches_routing=matches,
        active_expert_flops_per_token=active if flop_counts else None,
        all_expert_flops_per_token=full if flop_counts else None,
        routing_changes_computation=any(
            0 < ran < x.num_experts * (1 - TOLERANCE) for ran, x in zip(per_layer, layers,
                                                                      strict=True)),
        flops_per_slot_per_layer=per_slot if flop_counts else None)


def ratio_interval(model_s: Sequence[float], dense_s: Sequence[float], seed: int = 0,
                   resamples: int = BOOTSTRAP_RESAMPLES) -> Estimate:
    """Median of per-pair ratios ``model/dense``, with a 95% bootstrap interval over pairs."""
    ratios = np.asarray(model_s, dtype=np.float64) / np.asarray(dense_s, dtype=np.float64)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(ratios), size=(resamples, len(ratios)))
    boot = np.median(ratios[picks], axis=1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return Estimate(float(np.median(ratios)), [float(lo), float(hi)])


def side_summary(seconds: Sequence[float], tokens: int) -> SideTiming:
    """Median, min and max seconds per batch, and throughput at the median."""
    s = np.asarray(seconds, dtype=np.float64)
    median = float(np.median(s))
    return SideTiming(median, float(s.min()), float(s.max()), tokens / median)


@contextlib.contextmanager
def fixed_threads(threads: int | None) -> Iterator[int]:
    """Pin torch's CPU thread count (when given) for the measurement; yields the count used."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def _clocked(run: Callable[[], Any], on: torch.device) -> float:
    """Seconds ``run`` takes (the device synchronised before and after)."""
    if on.type == "cuda":
        torch.cuda.synchronize(on)
    start = time.perf_counter()
    run()
    if on.type == "cuda":
        torch.cuda.synchronize(on)
    return time.perf_counter() - start


def _paired(first: Callable[[], float], second: Callable[[], float], pairs: int,
            warmup: int, threads: int | None) -> tuple[list[float], list[float], int]:
    """The seconds ``first`` and ``second`` report (each times its own work) in ``pairs``
    pairs whose order alternates (A B, B A, ...) after ``warmup`` of each; and the thread
    count used."""
    if pairs < MIN_TIMING_PAIRS:
        raise ModelError(f"timing needs at least {MIN_TIMING_PAIRS} pairs, got {pairs}")
    with fixed_threads(threads) as used_threads:
        for _ in range(warmup):
            first(), second()
        a, b = [], []
        for i in range(pairs):
            if i % 2 == 0:
                a.append(first())
                b.append(second())
            else:
                b.append(second())
                a.append(first())
    return a, b, used_threads


def time_interleaved(model: nn.Module, dense: nn.Module, input_ids: Any, pairs: int = 10,
                     warmup: int = TIMING_WARMUP, seed: int = 0,
                     threads: int | None = None) -> Timing:
    """Time one batch on model and dense in ``pairs`` pairs (A B, B A, ...) after warm-up."""
    with inference(model, dense):
        on = input_ids.device
        model_s, dense_s, used_threads = _paired(
            lambda: _clocked(lambda: call_model(model, input_ids), on),
            lambda: _clocked(lambda: call_model(dense, input_ids), on), pairs, warmup, threads)
    timed = list(zip(model_s, dense_s, strict=True))
    # examples count as one unit each (seq_len 1): tokens_per_s is then examples per second
    batch_size, seq_len = (len(input_ids), 1) if isinstance(input_ids, ExampleBatch) else \
        input_ids.shape
    ratio = ratio_interval(model_s, dense_s, seed)
    return Timing(
        speed_ratio_vs_dense=ratio,
        ratio_definition="median over pairs of model/dense latency (> 1: model slower); "
                         "pair order alternates AB, BA",
        slowdown_percent=100 * (ratio.value - 1),
        model=side_summary(model_s, _units(input_ids)),
        dense=side_summary(dense_s, _units(input_ids)),
        pairs_s=[list(p) for p in timed], pairs=pairs, warmup=warmup,
        bootstrap_resamples=BOOTSTRAP_RESAMPLES, seed=seed, threads=used_threads,
        device=str(input_ids.device), device_name=device_name(input_ids.device),
        batch_size=batch_size, seq_len=seq_len)


def controller_cost(model: nn.Module, sites: Sequence[Site], input_ids: torch.Tensor,
                    pairs: int = 10, warmup: int = TIMING_WARMUP, seed: int = 0
                    ) -> ControllerCost:
    """One batch of token ids timed with the model's controllers computing and with their
    recorded outputs supplied (:func:`~fcaudit.core.replaying.replay`: each controller's
    computation skipped), interleaved; for a model that runs elsewhere (an engine), whose
    blocks and FLOPs cannot be counted here."""
    with inference(model):
        recorded = record(model, input_ids, list(sites))
        on = input_ids.device

        def supplied() -> float:  # the pass alone: swapping the controllers out is not timed
            with replay(model, recorded):
                return _clocked(lambda: call_model(model, input_ids), on)
        own_s, supplied_s, _ = _paired(lambda: _clocked(lambda: call_model(model, input_ids),
                                                        on), supplied, pairs, warmup, None)
    units = _units(input_ids)
    return ControllerCost(
        ratio=ratio_interval(own_s, supplied_s, seed),
        ratio_definition="median over pairs of latency with the controllers computing / "
                         "with their recorded outputs supplied (> 1: the controllers cost "
                         "time); pair order alternates",
        own=side_summary(own_s, units), supplied=side_summary(supplied_s, units),
        pairs_s=[list(p) for p in zip(own_s, supplied_s, strict=True)], pairs=pairs,
        warmup=warmup, device=str(input_ids.device),
        device_name=device_name(input_ids.device), batch_size=int(input_ids.shape[0]),
        seq_len=int(input_ids.shape[1]))


def measure_execution(model: nn.Module, dense: nn.Module | None, input_ids: Any, *,
                      batch_size: int = 16, block_paths: Sequence[str] | None = None,
                      dense_block_paths: Sequence[str] | None = None, pairs: int = 10,
                      warmup: int = 2, seed: int = 0, timing: bool = True,
                      threads: int | None = None, dense_source: str | None = None,
                      experts: Sequence[ExpertLayer] = (),
                      routers: Mapping[str, Site] | None = None,
                      gated: Sequence[str] = (), degenerate: str | None = None) -> Execution:
    """The execution section of ``audit.json``: counts and FLOPs on every sequence of
    ``input_ids [N, T]``, timing on its first batch of ``batch_size``; with ``experts``,
    the experts that ran. Without ``dense`` only the model's own counts are measured.

    ``saves_against_dense`` is true when the model runs fewer blocks per token or fewer
    FLOPs than dense, by more than ``TOLERANCE`` (relative), unless ``degenerate`` says
    its exit rule stops every unit at one layer (then what it saves is a fixed depth's);
    ``conditional_execution`` when it saves, or when routing skips experts per token
    (counted on the experts: execution is conditional at expert granularity); on the model
    alone (no ``dense``, no experts) it is false where every block runs on every unit and
    None (not compared) where some are skipped: no saving is shown. Operators doing
    matrix work that the FLOP counter cannot count are listed, and then no FLOPs ratio
    (and no FLOPs-based verdict) is given.
    """
    batches = _batches(model, input_ids, batch_size)
    own = execution_pass(model, resolve_blocks(model, block_paths), batches, experts=experts,
                         routers=routers, gated=gated)
    twin = execution_pass(dense, resolve_blocks(dense, dense_block_paths), batches) \
        if dense is not None else None
    uncounted = sorted(set(own["uncounted"]) | set(twin["uncounted"] if twin else []))
    flops = own["flops_per_token"]
    dense_flops = twin["flops_per_token"] if twin else None
    flops_ratio = flops / dense_flops if dense_flops and not uncounted else None
    experts = own.get("experts")
    saves, conditional = _saving(own, twin, flops_ratio, experts, degenerate)
    timed = time_interleaved(model, dense, batches[0], pairs, warmup, seed, threads) \
        if timing and dense is not None else None
    return Execution(
        measured=True, dense=dense_source, blocks_executed=own["blocks_executed"],
        blocks_present=own["blocks_present"],
        executed_fraction=own["blocks_executed"] / own["blocks_present"],
        blocks_executed_per_layer=own["blocks_executed_per_layer"], blocks=own["blocks"],
        dense_blocks_executed=twin["blocks_executed"] if twin else None,
        dense_blocks_present=twin["blocks_present"] if twin else None,
        tokens_counted=own["tokens"], flops_per_token=flops, dense_flops_per_token=dense_flops,
        flops_ratio=flops_ratio,
        flops_counted="forward matmuls and attention (torch.utils.flop_counter)",
        uncounted_operators=uncounted or None,
        conditional_execution=conditional,
        saves_against_dense=saves if twin is not None else None, experts=experts,
        flops_per_block=own["flops_per_block"],
        dense_flops_per_block=twin["flops_per_block"] if twin else None,
        gated_flops_per_token=own["gated_flops_per_token"] or None,
        positions_per_block=own.get("positions_per_block"),
        dense_positions_per_block=twin.get("positions_per_block") if twin else None,
        mode=execution_mode(model), dense_mode=execution_mode(dense) if dense else None,
        dense_class=type(dense).__name__ if dense is not None else None,
        degenerate_rule=degenerate, timing=timed,
        speed_ratio_vs_dense=timed.speed_ratio_vs_dense.value if timed else None)


def _saving(own: Mapping[str, Any], twin: Mapping[str, Any] | None, flops_ratio: float | None,
            experts: ExpertExecution | None, degenerate: str | None) -> tuple[bool, bool | None]:
    """(saves against dense, conditional execution) of :func:`measure_execution`: on the
    model alone, blocks skipped show no saving, so whether it is conditional is None."""
    fewer_blocks = twin is not None and \
        own["blocks_executed"] < twin["blocks_executed"] * (1 - TOLERANCE)
    saves = degenerate is None and \
        bool(fewer_blocks or (flops_ratio is not None and flops_ratio < 1 - TOLERANCE))
    skipped = own["blocks_executed"] < own["blocks_present"] * (1 - TOLERANCE)
    if twin is None and experts is None and skipped and degenerate is None:
        return saves, None
    return saves, saves or bool(experts and experts.routing_changes_computation)


def _batches(model: nn.Module, input_ids: Any, batch_size: int) -> Sequence[Any]:
    """The batches to count on: token ids ``[N, T]`` split, or examples on the model's
    device."""
    if isinstance(input_ids, Examples):  # inputs that are not token ids: per example
        device = next(model.parameters()).device
        return [input_ids.rows(i, i + batch_size).to(device)
                for i in range(0, len(input_ids), batch_size)]
    if input_ids.dim() != 2 or input_ids.numel() == 0:
        raise ModelError(f"execution measurement needs input_ids [N, T], got shape "
                         f"{tuple(input_ids.shape)}")
    return input_ids.split(batch_size)
