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
from safetensors import safe_open
from tokenizers import Tokenizer

from ..errors import FcauditError
from ..fileio import read_json
from .mudd import VARIANTS, MuddConfig, MuddModel

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


def load_mudd_tokenizer(path: str | Path) -> Tokenizer | None:
    """The folder's tokenizer.json, or None when it has none."""
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception
        raise FcauditError(f"{file} is not a readable tokenizer ({exc}); "
                           "replace it or remove it to load the model alone") from exc


def load_mudd_folder(path: str | Path, dtype: torch.dtype | None = None,
                     device: str | torch.device = "cpu") -> MuddModel:
    """The folder's model in eval mode, in ``dtype`` (default: the config's torch_dtype)."""
    folder = Path(path)
    raw = read_json(folder / "config.json", "MUDD config")
    if not isinstance(raw, dict):
        raise FcauditError(f"{folder / 'config.json'} is not a JSON object")
    try:
        config = MuddConfig.from_hf(raw)
    except FcauditError as exc:
        raise FcauditError(f"{folder}: {exc}") from exc
    dtype = dtype or _config_dtype(raw, folder)
    with torch.device("meta"):
        model = MuddModel(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    files = _weight_files(folder)
    if files[0].suffix == ".safetensors":
        _check_keys(folder, _safetensors_shapes(files), expected)
        state = dict(_safetensors_tensors(files, set(expected), dtype, device))
    else:
        state = dict(_bin_tensors(files, dtype, device))
        _check_keys(folder, {k: tuple(t.shape) for k, t in state.items()}, expected)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def _config_dtype(raw: dict, folder: Path) -> torch.dtype:
    name = str(raw.get("torch_dtype", "float32")).removeprefix("torch.")
    if name not in _DTYPES:
        raise FcauditError(f"{folder / 'config.json'} has torch_dtype {name!r}; expected one of "
                           f"{', '.join(_DTYPES)} (or pass a dtype)")
    return _DTYPES[name]


def _weight_files(folder: Path) -> list[Path]:
    """The weight files of the first layout present, safetensors before PyTorch bins."""
    for name in _LAYOUTS:
        file = folder / name
        if not file.is_file():
            continue
        if not name.endswith(".index.json"):
            return [file]
        index = read_json(file, "checkpoint index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise FcauditError(f"{file} has no 'weight_map'; restore the index file")
        shards = [folder / s for s in sorted(set(map(str, weight_map.values())))]
        absent = [s.name for s in shards if not s.is_file()]
        if absent:
            raise FcauditError(f"{file} lists missing shard(s): {', '.join(absent)}; "
                               "download them into the folder")
        return shards
    raise FcauditError(f"no weights in {folder}: expected one of {', '.join(_LAYOUTS)}")


def _safetensors_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Key -> shape from the headers alone, so bad keys fail before any tensor is read."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with _open_safetensors(file) as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
                if key in shapes:
                    raise FcauditError(f"{key} appears in more than one shard ({file.name} "
                                       "and another); rebuild the checkpoint")
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def _safetensors_tensors(files: list[Path], keys: set[str], dtype: torch.dtype,
                         device: str | torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Each wanted tensor, copied out of the file into ``dtype`` on ``device``."""
    for file in files:
        with _open_safetensors(file) as f:
            wanted = [k for k in f.keys() if k in keys]  # noqa: SIM118
        for key in wanted:
            # one handle per tensor: get_tensor maps the whole file lazily and the mapping
            # lives as long as the handle, so a single handle would keep every page it read
            # resident next to our copies (5.6 GB instead of 3 GB peak for 1.4B in bf16)
            with _open_safetensors(file) as f:
                yield key, f.get_tensor(key).to(device=device, dtype=dtype, copy=True)


def _open_safetensors(file: Path) -> safe_open:
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as exc:  # SafetensorError derives from Exception only
        raise FcauditError(f"{file} is not a readable safetensors file ({exc}); it may be "
                           "truncated or corrupt: download it again") from exc


def _bin_tensors(files: list[Path], dtype: torch.dtype,
                 device: str | torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of the pickled state dicts (decoding caches skipped) in ``dtype``."""
    seen: set[str] = set()
    for file in files:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            found = re.search(r"GLOBAL ([\w.]+)", str(exc))
            what = f"it imports {found.group(1)}" if found else "it holds non-tensor objects"
            raise FcauditError(f"refused to load {file}: unpickling would run code ({what}); "
                               "convert the checkpoint to safetensors") from exc
        except Exception as exc:  # zip/IO/format errors from torch.load
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise FcauditError(f"{file} is not a readable PyTorch checkpoint ({first}); it may be "
                               "truncated or corrupt: download it again") from exc
        if not isinstance(state, dict) or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
            raise FcauditError(f"{file} is not a state dict of named tensors")
        for key in list(state):
            tensor = state.pop(key)  # frees the original as soon as it is converted
            if key in seen:
                raise FcauditError(f"{key} appears in more than one shard ({file.name} and "
                                   "another); rebuild the checkpoint")
            seen.add(key)
            if not _CACHE_KEY.search(key):
                yield key, tensor.to(device=device, dtype=dtype)


def _names(keys: list[str], limit: int = 5) -> str:
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _check_keys(folder: Path, found: dict[str, tuple[int, ...]],
                expected: dict[str, tuple[int, ...]]) -> None:
    """One-line error naming missing and unexpected keys, else wrong shapes."""
    found = {k: v for k, v in found.items() if not _CACHE_KEY.search(k)}
    missing = sorted(expected.keys() - found.keys())
    unexpected = sorted(found.keys() - expected.keys())
    problems = []
    if missing:
        problems.append(f"missing keys: {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_names(unexpected)}")
    wrong = [f"{k} {list(found[k])} (config expects {list(expected[k])})"
             for k in sorted(expected.keys() & found.keys()) if found[k] != expected[k]]
    if wrong:
        problems.append(f"wrong shapes: {_names(wrong, 3)}")
    if problems:
        raise FcauditError(f"weights in {folder} do not match its config.json: "
                           + "; ".join(problems))
