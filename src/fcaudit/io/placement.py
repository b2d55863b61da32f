"""Models bigger than memory: a Hugging Face folder placed by accelerate's big-model dispatch.

``device_map="auto"`` lets transformers (through accelerate) put each layer on a GPU, in
CPU memory or on disk within a ``max_memory`` budget; modules on disk get an
``AlignDevicesHook`` that reads their weights in before each call and drops them after.
Everything here runs before the weights are read: the budget's syntax, the offload folder
a budget too small for the weights needs, and whose files that folder holds.

The offload folder: transformers writes there the weights it cannot read straight from the
checkpoint (fused MoE experts). fcaudit checks the folder as it checks ``--out`` (a file,
under a file, not writable) and apart from the output folder, claims it with a marker file
listing what loading wrote, refuses a folder holding anything else (never deleting or
overwriting what it did not write), and afterwards removes what loading wrote, and the
folder with the missing parents it made for it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fcaudit.core.errors import CacheError, UsageError, arg, install_extra
from fcaudit.core.registry import refusal

# io/outdir is imported where used: it brings numpy, and the ``fcaudit audit`` flags read
# DEVICE_MAPS while ``--help`` must stay instant

DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
MARKER = ".fcaudit-offload.json"
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_DEVICE = re.compile(r"^(cpu|disk|cuda:\d+|\d+)$")
_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
          "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class Placement:
    """Where the weights may go: accelerate's device map, its budget per device in bytes
    (``{"cpu": ..., 0: ...}``, GPUs by index), and the folder for weights put on disk."""

    device_map: str
    max_memory: dict[str | int, int] | None = None
    offload_folder: Path | None = None

    def load_kwargs(self) -> dict[str, Any]:
        """``from_pretrained`` arguments."""
        extra = {"max_memory": dict(self.max_memory)} if self.max_memory else {}
        if self.offload_folder is not None:
            extra["offload_folder"] = str(self.offload_folder)
        return {"device_map": self.device_map, **extra}

    def describe(self) -> dict[str, Any]:
        """As ``audit.json``'s runtime records it (where weights went changes no number)."""
        return {"device_map": self.device_map,
                "max_memory_bytes": {str(k): v for k, v in (self.max_memory or {}).items()},
                "offload_folder": str(self.offload_folder) if self.offload_folder else None}


