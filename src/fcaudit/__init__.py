"""fcaudit: the Frozen Controller Audit.

Three separate questions about a model with controllers (gates, mixing-weight
generators, routers): do the coefficients *vary*; does the *frozen* model *depend* on
each coefficient tensor staying matched to its input and token; and does the
mechanism change *execution*?

Public API (imported lazily, so ``import fcaudit`` and ``fcaudit --help`` stay fast)::

    fcaudit.load_model(spec)                   # any model spec -> nn.Module
    fcaudit.find_sites(model, globs=None)      # -> list[Site]
    fcaudit.record(model, input_ids, sites)    # -> Recording {site name: [B, T, ...]}
    with fcaudit.replay(model, recording):     # controllers replaced, never run
        model(input_ids)
    fcaudit.logits_of(output)                  # logits, also of a Hugging Face output
    fcaudit.reassign / shuffle / static        # interventions on recorded dicts
    fcaudit.audit(model, out=None, ...)        # -> AuditResult
    fcaudit.LoadedModel(module, spec, kind, tokenizer=tok)  # a module with its tokenizer
    fcaudit.compare([a, b], out=None, labels=None)  # audits side by side -> Comparison
    fcaudit.fold(audit_dir, profile, out)      # a static profile folded in -> FoldResult
    fcaudit.evaluate_tasks(audit_dir, tasks)   # lm-eval tasks per condition -> TasksResult
    with fcaudit.conditioned_model(audit_dir, "static-layer") as lm:  # an lm_eval LM
        lm_eval.simple_evaluate(model=lm, tasks=[...])
"""

from __future__ import annotations

import importlib
from typing import Any

from fcaudit._version import __version__
from fcaudit.core.errors import (
    CacheError,
    DataError,
    FcauditError,
    IdentityError,
    ModelError,
    UsageError,
)

# public name -> the module that defines it (docs/architecture.md shows the layers)
_EXPORTS = {
    "AuditOptions": "engine.options", "audit": "api",
    "AuditResult": "engine.result",
    "compare": "report.compare", "Comparison": "report.compare",
    "fold": "engine.actions.fold", "FoldResult": "engine.actions.fold",
    "evaluate_tasks": "engine.actions.tasks", "TasksResult": "engine.actions.tasks",
    "conditioned_model": "engine.actions.tasks",
    "DataSpec": "io.data", "AuditData": "io.data",
    "Site": "core.contract", "SiteCall": "core.contract", "ExpertLayer": "core.contract",
    "Gate": "core.contract", "Selection": "core.contract", "Exit": "core.contract",
    "TupleAdapter": "core.adapters", "RouterAdapter": "core.routers",
    "find_sites": "core.sites",
    "record": "core.recording", "Recording": "core.recording",
    "logits_of": "core.nll",
    "replay": "core.replaying",
    "load_model": "io.loading", "LoadedModel": "io.loading",
    "Intervention": "core.interventions", "InterventionContext": "core.interventions",
    "StaticProfiles": "core.interventions", "reassign": "core.interventions",
    "shuffle": "core.interventions", "static": "core.interventions",
}
# public modules under their short names: fcaudit.adapters.TupleAdapter without an import
_MODULES = {"adapters": "core.adapters", "routers": "core.routers",
            "interventions": "core.interventions", "errors": "core.errors"}

__all__ = ["FcauditError", "UsageError", "DataError", "ModelError", "IdentityError",
           "CacheError", "__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    try:
        return importlib.import_module(f".{_MODULES.get(name, name)}", __name__)
    except ModuleNotFoundError:
        raise AttributeError(f"module 'fcaudit' has no attribute {name!r}") from None
