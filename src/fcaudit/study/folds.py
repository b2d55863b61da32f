"""The fold study's step after each seed's audit (``fcaudit reproduce --preset fold``):
fold the group's condition into the seed's model, time it, and heal it with the control.

Its numbers go into the seed's metrics under plain keys (an estimate ``KEY`` with its
interval ``KEY_lo``, ``KEY_hi``), so the preset's table and findings read them as they
read any metric (:mod:`fcaudit.study.declare`, the ``estimate`` cell).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fcaudit.engine.result import AuditResult
from fcaudit.engine.result_parts import Estimate
from fcaudit.io.data import DataSpec
from fcaudit.study.declare import Group


def _estimate(key: str, e: Estimate | None) -> dict[str, float | None]:
    if e is None or e.value is None:
        return {key: None, f"{key}_lo": None, f"{key}_hi": None}
    return {key: e.value, f"{key}_lo": e.ci95[0], f"{key}_hi": e.ci95[1]}


def fold_seed(group: Group, run: Path, audit_dir: Path, audit: AuditResult, seed: int,
              settings: Any) -> dict[str, float | None]:
    """Fold ``group.fold`` into the seed's run (the fold's run folder beside it, replaced
    on rerun: folding is checked anew, never reused), time it against the original and
    the dense twin, and heal it for ``group.heal`` steps (``--steps`` in a smoke study)
    with the original fine-tuned alike as the control (a task run: with the task's
    accuracy of both before and after)."""
    from fcaudit.engine.actions.fold import fold
    from fcaudit.study.heal import heal
    assert group.fold is not None
    condition = audit.conditions[group.fold]
    out: dict[str, float | None] = {
        **_estimate("fold_penalty", Estimate(condition.delta, condition.ci95)),
        **_estimate("fold_retention", audit.retention.get(group.fold))}
    started = time.perf_counter()
    target = run.parent / f"{run.name}-{group.fold}"
    done = fold(audit_dir, group.fold, target, force=True,
                data=DataSpec(max_eval=settings.max_eval, max_calib=settings.max_calib),
                timing_pairs=settings.options.timing_pairs)
    out.update({"fold_max_diff": done.exactness.max_abs_diff,
                "fold_s": round(time.perf_counter() - started, 1)})
    for name, speed in (("source", done.vs_original), ("twin", done.vs_dense)):
        out.update(_estimate(f"fold_latency_{name}", None if speed is None else
                             speed.latency_ratio))
        out[f"fold_flops_{name}"] = None if speed is None else speed.flops_ratio
    steps = settings.steps or group.heal
    if group.heal:
        started = time.perf_counter()
        healed = heal(target, run, steps, done.eval_ids, eval_targets=done.eval_targets,
                      seed=seed, progress=settings.options.progress)
        out.update({**_estimate("heal_before", healed.penalty_before),
                    **_estimate("heal_after", healed.penalty_after),
                    **_estimate("heal_recovered", None if healed.recovered is None else
                                Estimate(100 * healed.recovered.value,
                                         [100 * x for x in healed.recovered.ci95])),
                    "heal_steps": steps, "heal_s": round(time.perf_counter() - started, 1)})
        first, last = healed.curve[0], healed.curve[-1]
        if first.folded_accuracy is not None:  # a task run: does healing make it pass?
            out.update({"heal_accuracy_before": first.folded_accuracy,
                        "heal_accuracy_after": last.folded_accuracy,
                        "heal_control_accuracy": last.original_accuracy})
    return out
