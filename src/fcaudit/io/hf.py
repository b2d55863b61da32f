"""Local Hugging Face causal-LM folders through ``transformers`` (optional extra ``hf``).

Loading is offline and code-free: ``local_files_only``, ``HF_HUB_OFFLINE=1``,
``trust_remote_code=False``, ``use_kernels=False`` (transformers >= 5.25 would otherwise
swap layers for kernels fetched from the hub, on GPUs) and safetensors only. A config
whose ``model_type`` the installed transformers does not implement cannot load (if it
has an ``auto_map``, the error says the model needs its own remote code, which fcaudit
never runs); a config with an ``auto_map`` *and* a natively implemented ``model_type``
(DeepSeek-V3 folders ship both) loads transformers' own implementation, as transformers
does without ``trust_remote_code``. MUDDPythia/MUDDFormer folders keep fcaudit's own
loader (:mod:`fcaudit.io.mudd_checkpoint`).

The weight files are resolved here and handed to transformers by name
(``config.transformers_weights``), and ``generation_config.json`` is not read (it does
not change logits), so ``files_read`` is exactly what loading opened.

Mixture-of-Experts models need no declaration:
:func:`fcaudit.core.routers.moe_router_sites` finds every module with an ``experts``
child and a ``gate`` or ``router`` child (all MoE blocks of transformers 5 follow this
layout) and returns its router, audited through
:class:`fcaudit.core.routers.RouterAdapter`, plus any per-token scalar shared-expert gate
(an ``nn.Linear(hidden, 1)`` child of the same block, e.g. Qwen2-MoE's
``shared_expert_gate``).
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from torch import nn

from fcaudit.core.errors import FcauditError, ModelError, arg, install_extra
from fcaudit.io.data import folder_tokenizer
from fcaudit.io.fileio import read_json
from fcaudit.io.mudd_checkpoint import weight_files
from fcaudit.io.placement import Placement, align_offloaded, check_budget, note_written
from fcaudit.io.weights import Shapes, header_shapes, held_depth
from fcaudit.models.mudd import VARIANTS


def _config(path: Path) -> dict[str, Any] | None:
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def is_hf_folder(path: str | Path) -> bool:
    """True for a folder whose config.json names a ``model_type`` that is neither an
    fcaudit run nor a MUDD checkpoint (those have their own loaders)."""
    raw = _config(Path(path))
    return (raw is not None and isinstance(raw.get("model_type"), str)
            and raw["model_type"] not in VARIANTS and "fcaudit_run" not in raw)


def _transformers() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before the hub client reads it
    try:
        import transformers
    except ImportError as exc:
        raise ModelError("loading a Hugging Face model folder needs the optional dependency "
                         f"transformers: {install_extra('hf')}") from exc
    return transformers


def _check_architecture(folder: Path, raw: dict[str, Any], transformers: Any) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    model_type = raw.get("model_type")
    where = folder / "config.json"
    if model_type in VARIANTS:
        raise ModelError(f"{folder} is a MUDD checkpoint ({model_type}); load it with "
                         "fcaudit.load_model, which has its own MUDD loader")
    if not isinstance(model_type, str) or model_type not in transformers.CONFIG_MAPPING:
        version = transformers.__version__
        if "auto_map" in raw:
            raise ModelError(
                f"{where}: model_type {model_type!r} needs the checkpoint's own Python code "
                f"(auto_map), which fcaudit never runs (no trust_remote_code), and transformers "
                f"{version} has no built-in implementation; use a transformers version that "
                "implements it, or wrap the model in a package.module:factory you trust")
        raise ModelError(f"{where}: model_type {model_type!r} is unknown to transformers "
                         f"{version}; upgrade transformers or check the folder")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelError(f"{where}: {model_type} is not a causal language model in "
                         "transformers (no AutoModelForCausalLM class); fcaudit audits models "
                         "that map input_ids to next-token logits")


def checked_weights(folder: Path) -> list[Path]:
    """The safetensors files to load (index first when sharded), or a one-line error."""
    if (folder / "adapter_config.json").is_file():
        raise ModelError(f"{folder} holds a PEFT adapter (adapter_config.json); merge it into "
                         "its base model and save the merged model with safetensors")
    files = weight_files(folder)
    if files[0].suffix != ".safetensors":
        raise ModelError(
            f"{folder} has only PyTorch pickle weights ({files[0].name}); fcaudit reads "
            "safetensors only: convert them (e.g. load once with transformers and "
            "save_pretrained, which writes model.safetensors)")
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    return files if single.is_file() else [index, *files]


def _built_shapes(transformers: Any, config: Any) -> Shapes | None:
    """The shape of every tensor the model ``config`` describes, as transformers builds it
    (on the meta device: no memory, whatever sizes the config claims; a tied tensor
    once); None where it cannot be built there or its weights are quantized (a quantizer
    changes the stored shapes), and then transformers' loading has the last word."""
    if getattr(config, "quantization_config", None) is not None:
        return None
    try:
        with torch.device("meta"):  # a copy: building may set fields of the config
            model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config))
    except Exception:  # noqa: BLE001 - from_pretrained raises it again, with its own words
        return None
    seen: set[int] = set()
    shapes: Shapes = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            shapes[key] = tuple(tensor.shape)
    return shapes