def parse_size(text: str, where: str) -> int:
    """``8GiB``, ``500MB``, ``1.5GB`` or plain bytes -> bytes (at least one)."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS or float(match.group(1)) * _UNITS[unit] < 1:
        raise UsageError(f"{where}: {text!r} is not a size; write a number with a unit "
                         "(8GiB, 500MB) or plain bytes", option="max_memory")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_max_memory(value: str | Mapping[Any, Any]) -> dict[str | int, int]:
    """``cpu=8GiB,cuda:0=70GiB`` (or a mapping of the same) -> ``{"cpu": bytes, 0: bytes}``."""
    where = arg("max_memory", value if isinstance(value, str) else dict(value))
    if isinstance(value, str):
        items = [part.partition("=") for part in value.split(",")]
        if any(not sep or not key.strip() for key, sep, _ in items):
            raise UsageError(f"{where}: write DEVICE=SIZE pairs separated by commas, e.g. "
                             "cpu=8GiB,cuda:0=70GiB", option="max_memory")
        pairs = [(key.strip(), size.strip()) for key, _, size in items]
    elif isinstance(value, Mapping):
        pairs = [(str(k), str(v)) for k, v in value.items()]
    else:
        raise UsageError(f"{where}: give a string like 'cpu=8GiB,cuda:0=70GiB' or a dict",
                         option="max_memory")
    budget: dict[str | int, int] = {}
    for key, size in pairs:
        if not _DEVICE.match(key):
            raise UsageError(f"{where}: {key!r} is not a device; use cpu, disk or cuda:N",
                             option="max_memory")
        device: str | int = int(key.removeprefix("cuda:")) if key[-1].isdigit() else key
        if device in budget:
            raise UsageError(f"{where}: {key} is given twice; give each device once",
                             option="max_memory")
        budget[device] = parse_size(size, where)
    return budget


def placement(device_map: str | None, max_memory: Any = None,
              offload_folder: str | Path | None = None) -> Placement | None:
    """The validated placement (None without a device map), in one line on any mistake."""
    if device_map is None:
        if max_memory is not None or offload_folder is not None:
            given = arg("max_memory") if max_memory is not None else arg("offload_folder")
            raise UsageError(f"{given} only applies with {arg('device_map', 'auto')}: add it "
                             "or drop the option",
                             option="max_memory" if max_memory is not None else "offload_folder")
        return None
    if device_map not in DEVICE_MAPS:
        raise refusal(arg("device_map", device_map), device_map, list(DEVICE_MAPS),
                      option="device_map")
    require_accelerate()
    budget = parse_max_memory(max_memory) if max_memory is not None else None
    folder = Path(offload_folder) if offload_folder is not None else None
    if folder is not None:  # a file, a path under one, no write permission: said before work
        from fcaudit.io.outdir import check_folder
        check_folder(folder, arg("offload_folder", str(folder)))
    return Placement(device_map, budget, folder)


def require_accelerate() -> None:
    try:
        import accelerate  # noqa: F401
    except ImportError as exc:
        raise UsageError(f"{arg('device_map')} needs the optional dependency accelerate: "
                         f"{install_extra('hf')}", option="device_map") from exc


def weight_bytes(files: list[Path], itemsize: int | None = None) -> int:
    """Bytes the floating-point weights take in memory, from the safetensors headers
    (``itemsize``: the loading dtype's, when it differs from the stored one)."""
    total = 0
    for file in files:
        with file.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            count = math.prod(entry["shape"])
            stored = _BYTES.get(entry["dtype"], 4)
            size = itemsize if itemsize and entry["dtype"].startswith(("F", "BF")) else stored
            total += count * size
    return total


def check_budget(place: Placement, files: list[Path], itemsize: int | None) -> None:
    """A budget that cannot hold the weights needs an offload folder: said before loading."""
    if place.offload_folder is not None or not place.max_memory:
        return
    memory = sum(v for k, v in place.max_memory.items() if k != "disk")
    needed = weight_bytes(files, itemsize)
    if needed > memory:
        raise UsageError(
            f"the weights take {needed / 2**30:.2f} GiB but {arg('max_memory')} allows "
            f"{memory / 2**30:.2f} GiB outside disk: add {arg('offload_folder', 'DIR')} for "
            "the layers placed on disk", option="max_memory")


class AlignedWeights(Mapping):
    """An accelerate hook's ``weights_map`` whose tensors are fresh torch allocations.

    Read from disk, a weight is a view into the memory-mapped safetensors file, at whatever
    offset the file's header leaves (8 bytes past a 64-byte boundary, say). CPU matrix
    kernels pick their code path by alignment, so the same weights at another address can
    change the last bits of a product: the audit of the in-memory model would then differ
    from the offloaded one. A copy lands where torch puts every in-memory weight.
    """

    def __init__(self, inner: Mapping) -> None:
        self.inner = inner

    def __getitem__(self, key: str) -> Any:
        value = self.inner[key]
        return value.clone() if hasattr(value, "clone") else value

    def __contains__(self, key: object) -> bool:
        return key in self.inner  # without reading the weight, as the wrapped map does

    def __iter__(self) -> Iterator[str]:
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)


def align_offloaded(model: Any) -> int:
    """Wrap every accelerate hook's weights map in :class:`AlignedWeights`; how many."""
    hooks = [getattr(m, "_hf_hook", None) for m in model.modules()]
    wrapped = 0
    for hook in hooks:
        inner = getattr(hook, "weights_map", None)
        if inner is not None and not isinstance(inner, AlignedWeights):
            hook.weights_map = AlignedWeights(inner)
            wrapped += 1
    return wrapped


def _listing(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir()} - {MARKER}


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_apart(folder: Path, out: str | Path | None) -> None:
    """The offload folder and the output folder must not overlap: fcaudit empties the
    offload folder after the audit, and refuses an output folder holding files it did not
    write there (so the same folder, either inside the other, is refused before work)."""
    if out is None:
        return
    offload, output = folder.resolve(), Path(out).resolve()
    where, out_arg = arg("offload_folder", str(folder)), arg("out", str(out))
    if offload == output or output in offload.parents:
        inside = "is" if offload == output else "lies inside"
        raise UsageError(f"{where} {inside} {out_arg}, the audit's output folder; give an "
                         "offload folder outside it (it holds weights only while the audit "
                         "runs)", option="offload_folder")
    if offload in output.parents:
        raise UsageError(f"{out_arg} lies inside {where}, whose files fcaudit removes after "
                         "the audit; give folders apart from each other", option="offload_folder")


