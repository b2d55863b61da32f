"""The two heavy stages, batch by batch into the cache: record and replay.

**Record**: calibration batches (float64 sums per batch, added in batch order later)
and evaluation batches (per-token NLL and every site's coefficients). **Replay**: every
planned run on every evaluation batch, batch-outer (all runs of a batch before the next
batch), the identity replay checked on each batch (first and again after every other
run), per-layer runs on the suffix of the model when each site's prefix reuse is proven
exact on that batch, routers' choices counted (and, under an expert ablation, how
often the ablated expert is still picked). Each finished batch is a checksummed
shard holding the digest of what every run was fed, so either stage resumes after an
interruption, a rerun reuses a batch only when every run would be fed the same tensors,
and under torchrun each rank takes its own batches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fcaudit.core.adapters import same_bits
from fcaudit.core.conditions import CORRECT, collections
from fcaudit.core.contract import Site
from fcaudit.core.digest import digest_tensors
from fcaudit.core.errors import CacheError, IdentityError, arg
from fcaudit.core.interventions import COLLECTIONS, StaticProfiles, batch_sums
from fcaudit.core.nll import device_of
from fcaudit.core.routers import changed_rows, expert_counts
from fcaudit.engine.analyses.base import picking_rows
from fcaudit.engine.analyses.routing import routing_sites
from fcaudit.engine.cache import (
    CalibrationShard,
    CoefficientCache,
    EvaluationShard,
    ReplayShard,
)
from fcaudit.engine.options import AuditOptions, Prepared, Progress, say
from fcaudit.engine.passes import (
    SINGLE,
    STATE_FIX,
    Ranks,
    Replayed,
    batches,
    check_finite,
    check_finite_losses,
    check_units,
)
from fcaudit.engine.plan import (
    ReplayInputs,
    ReuseSample,
    Run,
    choose,
    feed,
    first_difference,
    fresh_seed,
    replay_line,
    rerouting_rows,
    run_digest,
    run_name,
    sub_plan,
)

ALLOW_NONEXACT = arg("allow_nonexact_identity", py="AuditOptions(allow_nonexact_identity=True)")
IDENTITY_CAUSES = (
    "randomness in the forward pass (dropout or a model left in training mode, sampling, "
    "jitter noise), a model whose output depends on state that changes between calls, "
    "nondeterministic kernels (some CUDA operations), or a controller output the model "
    "uses in a way the site's adapter does not reproduce")


def record_calibration(setup: Prepared, cache: CoefficientCache, progress: Progress,
                       ranks: Ranks = SINGLE) -> dict[str, int]:
    """This rank's calibration batches: each batch's float64 sums (by position and by
    token id), cached; a shard already on disk is recomputed and used only when equal
    (:meth:`CoefficientCache.settle`). Returns how many were proven and recorded."""
    net, size = setup.model, setup.options.batch_size
    n = -(-setup.inputs.n_calib // size)
    todo = ranks.mine([b for b in range(n) if cache.calib_name(b) not in cache.proven])
    for done, (b, x) in enumerate(batches(setup.calib_source, size, device_of(net), todo),
                                  start=1):
        _, coefficients, _ = setup.executor.record(x, None)
        check_finite(coefficients, "calibration data")
        cache.settle(cache.calib_name(b), calibration_shard(setup, coefficients, x),
                     f"calibration batch {b} ({_rows(size, b, setup.inputs.n_calib)})")
        progress("record calibration", done, len(todo), "")
    from_disk = sum(cache.calib_name(b) in cache.reused for b in ranks.mine(list(range(n))))
    return {"batches_proven": from_disk, "batches_recorded": len(ranks.mine(list(range(n))))
            - from_disk}


def calibration_shard(setup: Prepared, coefficients: Mapping[str, Tensor],
                      x: Any) -> dict[str, Tensor]:
    """What a calibration batch's shard holds: float64 sums by position and, for token
    inputs, by token id (the cost plan sizes the cache from the same tensors)."""
    on_cpu = {k: c.cpu() for k, c in coefficients.items()}
    if setup.token_ids is None:  # no token ids, or sites without a token axis
        return CalibrationShard.build(batch_sums(on_cpu), None, {})
    ids = setup.inputs.batch_token_ids(x)
    return CalibrationShard.build(batch_sums(on_cpu),
                                  setup.inputs.calibration_token_sums(on_cpu, x), {
        name: COLLECTIONS[name](on_cpu, ids) for name in _collections(setup)})


def _collections(setup: Prepared) -> frozenset[str]:
    """The calibration sums beyond the default ones that the opted-in conditions which
    apply to these sites and inputs read (none by default)."""
    return collections([name for name in setup.conditions
                        if name not in setup.not_applicable])


def _rows(size: int, b: int, n: int) -> str:
    """The sequences (or examples) batch ``b`` holds, as a person counts them."""
    return f"rows {b * size + 1}-{min((b + 1) * size, n)}"


def record_frontier_calibration(setup: Prepared, cache: CoefficientCache, sites: Sequence[Site],
                                progress: Progress, ranks: Ranks = SINGLE) -> None:
    """The frontier's calibration coefficients of ``sites``, whole (its thresholds are
    calibration quantiles, which sums cannot give); a shard on disk is used once proven."""
    calib_name, net, size = cache.frontier_calib_name, setup.model, setup.options.batch_size
    n = -(-setup.inputs.n_calib // size)
    todo = ranks.mine([b for b in range(n) if calib_name(b) not in cache.proven])
    for done, (b, x) in enumerate(batches(setup.calib_source, size, device_of(net), todo),
                                  start=1):
        _, coefficients, _ = setup.executor.record(x, None, sites)
        cache.settle(calib_name(b), CalibrationShard.build({k: v.cpu() for k, v in
                                                             coefficients.items()}),
                     f"calibration batch {b} ({_rows(size, b, setup.inputs.n_calib)})")
        progress("record frontier calibration", done, len(todo), "")


def frontier_calibration(setup: Prepared, cache: CoefficientCache,
                         sites: Sequence[Site]) -> dict[str, Tensor]:
    """Site name -> its calibration coefficients, all batches in order."""
    size, names = setup.options.batch_size, [s.name for s in sites]
    shards = [CalibrationShard.per_site(cache.read(cache.frontier_calib_name(b)), names)
              for b in range(-(-setup.inputs.n_calib // size))]
    return {name: torch.cat([sh[name] for sh in shards]) for name in names}


def calibration_profiles(setup: Prepared, cache: CoefficientCache) -> StaticProfiles:
    """Static profiles from calibration data only: every batch's sums, added in batch
    order (so the result does not depend on which process recorded which batch)."""
    profiles = StaticProfiles(setup.sites)
    for b in range(-(-setup.inputs.n_calib // setup.options.batch_size)):
        add_calibration(setup, profiles, cache.read(cache.calib_name(b)), b)
    return profiles


def add_calibration(setup: Prepared, profiles: StaticProfiles, shard: Mapping[str, Tensor],
                    b: int) -> None:
    """Calibration batch ``b``'s shard (:func:`calibration_shard`) added to ``profiles``;
    batches are added in order."""
    size, n, names = setup.options.batch_size, setup.inputs.n_calib, [s.name for s in
                                                                       setup.sites]
    profiles.add_sums(CalibrationShard.per_site(shard, names),
                      len(range(n)[b * size:(b + 1) * size]),
                      CalibrationShard.tokens(shard, names),
                      **{name: CalibrationShard.collected(shard, names, name)
                         for name in _collections(setup)})


def eval_shard(nll: Tensor, coefficients: Mapping[str, Tensor],
                hits: Tensor | None = None) -> dict[str, Tensor]:
    """``nll``: the objective's per-unit losses; ``hits``: per example, 1 when classified
    correctly (classification only)."""
    return EvaluationShard.build(nll, coefficients, hits)


def adopt_probe(cache: CoefficientCache, coefficients: Mapping[str, Tensor], nll: Tensor,
                hits: Tensor | None = None) -> None:
    """Write the probe's batch as shard 0, or prove a cached shard 0 with it: the probe's
    pass is a fresh recomputation of the first batch (its values were checked there)."""
    cache.settle(cache.eval_name(0), eval_shard(nll, coefficients, hits),
                 f"evaluation batch 0 ({_rows(cache.batch_size, 0, cache.n_sequences)})")


def record_evaluation(setup: Prepared, cache: CoefficientCache, progress: Progress,
                      ranks: Ranks = SINGLE) -> dict[str, int]:
    """This rank's evaluation batches, one unperturbed pass each. A shard already on disk
    is used only once this pass reproduces it bit for bit (the cost of reuse: one forward
    per batch, which proves what no fingerprint can: that the model, its objective and
    everything they read still compute the cached record). Returns how many of this
    rank's batches were proven from disk and recorded."""
    net = setup.model
    mine = ranks.mine(list(range(cache.n_batches)))
    todo = [b for b in mine if cache.eval_name(b) not in cache.proven]
    objective, proven = setup.objective, 0
    earlier = len(mine) - len(todo)  # the probe's batch, or an earlier --target-ci round's
    said = earlier_batches(earlier, 0 in mine and cache.eval_name(0) not in todo)
    if todo and earlier:  # the count starts where the batches recorded before it end
        progress("record evaluation", earlier, len(mine), said)
    for done, (b, x) in enumerate(batches(setup.eval_source, cache.batch_size,
                                          device_of(net), todo), start=earlier + 1):
        logits, coefficients, nll = setup.executor.record(x, objective)
        check_finite(coefficients, "evaluation data")
        check_finite_losses(nll, objective, f"the unperturbed record pass, batch {b}")
        proven += cache.settle(cache.eval_name(b),
                               eval_shard(nll, coefficients, objective.hits(logits, x)),
                               f"evaluation batch {b} "
                               f"({_rows(cache.batch_size, b, cache.n_sequences)})")
        progress("record evaluation", done, len(mine), said)
    from_disk = sum(cache.eval_name(b) in cache.reused for b in mine)
    return {"batches_reused": earlier + proven, "batches_new": len(todo) - proven,
            "batches_proven": from_disk, "batches_recorded": len(mine) - from_disk}