def _fields_sized(config: Any, dims: set[int]) -> str:
    """The config fields whose value is one of ``dims`` (what made a tensor that size)."""
    stated = {**config.to_dict(), **config.get_text_config().to_dict()}
    names = sorted(k for k, v in stated.items()
                   if isinstance(v, int) and not isinstance(v, bool) and v in dims)
    return f" ({', '.join(f'{k}={stated[k]}' for k in names[:2])})" if names else ""


UNBUILT_DEPTH = 8  # layers per weights' list entry beyond which a config is not built


def _check_sizes(folder: Path, config: Any, weights: list[Path], transformers: Any) -> None:
    """The config against the weights' header, before anything real is built: a config
    claiming more than the weights hold (a million layers, a vocabulary of 1e9) is refused
    in a second instead of constructed (6 GB in 2 minutes). The sizes are the model's
    own, as transformers builds it from the config (on the meta device): a tensor must
    not hold more than the weights' tensor of its name, and all of them together not more
    than twice what the weight files hold (tensors renamed or merged on loading, as
    per-expert weights are, are matched by that total; a smaller difference costs no more
    than loading the weights, and transformers' own report of missing and mismatched keys
    has the last word on it). Only a layer count far beyond the weights' longest layer
    list is refused unbuilt: a million layers take minutes even on the meta device, and
    how many layers a list entry holds is the family's (LongCat-Flash's hold two)."""
    found = header_shapes([w for w in weights if w.suffix == ".safetensors"])
    layers = getattr(config.get_text_config(), "num_hidden_layers", None)
    depth = held_depth(found)
    if isinstance(layers, int) and depth is not None and layers > UNBUILT_DEPTH * depth:
        raise ModelError(f"{folder}: config.json says num_hidden_layers={layers} but the "
                         f"weights hold {depth} layers; the config and the weights come from "
                         "different models")
    built = _built_shapes(transformers, config) or {}
    bigger = next(((k, s) for k, s in built.items()
                   if k in found and math.prod(s) > math.prod(found[k])), None)
    held_total, built_total = (sum(map(math.prod, d.values())) for d in (found, built))
    if bigger is None and built_total <= 2 * held_total:
        return
    if bigger is not None:
        key, shape = bigger
        held = found[key]
        what = f"builds {key} {list(shape)} but the weights hold {list(held)}"
    else:
        key, shape = max(((k, s) for k, s in built.items() if k not in found),
                         key=lambda item: math.prod(item[1]))
        held = tuple(d for s in found.values() for d in s)
        what = (f"builds {built_total:,} weights, more than twice the {held_total:,} its "
                f"weight files hold (the largest, {key} {list(shape)}, under a name no file uses)")
    raise ModelError(f"{folder}: config.json{_fields_sized(config, set(shape) - set(held))} "
                     f"{what}; the config and the weights come from different models")


