"""The on-disk audit cache: safetensors shards, each with its own checksum.

* ``eval-00000.safetensors``: one evaluation batch of the unperturbed pass: the
  per-token NLL and every site's full coefficient tensor;
* ``calib-00000.safetensors``: one calibration batch: every site's float64 sum
  over the batch's sequences, by position, and per token id for the ids present
  (``token_ids``, ``token_counts``, ``token::SITE``: sparse, bounded by the batch's
  tokens), and the sums an opted-in condition reads (``+cells_keys``,
  ``+cells_counts``, ``+cells::SITE``: per token id and position) only when asked;
  static profiles add them in batch order, so the result does not depend on how
  batches were spread over processes;
* ``replay-runs/replay-00000.safetensors``: one evaluation batch's per-sequence NLL
  under every planned run, with the SHA-256 of what each run was fed (``feed_digest``),
  so an interrupted replay resumes too, and a rerun reuses a batch only when every run
  would be fed the same tensors bit for bit (else the batch is replayed and replaced).

``manifest.json`` names what the cache was recorded with (model, data, code
fingerprints, package versions, batch size); a cache recorded with anything else is
refused at once. A matching manifest proves nothing by itself (no fingerprint sees
everything a model reads: environment variables, files, attributes): a record shard
found on disk is used only once this process has recomputed it and found it bitwise
equal (:meth:`CoefficientCache.settle`), and replay shards rest on those records. Each
shard is written atomically and then its SHA-256 beside it (``NAME.sha256``), so
shards can be written by several processes at once, a killed writer leaves no
shard without checksum, and a corrupted shard is caught when read. Rows are read
lazily (``safe_open``): memory does not grow with the number of sequences.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from fcaudit.core.adapters import same_bits
from fcaudit.core.errors import CacheError, FcauditError, arg
from fcaudit.core.interventions import TokenSums
from fcaudit.io.fileio import (
    read_json,
    sha256_file,
    temporary_target,
    write_json,
    write_safetensors,
    write_text,
)

SCHEMA = "fcaudit.cache/5"  # 5: calibration shards hold sums per token id
_OPEN_HANDLES = 16
_REPLAY_FOLDER = "replay-runs"
_ROUND_PREFIX = "round-n"  # replay-runs/round-n0000032/: a --target-ci round's replays
_SHARD_SUFFIXES = (".safetensors", ".safetensors.sha256")
_SITE, _TOKEN, _ROUTE_LOAD = "site::", "token::", "route_load::"  # per-site key prefixes
_COLLECTED = "+"  # the keys of a calibration collection only some audits ask for

Tensors = dict[str, torch.Tensor]


class EvaluationShard:
    """The keys of an evaluation shard (``eval-NNNNN``): the record pass of one batch."""

    NLL = "nll"  # the objective's per-unit losses
    HITS = "hits"  # classification: 1 per correctly classified example

    @staticmethod
    def site(name: str) -> str:
        return f"{_SITE}{name}"

    @classmethod
    def build(cls, nll: torch.Tensor, coefficients: Mapping[str, torch.Tensor],
              hits: torch.Tensor | None = None) -> Tensors:
        shard = {cls.NLL: nll.cpu(), **{cls.site(k): v.cpu() for k, v in coefficients.items()}}
        return shard if hits is None else {**shard, cls.HITS: hits.cpu()}


class CalibrationShard:
    """The keys of a calibration shard (``calib-NNNNN``: float64 sums by position and, for
    token ids, by id; the frontier's ``frontier-calib-NNNNN``: whole coefficients). Sums an
    opt-in condition reads (its ``collects``: ``cells``, per token id and position) are a
    collection of their own, under keys starting ``+``, held only when an audit asked."""

    TOKEN_IDS, TOKEN_COUNTS = "token_ids", "token_counts"

    @staticmethod
    def build(per_site: Mapping[str, torch.Tensor], tokens: TokenSums | None = None,
              collected: Mapping[str, TokenSums] | None = None) -> Tensors:
        shard = {f"{_SITE}{k}": v for k, v in per_site.items()}
        if tokens is not None:
            shard.update(_keyed_sums(tokens, CalibrationShard.TOKEN_IDS,
                                     CalibrationShard.TOKEN_COUNTS, _TOKEN))
        for name, sums in (collected or {}).items():
            shard.update(_keyed_sums(sums, *_collection_keys(name)))
        return shard

    @staticmethod
    def per_site(shard: Mapping[str, torch.Tensor], names: Sequence[str]) -> Tensors:
        return {name: shard[f"{_SITE}{name}"] for name in names}

    @staticmethod
    def tokens(shard: Mapping[str, torch.Tensor], names: Sequence[str]) -> TokenSums | None:
        """The sums per token id, if the shard holds them (token inputs only)."""
        return _read_sums(shard, names, CalibrationShard.TOKEN_IDS,
                          CalibrationShard.TOKEN_COUNTS, _TOKEN)

    @staticmethod
    def collected(shard: Mapping[str, torch.Tensor], names: Sequence[str],
                  name: str) -> TokenSums | None:
        """The collection ``name``'s sums, if the shard holds them (an audit that asked)."""
        return _read_sums(shard, names, *_collection_keys(name))

    @staticmethod
    def optional(key: str) -> bool:
        """A key of a collection: a shard recorded without it holds the same default sums."""
        return key.startswith(_COLLECTED)


def _collection_keys(name: str) -> tuple[str, str, str]:
    """The keys of collection ``name``: its keys, its counts, its per-site prefix."""
    return f"{_COLLECTED}{name}_keys", f"{_COLLECTED}{name}_counts", f"{_COLLECTED}{name}::"


def _keyed_sums(sums: TokenSums, ids: str, counts: str, prefix: str) -> Tensors:
    return {ids: sums.ids, counts: sums.counts,
            **{f"{prefix}{k}": v for k, v in sums.sums.items()}}


def _read_sums(shard: Mapping[str, torch.Tensor], names: Sequence[str], ids: str, counts: str,
               prefix: str) -> TokenSums | None:
    if ids not in shard:
        return None
    return TokenSums(shard[ids], shard[counts], {name: shard[f"{prefix}{name}"] for name in names})


def _other_collections(cached: Tensors, fresh: Tensors) -> bool:
    """True when two shards differ only in which optional collections they hold, and the
    keys both hold are bitwise equal (the cached one is then proven on what it shares)."""
    both = fresh.keys() & cached.keys()
    return cached.keys() != fresh.keys() and all(
        CalibrationShard.optional(k) for k in cached.keys() ^ fresh.keys()) and \
        same_bits({k: cached[k] for k in both}, {k: fresh[k] for k in both})


class ReplayShard:
    """The keys of a replay shard (``replay-runs/replay-NNNNN``): one batch under every run."""

    NLL = "nll"  # [runs, batch] per-sequence mean loss
    FEED_DIGEST = "feed_digest"  # [runs, 32] SHA-256 of what each run was fed
    IDENTITY_DIFF = "identity_diff"
    PREFIX = "prefix"  # how the prefix schedule went
    PLAN_DIGEST = "plan_digest"
    ROUTE_CHANGED = "route_changed"  # [tracked runs, routers] tokens re-routed
    STILL_SELECTED = "ablation_still_selected"  # [ablation runs] picks of the ablated expert
    HITS = "hits"

    @staticmethod
    def route_load(name: str) -> str:
        return f"{_ROUTE_LOAD}{name}"

    @staticmethod
    def route_loads(shard: Mapping[str, torch.Tensor]) -> Tensors:
        """Router site name -> its expert load in this shard."""
        return {k.removeprefix(_ROUTE_LOAD): v for k, v in shard.items()
                if k.startswith(_ROUTE_LOAD)}


def _check_folder(folder: Path) -> None:
    """Refuse a cache folder fcaudit cannot use as its own: a file, or a symbolic link at the
    folder, its replay folder or a round's (fcaudit makes none and never writes through
    one; :func:`fcaudit.io.outdir.check_output` refuses them first, this is the cache's own
    guard)."""
    replays = folder / _REPLAY_FOLDER
    rounds = sorted(replays.glob(f"{_ROUND_PREFIX}*")) if replays.is_dir() and \
        not replays.is_symlink() and not folder.is_symlink() else []
    link = next((p for p in (folder, replays, *rounds) if p.is_symlink()), None)
    if link is not None:
        raise CacheError(f"{link} is a symbolic link, which fcaudit did not make, and it never "
                         f"writes through a link it did not make; move the link away or choose "
                         f"another {arg('out')}", folder=str(folder))
    if folder.exists() and not folder.is_dir():
        raise CacheError(f"{folder} is a file, but fcaudit keeps its cache folder there; "
                         f"move that file away or choose another {arg('out')}",
                         folder=str(folder))
    manifest = folder / "manifest.json"
    if manifest.exists() and not manifest.is_file():
        raise CacheError(f"{manifest} is not a file; delete {folder} and rerun", folder=str(folder))


# Each entry of a cache's identity (built by engine/run.py's ``cache_identity``) and of
# its setup, as a message names it: what changed, never "the model" for an option.
IDENTITY_WORDS = {
    "model": "model (its weights, config or code)", "model_class": "model class",
    "eval_data": "evaluation data", "calib_data": "calibration data",
    "dtype": "parameter dtype", "device": "device", "sites": "controller sites",
    "adapters": "site adapters", "layouts": "coefficient layouts", "objective": "objective",
    "exit_threshold": arg("exit_threshold", owner="AuditOptions"),
    "fcaudit": "fcaudit version", "torch": "torch version",
    "package versions": "package versions",
    "batch_size": arg("batch_size", owner="AuditOptions"),
    "n_sequences": "number of evaluation sequences"}
_SHOWN = 60  # an entry's values are quoted when this short (a fingerprint, 64, is not)


def _changed(key: str, before: Any, now: Any) -> str:
    """An identity entry that differs, in words, with what changed where that is short
    (``AuditOptions(exit_threshold=...) (0.8 -> 0.5)``) or a short mapping (package
    versions: ``mypkg 1.0 -> 2.0``)."""
    words = IDENTITY_WORDS.get(key, key.replace("_", " "))
    if isinstance(before, dict) and isinstance(now, dict):
        moved = [f"{name} {before.get(name, 'absent')} -> {now.get(name, 'absent')}"
                 for name in sorted(set(before) | set(now)) if before.get(name) != now.get(name)]
        return f"{words} ({', '.join(moved)})"
    shown = [_short(v) for v in (before, now)]
    return words if None in shown or shown[0] == shown[1] else \
        f"{words} ({shown[0]} -> {shown[1]})"


def _listed(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _short(value: Any) -> str | None:
    """A value as a message quotes it (a string: its first word, a callable objective's
    name without the digest of its state), or None where it is long or structured."""
    if value is None:
        return "none"
    text = value.split(" ")[0] if isinstance(value, str) else str(value)
    return text if isinstance(value, (str, int, float)) and len(text) <= _SHOWN else None


_LOSSES = {EvaluationShard.NLL: "losses", EvaluationShard.HITS: "hits (examples scored right)"}
_VARIES = ("or its forward pass varies between runs: another thread count or device can change "
           "the last bits")


def _entry(key: str) -> str:
    """A record shard's key as a message names it."""
    for prefix, words in ((_SITE, "coefficients of site"), (_TOKEN, "per-token sums of site")):
        if key.startswith(prefix):
            return f"{words} {key.removeprefix(prefix)}"
    named = {**_LOSSES, CalibrationShard.TOKEN_IDS: "token ids",
             CalibrationShard.TOKEN_COUNTS: "token counts"}
    return named.get(key, f"entry {key!r}")


def _difference(cached: Tensors, fresh: Tensors) -> str:
    """What a fresh record pass gives otherwise than the cached shard (a coefficient named
    first: it says most), and what that points at: differing coefficients, the model (or
    state it reads); losses alone while every coefficient is bitwise equal, the objective
    or what the model computes after its controllers."""
    odd = sorted(k for k in cached.keys() ^ fresh.keys() if not CalibrationShard.optional(k))
    if odd:
        return (f"other entries than its cached record ({', '.join(map(_entry, odd))} in only "
                "one of them): the cache was recorded with other sites, inputs or options")
    differ = sorted((k for k in fresh.keys() & cached.keys()
                     if not same_bits(cached[k], fresh[k])),
                    key=lambda k: (k in _LOSSES, k)) or sorted(cached.keys() ^ fresh.keys())
    named = _entry(differ[0]) + (f" and {len(differ) - 1} more" if len(differ) > 1 else "")
    if all(k in _LOSSES for k in differ):
        return (f"other {named} than its cached record while every coefficient is bitwise "
                "equal (the objective, or what the model computes after its controllers, or "
                "state either reads outside its code such as environment variables or files, "
                f"changed since; {_VARIES})")
    return (f"other {named} than its cached record (the model, or state it reads outside its "
            "code such as environment variables, files, attributes or package versions, "
            f"changed since; {_VARIES})")


class CoefficientCache:
    """The shards of one audit's cache folder (see the module docstring)."""

    def __init__(self, folder: Path, identity: dict[str, Any], batch_size: int,
                 n_sequences: int, owner: bool = True) -> None:
        """``owner``: the one process that may create the folder, rewrite the manifest and
        remove temporary files; other processes of a multi-process audit only read it."""
        self.folder = Path(folder)
        self.identity = identity
        self.batch_size = batch_size
        self.n_sequences = n_sequences
        self.pool_sequences = n_sequences  # what the manifest holds (use_prefix narrows)
        self.manifest_path = self.folder / "manifest.json"
        self._handles: OrderedDict[str, Any] = OrderedDict()
        self._verified: set[str] = set()
        # record shards this process wrote or recomputed bit for bit: the only ones it uses
        self.proven: set[str] = set()
        self.reused: set[str] = set()  # those of them that were on disk before: proven equal
        self.owner = owner
        self.replay_round = ""  # a --target-ci round's replay subfolder (see use_prefix)
        _check_folder(self.folder)
        if self.manifest_path.exists():
            self._adopt()
        elif not owner:
            raise CacheError(f"{self.manifest_path} is missing: rank 0 creates the cache "
                             f"first; every process must see the same {arg('out')} folder",
                             folder=str(self.folder))
        else:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._write_manifest()

    def _adopt(self) -> None:
        """Reuse an existing cache folder if it was recorded with the same setup."""
        if self.owner:  # another process may be writing its own temporaries right now
            self._clear_stale_temporaries()
        try:
            manifest = read_json(self.manifest_path, "cache manifest")
        except FcauditError as exc:
            raise CacheError(f"{exc.raw}; delete {self.folder} and rerun",
                             folder=str(self.folder)) from exc
        if not isinstance(manifest, dict):
            raise CacheError(f"cache manifest {self.manifest_path} is not a JSON object; "
                             f"delete {self.folder} and rerun", folder=str(self.folder))
        if manifest.get("schema") != SCHEMA:
            raise CacheError(f"the cache in {self.folder} was written by another fcaudit "
                             f"version ({manifest.get('schema')!r}); delete that folder and "
                             "rerun to record it again", folder=str(self.folder))
        recorded = manifest.get("identity") if isinstance(manifest.get("identity"), dict) else {}
        setup = {"batch_size": self.batch_size, "n_sequences": self.pool_sequences}
        diff = [_changed(k, recorded.get(k), self.identity.get(k))
                for k in dict.fromkeys([*self.identity, *recorded])
                if recorded.get(k) != self.identity.get(k)]
        diff += [_changed(k, manifest.get(k), v) for k, v in setup.items()
                 if manifest.get(k) != v]
        if diff and (any(self.folder.glob("*.sha256")) or not self.owner):
            raise CacheError(
                f"the cache in {self.folder} was recorded with a different {_listed(diff)}; "
                f"delete that folder or choose another {arg('out')} (or rerun with what it "
                "was recorded with)", folder=str(self.folder))
        if diff:  # nothing was recorded yet: nothing to lose, start afresh
            self._write_manifest()

    def _write_manifest(self) -> None:
        write_json(self.manifest_path, {"schema": SCHEMA, "identity": self.identity,
                                        "batch_size": self.batch_size,
                                        "n_sequences": self.pool_sequences})

    # ------------------------------------------------------------------ layout

    @property
    def n_batches(self) -> int:
        return -(-self.n_sequences // self.batch_size)

    def batch_range(self, b: int) -> range:
        return range(b * self.batch_size, min((b + 1) * self.batch_size, self.n_sequences))

    @staticmethod
    def eval_name(b: int) -> str:
        return f"eval-{b:05d}.safetensors"

    @staticmethod
    def calib_name(b: int) -> str:
        return f"calib-{b:05d}.safetensors"

    @staticmethod
    def frontier_calib_name(b: int) -> str:
        """The frontier's calibration coefficients of batch ``b``, whole (see
        :mod:`fcaudit.engine.frontier`)."""
        return f"frontier-calib-{b:05d}.safetensors"

    def replay_name(self, b: int) -> str:
        return f"{_REPLAY_FOLDER}/{self.replay_round}replay-{b:05d}.safetensors"

    def use_prefix(self, n: int) -> None:
        """Read and write only the first ``n`` evaluation sequences (a ``--target-ci``
        round, in whole batches of the pool the manifest was opened with, so every earlier
        batch keeps its rows and its record shard). Each round size keeps its own replay
        shards (a round's derangement depends on ``n``), so a resumed audit finds every
        finished round's replays again; reuse still needs every fed tensor to match."""
        if not 2 <= n <= self.pool_sequences or (n % self.batch_size and
                                                 n != self.pool_sequences):
            raise ValueError(f"a prefix of {n} is not whole batches of the "
                             f"{self.pool_sequences}-sequence pool")
        self.n_sequences = n
        self.replay_round = f"{_ROUND_PREFIX}{n:07d}/"
        _check_folder(self.folder)  # a round folder linked since the cache was opened
        if self.owner:
            (self.folder / _REPLAY_FOLDER / self.replay_round).mkdir(parents=True,
                                                                      exist_ok=True)

    def earlier_replay_name(self, b: int) -> str | None:
        """Batch ``b``'s replay shard from the largest earlier (smaller) round that holds it
        whole, or None: the batch has the same rows there (whole batches of one pool)."""
        if not self.replay_round:
            return None
        for folder in reversed(self._replay_folders()[1:]):
            n = int(folder.name.removeprefix(_ROUND_PREFIX))
            name = f"{_REPLAY_FOLDER}/{folder.name}/replay-{b:05d}.safetensors"
            if n < self.n_sequences and (b + 1) * self.batch_size <= n and self.has(name):
                return name
        return None

    def _replay_folders(self) -> list[Path]:
        """The replay folders fcaudit made here, if any (the folder and its round
        subfolders): only their own names, never a link."""
        folder = self.folder / _REPLAY_FOLDER
        if not folder.is_dir() or folder.is_symlink():
            return []
        return [folder, *(p for p in sorted(folder.glob(f"{_ROUND_PREFIX}*"))
                          if p.is_dir() and not p.is_symlink())]

    def _clear_stale_temporaries(self) -> None:
        """Remove temporary files a killed writer of this cache left behind (never under a
        final name), and nothing else: only names :func:`atomic_path` gives cache files."""
        for folder in (self.folder, *self._replay_folders()):
            for path in folder.iterdir():
                target = temporary_target(path)
                if target and (target == "manifest.json" or target.endswith(_SHARD_SUFFIXES)) \
                        and path.is_file() and not path.is_symlink():
                    path.unlink(missing_ok=True)

    def disk_usage(self) -> dict[str, Any]:
        """Bytes on disk, as the disk allocates them (whole blocks, as the plan counts
        them: engine/cost.py), folders included: the cache holds one shard set per batch,
        so it grows linearly with the number of evaluation sequences (memory does not:
        rows are read lazily)."""
        total = sum(p.lstat().st_blocks * 512 for p in (self.folder, *self.folder.rglob("*"))
                    if p.is_file() or p.is_dir())
        return {"bytes": total, "bytes_per_eval_sequence": round(total / self.n_sequences),
                "growth": "linear in the evaluation sequences (one shard set per batch)"}

    # ------------------------------------------------------------------ shards

    def has(self, name: str) -> bool:
        return (self.folder / name).is_file() and (self.folder / f"{name}.sha256").is_file()

    def write(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        """The shard, then its checksum: a shard without checksum does not exist (a shard
        being replaced loses its old checksum first, so a killed writer leaves no shard)."""
        path = self.folder / name
        self._handles.pop(name, None)  # a replaced shard is read and verified afresh
        self._verified.discard(name)
        (self.folder / f"{name}.sha256").unlink(missing_ok=True)
        write_safetensors(path, tensors)
        write_text(self.folder / f"{name}.sha256", sha256_file(path) + "\n")
        self.proven.add(name)

    def settle(self, name: str, fresh: dict[str, torch.Tensor], what: str) -> bool:
        """Write ``fresh`` (a record shard this process just computed) as ``name``, or,
        where the cache holds that shard already, prove it: the cached one is used only
        when it equals ``fresh`` bit for bit. True when it was on disk and proven. A
        difference means the model, or state it reads outside its code, is not the one
        that wrote the cache: refused, naming ``what`` (the batch). A cached calibration
        shard with other collections (:meth:`CalibrationShard.optional`) than this audit
        asks for is proven on the keys both hold, then replaced by ``fresh``: an audit never
        reads sums it did not recompute."""
        if not self.has(name):
            self.write(name, fresh)
            return False
        cached = self.read(name)
        if _other_collections(cached, fresh):
            self.write(name, fresh)
            return False
        if not same_bits(cached, fresh):
            raise CacheError(
                f"the cache in {self.folder} does not hold what this audit computes: a fresh "
                f"pass over {what} gives {_difference(cached, fresh)}; delete {self.folder} "
                f"or choose another {arg('out')}", folder=str(self.folder))
        self.proven.add(name)
        self.reused.add(name)
        return True

    def _verify(self, name: str) -> None:
        if name in self._verified:
            return
        if not self.has(name):
            raise CacheError(f"cache {self.folder} lacks {name}; rerun to finish recording",
                             folder=str(self.folder))
        expected = (self.folder / f"{name}.sha256").read_text(encoding="utf-8").strip()
        if sha256_file(self.folder / name) != expected:
            raise CacheError(
                f"cache file {self.folder / name} fails its checksum (corrupted or edited); "
                f"delete {self.folder} and rerun to record it again", folder=str(self.folder))
        self._verified.add(name)

    def verify_all(self) -> None:
        """Check every evaluation shard against its SHA-256 before replay reads it."""
        for b in range(self.n_batches):
            self._verify(self.eval_name(b))

    def _handle(self, name: str) -> Any:
        if name in self._handles:
            self._handles.move_to_end(name)
            return self._handles[name]
        self._verify(name)
        try:
            fh = safe_open(str(self.folder / name), framework="pt")
        except (SafetensorError, OSError) as exc:
            raise CacheError(f"cannot read cache shard {name} in {self.folder} ({exc}); "
                             "delete the folder and rerun", folder=str(self.folder)) from exc
        self._handles[name] = fh
        if len(self._handles) > _OPEN_HANDLES:
            self._handles.popitem(last=False)
        return fh

    def read(self, name: str) -> dict[str, torch.Tensor]:
        fh = self._handle(name)
        return {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 - not a dict

    def batch(self, b: int, key: str) -> torch.Tensor:
        """A whole evaluation-shard tensor (a key of :class:`EvaluationShard`)."""
        return self._handle(self.eval_name(b)).get_tensor(key)

    def coefficients(self, b: int, site: str) -> torch.Tensor:
        """Batch ``b``'s recorded coefficients of ``site``."""
        return self.batch(b, EvaluationShard.site(site))

    def coefficient_rows(self, site: str, indices: Any) -> torch.Tensor:
        """``site``'s recorded coefficients of any evaluation sequences, read lazily per
        shard."""
        key, out = EvaluationShard.site(site), []
        for i in (int(j) for j in indices):
            b, r = divmod(i, self.batch_size)
            out.append(self._handle(self.eval_name(b)).get_slice(key)[r:r + 1])
        return torch.cat(out, 0)
