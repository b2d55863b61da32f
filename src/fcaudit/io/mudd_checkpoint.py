"""Load MUDDPythia / MUDDFormer checkpoint folders (Hugging Face layout) without remote code.

A folder holds the official ``config.json`` and the weights as ``model.safetensors``,
sharded ``model-0000x-of-0000y.safetensors`` with ``model.safetensors.index.json``, or
``pytorch_model*.bin`` (with an index when sharded); ``tokenizer.json`` is optional.
A ``.bin`` is read only through ``torch.load(weights_only=True)``: a pickle that
would import anything beyond tensors is refused, never executed.

The model is built on the meta device and every tensor is converted to the target
dtype as it is read, then assigned: a 1.4B model in bfloat16 needs about 3 GB, with no
float32 copy on the way. Keys must match the config exactly (the official decoding
caches, which leak into ``state_dict()`` after ``setup_caches``, are ignored).
"""

from __future__ import annotations

import json
import pickle
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from fcaudit.core.errors import FcauditError, ModelError
from fcaudit.io.fileio import read_json
from fcaudit.io.weights import (
    check_depth,
    check_keys,
    header_shapes,
    index_files,
    load_into,
    read_tensors,
)
from fcaudit.models.mudd import VARIANTS, MuddConfig, MuddModel

_CACHE_KEY = re.compile(r"(^|\.)kv_cache\.|^layer_cache\.")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LAYOUTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
            "pytorch_model.bin.index.json")


def is_mudd_folder(path: str | Path) -> bool:
    """True for a folder whose config.json names a MUDDPythia or MUDDFormer model."""
    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") in VARIANTS


def load_mudd_folder(path: str | Path, dtype: torch.dtype | None = None) -> MuddModel:
    """The folder's model in eval mode, in ``dtype`` (default: the config's torch_dtype)."""
    folder = Path(path)
    raw = read_json(folder / "config.json", "MUDD config")
    if not isinstance(raw, dict):
        raise ModelError(f"{folder / 'config.json'} is not a JSON object")
    try:
        config = MuddConfig.from_hf(raw)
    except FcauditError as exc:
        raise ModelError(f"{folder}: {exc}") from exc
    dtype = dtype or _config_dtype(raw, folder)
    files = weight_files(folder)
    # safetensors are checked from their header before reading; pickles once read
    state = None if files[0].suffix == ".safetensors" else dict(_bin_tensors(files, dtype))
    found = {k: v for k, v in header_shapes(files).items() if not _CACHE_KEY.search(k)} \
        if state is None else {k: tuple(t.shape) for k, t in state.items()}
    check_depth(str(folder), found, config.n_layer)
    with torch.device("meta"):
        model = MuddModel(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    check_keys(str(folder), found, expected)
    if state is None:
        state = dict(read_tensors(files, set(expected), dtype))
    return load_into(model, state).eval()


def _config_dtype(raw: dict, folder: Path) -> torch.dtype:
    name = str(raw.get("torch_dtype", "float32")).removeprefix("torch.")
    if name not in _DTYPES:
        raise ModelError(f"{folder / 'config.json'} has torch_dtype {name!r}; expected one of "
                         f"{', '.join(_DTYPES)} (or pass a dtype)")
    return _DTYPES[name]


def _layout(folder: Path) -> Path:
    """The first weights layout present: safetensors before PyTorch bins."""
    for name in _LAYOUTS:
        if (folder / name).is_file():
            return folder / name
    raise ModelError(f"no weights in {folder}: expected one of {', '.join(_LAYOUTS)}")


def weight_files(folder: Path) -> list[Path]:
    """The weight files :func:`load_mudd_folder` reads (an index's shards, or one file)."""
    first = _layout(folder)
    return index_files(first) if first.name.endswith(".index.json") else [first]


def files_read(folder: Path) -> list[Path]:
    """Every file :func:`load_mudd_folder` reads: config, index (if any) and weights."""
    first = _layout(folder)
    index = [first] if first.name.endswith(".index.json") else []
    return [folder / "config.json", *index, *weight_files(folder)]


def _bin_tensors(files: list[Path], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of the pickled state dicts (decoding caches skipped) in ``dtype``."""
    seen: set[str] = set()
    for file in files:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            found = re.search(r"GLOBAL ([\w.]+)", str(exc))
            what = f"it imports {found.group(1)}" if found else "it holds non-tensor objects"
            raise ModelError(f"refused to load {file}: unpickling would run code ({what}); "
                             "convert the checkpoint to safetensors") from exc
        except Exception as exc:  # zip/IO/format errors from torch.load
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelError(f"{file} is not a readable PyTorch checkpoint ({first}); it may be "
                             "truncated or corrupt: download it again") from exc
        if not isinstance(state, dict) or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
            raise ModelError(f"{file} is not a state dict of named tensors")
        for key in list(state):
            tensor = state.pop(key)  # frees the original as soon as it is converted
            if key in seen:
                raise ModelError(f"{key} appears in more than one shard ({file.name} and "
                                 "another); rebuild the checkpoint")
            seen.add(key)
            if not _CACHE_KEY.search(key):
                yield key, tensor.to(dtype=dtype)