def earlier_batches(earlier: int, probed: bool) -> str:
    """What the record stage's count includes besides its own passes: the batch the probe
    recorded (the plan's first), and an earlier ``--target-ci`` round's."""
    if not earlier:
        return ""
    if probed and earlier == 1:
        return "(batch 1 recorded by the probe)"
    rounds = "the probe's batch 1 and earlier rounds'" if probed else "earlier rounds'"
    return f"({earlier} batches recorded before: {rounds})"


def replay_stage(setup: Prepared, inputs: ReplayInputs, runs: Sequence[Run], progress: Progress,
                 ranks: Ranks = SINGLE) -> dict[str, Any]:
    """This rank's batches under every run, batch by batch (every run of one batch before
    the next batch); each finished batch is cached, so an interrupted replay resumes there.

    A cached batch is a candidate for reuse only when every run's feed digest, recomputed
    now, equals the one stored with it (same runs, order, schedule, token ids and fed
    tensors, bit for bit); otherwise the whole batch is replayed again and its shard
    replaced. Candidates are then proven (:mod:`~fcaudit.engine.plan`): a fresh
    sample of their runs, covering every run of the plan, is replayed again and must
    equal the cached rows bit for bit, else the audit stops naming the run and the batch.
    Returns how many of this rank's batches were reused and recomputed, and the proof.
    """
    cache = inputs.cache
    mine = ranks.mine(list(range(cache.n_batches)))
    reused = [b for b in mine if _reusable(setup, inputs, runs, b)]
    everywhere = sorted(b for part in ranks.gather(reused, "cached replays") for b in part)
    sample = choose(setup.options.verify_reuse, len(runs), everywhere,
                    ranks.gather(fresh_seed(), "reuse sample")[0])
    line = replay_line(len(runs), cache.n_batches, len(everywhere), sample)
    if ranks.main and setup.options.progress and line:
        say(progress, line)
    _prove_reused(setup, inputs, runs, sample, [b for b in reused if sample.runs_in(b)],
                  progress)
    cache.proven.update(cache.replay_name(b) for b in reused)
    todo = [b for b in mine if b not in reused]
    kept_runs = 0
    for done, (b, x) in enumerate(batches(setup.eval_source, cache.batch_size,
                                          device_of(setup.model), todo), start=1):
        kept = _earlier_runs(setup, inputs, runs, b)
        kept_runs += len(kept.rows)
        info = f"batch {b + 1} of {cache.n_batches}"
        cache.write(cache.replay_name(b), _replay_one_batch(
            setup, inputs, runs, b, x, kept, _Ticks(progress, len(runs), len(kept.rows), info)))
        progress("replay", done, len(todo), info)
    return {"batches_reused": len(reused), "batches_recomputed": len(todo),
            "runs_kept_from_earlier_rounds": kept_runs,
            "proof": sample.summary(len(runs), len(everywhere))}


