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
"""

from __future__ import annotations

import importlib
from typing import Any

from fcaudit.core.errors import FcauditError

__version__ = "0.1.0"

_EXPORTS = {
    "AuditOptions": "options", "audit": "engine",
    "AuditResult": "result",
    "DataSpec": "data", "AuditData": "data",
    "Site": "contract", "SiteCall": "contract", "ExpertLayer": "contract",
    "find_sites": "sites",
    "record": "recording", "Recording": "recording",
    "logits_of": "nll",
    "replay": "replaying",
    "load_model": "loading",
    "Intervention": "interventions", "InterventionContext": "interventions",
    "StaticProfiles": "interventions", "reassign": "interventions", "shuffle": "interventions",
    "static": "interventions",
}

__all__ = ["FcauditError", "__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    try:  # submodules too: fcaudit.core.adapters.TupleAdapter without importing it first
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError:
        raise AttributeError(f"module 'fcaudit' has no attribute {name!r}") from None
