"""Model specs -> :class:`LoadedModel`, with an identity that covers everything read.

A spec is one of:

* an fcaudit run folder (``config.json`` with ``fcaudit_run``, ``model.safetensors``);
* a local MUDDPythia / MUDDFormer folder in the Hugging Face layout (fcaudit's own code);
* any other local Hugging Face causal-LM folder (through ``transformers``, the
  ``hf`` extra; safetensors only, never remote code);
* ``package.module:factory``, a zero-argument callable returning an ``nn.Module``
  (imported from the current directory as ``python -m`` would; only name code you trust).

The fingerprint of a loaded model is what the coefficient cache is keyed by, so it
covers the full config and the SHA-256 of every file the loader opened (by path
inside the folder); for a factory, its weights and the source of its module.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from torch import nn

from fcaudit.core.arrays import InputSpec
from fcaudit.core.codestate import Unreadable, read_state
from fcaudit.core.errors import FcauditError, ModelError, UsageError, arg
from fcaudit.core.sites import check_module_tree
from fcaudit.io.arches import (  # re-exported: the registry lives torch-free in io/arches
    ARCHES as ARCHES,
)
from fcaudit.io.arches import Arch as Arch
from fcaudit.io.arches import get_arch as get_arch
from fcaudit.io.data import folder_tokenizer
from fcaudit.io.fileio import read_json, sha256_file, write_safetensors
from fcaudit.io.placement import Placement
from fcaudit.io.runtime import package_versions
from fcaudit.io.weights import check_depth, check_keys, header_shapes, load_into, read_tensors


@dataclass
class LoadedModel:
    """A model plus what the audit needs to know about where it came from."""

    model: nn.Module
    spec: str
    kind: str  # "run", "hf-mudd", "hf", "hf-gguf", "factory" or "module"
    tokenizer: Tokenizer | None = None
    run_config: dict[str, Any] | None = None
    fingerprint: str = ""
    files: dict[str, str] = field(default_factory=dict)  # path in folder -> SHA-256
    identity_note: str | None = None  # what the fingerprint cannot see
    placement: dict[str, Any] | None = None  # accelerate's dispatch: where the weights went
    # installed distribution -> version of the packages the model's classes (and the code
    # they read) come from: library code enters the identity by name, so its version must
    packages: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # what the user should know of how it was loaded


def release(model: Any) -> None:
    """Free what a model holds beyond its weights (an engine serving it: its memory and
    threads), where it holds anything; the model cannot run after."""
    if callable(close := getattr(model, "close", None)):
        close()


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


def _digest(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def folder_identity(folder: Path, config: Any, read: list[Path]
                    ) -> tuple[str, dict[str, str]]:
    """A checkpoint folder's fingerprint, from its config and every file the loader read,
    and those files' SHA-256s."""
    files = {str(f.relative_to(folder)): sha256_file(f) for f in read}
    return _digest({"config": config, "files": files}), files


def _folder_model(folder: Path, model: nn.Module, kind: str, tokenizer: Tokenizer | None,
                  read: list[Path], config: Any, **extra: Any) -> LoadedModel:
    """A checkpoint folder's model, identified by its config and every file the loader read."""
    return LoadedModel(model, str(folder), kind, tokenizer, None,
                       *folder_identity(folder, config, read), **extra)


def _run_config(folder: Path) -> tuple[dict[str, Any], Arch, Any]:
    cfg = read_json(folder / "config.json", "run config")
    try:
        arch = get_arch(cfg["arch"])
        return cfg, arch, arch.config_from_dict(cfg["model_config"])
    except (KeyError, TypeError) as exc:
        raise ModelError(f"{folder / 'config.json'} is missing or has wrong fields ({exc}); "
                         "retrain the run or restore its config.json") from exc
    except FcauditError as exc:
        raise ModelError(f"{folder / 'config.json'}: {exc}") from exc


def load_run(folder: Path, dtype: torch.dtype | None = None) -> LoadedModel:
    """A run folder written by ``fcaudit train``; shapes are checked from the weights'
    header before anything is built or allocated."""
    cfg, arch, model_config = _run_config(folder)
    weights = folder / "model.safetensors"
    found = header_shapes([weights])
    files = {p.name: sha256_file(p) for p in (folder / "config.json", weights)}
    recorded = cfg.get("weights_sha256")  # absent in runs trained before it was recorded
    if recorded is not None and recorded != files[weights.name]:
        raise ModelError(f"{weights} has SHA-256 {files[weights.name][:12]}..., but "
                         f"{folder / 'config.json'} records {str(recorded)[:12]}... from "
                         "training; the weights were changed or corrupted since: re-copy "
                         "the run folder or retrain it")
    check_depth(str(folder), found, model_config.n_layer)
    with torch.device("meta"):
        model = arch.build(model_config)
    check_keys(str(folder), found, {k: tuple(v.shape) for k, v in model.state_dict().items()})
    model = load_into(model, dict(read_tensors([weights], set(found), dtype))).eval()
    return LoadedModel(model, str(folder), "run", folder_tokenizer(folder), cfg,
                       _digest({"config": cfg, "files": files}), files)