def _prove_reused(setup: Prepared, inputs: ReplayInputs, runs: Sequence[Run],
                  sample: ReuseSample, proving: Sequence[int], progress: Progress) -> None:
    """Replay the sampled runs of this rank's reused batches again (with the correct
    replay, which they rest on) and require their cached rows bit for bit."""
    cache = inputs.cache
    for done, (b, x) in enumerate(batches(setup.eval_source, cache.batch_size,
                                          device_of(setup.model), proving), start=1):
        index, sub = sub_plan(runs, sample.runs_in(b))
        info = f"batch {b + 1} of {cache.n_batches}"
        fresh = _replay_one_batch(setup, inputs, sub, b, x,
                                  tick=_Ticks(progress, len(sub), 0, info))
        differs = first_difference(runs, index, cache.read(cache.replay_name(b)), fresh)
        if differs is not None:
            i, what = differs
            raise CacheError(
                f"the cache in {cache.folder} holds replay results this model no longer "
                f"gives: run {run_name(runs[i])} on evaluation batch {b} "
                f"({_rows(cache.batch_size, b, cache.n_sequences)}), replayed again now, "
                f"gives other {what} than its cached result, though the batch's record pass "
                "and everything the run is fed are bit for bit the cached ones (the model "
                "under intervention reads state outside its code that changed since, such "
                "as environment variables, files, attributes or package versions, or varies "
                f"between runs); delete {cache.folder} or choose another {arg('out')}",
                folder=str(cache.folder), batch=b)
        progress("prove reused replays", done, len(proving), info)


