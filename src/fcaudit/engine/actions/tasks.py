"""``fcaudit tasks``: benchmark tasks scored on a finished audit (:func:`evaluate_tasks`),
its model and data loaded again and proven the audit's, its calibration profiles
recomputed; the scoring is :mod:`fcaudit.engine.actions.harness`'s, as an audit run with
``--lm-eval-tasks`` scores them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from fcaudit.core.conditions import CONDITIONS
from fcaudit.core.errors import UsageError
from fcaudit.core.interventions import StaticProfiles
from fcaudit.core.nll import model_limits
from fcaudit.core.registry import refusal
from fcaudit.engine.actions.harness import (
    Scorer,
    check_requests,
    conditioned_lm,
    load_tasks,
    require_lm_eval,
    runnable,
    score_tasks,
)
from fcaudit.engine.actions.reopen import Progress, read_audit, recomputed_profiles, reopened
from fcaudit.engine.analyses.tasks import TasksSection
from fcaudit.io.data import AuditData, DataSpec

SCHEMA = "fcaudit.tasks/1"


@dataclass
class TasksResult(TasksSection):
    """What :func:`evaluate_tasks` measured (``tasks.json`` with ``--json``): the section an
    audit with ``--lm-eval-tasks`` holds, the audit it scored and lm-eval's per-sample
    logs (not written)."""

    audit: str = ""
    schema: str = SCHEMA
    samples: dict[str, Any] = field(default_factory=dict, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "samples"}


@contextmanager
def _reopened_for_tasks(audit: str | Path, model: Any, data: DataSpec | AuditData | None,
                        tokenizer: Any, say: Progress
                        ) -> Iterator[tuple[Any, Any, StaticProfiles, list[str]]]:
    """The audit reopened (its model and data proven its own), with the tokenizer the
    requests are read with, the calibration profiles recomputed and its conditions."""
    require_lm_eval()
    result = read_audit(audit)
    with reopened(result, model, data, declared=False) as setup:
        tok = tokenizer if tokenizer is not None else setup.loaded.tokenizer
        if tok is None:
            raise UsageError("the audited model has no tokenizer to read the task requests "
                             "with: audit a run or checkpoint folder that holds its "
                             "tokenizer.json, or in Python give tokenizer= (a "
                             "tokenizers.Tokenizer)")
        profiles, _ = recomputed_profiles(setup, say, "tasks")
        yield setup, tok, profiles, list(result.conditions)


def evaluate_tasks(audit: str | Path, tasks: Sequence[str], *, model: Any = None,
                   data: DataSpec | AuditData | None = None, tokenizer: Any = None,
                   include_path: str | Path | None = None, limit: int | None = None,
                   seed: int = 0, progress: Progress | None = None) -> TasksResult:
    """Score the lm-evaluation-harness ``tasks`` (names it knows, or task YAMLs under
    ``include_path``) with the audited model under each condition of the audit that runs
    on task requests. ``model`` and ``data``: the audit's (default: the model audit.json
    names, the built-in corpus), checked to be; ``tokenizer``: a ``tokenizers.Tokenizer``
    (default: the model's own); ``limit``: examples per task. An audit run with
    ``--lm-eval-tasks`` holds the same in its ``tasks`` section."""
    require_lm_eval()
    loaded = load_tasks(tasks, include_path, seed)
    say = progress or (lambda *_: None)
    with _reopened_for_tasks(audit, model, data, tokenizer, say) as (setup, tok, profiles,
                                                                     conditions):
        check_requests(loaded, tok, model_limits(setup.model)[1], limit)
        section, samples = score_tasks(setup, profiles, tok, loaded, conditions, limit,
                                       seed, say)
    return TasksResult(**{f.name: getattr(section, f.name) for f in fields(TasksSection)},
                       audit=str(audit), samples=samples)


@contextmanager
def conditioned_model(audit: str | Path, condition: str, *, model: Any = None,
                      data: DataSpec | AuditData | None = None, tokenizer: Any = None,
                      seed: int = 0) -> Iterator[Any]:
    """The audited model as an lm-evaluation-harness model (``lm_eval.api.model.LM``)
    with ``condition`` applied to every request, for the harness's own entry points::

        with fcaudit.conditioned_model("audits/fg", "static-layer") as lm:
            lm_eval.simple_evaluate(model=lm, tasks=["my_cloze"], task_manager=...)

    ``condition``: one the audit ran that acts on task requests; the rest as
    :func:`evaluate_tasks`. The model is released when the block ends."""
    why = runnable(condition) if condition in CONDITIONS else "no condition of fcaudit's"
    with _reopened_for_tasks(audit, model, data, tokenizer, lambda *_: None) as (
            setup, tok, profiles, conditions):
        if why is not None or condition not in conditions:
            raise refusal(f"condition {condition!r}: {why or 'the audit did not run it'}",
                          condition, [c for c in conditions if runnable(c) is None],
                          option="condition")
        yield conditioned_lm(Scorer(setup, profiles, tok, condition, seed))


__all__ = ["SCHEMA", "TasksResult", "conditioned_model", "evaluate_tasks"]
