"""The on-disk coefficient cache: one safetensors shard per evaluation batch.

Each shard holds the per-token NLL of the unperturbed pass and every site's full
coefficient tensor for that batch. A JSON manifest names the model, data and
code fingerprints and each finished shard's SHA-256, and is rewritten atomically
after every shard: a killed record resumes at the first missing shard, a
corrupted shard is caught by its checksum, and a cache recorded with another
model or other data is refused. Rows are read back lazily (``safe_open``), so
memory does not grow with the number of evaluation sequences.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from .errors import FcauditError
from .fileio import read_json, sha256_file, write_json, write_safetensors

SCHEMA = "fcaudit.cache/1"


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> str:
    """Write a safetensors file atomically; return its SHA-256."""
    write_safetensors(path, tensors)
    return sha256_file(path)


class CoefficientCache:
    """Shards ``eval-00000.safetensors``... plus ``manifest.json`` in one folder."""

    def __init__(self, folder: Path, identity: dict[str, Any], batch_size: int,
                 n_sequences: int) -> None:
        self.folder = Path(folder)
        self.identity = identity
        self.batch_size = batch_size
        self.n_sequences = n_sequences
        self.manifest_path = self.folder / "manifest.json"
        self.shards: dict[str, str] = {}
        self.extras: dict[str, str] = {}
        self._handles: OrderedDict[int, Any] = OrderedDict()
        self._verified: set[str] = set()
        if self.manifest_path.exists():
            self._clear_stale_temporaries()
            try:
                manifest = read_json(self.manifest_path, "cache manifest")
            except FcauditError as exc:
                raise FcauditError(f"{exc}; delete {self.folder} and rerun") from exc
            if not isinstance(manifest, dict):
                raise FcauditError(f"cache manifest {self.manifest_path} is not a JSON object; "
                                   f"delete {self.folder} and rerun")
            recorded = manifest.get("identity")
            recorded = recorded if isinstance(recorded, dict) else {}
            setup = {"batch_size": batch_size, "n_sequences": n_sequences}
            diff = sorted(k for k in set(identity) | set(recorded)
                          if recorded.get(k) != identity.get(k))
            diff += [k for k, v in setup.items() if manifest.get(k) != v]
            if diff and (manifest.get("shards") or manifest.get("extras")):
                raise FcauditError(
                    f"the cache in {self.folder} was recorded with a different "
                    f"{', '.join(diff)}; delete that folder or choose another --out "
                    "(or rerun with the original model, data and --batch-size)")
            if diff:  # nothing was recorded yet: nothing to lose, start afresh
                self._write_manifest()
            else:
                self.shards = dict(manifest.get("shards", {}))
                self.extras = dict(manifest.get("extras", {}))
        else:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._write_manifest()

    def _clear_stale_temporaries(self) -> None:
        """Remove temporary files a killed writer left behind (never under a final name)."""
        for tmp in self.folder.glob(".*.tmp"):
            tmp.unlink(missing_ok=True)

    @property
    def n_batches(self) -> int:
        return -(-self.n_sequences // self.batch_size)

    def batch_range(self, b: int) -> range:
        return range(b * self.batch_size, min((b + 1) * self.batch_size, self.n_sequences))

    def _write_manifest(self) -> None:
        write_json(self.manifest_path, {"schema": SCHEMA, "identity": self.identity,
                                        "batch_size": self.batch_size,
                                        "n_sequences": self.n_sequences,
                                        "shards": self.shards, "extras": self.extras})

    @staticmethod
    def shard_name(b: int) -> str:
        return f"eval-{b:05d}.safetensors"

    def has_shard(self, b: int) -> bool:
        return self.shard_name(b) in self.shards and (self.folder / self.shard_name(b)).exists()

    def write_shard(self, b: int, nll: torch.Tensor, coefficients: dict[str, torch.Tensor]) -> None:
        tensors = {"nll": nll, **{f"site::{k}": v for k, v in coefficients.items()}}
        name = self.shard_name(b)
        self.shards[name] = save_tensors(self.folder / name, tensors)
        self._write_manifest()

    def write_extra(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        self.extras[name] = save_tensors(self.folder / name, tensors)
        self._write_manifest()

    def read_extra(self, name: str) -> dict[str, torch.Tensor] | None:
        if name not in self.extras or not (self.folder / name).exists():
            return None
        self._verify(name, self.extras[name])
        with safe_open(str(self.folder / name), framework="pt") as fh:
            return {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 - not a dict

    def _verify(self, name: str, expected: str) -> None:
        if name in self._verified:
            return
        if sha256_file(self.folder / name) != expected:
            raise FcauditError(
                f"cache file {self.folder / name} fails its checksum (corrupted or edited); "
                f"delete {self.folder} and rerun to record it again")
        self._verified.add(name)

    def verify_all(self) -> None:
        """Check every shard against its recorded SHA-256 before replay reads it."""
        for b in range(self.n_batches):
            name = self.shard_name(b)
            if name not in self.shards:
                raise FcauditError(f"cache {self.folder} lacks {name}; rerun to finish recording")
            self._verify(name, self.shards[name])

    def _handle(self, b: int) -> Any:
        if b in self._handles:
            self._handles.move_to_end(b)
            return self._handles[b]
        try:
            fh = safe_open(str(self.folder / self.shard_name(b)), framework="pt")
        except (SafetensorError, OSError) as exc:
            raise FcauditError(f"cannot read cache shard {self.shard_name(b)} in {self.folder} "
                               f"({exc}); delete the folder and rerun") from exc
        self._handles[b] = fh
        if len(self._handles) > 16:
            self._handles.popitem(last=False)
        return fh

    def batch(self, b: int, key: str) -> torch.Tensor:
        """A whole shard tensor (``nll`` or ``site::NAME``)."""
        return self._handle(b).get_tensor(key)

    def rows(self, key: str, indices: list[int] | Any) -> torch.Tensor:
        """Rows of ``key`` for arbitrary global sequence indices, read lazily per shard."""
        out = []
        for i in (int(j) for j in indices):
            b, r = divmod(i, self.batch_size)
            out.append(self._handle(b).get_slice(key)[r:r + 1])
        return torch.cat(out, 0)