class _Ticks:
    """Progress within one batch (a real model's batch can take minutes): one step per
    replay pass, up to the batch's runs (a prefix fallback's repeated passes stay there)."""

    def __init__(self, progress: Progress, runs: int, kept: int, info: str) -> None:
        self.progress, self.runs, self.done, self.info = progress, runs, kept, info

    def __call__(self) -> None:
        self.done = min(self.done + 1, self.runs)
        self.progress("passes of this batch", self.done, self.runs, self.info)


def plan_digest(runs: Sequence[Run]) -> Tensor:
    """SHA-256 of the plan's run identities in order: rows of another shard (routing and
    ablation rows are stored by position) are taken only from a shard of the same plan."""
    names = repr([(r.condition, r.repeat, *r.target.identity()) for r in runs]).encode()
    return torch.tensor(list(digest_tensors([], names)), dtype=torch.uint8)


@dataclass
class Kept:
    """Runs of one batch taken from an earlier ``--target-ci`` round's shard of the same
    batch and plan, each only because its digest (token ids, schedule, identity, every fed
    tensor) equals the one this round computes: run index -> its NLL row and digest, its
    re-routing row (tracked runs) and its picks of what it removed (counting runs)."""

    rows: dict[int, tuple[Tensor, bytes]]
    changed: dict[int, Tensor]
    still: dict[int, int]


NONE_KEPT = Kept({}, {}, {})


def _earlier_runs(setup: Prepared, inputs: ReplayInputs, runs: Sequence[Run], b: int) -> Kept:
    """The runs of batch ``b`` an earlier round already replayed with bitwise the same
    inputs (a round's derangement and permutations depend on its size, so the random
    conditions differ; static, per-layer static, ablation and frontier runs do not)."""
    name = inputs.cache.earlier_replay_name(b)
    if name is None or name not in inputs.cache.proven:  # written or proven by this audit
        return NONE_KEPT
    shard = inputs.cache.read(name)  # checksum verified
    if not same_bits(shard.get(ReplayShard.PLAN_DIGEST), plan_digest(runs)) or \
            float(shard[ReplayShard.IDENTITY_DIFF]) != 0:
        return NONE_KEPT
    context, cpu = _context(setup, b), torch.device("cpu")
    old = [bytes(row.tolist()) for row in shard[ReplayShard.FEED_DIGEST]]
    rows = {}
    for i, run in enumerate(runs[1:], start=1):  # the correct replay always runs again
        digest = run_digest(run, feed(run, b, inputs, cpu), context)
        if digest == old[i]:
            rows[i] = (shard[ReplayShard.NLL][i], digest)
    tracked = rerouting_rows(runs)
    changed = {i: shard[ReplayShard.ROUTE_CHANGED][j] for j, i in enumerate(tracked)
               if i in rows} if ReplayShard.ROUTE_CHANGED in shard else {}
    still = {i: int(shard[ReplayShard.STILL_SELECTED][j])
             for j, i in enumerate(picking_rows(runs)) if i in rows}
    return Kept(rows, changed, still)


