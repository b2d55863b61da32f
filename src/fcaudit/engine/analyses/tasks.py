"""Benchmark tasks as an analysis (``--lm-eval-tasks``): lm-evaluation-harness tasks
scored with the audited model under each condition the audit ran that acts on task
requests, once the audit is measured, beside its NLL answers (the section ``tasks`` of
``audit.json``, the report, ``metrics()``, ``fcaudit compare`` and ``to_frame("tasks")``).

The tasks are loaded before the model (:func:`before`): a task lm-eval does not know, one
whose data would need a download, a generation task or lm-eval missing is refused before
any audit work. The scoring is :mod:`fcaudit.engine.actions.harness`'s (lm-eval and torch
are imported where used, so reading an audit.json loads neither).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from fcaudit.core.conditions import CONDITIONS, audited
from fcaudit.core.errors import UsageError, arg
from fcaudit.engine.analyses.base import Analysis, Work
from fcaudit.engine.result_parts import Estimate

NAME = "tasks"


@dataclass
class MetricScores:
    """One metric of one task: its value under each condition (with a paired bootstrap
    interval over the task's examples), penalties against correct, retentions."""

    higher_is_better: bool
    values: dict[str, Estimate]
    penalty: dict[str, Estimate]  # the condition's value minus correct's
    # static profiles, in percent of the Correct-to-GlobalMean gap (None: no clear gap)
    retention: dict[str, Estimate | None]


@dataclass
class TaskScores:
    task: str
    examples: int
    metrics: dict[str, MetricScores]
    requests: dict[str, int]  # per condition
    not_applicable: dict[str, str]  # conditions not scored on this task, and why


@dataclass
class TasksSection:
    """The tasks scored under each condition (``conditions``; the others, with the reason,
    in ``not_applicable``), the wall time of each condition's evaluation and the
    lm-evaluation-harness that scored them."""

    conditions: list[str]
    not_applicable: dict[str, str]
    tasks: dict[str, TaskScores]
    wall_s: dict[str, float]
    lm_eval_version: str

    def markdown(self) -> str:
        """A table per task and metric: each condition's value, its penalty against correct
        and a static profile's retention, with 95% intervals."""
        def est(e: Estimate | None, spec: str) -> str:
            return "undefined (no clear gap)" if e is None else \
                f"{e.value:{spec}} [{e.ci95[0]:{spec}}, {e.ci95[1]:{spec}}]"

        def pct(e: Estimate | None) -> str:
            return "undefined (no clear gap)" if e is None else \
                f"{e.value:.1f}% [{e.ci95[0]:.1f}%, {e.ci95[1]:.1f}%]"
        lines = []  # audit.json sorts its keys: conditions in the audit's order, tasks by name
        for task, scores in sorted(self.tasks.items()):
            for metric, m in sorted(scores.metrics.items()):
                lines += [f"\n{task} ({scores.examples} examples): {metric} "
                          f"({'higher' if m.higher_is_better else 'lower'} is better)\n",
                          "| condition | value | minus correct | retention |",
                          "|---|---:|---:|---:|"]
                lines += [f"| {c} | {est(m.values[c], '.4f')} | "
                          f"{est(m.penalty[c], '+.4f') if c in m.penalty else ''} | "
                          f"{pct(m.retention[c]) if c in m.retention else ''} |"
                          for c in self.conditions if c in m.values]
        lines += [f"\nnot run: {c} ({self.not_applicable[c]})"
                  for c in in_registry_order(self.not_applicable)]
        lines += [f"\nnot scored on {t}: {c} ({scores.not_applicable[c]})"
                  for t, scores in sorted(self.tasks.items())
                  for c in in_registry_order(scores.not_applicable)]
        return "\n".join(lines).lstrip("\n")


def in_registry_order(names: Collection[str]) -> list[str]:
    """Condition names in the registry's order (audit.json sorts its keys)."""
    order = list(CONDITIONS)
    return sorted(names, key=lambda n: order.index(n) if n in order else len(order))


PARTS = ("", "penalty", "retention")  # a value, its difference from correct, a retention


def _name(task: str, metric: str, condition: str, part: str) -> str:
    return f"{task}_{metric}_{part}{'_' * bool(part)}{condition}"


def metric_key(task: str, metric: str, condition: str, part: str = "") -> str:
    """The name in :meth:`AuditResult.metrics` of a task's metric under a condition
    (``part``: "penalty", its difference from correct's; "retention", a static profile's
    retention of the Correct-to-GlobalMean gap)."""
    assert part in PARTS, part
    return f"{NAME}_{_name(task, metric, condition, part)}"


def _numbers(section: TasksSection) -> dict[str, Estimate | None]:
    """Every value, penalty and retention, named ``<task>_<metric>_<condition>``,
    ``<task>_<metric>_penalty_<condition>`` and ``<task>_<metric>_retention_<profile>``
    (None: no clear gap)."""
    out: dict[str, Estimate | None] = {}
    for task, scores in section.tasks.items():
        for metric, m in scores.metrics.items():
            for part, numbers in zip(PARTS, (m.values, m.penalty, m.retention), strict=True):
                out |= {_name(task, metric, c, part): e for c, e in numbers.items()}
    return out


def metrics(section: TasksSection) -> dict[str, float | None]:
    return {k: None if e is None else e.value for k, e in _numbers(section).items()}


def intervals(section: TasksSection) -> dict[str, list[float] | None]:
    return {k: None if e is None else list(e.ci95) for k, e in _numbers(section).items()}


def rows(section: TasksSection) -> list[dict[str, Any]]:
    """One row per task, metric and condition: value, penalty against correct and
    retention, each with its interval (None where it has none)."""
    def cells(name: str, e: Estimate | None) -> dict[str, Any]:
        lo, hi = (None, None) if e is None else e.ci95
        return {name: None if e is None else e.value, f"{name}_ci_low": lo,
                f"{name}_ci_high": hi}
    return [{"task": task, "metric": metric, "condition": c, "examples": scores.examples,
             **cells("value", v), **cells("penalty", m.penalty.get(c)),
             **cells("retention", m.retention.get(c))}
            for task, scores in section.tasks.items()
            for metric, m in scores.metrics.items() for c, v in m.values.items()]


def before(options: Any) -> Any:
    """lm-eval's tasks, loaded and checked from the options alone (None: none asked)."""
    if not options.lm_eval_tasks:
        return None
    from fcaudit.engine.actions.harness import load_tasks, require_lm_eval
    require_lm_eval()
    return load_tasks(options.lm_eval_tasks, options.lm_eval_include_path, options.seed,
                      flags=("lm_eval_tasks", "lm_eval_include_path"), owner="AuditOptions")


def plan(setup: Any, probe: Any) -> list[Any]:
    """No replays of the audit's batches, but the requests' passes, said in the plan (at
    most a record and a replay of each batch of requests and each rolling window, under
    each condition that runs on requests, a random one once per repeat); refuses, before
    any file, a model with no tokenizer to read the requests with, data that are not
    token ids and a request longer than the model's context."""
    loaded = setup.before.get(NAME)
    if loaded is None:
        return []
    if setup.inputs.token_ids is None:
        raise UsageError(f"{arg('lm_eval_tasks', owner='AuditOptions')} scores text with a "
                         "language model: this audit's data are not token ids",
                         option="lm_eval_tasks")
    if setup.loaded.tokenizer is None:
        raise UsageError(f"{arg('lm_eval_tasks', owner='AuditOptions')} reads the task "
                         "requests with the model's tokenizer and this model has none: audit "
                         "a run or checkpoint folder that holds its tokenizer.json, or in "
                         "Python give a LoadedModel with tokenizer= (a tokenizers.Tokenizer)",
                         option="lm_eval_tasks")
    from fcaudit.core.nll import model_limits
    from fcaudit.engine.actions.harness import (
        check_requests,
        draws,
        pass_positions,
        passes_for,
        rows_per_pass,
        runnable,
    )
    requests, windows = check_requests(loaded, setup.loaded.tokenizer,
                                       model_limits(setup.model)[1],
                                       setup.options.lm_eval_limit, "lm_eval_tasks",
                                       "AuditOptions")
    scored = sum(draws(c, setup.options.repeats) for c in audited(setup.conditions)
                 if c not in setup.not_applicable and runnable(c) is None)
    positions = pass_positions(setup)
    passes = 2 * passes_for(requests, windows, positions) * scored
    longest = max([*requests, *windows], default=1)
    shape = (rows_per_pass(positions, longest), longest)
    return [Work("benchmark task requests", passes, passes * _pass_seconds(setup, shape),
                 ("lm_eval_limit", "AuditOptions(lm_eval_limit=N)", "--lm-eval-limit N"))]


def _pass_seconds(setup: Any, shape: tuple[int, int]) -> float:
    """One pass of the fullest batch of the longest requests, timed (the second of two:
    the first may carry one-time costs): what the plan prices each pass at."""
    import time

    import torch

    from fcaudit.core.nll import device_of
    x = torch.zeros(shape, dtype=torch.long, device=device_of(setup.model))
    seconds = []
    for _ in range(2):
        started = time.perf_counter()
        setup.executor.record(x, None)
        seconds.append(time.perf_counter() - started)
    return seconds[-1]


def summarise(measured: Any, analysis: Analysis) -> TasksSection | None:
    setup = measured.setup
    loaded = setup.before.get(NAME)
    if loaded is None:
        return None
    from fcaudit.engine.actions.harness import score_tasks
    conditions = [c for c in audited(setup.conditions) if c not in setup.not_applicable]
    section, _ = score_tasks(setup, measured.profiles, setup.loaded.tokenizer, loaded,
                             conditions, limit=setup.options.lm_eval_limit,
                             seed=setup.options.seed, say=measured.say)
    return section


ANALYSIS = Analysis(NAME, plan=plan, summarise=summarise, metrics=metrics,
                    section_type=TasksSection, before=before, intervals=intervals,
                    rows=rows, compared=True)

__all__ = ["ANALYSIS", "MetricScores", "TaskScores", "TasksSection", "metric_key"]
