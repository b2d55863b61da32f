"""Architectures and ``load_model(spec)`` for every kind of model spec.

A spec is one of:

* an fcaudit run folder (``config.json`` with ``fcaudit_run``, ``model.safetensors``);
* a local MUDDPythia / MUDDFormer folder in the Hugging Face layout;
* ``package.module:factory``, a zero-argument callable returning an ``nn.Module``
  (the module's file is imported: only name code you trust).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from tokenizers import Tokenizer
from torch import nn

from .data import load_tokenizer
from .errors import FcauditError
from .fileio import read_json, sha256_file, write_safetensors
from .models import featuregate, moe, mudd, skipgate


@dataclass(frozen=True)
class Arch:
    """How to build one architecture from a preset or a saved config."""

    name: str
    presets: dict[str, Any]
    config_class: type
    build: Callable[[Any], nn.Module]
    fixed: dict[str, Any] = dataclasses.field(default_factory=dict)  # forced config fields

    def config(self, preset: str, vocab_size: int | None = None) -> Any:
        if preset not in self.presets:
            raise FcauditError(f"unknown preset {preset!r} for --arch {self.name}; choose one of "
                               f"{', '.join(sorted(self.presets))}")
        extra = {"vocab_size": vocab_size} if vocab_size else {}
        return dataclasses.replace(self.presets[preset], **self.fixed, **extra)

    def config_from_dict(self, values: dict[str, Any]) -> Any:
        return self.config_class(**values)


ARCHES: dict[str, Arch] = {
    "featuregate": Arch("featuregate", featuregate.PRESETS, featuregate.GPTConfig,
                        featuregate.GPT, {"gated": True}),
    "dense": Arch("dense", featuregate.PRESETS, featuregate.GPTConfig, featuregate.GPT,
                  {"gated": False}),
    "skipgate": Arch("skipgate", skipgate.PRESETS, skipgate.SkipGateConfig, skipgate.SkipGateGPT),
    "mudd": Arch("mudd", mudd.PRESETS, mudd.MuddConfig, mudd.MuddModel),
    "moe": Arch("moe", moe.PRESETS, moe.MoEConfig, moe.MoEGPT),
}


def get_arch(name: str) -> Arch:
    if name not in ARCHES:
        raise FcauditError(f"unknown arch {name!r}; choose one of {', '.join(ARCHES)}")
    return ARCHES[name]


@dataclass
class LoadedModel:
    """A model plus what the audit needs to know about where it came from."""

    model: nn.Module
    spec: str
    kind: str  # "run", "hf-mudd" or "factory"
    tokenizer: Tokenizer | None = None
    run_config: dict[str, Any] | None = None
    weights_fingerprint: str = ""


def is_run_folder(path: Path) -> bool:
    cfg = path / "config.json"
    if not cfg.is_file():
        return False
    try:
        return "fcaudit_run" in json.loads(cfg.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def save_run_model(folder: Path, model: nn.Module) -> None:
    write_safetensors(folder / "model.safetensors", dict(model.state_dict()))


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Load a safetensors file or raise a one-line error (truncated, corrupt, missing)."""
    if not path.is_file():
        raise FcauditError(f"weights file not found: {path}; copy the weights into the folder "
                           "or retrain the run")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise FcauditError(f"{path} is not a readable safetensors file ({exc}); the file is "
                           "truncated or corrupt: re-copy or retrain it") from exc


def load_state_strict(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """``load_state_dict`` that reports missing, unexpected and mis-shaped keys in one line."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    bad_shape = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
    if missing or unexpected or bad_shape:
        parts = []
        for label, keys in (("missing", missing), ("unexpected", unexpected),
                            ("wrong shape", bad_shape)):
            if keys:
                parts.append(f"{label}: {', '.join(keys[:5])}"
                             + (f" (+{len(keys) - 5} more)" if len(keys) > 5 else ""))
        raise FcauditError(f"weights in {source} do not fit the model config ({'; '.join(parts)})"
                           "; the folder's config.json and weights come from different models")
    model.load_state_dict(state)


def load_run(folder: Path) -> LoadedModel:
    cfg = read_json(folder / "config.json", "run config")
    try:
        arch = get_arch(cfg["arch"])
        model = arch.build(arch.config_from_dict(cfg["model_config"]))
    except (KeyError, TypeError) as exc:
        raise FcauditError(f"{folder / 'config.json'} is missing or has wrong fields ({exc}); "
                           "retrain the run or restore its config.json") from exc
    load_state_strict(model, read_safetensors(folder / "model.safetensors"), str(folder))
    model.eval()
    tok_path = folder / "tokenizer.json"
    tok = load_tokenizer(tok_path) if tok_path.is_file() else None
    return LoadedModel(model, str(folder), "run", tok, cfg, sha256_file(
        folder / "model.safetensors"))


def folder_fingerprint(folder: Path) -> str:
    """Identity of a checkpoint folder: the full SHA-256 of its config and weight files
    (a partial hash could let a fine-tuned model reuse another model's cache)."""
    files = sorted(p for p in folder.iterdir()
                   if p.suffix in (".safetensors", ".bin") or p.name == "config.json")
    return hashlib.sha256("".join(p.name + sha256_file(p) for p in files).encode()).hexdigest()


def load_factory(spec: str) -> LoadedModel:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise FcauditError(f"cannot import {module_name!r} for --model {spec} ({exc}); make sure "
                           "it is on PYTHONPATH") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise FcauditError(f"{spec}: {module_name} has no callable {attr!r}; name a "
                           "zero-argument function that builds the model")
    model = factory()
    if not isinstance(model, nn.Module):
        raise FcauditError(f"{spec} returned {type(model).__name__}, not a torch.nn.Module; "
                           "the factory must return the model itself")
    model.eval()
    digest = state_fingerprint(model)
    return LoadedModel(model, spec, "factory", None, None, digest)


def state_fingerprint(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def load(spec: str, dtype: torch.dtype | None = None) -> LoadedModel:
    """Resolve any model spec (see module docstring) to a :class:`LoadedModel`."""
    path = Path(spec)
    if path.is_dir():
        if is_run_folder(path):
            return load_run(path)
        from .models import mudd_checkpoint
        if mudd_checkpoint.is_mudd_folder(path):
            model = mudd_checkpoint.load_mudd_folder(path, dtype=dtype)
            model.eval()
            return LoadedModel(model, spec, "hf-mudd", mudd_checkpoint.load_mudd_tokenizer(path),
                               None, folder_fingerprint(path))
        if (path / "config.json").is_file():
            read_json(path / "config.json", "model config")  # garbled JSON: clear error
        raise FcauditError(f"{path} is neither an fcaudit run folder nor a MUDDPythia/"
                           "MUDDFormer checkpoint folder (config.json with fcaudit_run or "
                           "model_type muddpythia); see `fcaudit audit --help`")
    if ":" in spec and not path.exists():
        return load_factory(spec)
    raise FcauditError(f"model not found: {spec} (expected a folder or package.module:factory)")


def load_model(spec: str, dtype: torch.dtype | None = None) -> nn.Module:
    """Public API: the ``nn.Module`` for any spec (tokenizer optional, see :func:`load`)."""
    return load(spec, dtype).model