def _context(setup: Prepared, b: int) -> bytes:
    """What a batch's runs depend on besides their fed tensors: its token ids (or every
    input and target tensor of its examples, bitwise), the schedule."""
    size = setup.options.batch_size
    named, head = setup.inputs.batch_context(b * size, (b + 1) * size, setup.options.schedule,
                                             lambda: setup.objective.identity())
    return digest_tensors(named, head)


def _reusable(setup: Prepared, inputs: ReplayInputs, runs: Sequence[Run], b: int) -> bool:
    """True when batch ``b``'s cached shard was computed from exactly what this audit would
    feed: every run's digest, recomputed from fresh feeds, equals the stored one."""
    cache, name = inputs.cache, inputs.cache.replay_name(b)
    if not cache.has(name):
        return False
    shard = cache.read(name)  # checksum verified: a corrupted shard is an error, not a miss
    if float(shard[ReplayShard.IDENTITY_DIFF]) != 0 and \
            not setup.options.allow_nonexact_identity:
        return False  # replayed again: the identity check then stops the audit
    context = _context(setup, b)
    cpu = torch.device("cpu")
    expected = [run_digest(run, feed(run, b, inputs, cpu), context) for run in runs]
    return same_bits(shard.get(ReplayShard.FEED_DIGEST), _digest_tensor(expected))


def _digest_tensor(digests: Sequence[bytes]) -> Tensor:
    return torch.tensor([list(d) for d in digests], dtype=torch.uint8)


@dataclass
class Replays:
    """Every batch's replay results, gathered: per-sequence NLL per run (run order), the
    identity replay's max |diff|, how the schedule went, and routing counts."""

    per_run: list[np.ndarray]
    identity_diff: float
    schedule: dict[str, Any]
    route_load: dict[str, Tensor]  # router site -> token-slots per expert (correct replay)
    route_changed: Tensor | None  # [tracked runs, router sites] tokens re-routed
    # [expert-ablation runs] token-slots that still picked the ablated expert (0: removed)
    still_selected: Tensor | None = None
    hits: list[np.ndarray] | None = None  # per run: 1 per correctly classified example


def replay_results(cache: CoefficientCache, options: AuditOptions) -> Replays:
    shards = [cache.read(cache.replay_name(b)) for b in range(cache.n_batches)]
    R = ReplayShard
    per_run = torch.cat([s[R.NLL] for s in shards], dim=1).numpy()
    states = [int(s[R.PREFIX]) for s in shards]
    schedule = {"requested": options.schedule,
                "batches_prefix_reused": states.count(PREFIX_REUSED),
                "batches_fell_back_to_full_passes": states.count(PREFIX_FELL_BACK),
                "batches": len(states)}
    loads = [R.route_loads(s) for s in shards]
    load = {k: sum(one[k] for one in loads) for k in loads[0]}
    changed = sum(s[R.ROUTE_CHANGED] for s in shards) if R.ROUTE_CHANGED in shards[0] else None
    still = sum(s[R.STILL_SELECTED] for s in shards) if R.STILL_SELECTED in shards[0] else None
    hits = list(torch.cat([s[R.HITS] for s in shards], dim=1).numpy()) \
        if R.HITS in shards[0] else None
    return Replays(list(per_run), max(float(s[R.IDENTITY_DIFF]) for s in shards), schedule,
                   load, changed, still, hits)


PREFIX_OFF, PREFIX_REUSED, PREFIX_FELL_BACK = 0, 1, 2


