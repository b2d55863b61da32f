"""The Frozen Controller Audit, in stages with plain data between them.

    prepare  -> validate every option and input, load models, resolve sites and data,
                check the output folder (nothing is written before this passes)
    probe    -> record and replay the first batch in memory: adapters, call counts and
                the identity replay are checked before any real work
    record   -> calibration sums and evaluation coefficients into the on-disk cache
    plan     -> the replay runs (SPEC conditions, per-layer variants, user interventions)
    replay   -> every run on every batch, batch by batch (resumable), identity checked
    summarize-> penalties, retention, interaction with paired bootstrap intervals
    describe -> variance decomposition, variation, profiles of the cached coefficients
    execute  -> blocks, FLOPs and latency against the dense counterpart
    verdicts -> one sentence per question
    assemble -> an :class:`~fcaudit.result.AuditResult` (and, with an output folder, the
                report and audit.json)

Progress is reported through an optional callback ``progress(stage, done, total, info)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from . import __version__
from .adapters import adapter_name, same_bits
from .cache import CoefficientCache
from .contract import Site, declared_blocks, declared_experts
from .data import AuditData, DataSpec, resolve_data
from .distributed import SINGLE, Ranks, current
from .errors import FcauditError
from .interventions import (
    Intervention,
    InterventionContext,
    RandomDraw,
    StaticProfiles,
    batch_sums,
    draw,
    shuffle_positions,
    static_tensor,
)
from .loading import LoadedModel, load, load_module
from .metrics import Bootstrap, VarianceAccumulator, interaction, penalty, retention
from .nll import device_of, logits_of, model_limits, probe_vocab, token_nll
from .record import recording
from .replay import BlockTrace, OutputStub, replaying, selecting, swapped, tracing
from .result import (
    MAIN_CONDITIONS,
    NONDETERMINISTIC_KEYS,
    PER_LAYER_CONDITIONS,
    RANDOM_CONDITIONS,
    RETENTION_PROFILES,
    SCHEMA,
    STATIC_CONDITIONS,
    TIMED_VERDICT_KEY,
    AuditResult,
    ConditionResult,
    Execution,
    Identity,
    LayerConditionResult,
    ModelInfo,
    Runtime,
    Seeds,
    SiteInfo,
    Verdict,
)
from .routers import changed_rows, expert_counts, routing_summary
from .runtime import host, versions
from .sites import SiteSpec, families, find_sites, match_modules
from .verdicts import dependence, qualified, variation

Progress = Callable[[str, int, int, str], None]
MAX_BOOTSTRAP = 100_000
SCHEDULES = ("prefix", "naive")


def _silent(stage: str, done: int, total: int, info: str = "") -> None:
    """The default progress callback: report nothing."""


@dataclass(frozen=True)
class AuditOptions:
    """Knobs of one audit; every one is recorded in ``audit.json`` (``settings``)."""

    repeats: int = 3  # K seeds per random condition
    seed: int = 0
    bootstrap: int = 1000
    batch_size: int = 8
    per_layer: bool = True
    execution: bool = True
    timing_pairs: int = 10
    progress: bool = True  # the CLI shows progress bars (the engine takes a callback)
    allow_nonexact_identity: bool = False
    schedule: str = "prefix"  # "prefix": per-layer runs recompute only the suffix; "naive"

    def validate(self) -> None:
        """Refuse option values no audit can run with, naming the option."""
        checks = (("--repeats", self.repeats, 1, None), ("--seed", self.seed, 0, None),
                  ("--bootstrap", self.bootstrap, 10, MAX_BOOTSTRAP),
                  ("--batch-size", self.batch_size, 1, None),
                  ("--timing-pairs", self.timing_pairs, 0, None))
        for option, value, lo, hi in checks:
            if isinstance(value, bool) or not isinstance(value, int) or value < lo or (
                    hi is not None and value > hi):
                bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
                raise FcauditError(f"{option} {value!r}: must be an integer {bound}")
        if self.schedule not in SCHEDULES:
            raise FcauditError(f"--schedule {self.schedule!r}: choose one of "
                               f"{', '.join(SCHEDULES)}")
        if 0 < self.timing_pairs < 10:
            raise FcauditError(f"--timing-pairs {self.timing_pairs}: use 0 (no timing) or at "
                               "least 10 pairs for a meaningful interval")


# ------------------------------------------------------------------------- prepare


@dataclass
class Setup:
    """Everything validated before the first forward pass."""

    loaded: LoadedModel
    sites: list[Site]
    blocks: list[str] | None
    blocks_glob: str | None
    data: AuditData
    options: AuditOptions
    interventions: list[Intervention]
    dense: nn.Module | None = None
    dense_source: str = ""
    out: Path | None = None
    started: float = field(default_factory=time.perf_counter)

    @property
    def model(self) -> nn.Module:
        return self.loaded.model


def as_loaded(model: str | Path | nn.Module | LoadedModel,
              dtype: torch.dtype | None = None) -> LoadedModel:
    if isinstance(model, LoadedModel):
        return model
    if isinstance(model, nn.Module):
        return load_module(model, type(model).__name__)
    return load(str(model), dtype)


def resolve_block_paths(model: nn.Module, pattern: str | None) -> list[str] | None:
    if pattern is not None:
        return match_modules(model, pattern, "--blocks", "blocks.*")
    return declared_blocks(model)


def _interventions(given: Mapping[str, Any] | Sequence[Intervention] | None) -> list[Intervention]:
    if not given:
        return []
    items = list(given.items()) if isinstance(given, Mapping) else [(i.name, i) for i in given]
    out = []
    for name, item in items:
        iv = item if isinstance(item, Intervention) else Intervention(name, item)
        if iv.name in MAIN_CONDITIONS or not callable(iv.fn) or iv.repeats < 1:
            raise FcauditError(f"intervention {iv.name!r}: give a new name (not a built-in "
                               "condition), a callable and repeats >= 1")
        out.append(iv)
    return out


def prepare(model: Any, out: str | Path | None, *, sites: SiteSpec, data: DataSpec | AuditData,
            dense: Any, blocks: str | None, options: AuditOptions,
            interventions: Any) -> Setup:
    """Every check that does not need a forward pass of the audit itself."""
    options.validate()
    if dense is not None and not options.execution:
        raise FcauditError("--dense is ignored with --no-execution (the dense counterpart only "
                           "serves the execution audit): drop one of them")
    loaded = as_loaded(model)
    net = loaded.model.eval()
    site_list = find_sites(net, sites)
    block_paths = resolve_block_paths(net, blocks)  # for execution and prefix reuse
    audit_data = data if isinstance(data, AuditData) else resolve_data(loaded.tokenizer, data,
                                                                       loaded_seq_len(loaded))
    vocab, ctx = model_limits(net)
    if vocab is None:
        vocab = probe_vocab(net, audit_data.eval_ids.shape[1])
    audit_data.validate(vocab, ctx)
    setup = Setup(loaded, site_list, block_paths, blocks, audit_data, options,
                  _interventions(interventions), out=Path(out) if out is not None else None)
    if options.execution:
        setup.dense, setup.dense_source = _dense(setup, dense, blocks)
    if setup.out is not None:
        from .outdir import check_output
        check_output(setup.out, "audit")
    return setup


def loaded_seq_len(loaded: LoadedModel) -> int:
    """The default window: the run's training length, or 256 capped by the context."""
    train_cfg = (loaded.run_config or {}).get("train")
    if isinstance(train_cfg, dict) and isinstance(train_cfg.get("seq_len"), int):
        return int(train_cfg["seq_len"])
    _, ctx = model_limits(loaded.model)
    return min(256, ctx) if ctx else 256


