"""``--target-ci``: rounds of fixed audits on growing prefixes of the ordered pool.

Round ``k`` audits the first ``n_k`` sequences exactly as a fixed audit of them would;
the loop stops when every counted half-width reaches the target or the pool is used up
(the rule and the growth are :mod:`fcaudit.engine.stopping`'s).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from fcaudit.engine import stopping as st
from fcaudit.engine.cache import CoefficientCache
from fcaudit.engine.distributed import SINGLE
from fcaudit.engine.measure import Measurements, measure, reuse_summary
from fcaudit.engine.options import Prepared, Progress, say
from fcaudit.engine.probe import Probe
from fcaudit.engine.result import Stopping


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
    floor = st.min_sequences(opts.min_sequences, n_pool)
    n, previous, entries, spent = st.first_size(floor, opts.batch_size, n_pool), 0, [], []
    while True:
        started = time.perf_counter()
        cache.use_prefix(n)
        prefix = dataclasses.replace(pool.data, eval_ids=pool.data.eval_ids[:n])
        setup = dataclasses.replace(pool, data=prefix, data_summary=prefix.checked().summary())
        m = measure(setup, cache, first, progress, SINGLE)
        assert m is not None
        entry = st.round_entry(n, opts.batch_size, previous, len(m.runs),
                               st.half_widths(m.summary.conditions), target)
        entries.append(entry)
        spent.append(_round_cost(n, m, time.perf_counter() - started))
        if opts.progress:
            say(progress, f"target-ci round {len(entries)}: {n} of {n_pool} sequences, "
                          f"widest half-width {entry.half_widths[entry.widest]:.4g} nats "
                          f"({entry.widest}), target {target:g}")
        if entry.met or n == n_pool:
            break
        previous, n = n, st.next_size(n, entry.half_widths[entry.widest], target,
                                      opts.batch_size, n_pool)
    return Rounds(m, spent, st.stopping(pool.data, opts.seed, target, floor, entries,
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
