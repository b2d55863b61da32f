"""The Frozen Controller Audit: an orchestration of typed steps.

    prepare       -> :class:`Prepared`: every option and input validated once, models
                     loaded, sites, layouts and data resolved, the output folder checked
                     (nothing is written before this passes; :mod:`~fcaudit.engine.prepare`)
    probe         -> the first batch recorded and replayed in memory: adapters, call counts
                     and the identity replay checked before any real work
                     (:mod:`~fcaudit.engine.probe`)
    measure       -> :class:`Measurements`: calibration and evaluation recorded into the
                     on-disk cache, the runs planned (:mod:`~fcaudit.engine.plan`, the
                     analyses': :mod:`~fcaudit.engine.analyses`) and replayed batch by
                     batch (resumable), then summarized (:mod:`~fcaudit.engine.measure`;
                     with ``target_ci``, round after round: :mod:`~fcaudit.engine.run`)
    build_result  -> execution against the dense counterpart, verdicts and one
                     :class:`~fcaudit.engine.result.AuditResult` (:mod:`~fcaudit.engine.
                     assemble`)

Progress, and every line a person reads, goes through an optional callback
``progress(stage, done, total, info)`` (lines as stage :data:`~fcaudit.engine.options.
NOTE`): the engine never prints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fcaudit._version import __version__
from fcaudit.core.conditions import by_role
from fcaudit.core.errors import FcauditError, arg
from fcaudit.core.errors import render as for_reader
from fcaudit.core.layout import spell_axes
from fcaudit.core.nll import device_of
from fcaudit.engine.analyses.runs import analysis_runs
from fcaudit.engine.budget import AuditPlan, audit_plan, say_plan
from fcaudit.engine.cache import CoefficientCache
from fcaudit.engine.measure import Measurements, build_result, measure, reuse_summary
from fcaudit.engine.objectives import UNREADABLE
from fcaudit.engine.options import AuditOptions, Prepared, Progress, SeedPlan, say, silent
from fcaudit.engine.passes import SINGLE, Ranks, current
from fcaudit.engine.prepare import AuditRequest, prepare
from fcaudit.engine.probe import Probe, probe, same_probe_on_every_rank
from fcaudit.engine.result import AuditResult, ConditionResult, Stopping, StoppingRound
from fcaudit.engine.stages import adopt_probe
from fcaudit.io.data import AuditData, fingerprint_array
from fcaudit.io.loading import release
from fcaudit.io.outdir import hold_output
from fcaudit.io.placement import offload_space
from fcaudit.io.results import ResultWriter, replacing_results

__all__ = ["AuditOptions", "AuditRequest", "Audited", "Measurements", "Prepared", "audit",
           "audited", "build_result", "measure", "prepare"]


def audit(request: AuditRequest, progress: Progress | None = None) -> AuditResult | None:
    """Run the whole Frozen Controller Audit and return its :class:`AuditResult`, writing
    only ``audit.json`` (so the engine never imports the report layer), the engine's notes
    going to ``progress`` alone. The public entry is :func:`fcaudit.api.audit`, which
    also writes the report and shows the notes (through :func:`audited`).

    In a ``torchrun`` process group every rank calls this; rank 0 validates and claims
    ``out`` first, the batches are shared out, and rank 0 alone returns the result
    (the other ranks return None).
    """
    with audited(request, progress) as done:
        if done.files is not None:
            done.finish()
        return done.result


@dataclass(frozen=True)
class Audited:
    """A measured audit: its result (None on ranks other than 0) and, with an output
    folder, the writer its results go through while the folder is held."""

    result: AuditResult | None
    out: Path | None = None  # the output folder, as given
    files: ResultWriter | None = None  # None: no output folder (or not rank 0)

    def finish(self) -> None:
        """Write ``audit.json``, the completion file: last, after any other result."""
        assert self.result is not None and self.files is not None and self.out is not None
        self.files.write_json(self.out / "audit.json", self.result.to_json())


@contextlib.contextmanager
def audited(request: AuditRequest, progress: Progress | None = None) -> Iterator[Audited]:
    """Run the audit (:func:`audit`) and hand its result to the block; with ``out``, the
    block runs while the folder is held and its previous results are aside: it writes the
    new ones through ``Audited.files``, ``audit.json`` last (:meth:`Audited.finish`), and
    if it raises, the previous results come back."""
    place = request.options.placement() if isinstance(request.model, (str, Path)) else None
    with offload_space(place, request.out):  # weights on disk stay readable until the end
        yield from _audited(request, progress or silent)


def _audited(request: AuditRequest, progress: Progress) -> Iterator[Audited]:
    ranks = current()
    if not ranks.main:
        ranks.barrier(CLAIMED)
    setup = prepare(request, ranks)
    with _closing(setup.model, owned=isinstance(request.model, (str, Path))):
        yield from _audit_prepared(setup, request, progress, ranks)


@contextlib.contextmanager
def _closing(model: Any, owned: bool) -> Iterator[None]:
    """A model this audit loaded itself is released when the audit ends (an engine
    serving it: :func:`~fcaudit.io.loading.release`)."""
    try:
        yield
    finally:
        if owned:
            release(model)


def _audit_prepared(setup: Prepared, request: AuditRequest, progress: Progress,
                    ranks: Ranks) -> Iterator[Audited]:
    command = request.command
    if ranks.main and request.options.progress:
        for line in setup.notes:
            say(progress, for_reader(line, cli=command is not None))
    first = probe(setup)  # every rank: the same checks, and AUTO adapters learn their layout
    # the extra runs' plans, decided once: an impossible --expert-ablation or --frontier
    # stops here, before any file
    planned, later = analysis_runs(setup, first)
    first = dataclasses.replace(first, planned=planned, later=later)
    plan = audit_plan(setup, first)  # every pass and its time, said before the work
    if not ranks.main:
        _run(setup, open_cache(setup, setup.out / "cache", ranks), first, progress, command,
             ranks)
        yield Audited(None)
        return
    if setup.out is None:
        with tempfile.TemporaryDirectory(prefix="fcaudit-") as tmp:
            say_plan(setup, plan, Path(tmp), progress)
            result = _run(setup, open_cache(setup, Path(tmp), ranks, first), first, progress,
                          command, ranks, plan)
        yield Audited(result)
        return
    say_plan(setup, plan, setup.out / "cache", progress)
    with hold_output(setup.out, "audit", command):
        cache = open_cache(setup, setup.out / "cache", ranks, first)
        ranks.barrier(CLAIMED)
        result = _run(setup, cache, first, progress, command, ranks, plan)
        assert result is not None
        with replacing_results(setup.out) as files:
            yield Audited(result, setup.out, files)


CLAIMED = "rank 0 validated the inputs and claimed the output folder"


def open_cache(setup: Prepared, folder: Path, ranks: Ranks,
               first: Probe | None = None) -> CoefficientCache:
    """The cache; rank 0 opens (or creates) it and adopts the probe's batch before the
    other ranks open it."""
    if ranks.main and not setup.objective.provable and any(folder.glob("**/*.sha256")):
        raise FcauditError(
            f"{folder} holds an earlier audit's results, and the objective reads "
            f"{setup.objective.state.removeprefix(UNREADABLE + ': ')}, whose state fcaudit "
            "cannot read as bits, so they cannot be proven to be this objective's: delete "
            f"that folder or choose another {arg('out')} (an objective that reads only "
            "functions, tensors, arrays, numbers and strings resumes from its cache)")
    cache = CoefficientCache(folder, cache_identity(setup), setup.options.batch_size,
                             setup.inputs.n_eval, owner=ranks.main)
    if first is not None:
        adopt_probe(cache, first.coefficients, first.nll, first.hits)
    return cache


def cache_identity(setup: Prepared) -> dict[str, Any]:
    net, data = setup.model, setup.data_summary
    param = next(net.parameters(), None)
    return {"model": setup.loaded.fingerprint or setup.loaded.spec,
            "model_class": type(net).__name__, "eval_data": data["eval_fingerprint"],
            "calib_data": data["calib_fingerprint"],
            "dtype": str(param.dtype) if param is not None else "unknown",
            "device": device_of(net).type, "sites": [s.name for s in setup.sites],
            "adapters": [getattr(s.adapter, "name", type(s.adapter).__name__)
                         for s in setup.sites],
            "layouts": [spell_axes(s.axes or (), s.positions or ()) for s in setup.sites],
            "objective": setup.objective.identity(),
            "exit_threshold": setup.options.exit_threshold if setup.options.early_exit
            else None,
            "fcaudit": __version__, "torch": torch.__version__,
            "package versions": setup.loaded.packages}


def _run(setup: Prepared, cache: CoefficientCache, first: Probe, progress: Progress,
         command: str | None, ranks: Ranks, plan: AuditPlan | None = None
         ) -> AuditResult | None:
    """Record and replay this rank's batches; rank 0 then summarizes every batch (with
    ``target_ci``, round after round: :func:`~fcaudit.engine.run.run_to_target`)
    and builds the result."""
    same_probe_on_every_rank(ranks, first)
    if setup.options.target_ci is not None:
        rounds = run_to_target(setup, cache, first, progress)
        return build_result(rounds.last, cache, command, SINGLE, rounds, plan)  # one process
    measured = measure(setup, cache, first, progress, ranks)
    if measured is None:
        return None
    return build_result(measured, cache, command, ranks, plan=plan)


# ---------------------------------------------------------------------- stopping
# Precision-driven stopping (``--target-ci``): the rule, the growth of the rounds, the
# order of the evaluation pool (docs/method.md, "Cost that follows the precision asked for").
#
# The pool (the evaluation windows the data gives) is put in one seeded order before the
# probe; round ``k`` audits exactly the first ``n_k`` sequences of that order, as a fixed
# audit of those sequences would (same batches, same derangement of ``n_k``, same
# bootstrap), and the audit stops at the first round whose counted penalties all have
# 95% intervals reaching at most ``target_ci`` nats on each side of their estimate, or
# when the pool is used up. So the numbers at the stop are those of a fixed audit of
# :func:`prefix_data` ``(pool, N, seed)``; only the choice of ``N`` depends on the data.
# :func:`run_to_target` runs the rounds.

DEFAULT_MIN_SEQUENCES = 16  # the first round: a bootstrap over fewer is too coarse to trust
# the penalties whose intervals must reach the target: the penalties against correct a
# user reads as answers (reassign, shuffle, the pair, the static profiles); not global-mean,
# the retention's floor, whose own interval answers no question (the interaction,
# retention and per-layer variants follow from them or are localisations)
COUNTED = by_role("counted")
MAX_GROWTH = 2  # a round at most doubles the sequences of the last one
RULE = ("stop at the first round where every counted penalty's 95% paired bootstrap "
        "interval [lo, hi] has max(delta - lo, hi - delta) <= target_ci, or when the pool "
        "is used up")
GROWTH = ("first round: min_sequences rounded up to a whole batch; next: the projection "
          "n * (widest half-width / target)^2 (half-widths shrink as 1/sqrt(n)), rounded up "
          "to a whole batch, at least one batch more and at most twice the last round, "
          "capped at the pool")
CAVEAT = ("N was chosen by looking at the intervals (optional stopping): the 95% intervals "
          "at N are those of a fixed audit of the same N sequences, but their coverage after "
          "a data-dependent stop is approximate, not exactly 95%")


def order_seed(seed: int) -> int:
    return SeedPlan(seed).order


def pool_order(n_pool: int, seed: int) -> np.ndarray:
    """The audit order of the pool's rows: one seeded permutation, so every prefix is a
    random subset of the pool (the pool's own order may run work by work)."""
    return np.random.default_rng(order_seed(seed)).permutation(n_pool)


def ordered_pool(data: AuditData, seed: int) -> AuditData:
    """``data`` with its evaluation windows in the audit order (calibration unchanged)."""
    return dataclasses.replace(data, eval_ids=data.eval_ids[pool_order(len(data.eval_ids),
                                                                       seed)])


def prefix_data(pool: AuditData, n: int, seed: int) -> AuditData:
    """The first ``n`` sequences of ``pool`` in the audit order: what a fixed audit must
    be given to reproduce a ``target_ci`` audit that stopped at ``n`` (same sources)."""
    ordered = ordered_pool(pool, seed)
    return dataclasses.replace(ordered, eval_ids=ordered.eval_ids[:n])


def min_sequences(given: int | None, pool: int) -> int:
    """The floor: as given (refused above the pool), else the default capped at the pool."""
    if given is None:
        return min(DEFAULT_MIN_SEQUENCES, pool)
    if given > pool:
        raise FcauditError(f"{arg('min_sequences', given, owner='AuditOptions')} exceeds the "
                           f"{pool} evaluation sequences the data gives: lower it, or give "
                           f"more data ({arg('max_eval', owner='DataSpec')})")
    return given


def _whole_batches(n: float, batch_size: int, pool: int) -> int:
    return min(pool, batch_size * math.ceil(n / batch_size))


def first_size(floor: int, batch_size: int, pool: int) -> int:
    return _whole_batches(floor, batch_size, pool)


def next_size(n: int, widest: float, target: float, batch_size: int, pool: int) -> int:
    """The next round's sequences (see :data:`GROWTH`): whole batches, so the batches of
    earlier rounds keep their composition and their record passes stay valid."""
    ratio = widest / target  # inf when it overflows; nan when no width could be measured
    growth = MAX_GROWTH if math.isnan(ratio) else min(ratio, MAX_GROWTH)  # capped: no overflow
    projected = n * growth ** 2
    return _whole_batches(min(max(projected, n + batch_size), MAX_GROWTH * n), batch_size, pool)


def half_widths(conditions: Mapping[str, ConditionResult]) -> dict[str, float]:
    """Counted condition -> the larger distance from its penalty to an end of its interval."""
    return {c: max(conditions[c].delta - conditions[c].ci95[0],
                   conditions[c].ci95[1] - conditions[c].delta) for c in COUNTED}


def met(widths: Mapping[str, float], target: float) -> bool:
    return all(math.isfinite(w) and w <= target for w in widths.values())


def round_entry(n: int, batch_size: int, previous: int, n_runs: int,
                widths: dict[str, float], target: float) -> StoppingRound:
    batches = -(-n // batch_size)
    return StoppingRound(sequences=n, batches=batches,
                         record_batches_new=batches - -(-previous // batch_size),
                         replay_passes=batches * n_runs, half_widths=widths,
                         widest=max(widths, key=lambda c: widths[c]), met=met(widths, target))


def _pool_end(sources: Mapping[str, object], n_pool: int) -> str:
    """Why the pool ended: the data ran out, or the evaluation count picked a part of it."""
    available = sources.get("eval_available")
    if isinstance(available, int) and available > n_pool:
        return (f"the pool ran out at the max_eval cap (--max-eval): all {n_pool} sequences "
                f"it picked of the {available} the data holds audited (raise the cap to go "
                "on),")
    return f"the data ran out: all {n_pool} sequences audited"


def stopping(ordered: AuditData, seed: int, target: float, floor: int,
             rounds: list[StoppingRound], n_runs: int) -> Stopping:
    """The ``stopping`` section: the rule, each round, and why the audit stopped
    (``ordered``: the pool in audit order, as :func:`ordered_pool` gives it)."""
    last = rounds[-1]
    n, n_pool = last.sequences, len(ordered.eval_ids)
    order = pool_order(n_pool, seed)
    if last.met:
        reason = (f"target reached: every counted half-width <= {target:g} nats at {n} of "
                  f"{n_pool} sequences (round {len(rounds)}); the widest, which stopped it, "
                  f"{last.widest}'s {last.half_widths[last.widest]:.4g} nats")
    else:
        reason = (f"{_pool_end(ordered.sources, n_pool)} and the widest half-width, "
                  f"{last.widest}'s {last.half_widths[last.widest]:.4g} nats, is still above "
                  f"the target of {target:g}")
    return Stopping(
        target_ci=float(target), min_sequences=floor, pool_sequences=n_pool,
        pool_fingerprint=fingerprint_array(ordered.eval_ids[np.argsort(order)]),
        order_seed=order_seed(seed), pool_rows=[int(i) for i in order[:n]],
        conditions=list(COUNTED),
        rule=RULE, growth=GROWTH, rounds=rounds, sequences_used=n, reached=last.met,
        reason=reason, replay_passes_total=sum(r.replay_passes for r in rounds),
        replay_passes_fixed=last.batches * n_runs, caveat=CAVEAT)


@dataclass(frozen=True)
class Rounds:
    """The last round's measurements, every round's cost and the stopping section."""

    last: Measurements
    spent: list[dict[str, Any]]
    stopping: Stopping


def run_to_target(pool: Prepared, cache: CoefficientCache, first: Probe,
                  progress: Progress) -> Rounds:
    """Audit round after round, each on a larger prefix of the (already ordered) pool,
    until the target is met or the pool is used up."""
    opts, n_pool = pool.options, pool.inputs.n_eval
    target = float(opts.target_ci)  # type: ignore[arg-type]
    floor = min_sequences(opts.min_sequences, n_pool)
    n, previous, entries, spent = first_size(floor, opts.batch_size, n_pool), 0, [], []
    while True:
        started = time.perf_counter()
        cache.use_prefix(n)
        prefix = dataclasses.replace(pool.data, eval_ids=pool.data.eval_ids[:n])
        setup = dataclasses.replace(pool, data=prefix, data_summary=prefix.checked().summary())
        m = measure(setup, cache, first, progress, SINGLE)
        assert m is not None
        entry = round_entry(n, opts.batch_size, previous, len(m.runs),
                               half_widths(m.summary.conditions), target)
        entries.append(entry)
        spent.append(_round_cost(n, m, time.perf_counter() - started))
        if opts.progress:
            say(progress, f"target-ci round {len(entries)}: {n} of {n_pool} sequences, "
                          f"widest half-width {entry.half_widths[entry.widest]:.4g} nats "
                          f"({entry.widest}), target {target:g}")
        if entry.met or n == n_pool:
            break
        previous, n = n, next_size(n, entry.half_widths[entry.widest], target,
                                      opts.batch_size, n_pool)
    return Rounds(m, spent, stopping(pool.data, opts.seed, target, floor, entries,
                                        len(m.runs)))


def _round_cost(n: int, m: Measurements, wall_s: float) -> dict[str, Any]:
    """A round's runtime facts: its wall time and what it took from the cache."""
    replayed = reuse_summary(m.reuse, len(m.runs), m.recorded)
    return {"sequences": n, "wall_s": round(wall_s, 3),
            "record_batches_reused": m.recorded["evaluation"]["batches_reused"],
            "record_batches_recorded": m.recorded["evaluation"]["batches_new"],
            **{k: replayed[k] for k in ("batches_reused", "batches_recomputed",
                                        "runs_reused", "runs_recomputed",
                                        "replay_runs_verified")}}