def _dense(setup: Setup, dense: Any, blocks: str | None) -> tuple[nn.Module | None, str]:
    """The dense counterpart, loaded and probed now (a bad --dense fails before recording)."""
    from .contract import dense_twin
    net = setup.model
    if dense is None:
        twin = dense_twin(net, setup.options.seed)
        return twin, ("built from the model's architecture (dense_counterpart, fresh "
                      "weights)" if twin is not None else "")
    twin = as_loaded(dense).model
    param = next(net.parameters(), None)
    if param is not None:
        twin = twin.to(dtype=param.dtype, device=param.device)
    twin.eval()
    ids = torch.from_numpy(setup.data.eval_ids[:1]).to(device_of(net))
    vocab, _ = model_limits(twin)
    if vocab is not None and int(ids.max()) >= vocab:
        raise FcauditError(f"--dense {dense}: its vocabulary has {vocab} entries but the "
                           f"evaluation token ids reach {int(ids.max())}; give a dense model "
                           "with the same tokenizer")
    try:
        with torch.no_grad():
            logits_of(twin(ids))
    except FcauditError as exc:
        raise FcauditError(f"--dense {dense}: {exc}") from exc
    resolve_block_paths(twin, blocks)
    return twin, str(dense)


# --------------------------------------------------------------------------- probe


def batches(ids: np.ndarray, batch_size: int, device: torch.device,
            only: Sequence[int] | None = None) -> Iterator[tuple[int, Tensor]]:
    for b, start in enumerate(range(0, len(ids), batch_size)):
        if only is None or b in only:
            chunk = np.ascontiguousarray(ids[start:start + batch_size])
            yield b, torch.from_numpy(chunk).to(device)


@torch.no_grad()
def record_batch(model: nn.Module, sites: Sequence[Site], x: Tensor
                 ) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """One unperturbed pass: logits, every site's coefficients, per-token NLL."""
    with recording(model, sites, *x.shape) as captured:
        logits = logits_of(model(x))
    return logits, {s.name: captured[s.name] for s in sites}, token_nll(logits, x)


@dataclass
class Replayed:
    """One replay pass: logits, the block trace (if asked) and the routers' choices."""

    logits: Tensor
    trace: BlockTrace | None = None
    chosen: dict[str, Tensor] = field(default_factory=dict)