def _claim(folder: Path) -> int | None:
    """Make ``folder`` fcaudit's for one load; refuse a folder holding files fcaudit did
    not write, or one another live audit is using. Returns how many folders above
    ``folder`` fcaudit created with it (None: ``folder`` was there already)."""
    from fcaudit.io.outdir import topmost_missing
    where = arg("offload_folder", str(folder))
    top = topmost_missing(folder)
    created = None if top is None else len(folder.relative_to(top).parts)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CacheError(f"cannot create {where} ({exc.strerror or exc}); check the path "
                         "and its permissions", folder=str(folder)) from exc
    found, marker = _listing(folder), folder / MARKER
    state: dict[str, Any] = {}
    if marker.is_file():
        with contextlib.suppress(OSError, ValueError):
            state = json.loads(marker.read_text(encoding="utf-8"))
        if _alive(state.get("pid")):
            raise CacheError(f"{where} is in use by another fcaudit process (pid "
                             f"{state['pid']}); give each audit its own offload folder",
                             folder=str(folder))
    ours = set(state.get("files", [])) if isinstance(state.get("files"), list) else set()
    foreign = sorted(found - ours)
    if foreign:
        raise CacheError(f"{where} holds {len(foreign)} file(s) fcaudit did not write "
                         f"(e.g. {foreign[0]}); fcaudit never deletes them: give an "
                         "empty or new folder", folder=str(folder))
    if marker.is_file():
        created = _created(state)
        _remove(folder, ours & found)  # a previous run's, left by a crash
    _write_marker(folder, created, None)
    return created


def _created(state: dict[str, Any]) -> int | None:
    """From a marker: how many folders above the offload folder fcaudit created with it
    (None: none, the folder was there). A marker of an earlier version says only
    ``created: true``, the folder itself."""
    made = state.get("created")
    if made is True:
        made = 0
    return made if isinstance(made, int) and not isinstance(made, bool) and made >= 0 else None


def _write_marker(folder: Path, created: int | None, files: set[str] | None) -> None:
    # files None: loading is under way, so nothing in the folder is known to be ours yet;
    # created: how many parent folders fcaudit made with this one (None: it was there)
    state = {"written_by": "fcaudit (accelerate disk offload)", "pid": os.getpid(),
             "created": created, "files": sorted(files) if files is not None else None}
    try:
        (folder / MARKER).write_text(json.dumps(state, indent=1) + "\n", encoding="utf-8")
    except OSError as exc:
        raise CacheError(f"cannot write in {arg('offload_folder', str(folder))} "
                         f"({exc.strerror or exc}); fix its permissions or give another "
                         "folder", folder=str(folder)) from exc


def _remove(folder: Path, files: set[str]) -> None:
    for name in sorted(files, key=len, reverse=True):
        (folder / name).unlink(missing_ok=True)


@contextlib.contextmanager
def offload_space(place: Placement | None, out: str | Path | None = None) -> Iterator[None]:
    """The offload folder claimed for a load and the audit using it (refused first when it
    overlaps ``out``, the audit's output folder); afterwards what loading wrote there is
    removed, and the folder with the parents fcaudit created for it, when empty."""
    folder = place.offload_folder if place is not None else None
    if folder is None:
        yield
        return
    check_apart(folder, out)
    created = _claim(folder)
    try:
        yield
    finally:
        _remove(folder, _written(folder))
        (folder / MARKER).unlink(missing_ok=True)
        if created is not None:
            _remove_folders(folder, created)


def _remove_folders(folder: Path, created: int) -> None:
    """The emptied offload folder, its empty sub-folders and the ``created`` parent folders
    fcaudit made for it; a folder holding anything stops the removal there."""
    with contextlib.suppress(OSError):  # not empty: someone added files meanwhile
        for sub in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            sub.rmdir()
    folder = folder.absolute()
    top = folder.parents[created - 1] if 0 < created < len(folder.parents) else folder
    from fcaudit.io.outdir import remove_created
    remove_created(folder, top)


def _written(folder: Path) -> set[str]:
    """What loading wrote: as the marker lists it, or (loading failed before it could be
    listed) everything now in the folder, which was empty of other files when claimed."""
    try:
        files = json.loads((folder / MARKER).read_text(encoding="utf-8")).get("files")
    except (OSError, ValueError):
        files = None
    return set(files) & _listing(folder) if isinstance(files, list) else _listing(folder)


def note_written(place: Placement | None) -> None:
    """After loading: record in the marker which files loading wrote (so a crash leaves a
    folder the next run can tell is fcaudit's)."""
    folder = place.offload_folder if place is not None else None
    if folder is not None and (folder / MARKER).is_file():
        state = json.loads((folder / MARKER).read_text(encoding="utf-8"))
        _write_marker(folder, _created(state), _listing(folder))
