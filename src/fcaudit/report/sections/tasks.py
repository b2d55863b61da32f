"""The benchmark tasks' section: each task's metric under each condition, beside the
audit's NLL answers."""

from __future__ import annotations

from fcaudit.engine.analyses.tasks import NAME, TasksSection
from fcaudit.engine.result import AuditResult
from fcaudit.report.markdown import md_text
from fcaudit.report.sections.base import Renderer


def render(r: AuditResult, t: TasksSection) -> list[str]:
    return ["## Benchmark tasks (lm-evaluation-harness)",
            f"Scored by lm-evaluation-harness {md_text(t.lm_eval_version)} with the audited "
            "model under each condition, each request recorded and replayed as the audit's "
            "sequences are (`correct` reproduced every request's logits bit for bit). "
            "Values with paired bootstrap 95% intervals over each task's examples; "
            "retention: of the gap between `correct` and `global-mean` on the task's "
            "metric, as for the NLL above.",
            t.markdown()]


RENDERER = Renderer(NAME, render)