@torch.no_grad()
def replay_batch(model: nn.Module, x: Tensor, fed: Mapping[Site, Tensor], *,
                 known: Mapping[str, Any] | None = None, trace: Sequence[str] | None = None,
                 select: bool = False) -> Replayed:
    """One pass with the given sites fed; each stub must run exactly once.

    ``known``: block outputs to stand in for those blocks (prefix reuse); sites inside
    them do not run. ``trace``: block paths whose call order and outputs to record.
    ``select``: also return the experts each router site selects.
    """
    known = known or {}
    observed = tracing(model, trace, [s.path for s in fed]) if trace else \
        contextlib.nullcontext()
    with replaying(model, fed) as stubs, \
            swapped(model, {p: OutputStub(out) for p, out in known.items()}), \
            observed as traced, \
            selecting(stubs) if select else contextlib.nullcontext({}) as chosen:
        logits = logits_of(model(x))
    skipped = {s.name for s in fed
               if any(s.path == p or s.path.startswith(p + ".") for p in known)}
    wrong = {n: s.calls for n, s in stubs.items() if s.calls != (0 if n in skipped else 1)}
    if wrong:
        name, calls = next(iter(wrong.items()))
        raise FcauditError(f"site {name} ran {calls} times during replay (once when recorded); "
                           "the model takes another path when its controller is replaced: "
                           "name a module the model calls exactly once per forward pass")
    return Replayed(logits, traced, chosen)


IDENTITY_CAUSES = (
    "randomness in the forward pass (dropout or a model left in training mode, sampling, "
    "jitter noise), a model whose output depends on state that changes between calls, "
    "nondeterministic kernels (some CUDA operations), or a controller output the model "
    "uses in a way the site's adapter does not reproduce")


@dataclass
class Probe:
    """The first evaluation batch, recorded and replayed in memory."""

    identity: Identity
    coefficients: dict[str, Tensor]
    nll: Tensor


@torch.no_grad()
def probe(setup: Setup) -> Probe:
    """Record and replay the first evaluation batch in memory, before anything is written.

    Sites that run twice, outputs no adapter fits, non-floating coefficients and a
    non-exact identity replay all stop the audit here (the last one unless
    ``allow_nonexact_identity``), naming the site and the likely causes.
    """
    net, sites = setup.model, setup.sites
    _, x = next(batches(setup.data.eval_ids, setup.options.batch_size, device_of(net)))
    logits, coefficients, nll = record_batch(net, sites, x)
    replayed = replay_batch(net, x, {s: coefficients[s.name] for s in sites}).logits
    if same_bits(logits, replayed):
        return Probe(Identity(True, 0.0, setup.options.allow_nonexact_identity,
                              "identity replay is bitwise exact"), coefficients, nll)
    diff = float((token_nll(replayed, x) - nll).abs().max())
    again, _, _ = record_batch(net, sites, x)
    if not same_bits(logits, again):
        cause = "two unperturbed passes over the same batch already differ: the forward " \
                "pass is not deterministic (dropout, sampling or training mode?)"
    else:
        culprit = _first_nonexact_site(net, sites, coefficients, x, logits)
        cause = f"replaying site {culprit} alone already changes the output" if culprit \
            else "replaying all sites together changes the output"
    message = (f"identity replay is not exact: replaying the recorded coefficients changes "
               f"the per-token NLL by up to {diff:.3g} nats ({cause}). Likely causes: "
               f"{IDENTITY_CAUSES}")
    if not setup.options.allow_nonexact_identity:
        raise FcauditError(f"{message}. No verdict can rest on such a replay: fix the model "
                           "(model.eval(), fixed seeds, deterministic kernels) or rerun with "
                           "--allow-nonexact-identity to see the numbers flagged as not exact")
    return Probe(Identity(False, diff, True, message), coefficients, nll)


def _first_nonexact_site(net: nn.Module, sites: Sequence[Site], coefficients: dict[str, Tensor],
                         x: Tensor, logits: Tensor) -> str | None:
    for site in sites:
        if not same_bits(replay_batch(net, x, {site: coefficients[site.name]}).logits, logits):
            return site.name
    return None


# -------------------------------------------------------------------------- record


def cache_identity(setup: Setup) -> dict[str, Any]:
    net, data = setup.model, setup.data.summary()
    param = next(net.parameters(), None)
    return {"model": setup.loaded.fingerprint or setup.loaded.spec,
            "model_class": type(net).__name__, "eval_data": data["eval_fingerprint"],
            "calib_data": data["calib_fingerprint"],
            "dtype": str(param.dtype) if param is not None else "unknown",
            "device": device_of(net).type, "sites": [s.name for s in setup.sites],
            "adapters": [getattr(s.adapter, "name", type(s.adapter).__name__)
                         for s in setup.sites],
            "fcaudit": __version__, "torch": torch.__version__}


def _finite(values: Mapping[str, Tensor], where: str) -> None:
    bad = {k: int((~torch.isfinite(v)).sum()) for k, v in values.items()
           if not torch.isfinite(v).all()}
    if bad:
        listing = ", ".join(f"{k} ({n} values)" for k, n in bad.items())
        raise FcauditError(f"non-finite (NaN or inf) coefficients recorded on {where} at "
                           f"{listing}; no dependence metric is computed on them: fix the "
                           "model or its weights (try float32)")


def _finite_nll(nll: Tensor, where: str) -> None:
    if not torch.isfinite(nll).all():
        raise FcauditError(f"the model's NLL is not finite (NaN or inf) in {where} "
                           f"({int((~torch.isfinite(nll)).sum())} tokens); no metric can be "
                           "computed: check the model's weights and dtype (try float32)")