class _Passes:
    """The replay passes of one batch: each run fed from the cache, its digest taken from
    exactly the tensors fed, its per-token NLL checked finite."""

    def __init__(self, setup: Prepared, inputs: ReplayInputs, b: int, x: Tensor,
                 tick: Callable[[], None] | None) -> None:
        self.executor, self.inputs, self.b, self.x = setup.executor, inputs, b, x
        self.tick = tick or (lambda: None)  # progress within a batch: a step per pass
        self.objective = setup.objective
        self.recorded = inputs.cache.batch(b, EvaluationShard.NLL)  # record pass's losses
        self.context = _context(setup, b)
        self.correct_fed: dict[Site, Tensor] = {}
        self.still_selected: dict[str, int] = {}  # counting run key -> its picks
        self.hits: dict[tuple[str, int], Tensor | None] = {}  # run -> correct per example

    def replay(self, run: Run, **kw: Any) -> tuple[Replayed, Tensor, bytes]:
        fed = feed(run, self.b, self.inputs, torch.device("cpu"))
        digest = run_digest(run, fed, self.context)
        fed = {s: t.to(self.x.device) for s, t in fed.items()}
        if run.condition == CORRECT:
            self.correct_fed = fed
        counts = run.target.counts_picks
        out = self.executor.replay(self.x, fed, objective=self.objective,
                                   **{**kw, "select": kw.get("select") or counts})
        if counts:  # the family's own rule, on what was fed: does it still pick it?
            self.still_selected[run.key] = run.target.picks(out.chosen)
        nll = self.objective.units(out.output, self.x).cpu()
        where = f"replay under {run.key}, batch {self.b}"
        check_units(nll, self.recorded.shape, self.objective, where)
        check_finite_losses(nll, self.objective, where)
        hits = self.objective.hits(out.output, self.x)
        self.hits[run.key, run.repeat] = hits.cpu() if hits is not None else None
        self.tick()
        return out, nll, digest

    def correct_with(self, known: Mapping[str, Any] | None = None) -> Replayed:
        """The correct replay again (with ``known`` blocks stubbed)."""
        return self.executor.replay(self.x, self.correct_fed, known=known,
                            objective=self.objective)


@torch.no_grad()
def _replay_one_batch(setup: Prepared, inputs: ReplayInputs, runs: Sequence[Run], b: int,
                      x: Tensor, kept: Kept = NONE_KEPT,
                      tick: Callable[[], None] | None = None) -> dict[str, Tensor]:
    """Every run on batch ``b``: the correct replay first, then the per-layer runs (on the
    suffix when prefix reuse holds, see :func:`_per_layer`), then the other runs, then the
    correct replay again, which must equal the first bit for bit; for router sites, the
    expert load of the correct replay and how many tokens each main condition re-routes.
    Rows stay in plan order, each with the digest of what its run was fed; the runs in
    ``kept`` are not replayed again (their rows come from an earlier round's shard)."""
    assert runs[0].condition == CORRECT and runs[0].target.only_site is None
    passes, routed = _Passes(setup, inputs, b, x, tick), routing_sites(inputs.sites)
    passes.still_selected.update({runs[i].key: n for i, n in kept.still.items()})
    traced = setup.blocks if setup.options.schedule == "prefix" and \
        any(r.target.only_site is not None for r in runs) else None
    first, nll, digest = passes.replay(runs[0], select=bool(routed), trace=traced)
    diff = _identity_diff(setup, nll, passes.recorded, b)
    done = {0: (nll.double().mean(1), digest), **kept.rows}
    state = _per_layer(passes, runs, first, done)
    shard = {ReplayShard.route_load(s.name): expert_counts(first.chosen[s.name],
                                                          passes.correct_fed[s].shape[-1])
             for s in routed}
    changed = {i: row.tolist() for i, row in kept.changed.items()}
    for i, run in enumerate(runs):
        if i in done:
            continue
        tracked = bool(routed) and run.target.counts_rerouting
        out, nll, digest = passes.replay(run, select=tracked)
        if tracked:
            changed[i] = [changed_rows(first.chosen[s.name], out.chosen[s.name])
                          for s in routed]
        done[i] = (nll.double().mean(1), digest)
    diff = max(diff, _history_diff(setup, passes, first, len(runs)))
    if routed:
        shard[ReplayShard.ROUTE_CHANGED] = torch.tensor([changed[i] for i in rerouting_rows(runs)],
                                              dtype=torch.float64)
    if counting := picking_rows(runs):
        shard[ReplayShard.STILL_SELECTED] = torch.tensor(
            [passes.still_selected[runs[i].key] for i in counting], dtype=torch.int64)
    rows = [done[i] for i in range(len(runs))]
    if passes.objective.accuracy:
        shard[ReplayShard.HITS] = torch.stack([passes.hits[r.key, r.repeat] for r in runs])
    return {ReplayShard.NLL: torch.stack([r[0] for r in rows]),
            ReplayShard.FEED_DIGEST: _digest_tensor([r[1] for r in rows]),
            ReplayShard.IDENTITY_DIFF: torch.tensor(diff, dtype=torch.float64),
            ReplayShard.PREFIX: torch.tensor(state), ReplayShard.PLAN_DIGEST: plan_digest(runs),
            **shard}


