"""What fcaudit finds in a model: its own declaration, else every structural rule that fits.

Each kind (sites, blocks, expert layers) has a list of rules: the model's own
declaration (:mod:`fcaudit.core.contract`'s protocols) first, which wins when present;
else the structural rules that fit any model of a shape, all of them together (the
Mixture-of-Experts rule lives with the routers in :mod:`fcaudit.core.routers`, the
selective state-space rule in :mod:`fcaudit.core.selection`, the selection sites of gated
recurrences in :mod:`fcaudit.core.gated_recurrence`; the layer stack of a
``transformers`` model here). A rule returns None or an empty list when it
does not apply. Every rule is a plain function of the model, testable alone; adding one
is adding it to its registry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

from fcaudit.core.contract import (
    DeclaresBlocks,
    DeclaresExperts,
    DeclaresSites,
    ExpertLayer,
    Site,
)
from fcaudit.core.gated_recurrence import gated_recurrence_sites
from fcaudit.core.registry import Registry
from fcaudit.core.routers import moe_expert_layers, moe_router_sites
from fcaudit.core.selection import selection_sites

T = TypeVar("T")
Rule = Callable[[nn.Module], "list[Any] | None"]


def own_sites(model: nn.Module) -> list[Site] | None:
    return list(model.controller_sites()) if isinstance(model, DeclaresSites) else None


def own_blocks(model: nn.Module) -> list[str] | None:
    return list(model.execution_blocks()) if isinstance(model, DeclaresBlocks) else None


def own_experts(model: nn.Module) -> list[ExpertLayer] | None:
    return list(model.expert_layers()) if isinstance(model, DeclaresExperts) else None


def transformers_layer_stack(model: nn.Module) -> list[str]:
    """The decoder layers of a transformers model: the items of the ``nn.ModuleList``
    holding the most parameters (its layer stack). Other models name theirs (--blocks)."""
    if not type(model).__module__.startswith("transformers."):
        return []
    lists = [(sum(p.numel() for p in m.parameters()), path, len(m))
             for path, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return []
    _, path, count = max(lists)
    return [f"{path}.{i}" if path else str(i) for i in range(count)]


def _rules(kind: str, *rules: Rule) -> Registry[Rule]:
    return Registry(f"{kind} rule", rules, name=lambda rule: rule.__name__)


SITE_RULES = _rules("site", own_sites, moe_router_sites, selection_sites,
                    gated_recurrence_sites)
BLOCK_RULES = _rules("block", own_blocks, transformers_layer_stack)
EXPERT_RULES = _rules("expert", own_experts, moe_expert_layers)


def _first(rules: Registry[Rule], model: nn.Module) -> list[Any] | None:
    """A model's own declaration (counted even when empty); else what every structural
    rule finds, together (a hybrid has routers beside its selection sites), in rule order
    and without repeats; None when nothing applies."""
    own, *structural = rules.values()
    declared = own(model)
    if declared is not None:
        return list(declared)
    found: list[Any] = []
    for rule in structural:
        found += [item for item in rule(model) or () if item not in found]
    return found or None


def declared_sites(model: nn.Module) -> list[Site] | None:
    """The model's own site declaration, else the routers fcaudit finds, else None."""
    return _first(SITE_RULES, model)


def declared_blocks(model: nn.Module) -> list[str] | None:
    """The model's own execution blocks, else those fcaudit finds, else None."""
    return _first(BLOCK_RULES, model)


def declared_experts(model: nn.Module) -> list[ExpertLayer] | None:
    """The model's routed layers, else those fcaudit finds, else None (no experts)."""
    return _first(EXPERT_RULES, model)
