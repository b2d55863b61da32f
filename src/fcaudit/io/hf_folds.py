"""Folds of Hugging Face MoE folders (``fcaudit fold`` of a Mixtral folder): the model with
its routers replaced by what a static profile fixes.

At one router logit row per layer (``static-layer``) every token of a layer goes to the
same experts with the same weights, so the layer's sparse MoE block is one gated MLP: the
chosen experts' gate and up projections side by side, their down projections side by
side, each scaled by its routing weight. A Mixtral so folded is a Mistral whose MLP is
``k`` experts wide: the same attention, norms and embeddings, no router. The experts and
weights each layer's router gives are read from the router's own forward with the logits
supplied (:func:`fcaudit.core.routers.routing_of`), so its softmax, top-k and
renormalisation run as the family wrote them.

At one row per token id (``static-layer-token``) or per position
(``static-layer-position``) the routing still varies, and no transformers class routes by a
table: the Mixtral becomes fcaudit's own (:mod:`fcaudit.models.mixtral`), its weights
as they are, each router a table of logits (per token id: a hash-routed MoE), written as
a run folder fcaudit loads.

One entry per source family (``model_type``); a family not here does not fold.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fcaudit.core.errors import ModelError
from fcaudit.core.registry import Registry
from fcaudit.io.fileio import write_json, write_text

if TYPE_CHECKING:  # the registry is read by --help, which loads no torch
    from torch import Tensor, nn

    from fcaudit.core.contract import Site


@dataclass(frozen=True)
class HFFold:
    """A Hugging Face family that folds: ``name`` its ``model_type``, ``into`` what each
    fold (a condition's ``fold``) gives, as a person reads it, ``build(model, sites, key,
    values)`` the folded model (a transformers model, or one of fcaudit's architectures)."""

    name: str
    into: tuple[tuple[str, str], ...]
    build: Callable[[nn.Module, Sequence[Site], str, Sequence[Tensor]], nn.Module]

    @property
    def folds(self) -> tuple[str, ...]:
        return tuple(key for key, _ in self.into)


# a sparse MoE block's settings that a dense MLP has no use for
_MOE_KEYS = ("num_local_experts", "num_experts_per_tok", "output_router_logits",
             "router_aux_loss_coef", "router_jitter_noise")


def _folded_mixtral(model: nn.Module, sites: Sequence[Site], key: str,
                    values: Sequence[Tensor]) -> nn.Module:
    """One row per layer: a Mistral, where the weights are float32; per token id or
    position, or in a lower precision: fcaudit's Mixtral. (In bfloat16 or float16 the merged
    MLP's scaled down projections round, and its sum over experts runs in another order:
    its losses miss the condition's by far more than the fold's bound, while fcaudit's
    Mixtral with one fixed row per layer computes the condition to the bit.)"""
    import torch
    if key == "layer" and next(model.parameters()).dtype == torch.float32:
        return _merged_mixtral(model, sites, values)
    from fcaudit.models.mixtral import from_hf
    return from_hf(model, key, list(values))


def _merged_mixtral(model: nn.Module, sites: Sequence[Site], values: Sequence[Tensor]
                    ) -> nn.Module:
    """A Mixtral with each layer's experts at the router's fixed choice merged into one
    Mistral MLP (``k`` times an expert's width)."""
    import torch
    import transformers

    from fcaudit.core.routers import routing_of
    cfg, k = model.config, int(model.config.num_experts_per_tok)
    raw = {key: v for key, v in cfg.to_dict().items() if key not in _MOE_KEYS}
    raw.update(model_type="mistral", architectures=["MistralForCausalLM"],
               intermediate_size=k * int(cfg.intermediate_size))
    # built on the source's device, not meta: its non-persistent buffers (rotary
    # frequencies) come from the config, and load_state_dict does not hold them
    dtype = next(model.parameters()).dtype
    with torch.device(next(model.parameters()).device):
        folded = transformers.MistralForCausalLM._from_config(
            transformers.MistralConfig(**raw), dtype=dtype)
    state = {key: v for key, v in model.state_dict().items() if ".mlp." not in key}
    for site, value in zip(sites, values, strict=True):
        block = site.path.rsplit(".", 1)[0]  # the router's sparse MoE block
        experts = model.get_submodule(block).experts
        ids, weights = routing_of(model.get_submodule(site.path), value[0])
        width = int(experts.intermediate_dim)
        gate_up = experts.gate_up_proj[ids]  # [k, 2I, H]: gate rows, then up rows
        down = (experts.down_proj[ids].double() * weights.double()[:, None, None]).to(
            experts.down_proj.dtype)  # [k, H, I], each expert scaled by its weight
        state[f"{block}.gate_proj.weight"] = gate_up[:, :width].reshape(k * width, -1)
        state[f"{block}.up_proj.weight"] = gate_up[:, width:].reshape(k * width, -1)
        state[f"{block}.down_proj.weight"] = down.permute(1, 0, 2).reshape(-1, k * width)
    try:
        with torch.no_grad():
            folded.load_state_dict(state)
    except RuntimeError as exc:
        raise ModelError(f"this Mixtral's weights do not map onto a Mistral's ({exc}); it "
                         "does not fold") from exc
    return folded.eval()


HF_FOLDS: Registry[HFFold] = Registry("Hugging Face fold", (
    HFFold("mixtral", (("layer", "a mistral folder (float32) or an fcaudit mixtral run folder"),
                       ("layer_position", "an fcaudit mixtral run folder"),
                       ("layer_token", "an fcaudit mixtral run folder")), _folded_mixtral),
))


def hf_fold(model: nn.Module) -> HFFold | None:
    """The fold entry of a transformers model's family (None: it does not fold)."""
    config = getattr(model, "config", None)
    name = getattr(config, "model_type", None)
    return HF_FOLDS[name] if isinstance(name, str) and name in HF_FOLDS else None


def foldable() -> str:
    """The Hugging Face families that fold, as a person reads it."""
    from fcaudit.core.conditions import CONDITIONS
    names = {c.fold: c.name for c in CONDITIONS.values() if c.fold}

    def what(entry: HFFold) -> str:
        by_into: dict[str, list[str]] = {}
        for key, into in entry.into:
            by_into.setdefault(into, []).append(names[key])
        return ", ".join(f"{' and '.join(keys)}: {into}" for into, keys in by_into.items())
    return "; ".join(f"{f.name} folders ({what(f)})" for f in HF_FOLDS.values())


def write_hf_folder(work: Path, folded: nn.Module, record: dict[str, Any],
                    tokenizer: str | None) -> None:
    """The folded model as a folder transformers loads: ``config.json`` (with the fold's
    record under ``fcaudit_fold``), one ``model.safetensors`` and the source's tokenizer
    (``tokenizer``: its JSON); saved by transformers itself (tied weights as it expects them)."""
    from transformers.utils import logging as hf_logging
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # its shard bar: fcaudit reports its own progress
    try:
        with tempfile.TemporaryDirectory(dir=work) as tmp:
            folded.save_pretrained(tmp, max_shard_size="1000GB")
            os.replace(Path(tmp) / "model.safetensors", work / "model.safetensors")
            config = json.loads((Path(tmp) / "config.json").read_text(encoding="utf-8"))
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    write_json(work / "config.json", {**config, "fcaudit_fold": record})
    if tokenizer is not None:
        write_text(work / "tokenizer.json", tokenizer)


__all__ = ["HF_FOLDS", "HFFold", "foldable", "hf_fold", "write_hf_folder"]