def record_calibration(setup: Setup, cache: CoefficientCache, progress: Progress,
                       ranks: Ranks = SINGLE) -> None:
    """This rank's calibration batches: each batch's float64 sums, cached."""
    net, size = setup.model, setup.options.batch_size
    n = -(-len(setup.data.calib_ids) // size)
    todo = ranks.mine([b for b in range(n) if not cache.has(cache.calib_name(b))])
    for done, (b, x) in enumerate(batches(setup.data.calib_ids, size, device_of(net), todo),
                                  start=1):
        _, coefficients, _ = record_batch(net, setup.sites, x)
        _finite(coefficients, "calibration data")
        sums = batch_sums({k: c.cpu() for k, c in coefficients.items()})
        cache.write(cache.calib_name(b), {f"site::{k}": v for k, v in sums.items()})
        progress("record calibration", done, len(todo), "")


def calibration_profiles(setup: Setup, cache: CoefficientCache) -> StaticProfiles:
    """Static profiles from calibration data only: every batch's sums, added in batch
    order (so the result does not depend on which process recorded which batch)."""
    size, ids = setup.options.batch_size, setup.data.calib_ids
    profiles = StaticProfiles(setup.sites)
    for b in range(-(-len(ids) // size)):
        sums = cache.read(cache.calib_name(b))
        profiles.add_sums({k.removeprefix("site::"): v for k, v in sums.items()},
                          len(ids[b * size:(b + 1) * size]))
    return profiles


def _eval_shard(nll: Tensor, coefficients: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {"nll": nll.cpu(), **{f"site::{k}": v.cpu() for k, v in coefficients.items()}}


def adopt_probe(cache: CoefficientCache, first: Probe) -> None:
    """Write the probe's batch as shard 0, or check it against a cached shard 0: a cache
    whose first batch a fresh pass does not reproduce bit for bit is never reused."""
    name = cache.eval_name(0)
    shard = _eval_shard(first.nll, first.coefficients)
    if not cache.has(name):
        _finite(first.coefficients, "evaluation data")
        _finite_nll(first.nll, "the unperturbed record pass, batch 0")
        cache.write(name, shard)
    elif not same_bits(cache.read(name), shard):
        raise FcauditError(
            f"the cache in {cache.folder} does not match this model: a fresh pass over the "
            "first batch gives other coefficients or NLL than the cached one (the model "
            "changed in a way its fingerprint cannot see, or its forward pass varies between "
            f"runs); delete {cache.folder} and rerun")


def record_evaluation(setup: Setup, cache: CoefficientCache, progress: Progress,
                      ranks: Ranks = SINGLE) -> None:
    """This rank's evaluation batches, one unperturbed pass each; resumes at the shards
    not yet on disk."""
    net, sites = setup.model, setup.sites
    todo = ranks.mine([b for b in range(cache.n_batches) if not cache.has(cache.eval_name(b))])
    for done, (b, x) in enumerate(batches(setup.data.eval_ids, cache.batch_size,
                                          device_of(net), todo), start=1):
        _, coefficients, nll = record_batch(net, sites, x)
        _finite(coefficients, "evaluation data")
        _finite_nll(nll, f"the unperturbed record pass, batch {b}")
        cache.write(cache.eval_name(b), _eval_shard(nll, coefficients))
        progress("record evaluation", done, len(todo), "")


# ---------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Run:
    """One replay pass over the evaluation set."""

    condition: str  # a main condition, or a user intervention's name
    repeat: int = 0
    site: Site | None = None  # per-layer variant: only this site is intervened
    custom: Intervention | None = None

    @property
    def key(self) -> str:
        return self.condition if self.site is None else f"{self.condition}@{self.site.name}"


def plan_runs(sites: Sequence[Site], options: AuditOptions,
              interventions: Sequence[Intervention] = ()) -> list[Run]:
    runs = [Run("correct")]
    runs += [Run(c, k) for k in range(options.repeats) for c in RANDOM_CONDITIONS]
    runs += [Run(c) for c in STATIC_CONDITIONS]
    if options.per_layer:
        for site in sites:
            runs += [Run("reassign", k, site) for k in range(options.repeats)]
            runs.append(Run("static-layer", 0, site))
    runs += [Run(iv.name, k, custom=iv) for iv in interventions for k in range(iv.repeats)]
    return runs


def plan_key(runs: Sequence[Run], options: AuditOptions) -> str:
    """What the replay results depend on besides the cache identity."""
    parts = [(r.key, r.repeat, r.custom and _code_of(r.custom.fn)) for r in runs]
    text = repr((parts, options.seed))
    return hashlib.sha256(text.encode()).hexdigest()


def _code_of(fn: Any) -> str:
    code = getattr(fn, "__code__", None)
    return hashlib.sha256(code.co_code).hexdigest() if code is not None else repr(fn)


# -------------------------------------------------------------------------- replay


@dataclass
class ReplayInputs:
    """What feeding a batch needs: the cache, calibration profiles and random draws."""

    cache: CoefficientCache
    sites: list[Site]
    profiles: StaticProfiles
    draws: list[RandomDraw]
    seed: int


def feed(run: Run, b: int, inputs: ReplayInputs, device: torch.device) -> dict[Site, Tensor]:
    """The coefficient tensors every site receives for batch ``b`` under ``run``."""
    cache, rows = inputs.cache, inputs.cache.batch_range(b)
    correct = {s: cache.batch(b, f"site::{s.name}") for s in inputs.sites}
    if run.custom is not None:
        fed = dict(correct)
        fed.update(_custom_feed(run, b, rows, inputs, correct))
        return {s: t.to(device) for s, t in fed.items()}
    rand = inputs.draws[run.repeat] if run.condition in RANDOM_CONDITIONS else None
    targets = [run.site] if run.site is not None else inputs.sites
    fed = dict(correct)
    for site in targets:
        x = correct[site]
        if rand is not None and run.condition in ("reassign", "reassign+shuffle"):
            x = cache.rows(f"site::{site.name}", rand.donor[rows.start:rows.stop])
        if rand is not None and run.condition in ("shuffle", "reassign+shuffle"):
            x = shuffle_positions(x, rand.positions[rows.start:rows.stop])
        if run.condition in STATIC_CONDITIONS:
            x = static_tensor(run.condition, site, inputs.profiles, x)
        fed[site] = x
    return {s: t.to(device) for s, t in fed.items()}


def _custom_feed(run: Run, b: int, rows: range, inputs: ReplayInputs,
                 correct: dict[Site, Tensor]) -> dict[Site, Tensor]:
    assert run.custom is not None
    by_name = {s.name: s for s in inputs.sites}
    context = InterventionContext(
        tuple(inputs.sites), rows, inputs.profiles, run.repeat,
        run.custom.rng(inputs.seed, run.repeat, b),
        lambda name, idx: inputs.cache.rows(f"site::{name}", idx))
    given = run.custom.fn({s.name: t.clone() for s, t in correct.items()}, context)
    fed = {}
    for name, tensor in given.items():
        site = by_name.get(name)
        if site is None or not isinstance(tensor, Tensor) or \
                tensor.shape != correct[site].shape:
            raise FcauditError(f"intervention {run.custom.name!r} returned {name!r}: it must "
                               "map site names to tensors shaped like their recorded "
                               "coefficients")
        fed[site] = tensor.to(correct[site].dtype)
    return fed


def replay_stage(setup: Setup, inputs: ReplayInputs, runs: Sequence[Run], plan: str,
                 progress: Progress, ranks: Ranks = SINGLE) -> None:
    """This rank's batches under every run, batch by batch (every run of one batch before
    the next batch); each finished batch is cached, so an interrupted replay resumes there.
    """
    cache = inputs.cache
    todo = ranks.mine([b for b in range(cache.n_batches)
                       if not cache.has(cache.replay_name(plan, b))])
    for done, (b, x) in enumerate(batches(setup.data.eval_ids, cache.batch_size,
                                          device_of(setup.model), todo), start=1):
        cache.write(cache.replay_name(plan, b), _replay_one_batch(setup, inputs, runs, b, x))
        progress("replay", done, len(todo), f"batch {b + 1} of {cache.n_batches}")


@dataclass
class Replays:
    """Every batch's replay results, gathered: per-sequence NLL per run (run order), the
    identity replay's max |diff|, how the schedule went, and routing counts."""

    per_run: list[np.ndarray]
    identity_diff: float
    schedule: dict[str, Any]
    route_load: dict[str, Tensor]  # router site -> token-slots per expert (correct replay)
    route_changed: Tensor | None  # [tracked runs, router sites] tokens re-routed


def replay_results(cache: CoefficientCache, plan: str, options: AuditOptions) -> Replays:
    shards = [cache.read(cache.replay_name(plan, b)) for b in range(cache.n_batches)]
    per_run = torch.cat([s["nll"] for s in shards], dim=1).numpy()
    states = [int(s["prefix"]) for s in shards]
    schedule = {"requested": options.schedule,
                "batches_prefix_reused": states.count(PREFIX_REUSED),
                "batches_fell_back_to_full_passes": states.count(PREFIX_FELL_BACK),
                "batches": len(states)}
    load = {k.removeprefix("route_load::"): sum(s[k] for s in shards)
            for k in shards[0] if k.startswith("route_load::")}
    changed = sum(s["route_changed"] for s in shards) if "route_changed" in shards[0] else None
    return Replays(list(per_run), max(float(s["identity_diff"]) for s in shards), schedule,
                   load, changed)


def tracked_runs(runs: Sequence[Run]) -> list[Run]:
    """The runs whose re-routing is counted: main conditions other than correct."""
    return [r for r in runs if r.site is None and r.custom is None and r.condition != "correct"]


PREFIX_OFF, PREFIX_REUSED, PREFIX_FELL_BACK = 0, 1, 2


@torch.no_grad()
def _replay_one_batch(setup: Setup, inputs: ReplayInputs, runs: Sequence[Run], b: int,
                      x: Tensor) -> dict[str, Tensor]:
    """Every run on batch ``b`` (the correct replay first), per-layer runs on the suffix
    only when prefix reuse is on and proven exact on this batch; for router sites, the
    expert load of the correct replay and how many tokens each main condition re-routes."""
    net = setup.model
    recorded = inputs.cache.batch(b, "nll")
    per_layer = any(r.site is not None for r in runs)
    traced = setup.blocks if setup.options.schedule == "prefix" and per_layer else None
    routed = routing_sites(inputs.sites)
    rows, diff, reuse, state = [], 0.0, None, PREFIX_OFF
    base: dict[str, Tensor] = {}
    shard: dict[str, Tensor] = {}
    changed = []
    for run in runs:
        fed = feed(run, b, inputs, x.device)
        known = reuse.get(run.site.path) if reuse is not None and run.site is not None else None
        tracked = bool(routed) and run.site is None and run.custom is None
        out = replay_batch(net, x, fed, known=known, select=tracked,
                           trace=traced if run.condition == "correct" else None)
        nll = token_nll(out.logits, x).cpu()
        _finite_nll(nll, f"replay under {run.key}, batch {b}")
        if run.condition == "correct":
            diff = _identity_diff(setup, nll, recorded, b)
            base = out.chosen
            shard.update({f"route_load::{s.name}": expert_counts(base[s.name], fed[s].shape[-1])
                          for s in routed})
            if out.trace is not None:
                reuse, state = _prove_prefix(net, x, fed, inputs.sites, out.trace, out.logits)
        elif tracked:
            changed.append([changed_rows(base[s.name], out.chosen[s.name]) for s in routed])
        rows.append(nll.double().mean(1))
    if routed:
        shard["route_changed"] = torch.tensor(changed, dtype=torch.float64)
    return {"nll": torch.stack(rows), "identity_diff": torch.tensor(diff, dtype=torch.float64),
            "prefix": torch.tensor(state), **shard}


def routing_sites(sites: Sequence[Site]) -> list[Site]:
    """Sites whose adapter can say which experts a router selects."""
    from .contract import RoutingAdapter
    return [s for s in sites if isinstance(s.adapter, RoutingAdapter)]


def _identity_diff(setup: Setup, nll: Tensor, recorded: Tensor, b: int) -> float:
    diff = float((nll - recorded).abs().max())
    if diff != 0 and not setup.options.allow_nonexact_identity:
        raise FcauditError(
            f"identity replay is not exact on batch {b}: the per-token NLL differs by up to "
            f"{diff:.3g} nats. Likely causes: {IDENTITY_CAUSES}. Rerun with "
            "--allow-nonexact-identity to see the numbers flagged as not exact")
    return diff


def _prove_prefix(net: nn.Module, x: Tensor, fed: Mapping[Site, Tensor], sites: Sequence[Site],
                  trace: BlockTrace, logits: Tensor) -> tuple[dict[str, Any] | None, int]:
    """Each site's reusable prefix, once the correct replay with the longest prefix stubbed
    reproduces the full correct replay bit for bit (else: full passes for this batch)."""
    prefixes = {s.path: {p: trace.outputs[p] for p in trace.prefix(s.path)} for s in sites}
    longest = max(prefixes.values(), key=len)
    if not longest:
        return None, PREFIX_OFF
    check = replay_batch(net, x, fed, known=longest).logits
    if not same_bits(check, logits):
        return None, PREFIX_FELL_BACK
    return prefixes, PREFIX_REUSED


# ----------------------------------------------------------------------- summarize


def _condition(per_seq: Mapping[str, np.ndarray], repeats: Mapping[str, list[np.ndarray]],
               key: str, boot: Bootstrap) -> ConditionResult:
    correct = per_seq["correct"]
    delta, ci = penalty(per_seq[key], correct, boot)
    reps = repeats[key]
    return ConditionResult(float(per_seq[key].mean()), delta, ci,
                           [float(r.mean()) for r in reps],
                           [float((r - correct).mean()) for r in reps])


@dataclass
class Summary:
    conditions: dict[str, ConditionResult]
    per_layer: dict[str, list[LayerConditionResult]]
    retention: dict[str, Any]
    interaction: Any
    custom: dict[str, ConditionResult]


def summarize(runs: Sequence[Run], replayed: Sequence[np.ndarray], original: np.ndarray,
              sites: Sequence[Site], options: AuditOptions) -> Summary:
    """Penalties, retention and interaction from per-sequence NLLs (paired bootstrap);
    ``replayed`` holds one array per run, in run order."""
    repeats: dict[str, list[np.ndarray]] = {}
    for run, values in zip(runs, replayed, strict=True):  # repeats of a key come in order
        repeats.setdefault(run.key, []).append(values)
    repeats["original"] = [original]
    per_seq = {k: np.mean(v, axis=0) for k, v in repeats.items()}
    boot = Bootstrap(len(original), options.bootstrap, options.seed * 1000 + 7)
    conditions = {c: _condition(per_seq, repeats, c, boot) for c in MAIN_CONDITIONS}
    per_layer = {c: [LayerConditionResult(**dataclasses.asdict(_condition(
        per_seq, repeats, f"{c}@{s.name}", boot)), layer=s.layer, site=s.name, family=s.family)
        for s in sites] for c in PER_LAYER_CONDITIONS} if options.per_layer else {}
    correct = per_seq["correct"]
    ret = {p: retention(per_seq[p], correct, per_seq["global-mean"], boot)
           for p in RETENTION_PROFILES}
    inter = interaction(per_seq["reassign+shuffle"], per_seq["reassign"], per_seq["shuffle"],
                        correct, boot)
    custom = {r.custom.name: _condition(per_seq, repeats, r.key, boot)
              for r in runs if r.custom is not None}
    return Summary(conditions, per_layer, ret, inter, custom)


def describe(cache: CoefficientCache, sites: Sequence[Site]) -> tuple[dict, dict, dict, np.ndarray]:
    """Variance, variation and profiles per family, and the original per-sequence NLL."""
    accumulators = {f: VarianceAccumulator([s for s in sites if s.family == f])
                    for f in families(sites)}
    original = np.empty(cache.n_sequences)
    for b in range(cache.n_batches):
        coefficients = {s.name: cache.batch(b, f"site::{s.name}") for s in sites}
        for acc in accumulators.values():
            acc.add(coefficients)
        rows = cache.batch_range(b)
        original[rows.start:rows.stop] = cache.batch(b, "nll").double().mean(1).numpy()
    return ({f: a.decompose() for f, a in accumulators.items()},
            {f: a.variation() for f, a in accumulators.items()},
            {f: a.profile() for f, a in accumulators.items()}, original)


# ------------------------------------------------------------------------- execute


def execute(setup: Setup) -> Execution:
    """The execution section: counts, FLOPs and (with timing pairs) latency vs dense; for a
    routed model, the experts that ran (measured even without a dense counterpart)."""
    from .execution import measure_execution
    opts = setup.options
    if not opts.execution:
        return Execution(measured=False, reason="disabled (--no-execution)")
    experts = declared_experts(setup.model) or []
    if setup.dense is None and not experts:
        return Execution(measured=False, reason="no dense counterpart: pass --dense SPEC")
    dense_blocks = resolve_block_paths(setup.dense, setup.blocks_glob) \
        if setup.dense is not None else []
    if setup.blocks is None or dense_blocks is None:
        return Execution(measured=False, reason="the model does not declare its blocks: pass "
                                                "--blocks GLOB (e.g. 'layers.*')")
    x = torch.from_numpy(np.ascontiguousarray(setup.data.eval_ids)).to(device_of(setup.model))
    routers = {s.name: s for s in routing_sites(setup.sites)}
    return measure_execution(setup.model, setup.dense, x, batch_size=opts.batch_size,
                             block_paths=setup.blocks, dense_block_paths=dense_blocks or None,
                             pairs=opts.timing_pairs, seed=opts.seed,
                             timing=opts.timing_pairs > 0, dense_source=setup.dense_source or None,
                             experts=[e for e in experts if e.name in routers], routers=routers)


# ------------------------------------------------------------------------ assemble


def _model_info(setup: Setup) -> ModelInfo:
    net, loaded = setup.model, setup.loaded
    param = next(net.parameters(), None)
    return ModelInfo(spec=loaded.spec, kind=loaded.kind, class_=type(net).__name__,
                     arch=(loaded.run_config or {}).get("arch"),
                     n_params=sum(p.numel() for p in net.parameters()),
                     fingerprint=loaded.fingerprint,
                     dtype=str(param.dtype) if param is not None else "unknown",
                     identity_note=loaded.identity_note)


def assemble(setup: Setup, cache: CoefficientCache, summary: Summary, stats: tuple,
             execution: Execution, identity: Identity, command: str | None,
             runtime: Runtime) -> AuditResult:
    variance, spread, profiles = stats[:3]
    opts = setup.options
    seeds = [opts.seed * 1000 + 17 + k for k in range(opts.repeats)]
    from .execution import verdict_execution
    execution_text = verdict_execution(execution) if execution.measured else \
        f"Execution not measured: {execution.reason}."
    verdict = Verdict(qualified(variation(variance, spread), identity),
                      qualified(dependence(summary.conditions, summary.retention), identity),
                      qualified(execution_text, identity))
    timed = execution.timing is not None
    return AuditResult(
        schema=SCHEMA, fcaudit_version=__version__, model=_model_info(setup),
        data=setup.data.summary(),
        sites=[SiteInfo(s.name, s.family, s.layer,
                        list(cache.batch(0, f"site::{s.name}").shape[2:]),
                        _adapter_name(s, setup.model)) for s in setup.sites],
        identity_replay_max_abs_diff=identity.max_abs_diff, conditions=summary.conditions,
        per_layer=summary.per_layer, retention=summary.retention,
        interaction=summary.interaction, variance=variance, variation=spread,
        profiles=profiles, execution=execution, verdict=verdict,
        seeds=Seeds(opts.seed, seeds, seeds, opts.seed * 1000 + 7),
        settings={**{k: v for k, v in dataclasses.asdict(opts).items() if k != "schedule"},
                  "bootstrap_resamples": opts.bootstrap,
                  "calibration_sequences_used_for_static": len(setup.data.calib_ids),
                  "layer_index": "a site's index within its family"},
        versions=versions(), command=command,
        nondeterministic_keys=[*NONDETERMINISTIC_KEYS, *([TIMED_VERDICT_KEY] if timed else [])],
        runtime=runtime,
        identity=None if identity.exact and not identity.allowed_nonexact else identity,
        custom_conditions=summary.custom or None)


def _adapter_name(site: Site, model: nn.Module) -> str | None:
    name = adapter_name(site.adapter, model.get_submodule(site.path))
    return None if name == "tensor" else name


# ----------------------------------------------------------------------------- run


def audit(model: Any, out: str | Path | None = None, *, sites: SiteSpec = None,
          data: DataSpec | AuditData | None = None, dense: Any = None,
          blocks: str | None = None, options: AuditOptions | None = None,
          interventions: Mapping[str, Any] | Sequence[Intervention] | None = None,
          progress: Progress | None = None, command: str | None = None,
          report: bool = True) -> AuditResult | None:
    """Run the whole Frozen Controller Audit and return its :class:`AuditResult`.

    ``model``: a spec (run folder, checkpoint folder, ``pkg.module:factory``), an
    ``nn.Module`` or a :class:`~fcaudit.loading.LoadedModel`. ``out``: the output
    folder (cache, ``audit.json``, report); None runs in a temporary cache and writes
    nothing. ``sites``: module-path globs or :class:`~fcaudit.Site` objects (default:
    the model's declaration). ``data``: a :class:`DataSpec` (text, token arrays or the
    built-in corpus) or ready :class:`AuditData`. ``interventions``: user-defined
    conditions, ``{name: fn}`` or :class:`~fcaudit.interventions.Intervention` objects.

    In a ``torchrun`` process group every rank calls this; rank 0 validates and claims
    ``out`` first, the batches are shared out, and rank 0 alone returns the result
    (the other ranks return None).
    """
    options = options or AuditOptions()
    progress = progress or _silent
    ranks = current()
    if not ranks.main:
        ranks.barrier(CLAIMED)
    setup = prepare(model, out, sites=sites, data=data or DataSpec(), dense=dense,
                    blocks=blocks, options=options, interventions=interventions)
    if setup.out is None and ranks.world > 1:
        raise FcauditError("an audit over several processes needs --out, a folder every "
                           "process sees")
    first = probe(setup)  # every rank: the same checks, and AUTO adapters learn their layout
    if not ranks.main:
        _run(setup, open_cache(setup, setup.out / "cache", ranks), None, progress, command,
             ranks)
        return None
    if setup.out is None:
        import tempfile
        with tempfile.TemporaryDirectory(prefix="fcaudit-") as tmp:
            return _run(setup, open_cache(setup, Path(tmp), ranks, first), first, progress,
                        command, ranks)
    from .outdir import hold_output, replacing_results
    with hold_output(setup.out, "audit", command):
        cache = open_cache(setup, setup.out / "cache", ranks, first)
        ranks.barrier(CLAIMED)
        result = _run(setup, cache, first, progress, command, ranks)
        assert result is not None
        with replacing_results(setup.out):
            write_outputs(result, setup.out, report)
    return result


CLAIMED = "rank 0 validated the inputs and claimed the output folder"


def open_cache(setup: Setup, folder: Path, ranks: Ranks,
               first: Probe | None = None) -> CoefficientCache:
    """The cache; rank 0 opens (or creates) it, adopts the probe's batch and drops replay
    results of other plans before the other ranks open it."""
    cache = CoefficientCache(folder, cache_identity(setup), setup.options.batch_size,
                             len(setup.data.eval_ids), owner=ranks.main)
    if first is not None:
        adopt_probe(cache, first)
        cache.use_replay_plan(plan_key(plan_runs(setup.sites, setup.options,
                                                 setup.interventions), setup.options))
    return cache


def _run(setup: Setup, cache: CoefficientCache, first: Probe | None, progress: Progress,
         command: str | None, ranks: Ranks) -> AuditResult | None:
    """Record and replay this rank's batches; rank 0 then summarizes every batch."""
    opts, timings = setup.options, {}
    record_calibration(setup, cache, progress, ranks)
    record_evaluation(setup, cache, progress, ranks)
    ranks.barrier("recorded")
    profiles = calibration_profiles(setup, cache)
    cache.verify_all()
    timings["record_s"] = time.perf_counter() - setup.started
    n, seq_len = setup.data.eval_ids.shape
    inputs = ReplayInputs(cache, setup.sites, profiles,
                          [draw(opts.seed * 1000 + 17 + k, n, seq_len)
                           for k in range(opts.repeats)], opts.seed)
    runs = plan_runs(setup.sites, opts, setup.interventions)
    plan = plan_key(runs, opts)
    started = time.perf_counter()
    replay_stage(setup, inputs, runs, plan, progress, ranks)
    ranks.barrier("replayed")
    if first is None:
        return None
    replays = replay_results(cache, plan, opts)
    timings["replay_s"] = time.perf_counter() - started
    diff = replays.identity_diff
    identity = dataclasses.replace(first.identity, exact=first.identity.exact and diff == 0,
                                   max_abs_diff=max(first.identity.max_abs_diff, diff))
    stats = describe(cache, setup.sites)
    summary = summarize(runs, replays.per_run, stats[3], setup.sites, opts)
    routed = routing_sites(setup.sites)
    routing = routing_summary(routed, tracked_runs(runs), replays.route_load,
                              replays.route_changed, setup.data.eval_ids.size) \
        if routed else None
    started = time.perf_counter()
    execution = execute(setup)
    timings["execution_s"] = time.perf_counter() - started
    timings["total_s"] = time.perf_counter() - setup.started
    runtime = Runtime(host(), {k: round(v, 3) for k, v in timings.items()},
                      {**replays.schedule, "processes": ranks.world})
    result = assemble(setup, cache, summary, stats, execution, identity, command, runtime)
    result.routing = routing
    return result


def write_outputs(result: AuditResult, out: Path, report: bool = True) -> None:
    """The report (when asked) first, then audit.json: its presence means the audit finished."""
    from .fileio import write_json
    if report:
        from .report import write_report
        write_report(result, out)
    write_json(out / "audit.json", result.to_json())