def _identity_diff(setup: Prepared, nll: Tensor, recorded: Tensor, b: int) -> float:
    diff = float((nll - recorded).abs().max())
    if diff != 0 and not setup.options.allow_nonexact_identity:
        raise IdentityError(
            f"identity replay is not exact on batch {b}: the per-token NLL differs by up to "
            f"{diff:.3g} nats. Likely causes: {IDENTITY_CAUSES}. Rerun with "
            f"{ALLOW_NONEXACT} to see the numbers flagged as not exact", max_abs_diff=diff)
    return diff


def _history_diff(setup: Prepared, passes: _Passes, first: Replayed, n_runs: int) -> float:
    """The correct replay once more, after every other run of the batch: a model whose
    output depends on earlier passes (state kept between calls) shows here, any schedule."""
    again = passes.correct_with()
    if same_bits(again.logits, first.logits):
        return 0.0
    x, units = passes.x, passes.objective.units
    diff = float((units(again.output, x) - units(first.output, x)).abs().max())
    if not setup.options.allow_nonexact_identity:
        raise IdentityError(
            f"the correct replay of batch {passes.b}, repeated after the batch's other "
            f"{n_runs - 1} runs, differs from the first by up to {diff:.3g} nats: the model's "
            "output depends on earlier forward passes (state kept between calls, e.g. a "
            "recurrent state or a generation cache), so every replay's number would depend "
            f"on the order of the runs; {STATE_FIX}, or rerun with {ALLOW_NONEXACT} to see "
            "the numbers flagged as not exact", max_abs_diff=diff)
    return diff


def _per_layer(passes: _Passes, runs: Sequence[Run], first: Replayed,
               done: dict[int, tuple[Tensor, bytes]]) -> int:
    """The per-layer runs, right after the correct replay. With a trace (prefix schedule)
    the sites go from the last called to the first, so the blocks a run takes from the
    correct replay have not run since it; before a site's runs, the correct replay with
    that site's prefix stubbed must equal the full one bit for bit, from the state those
    runs start in. One failure: every per-layer run of the batch becomes a full pass."""
    layer = [(i, r.target.only_site) for i, r in enumerate(runs)
             if r.target.only_site is not None and i not in done]
    trace = first.trace
    if trace is not None:
        layer.sort(key=lambda item: -trace.starts[item[1].path])
    state, proven = PREFIX_OFF, set()
    for i, site in layer:
        known = {p: trace.outputs[p] for p in trace.prefix(site.path)} if trace else {}
        if known and site.path not in proven:
            if not _prefix_holds(passes, known, first):
                for j, _ in layer:
                    done[j] = _row(passes, runs[j])
                return PREFIX_FELL_BACK
            proven.add(site.path)
            state = PREFIX_REUSED
        done[i] = _row(passes, runs[i], known=known or None)
    return state


def _prefix_holds(passes: _Passes, known: Mapping[str, Any], first: Replayed) -> bool:
    """The correct replay with ``known`` blocks stubbed equals the full one bit for bit.
    A pass the stubs break (a model that tells a stub from its block: by its type, by a
    method of its own) proves nothing and is no error of the model: the batch falls back
    to full passes, which run no stub and raise whatever the model itself raises."""
    try:
        stubbed = passes.correct_with(known)
    except Exception:  # noqa: BLE001 - only this stubbed pass is given up, never a full one
        return False
    return same_bits(stubbed.logits, first.logits)


def _row(passes: _Passes, run: Run, **kw: Any) -> tuple[Tensor, bytes]:
    _, nll, digest = passes.replay(run, **kw)
    return nll.double().mean(1), digest