def _placing(place: Placement | None, weights: list[Path], dtype: torch.dtype | None
             ) -> dict[str, Any]:
    """``from_pretrained``'s placement arguments, after the checks that need no loading."""
    if place is None:
        return {}
    itemsize = torch.empty(0, dtype=dtype).element_size() if dtype is not None else None
    check_budget(place, [w for w in weights if w.suffix == ".safetensors"], itemsize)
    return place.load_kwargs()


def _load_error(folder: Path, exc: Exception) -> FcauditError:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if "offload_folder" in first:  # the device map put weights on disk that need re-saving
        return FcauditError(f"{folder}: the budget places weights on disk and transformers "
                            f"must re-save some of them: add {arg('offload_folder', 'DIR')}")
    return FcauditError(f"transformers could not load {folder} ({first}); check that "
                        "config.json and the weights belong together")


def load_hf_folder(path: str | Path, dtype: torch.dtype | None = None,
                   placement: Placement | None = None
                   ) -> tuple[nn.Module, Tokenizer | None, list[Path]]:
    """The folder's causal LM in eval mode (``dtype``, default the config's), its
    tokenizer.json if any, and every file loading opened (for cache identity).
    ``placement``: accelerate's big-model dispatch (:mod:`fcaudit.io.placement`).

    The model maps ``input_ids [B, T]`` to an output with ``.logits [B, T, V]``.
    """
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ModelError(f"{folder} has no config.json: not a Hugging Face model folder "
                         "(expected config.json and model.safetensors)")
    raw = read_json(folder / "config.json", "model config")
    if not isinstance(raw, dict):
        raise ModelError(f"{folder / 'config.json'} is not a JSON object")
    transformers = _transformers()
    _check_architecture(folder, raw, transformers)
    weights = checked_weights(folder)
    transformers.utils.logging.disable_progress_bar()  # fcaudit reports its own progress
    try:
        config = transformers.AutoConfig.from_pretrained(
            folder, local_files_only=True, trust_remote_code=False)
        config.transformers_weights = weights[0].name
        _check_sizes(folder, config, weights, transformers)
        placing = _placing(placement, weights, dtype)
        extra = [folder / f for f in getattr(type(config), "extra_files", ())
                 if (folder / f).is_file()]
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            folder, config=config, dtype=dtype or "auto", local_files_only=True,
            trust_remote_code=False, use_safetensors=True, output_loading_info=True,
            use_kernels=False, generation_config=transformers.GenerationConfig(), **placing)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise _load_error(folder, exc) from exc
    note_written(placement)
    align_offloaded(model)  # weights read from disk compute as the in-memory ones do
    problems = {kind: sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(key, []))
                for kind, key in (("missing", "missing_keys"), ("unexpected", "unexpected_keys"),
                                  ("of the wrong shape", "mismatched_keys"))}
    if any(problems.values()):
        found = "; ".join(f"{len(keys)} {kind}: {', '.join(keys[:3])}"
                          for kind, keys in problems.items() if keys)
        raise ModelError(f"weights in {folder} do not fit its config.json ({found}); "
                         "transformers would leave weights random or drop some: the folder's "
                         "config and weights come from different models")
    model.eval()
    model.config.use_cache = False  # fcaudit runs whole windows, never incremental decoding
    if getattr(model.config, "output_router_logits", False):
        # routers are read through hooks; the aux loss over every layer's logits changes no
        # logit and, with layers on several devices, breaks the forward (transformers #29087)
        model.config.output_router_logits = False
    tokenizer = folder_tokenizer(folder)
    files = [folder / "config.json", *weights, *extra]
    return model, tokenizer, files + ([folder / "tokenizer.json"] if tokenizer else [])
