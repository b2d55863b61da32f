"""``fcaudit tasks``: benchmark tasks scored on a finished audit (:func:`evaluate_tasks`),
its model and data loaded again and proven the audit's, its calibration profiles
recomputed; the scoring is :mod:`fcaudit.engine.harness`'s, as an audit run with
``--lm-eval-tasks`` scores them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from fcaudit.core.errors import UsageError
from fcaudit.core.nll import model_limits
from fcaudit.engine.actions.reopen import Progress, read_audit, recomputed_profiles, reopened
from fcaudit.engine.analyses.tasks import TasksSection
from fcaudit.engine.harness import check_requests, load_tasks, require_lm_eval, score_tasks
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
    result = read_audit(audit)
    loaded = load_tasks(tasks, include_path, seed)
    say = progress or (lambda *_: None)
    with reopened(result, model, data, declared=False) as setup:
        tok = tokenizer if tokenizer is not None else setup.loaded.tokenizer
        if tok is None:
            raise UsageError("the audited model has no tokenizer to read the task requests "
                             "with: audit a run or checkpoint folder that holds its "
                             "tokenizer.json, or in Python give tokenizer= (a "
                             "tokenizers.Tokenizer)")
        check_requests(loaded, tok, model_limits(setup.model)[1], limit)
        profiles, _ = recomputed_profiles(setup, say, "tasks")
        section, samples = score_tasks(setup, profiles, tok, loaded, tasks,
                                       list(result.conditions), limit, seed, say)
    return TasksResult(**{f.name: getattr(section, f.name) for f in fields(TasksSection)},
                       audit=str(audit), samples=samples)


__all__ = ["SCHEMA", "TasksResult", "evaluate_tasks"]
