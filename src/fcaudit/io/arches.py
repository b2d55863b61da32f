"""The architectures ``fcaudit train`` builds: the model registry.

Each :class:`Arch` names the module, model and config classes of one architecture; they
are imported when a model is built, so this registry (``--arch``'s choices) loads without
torch.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fcaudit.core.errors import FcauditError, arg
from fcaudit.core.registry import Registry, refusal

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class Arch:
    """How to build one architecture from a preset or a saved config (imported lazily)."""

    name: str
    module: str  # fcaudit.models.<file>
    model_class: str
    config_class: str
    fixed: tuple[tuple[str, Any], ...] = ()  # config fields this arch forces
    task: str = "lm"  # "lm": tokens to next-token logits; "vision": digits to class logits
    # what its model folds in place of its controllers (a condition's ``fold``: a static
    # profile's rows, layer, layer_position or layer_token, or the exit depth; ``fcaudit
    # fold``: the model's ``folded(key, values)``, whose class and config say which arch it
    # is: arch_of)
    folds: tuple[str, ...] = ()

    def _attr(self, name: str) -> Any:
        return getattr(importlib.import_module(self.module), name)

    @property
    def presets(self) -> dict[str, Any]:
        return self._attr("PRESETS")

    def config(self, preset: str, vocab_size: int | None = None) -> Any:
        if preset not in self.presets:
            raise refusal(f"unknown preset {preset!r} for {arg('arch', self.name)}", preset,
                          sorted(self.presets), option="preset")
        extra = {"vocab_size": vocab_size} if vocab_size else {}
        return dataclasses.replace(self.presets[preset], **dict(self.fixed), **extra)

    def config_from_dict(self, values: dict[str, Any]) -> Any:
        return self._attr(self.config_class)(**values)

    def build(self, config: Any) -> nn.Module:
        return self._attr(self.model_class)(config)


ARCHES: Registry[Arch] = Registry("arch", (
    # folded, a FeatureGate is its Dense twin with fixed gate values (models/featuregate.py)
    Arch("featuregate", "fcaudit.models.featuregate", "GPT", "GPTConfig",
         (("gated", True),), folds=("layer", "layer_position", "layer_token")),
    Arch("dense", "fcaudit.models.featuregate", "GPT", "GPTConfig", (("gated", False),)),
    Arch("skipgate", "fcaudit.models.skipgate", "SkipGateGPT", "SkipGateConfig"),
    # folded at one exit depth, an exit model is its twin truncated there, no exit rule
    Arch("earlyexit", "fcaudit.models.earlyexit", "EarlyExitGPT",
         "EarlyExitConfig", folds=("exit_depth",)),
    Arch("ponder", "fcaudit.models.ponder", "PonderGPT", "PonderConfig",
         (("halting", True),), folds=("exit_depth",)),
    # ponder's twin: the same shared block run max_steps times on every token, no halting
    Arch("dense-ponder", "fcaudit.models.ponder", "PonderGPT", "PonderConfig",
         (("halting", False),)),
    # folded at one set of mixing weights per layer: static dense connections (DenseFormer)
    Arch("mudd", "fcaudit.models.mudd", "MuddModel", "MuddConfig", folds=("layer",)),
    # folded, an MoE reads its router logits from a table (per token id: a hash-routed
    # MoE); at one row per layer its experts merge into the Dense twin's MLP
    Arch("moe", "fcaudit.models.moe", "MoEGPT", "MoEConfig",
         folds=("layer", "layer_position", "layer_token")),
    # a Mixtral in fcaudit's code: what a Hugging Face Mixtral folds into per token id or
    # position (its routers a table); folded, one of ours reads its logits from a table too
    Arch("mixtral", "fcaudit.models.mixtral", "Mixtral", "MixtralConfig",
         folds=("layer", "layer_position", "layer_token")),
    # folded at one Δ, B, C per layer, a Mamba is time-invariant: its LTI twin's network
    Arch("mamba", "fcaudit.models.mamba", "Mamba", "MambaConfig", folds=("layer",)),
    Arch("s4d", "fcaudit.models.s4d", "S4D", "S4DConfig"),
    Arch("vit-moe", "fcaudit.models.vit_moe", "ViTMoE", "ViTMoEConfig", task="vision"),
    Arch("tokenprune", "fcaudit.models.tokenprune", "TokenPruneViT",
         "TokenPruneConfig", task="vision"),
    Arch("dense-vit", "fcaudit.models.vit", "ViT", "ViTConfig", task="vision"),
    Arch("condconv", "fcaudit.models.condconv", "CNN", "CNNConfig",
         (("condconv", True),), task="vision"),
    Arch("branchy", "fcaudit.models.branchy", "BranchyCNN", "BranchyConfig", task="vision"),
    Arch("dense-cnn", "fcaudit.models.condconv", "CNN", "CNNConfig",
         (("condconv", False),), task="vision"),
), option="arch")


def get_arch(name: str) -> Arch:
    return ARCHES.lookup(name)


def arch_of(model: nn.Module) -> Arch:
    """The architecture a model built by one of these classes is (its class, and the config
    fields the arch forces): what a folded model's run folder names."""
    for a in ARCHES.values():
        if (type(model).__module__, type(model).__name__) == (a.module, a.model_class) and \
                all(getattr(model.config, k, None) == v for k, v in a.fixed):
            return a
    raise FcauditError(f"{type(model).__name__} is none of fcaudit's architectures")


def foldable() -> str:
    """Which profiles of which architectures fold (``fcaudit fold``), as a person reads it:
    each fold's key named by the static condition that feeds that profile."""
    from fcaudit.core.conditions import CONDITIONS
    from fcaudit.io import hf_folds
    names = {c.fold: c.name for c in CONDITIONS.values() if c.fold}
    return "; ".join(f"{a.name} ({', '.join(names[k] for k in a.folds)})"
                     for a in ARCHES.values() if a.folds) + f"; {hf_folds.foldable()}"