def _load_mudd(folder: Path, dtype: torch.dtype | None) -> LoadedModel:
    from fcaudit.io import mudd_checkpoint
    model = mudd_checkpoint.load_mudd_folder(folder, dtype=dtype)
    config = read_json(folder / "config.json", "MUDD config")
    return _folder_model(folder, model, "hf-mudd", folder_tokenizer(folder),
                         mudd_checkpoint.files_read(folder), config)


def _load_hf(folder: Path, dtype: torch.dtype | None,
             placement: Placement | None = None) -> LoadedModel:
    from fcaudit.io import hf
    config = read_json(folder / "config.json", "model config")  # garbled JSON: a clear error
    model, tokenizer, read = hf.load_hf_folder(folder, dtype=dtype, placement=placement)
    placed = None
    if placement is not None:  # how many modules each device holds (disk: read per call)
        mapped = getattr(model, "hf_device_map", None) or {"": "cpu"}  # None: all fitted
        where = [str(d) for d in mapped.values()]
        placed = {**placement.describe(), "modules_per_device": {d: where.count(d)
                                                                 for d in sorted(set(where))}}
    return _folder_model(folder, model, "hf", tokenizer, read, config, placement=placed)


def state_fingerprint(model: nn.Module) -> str:
    """Weights and plain settings of an in-memory model: every tensor of its state dict,
    and every module attribute of a plain type (a mode string, a top-k, an epsilon), which
    can change what the same weights compute."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(str(tensor.dtype).encode())
        h.update(tensor.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    plain = (str, int, float, bool, type(None))
    settings = {name: {k: v for k, v in sorted(vars(m).items())
                       if not k.startswith("_") and k != "training" and isinstance(v, plain)}
                for name, m in model.named_modules()}
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()


def code_identity(obj: Any) -> tuple[dict[str, str], str]:
    """The SHA-256 of the source file defining ``obj``, and a note on what it misses."""
    try:
        source = Path(inspect.getsourcefile(obj) or "")
    except TypeError:
        source = Path()
    if source.is_file():
        return ({str(source): sha256_file(source)},
                f"code identity covers {source.name} only: edits to other code the model "
                "imports are not detected; delete OUT/cache after changing it")
    return {}, "the model's code could not be located: code edits are not detected; delete " \
               "OUT/cache after changing it"


READS_NOTE = ("code identity covers the model's classes and everything their code reads (your "
              "code by content, installed libraries by version); code reached only by name "
              "at run time (importlib, getattr) is not seen: delete OUT/cache after changing it")


def classes_read(model: nn.Module, code: Any, fallback: str
                 ) -> tuple[str | None, str, frozenset[str]]:
    """The digest of ``code`` and every class the model is built of, through all the code
    and state their methods read (:mod:`fcaudit.core.codestate`), the note on what it
    covers and the library packages that code reached; (None, ``fallback`` and why, no
    packages) where some of it cannot be read as bits."""
    try:
        digest, libraries = read_state([code, *_classes(model)])
        return digest, READS_NOTE, libraries
    except Unreadable as exc:
        return (None, f"{fallback} (its code reads {exc}, whose state cannot be read as "
                      "bits)", frozenset())


def _classes(model: nn.Module) -> list[type]:
    return sorted({type(m) for m in model.modules()},
                  key=lambda c: (c.__module__, c.__qualname__))


def model_packages(model: nn.Module, libraries: frozenset[str] = frozenset()
                   ) -> dict[str, str]:
    """Installed versions of the packages the model's classes come from, and of the
    ``libraries`` their code reached."""
    return package_versions({*(c.__module__ for c in _classes(model)), *libraries})


def load_module(model: nn.Module, spec: str, kind: str = "module",
                code: Any = None) -> LoadedModel:
    """An in-memory model (a factory's, or one passed to :func:`fcaudit.audit`)."""
    check_module_tree(model)  # before any walk of its submodules recurses forever
    dispatched = any(hasattr(m, "_hf_hook") for m in model.modules())  # accelerate loads
    empty = next((n for n, t in [*model.named_parameters(), *model.named_buffers()]
                  if t.is_meta), None)  # offloaded weights at call time; nothing else does
    if empty is not None and not dispatched:
        raise ModelError(f"{spec}: its weight {empty} is on the meta device, which holds no "
                         "values (a model built under torch.device('meta') or "
                         "init_empty_weights); load its weights before auditing it")
    model.eval()
    files, note = code_identity(code if code is not None else type(model))
    reads, note, libraries = classes_read(model, code, note)
    code_digests = sorted(files.values())  # by content: a copied or linked folder is the same
    return LoadedModel(model, spec, kind, None, None,
                       _digest({"state": state_fingerprint(model), "code": code_digests,
                                "spec": spec, "class": type(model).__qualname__,
                                "reads": reads}), files, note,
                       packages=model_packages(model, libraries))


def load_factory(spec: str, dtype: torch.dtype | None = None) -> LoadedModel:
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: the user's own package here
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelError(f"cannot import {module_name!r} for {arg('model', spec)} ({exc}); "
                         "run from "
                         "the folder that holds it, or add that folder to PYTHONPATH") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelError(f"{spec}: {module_name} has no callable {attr!r}; name a "
                         "zero-argument function that builds the model")
    try:
        model = factory()
    except Exception as exc:  # the user's own code: their error to fix, not fcaudit's bug
        raise ModelError(f"{spec}() raised {type(exc).__name__}: {exc}; the factory must "
                         "build the model with no arguments") from exc
    if not isinstance(model, nn.Module):
        raise ModelError(f"{spec} returned {type(model).__name__}, not a torch.nn.Module; "
                         "the factory must return the model itself")
    if dtype is not None:
        model = model.to(dtype)
    return load_module(model, spec, "factory", code=module)


def load(spec: str, dtype: torch.dtype | None = None,
         placement: Placement | None = None) -> LoadedModel:
    """Resolve any model spec (see module docstring) to a :class:`LoadedModel`;
    ``placement`` (accelerate's dispatch) for Hugging Face folders only."""
    loaded = _load(spec, dtype, placement)
    if not loaded.packages:  # folders: the packages their classes come from
        loaded.packages = model_packages(loaded.model)
    return loaded


def _load(spec: str, dtype: torch.dtype | None, placement: Placement | None) -> LoadedModel:
    path = Path(spec)
    if placement is not None and not (path.is_dir() and _hf_layout(path)):
        raise UsageError(f"{arg('device_map', placement.device_map)} loads a local Hugging "
                         f"Face model folder; {spec} is not one (run folders, GGUF files and "
                         "factories load whole)", option="device_map")
    if path.is_dir():
        if placement is not None:
            return _load_hf(path, dtype, placement)
        if is_run_folder(path):
            return load_run(path, dtype)
        from fcaudit.io.mudd_checkpoint import is_mudd_folder
        if is_mudd_folder(path):
            return _load_mudd(path, dtype)
        if (path / "config.json").is_file():
            return _load_hf(path, dtype)
        raise ModelError(f"{path} has no config.json: it is neither an fcaudit run folder nor "
                         "a checkpoint folder in the Hugging Face layout; see "
                         "`fcaudit audit --help`")
    from fcaudit.io import gguf
    if path.suffix.lower() == gguf.SUFFIX:
        model, tokenizer, files, note = gguf.load_gguf(path, dtype)
        return LoadedModel(model, str(path), "hf-gguf", tokenizer, None,
                           _digest({"files": files}), files, notes=(note,))
    if ":" in spec and not path.exists():
        return load_factory(spec, dtype)
    raise ModelError(f"model not found: {spec} (expected a folder, a .gguf file or "
                     "package.module:factory)")


def _hf_layout(path: Path) -> bool:
    from fcaudit.io.hf import is_hf_folder
    from fcaudit.io.mudd_checkpoint import is_mudd_folder
    return (path / "config.json").is_file() and not is_run_folder(path) \
        and not is_mudd_folder(path) and is_hf_folder(path)


def input_spec(loaded: LoadedModel) -> InputSpec | None:
    """What a run folder's model takes per example, from its arch's task (None for other
    models, whose inputs fcaudit cannot know): a vision run its images ``[C, H, W]`` in
    the dtype it computes in, a language run token ids ``[T]``."""
    if not loaded.run_config:
        return None
    if get_arch(loaded.run_config["arch"]).task == "vision":
        cfg, dtype = loaded.model.config, next(p.dtype for p in loaded.model.parameters())
        return InputSpec(f"the vision run {loaded.spec}", "images",
                         (cfg.channels, cfg.image_size, cfg.image_size), dtype)
    how = arg("tokens", py="AuditData(eval_ids=..., calib_ids=...)",
              cli="--tokens and --calib-tokens")
    return InputSpec(f"the language run {loaded.spec}", "token ids", None, None,
                     f": give them as {how}, scored by next-token NLL")


def load_model(spec: str, dtype: torch.dtype | None = None) -> nn.Module:
    """Public API: the ``nn.Module`` for any spec (tokenizer optional, see :func:`load`)."""
    return load(spec, dtype).model
