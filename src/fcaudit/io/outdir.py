"""Output folders: which ones fcaudit may write, replace or clean, and who holds them.

Users point ``--out`` at their own disks. fcaudit writes only into a folder that is
new, empty, or one it wrote itself: every output folder gets a marker file
(:data:`MARKER`, its kind and the fcaudit version), and folders of earlier versions are
recognised by their own files. The marker also records every result file fcaudit wrote
there with its SHA-256 (``files``), written before the file takes its name: a rerun
moves, replaces or removes only files listed there whose bytes still have the recorded
digest. A user's file, a file edited since, or a marker copied or forged into a user's
folder therefore never licenses a deletion; a result name held by such a file is refused.

One run at a time holds an output folder: an exclusive ``flock`` on :data:`LOCK`
inside it, which the kernel drops when the process dies (also on ``kill -9``), so a
stale lock never blocks anyone. The lock file holds the holder's pid, host, start time
and command, which a refused second run quotes.

API for a command writing the output folder ``out`` of kind ``kind``:

1. ``check_output(out, kind)`` while validating the inputs, before any work: it has no
   side effects, so a refused run leaves no output folder;
2. ``with hold_output(out, kind, command=...):`` around the work: it checks again,
   creates the folder and its marker (``claim_output``), holds the lock
   (``OutputLock``) until the block exits, and removes the folder again if the run
   created it and wrote nothing into it;
3. ``with replacing_results(out) as files:`` (:mod:`fcaudit.io.results`) around writing
   the results through ``files``, the completion file (``audit.json``) last: a rerun
   never leaves old and new results side by side.

POSIX only (``fcntl``). ``flock`` may not lock across machines on some network file
systems.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from fcaudit._version import __version__
from fcaudit.core.errors import CacheError, FcauditError, arg
from fcaudit.io.fileio import read_json, sha256_file, write_json

MARKER = ".fcaudit-output.json"
MARKER_SCHEMA = "fcaudit.output/1"
LOCK = ".fcaudit-lock"
PREVIOUS = ".previous"
BOOKKEEPING = frozenset({MARKER, LOCK})
KINDS = ("run", "audit", "study", "demo", "compare")

RUN_FILES = frozenset({"config.json", "model.safetensors", "tokenizer.json", "train_log.jsonl"})
# Result files of one audit or study; the first, written last, means the run finished.
AUDIT_RESULTS = ("audit.json", "report.md", "report.html", "figures")
STUDY_RESULTS = ("reproduction.json", "reproduction.md", "report.html", "figures")
COMPARE_RESULTS = ("compare.json", "compare.md", "compare.html", "figures")  # fcaudit compare
FIGURES = "figures"  # the one result that is a folder
RESULTS = {"audit": AUDIT_RESULTS, "study": (*STUDY_RESULTS, "trend.md"),
           "compare": COMPARE_RESULTS}

# What a demo folder holds (sub-folder: kind), and a study's folders of outputs; they also
# recognise such folders that fcaudit wrote before the marker existed.
DEMO_PARTS = {"featuregate": "run", "dense": "run", "audit": "audit"}
_STUDY_GROUPS = {"runs": "run", "audits": "audit"}
STUDY_POINTS = "points"  # a trend study's sub-folder of point summaries
STUDY_TASKS = "lm-eval-tasks"  # a study's benchmark tasks (study/lm_tasks.py)
# the folders fcaudit writes inside an output folder of each kind besides its results
OWN_FOLDERS = {"audit": ("cache",), "study": (*_STUDY_GROUPS, STUDY_POINTS, STUDY_TASKS),
               "demo": tuple(DEMO_PARTS)}


# ---------------------------------------------------------------------- recognition

def _json(path: Path) -> Any:
    """A JSON file's content, or None when it is missing, unreadable, not JSON, or not a
    regular file (a FIFO named ``audit.json`` would block a plain read for ever)."""
    try:
        return read_json(path, "file")
    except FcauditError:
        return None


def _has_schema(path: Path, prefix: str) -> bool:
    data = _json(path)
    return isinstance(data, dict) and str(data.get("schema", "")).startswith(prefix)


def entries(folder: Path) -> list[Path]:
    """What a folder holds besides fcaudit's bookkeeping files, sorted (none: empty)."""
    return sorted(p for p in folder.iterdir() if p.name not in BOOKKEEPING)


def _marker_kind(folder: Path) -> str | None:
    marker = _json(folder / MARKER)
    if isinstance(marker, dict) and marker.get("schema") == MARKER_SCHEMA \
            and marker.get("kind") in KINDS:
        return str(marker["kind"])
    return None


def _legacy_kind(folder: Path) -> str | None:
    """The kind of a folder an fcaudit version before the marker wrote, from its files."""
    cfg = _json(folder / "config.json")
    if isinstance(cfg, dict) and "fcaudit_run" in cfg:
        return "run"
    if _has_schema(folder / "audit.json", "fcaudit.audit/") \
            or _has_schema(folder / "cache" / "manifest.json", "fcaudit.cache/"):
        return "audit"
    held = [p for p in entries(folder) if p.name != PREVIOUS]  # a rerun's aside copy
    if held and all(p.name in DEMO_PARTS and output_kind(p) == DEMO_PARTS[p.name]
                    for p in held):
        return "demo"
    if _has_schema(folder / "reproduction.json", "fcaudit.reproduction/") or _is_legacy_study(held):
        return "study"
    return None


def _is_legacy_study(held: list[Path]) -> bool:
    """runs/ and audits/ folders of outputs (plus the study's results), as `reproduce` left
    them when interrupted; hidden entries of runs/ are work folders of killed trainings."""
    groups = [p for p in held if p.name in _STUDY_GROUPS]
    return bool(groups) and all(p.name in _STUDY_GROUPS or p.name in STUDY_RESULTS
                                for p in held) \
        and all(g.is_dir() and all(output_kind(child) == _STUDY_GROUPS[g.name]
                                   for child in entries(g) if not child.name.startswith("."))
                for g in groups)


def output_kind(path: str | Path) -> str | None:
    """``run``, ``audit``, ``study``, ``demo`` or ``compare`` for a folder fcaudit wrote,
    else None."""
    path = Path(path)
    if not path.is_dir():
        return None
    return _marker_kind(path) or _legacy_kind(path)


# ---------------------------------------------------------------------------- check

def _names(paths: Sequence[Path], limit: int = 3) -> str:
    shown = [p.name + ("/" if p.is_dir() else "") for p in paths[:limit]]
    return ", ".join(shown) + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def _usable(folder: Path) -> bool:
    return os.access(folder, os.R_OK | os.W_OK | os.X_OK)


def _check_new(path: Path, where: str) -> None:
    """A path that does not exist yet: its nearest existing parent must be a writable folder."""
    for parent in path.absolute().parents:
        if parent.is_symlink() and not parent.exists():
            raise CacheError(f"{where} lies under {parent}, a symbolic link to "
                             f"{os.readlink(parent)}, which does not exist; remove the link "
                             "or choose another folder")
        if not parent.exists():
            continue
        if not parent.is_dir():
            raise CacheError(f"{where} lies under {parent}, which is a file; choose a path "
                             "inside a folder")
        if not _usable(parent):
            raise CacheError(f"cannot create {where}: {parent} is not writable; fix its "
                             "permissions or choose a folder you can write to")
        return


def check_folder(path: Path, where: str) -> None:
    """Refuse, in one line, a folder fcaudit cannot create or write (touches nothing): a
    dangling symbolic link, a file, a path under a file, a folder that is not writable,
    or a new one whose nearest existing parent is not. ``where`` names the option."""
    if path.is_symlink() and not path.exists():
        raise CacheError(f"{where} is a symbolic link to {os.readlink(path)}, which does "
                         "not exist; remove the link or choose another folder")
    if not path.exists():
        _check_new(path, where)
        return
    if not path.is_dir():
        raise CacheError(f"{where} is a file, not a folder; choose a folder")
    if not _usable(path):
        raise CacheError(f"{where} is not writable (or not readable); fix its permissions "
                         "or choose another folder")


def check_output(path: str | Path, kind: str) -> None:
    """Refuse, in one line, an output path fcaudit must not write to. Touches nothing.

    Refused: a file, a path under a file, a dangling symbolic link, a folder that is not
    writable (or, for a new folder, whose nearest existing parent is not), a folder of
    another kind of fcaudit output, a non-empty folder fcaudit did not write, and a result
    name (``report.md``) held by a file fcaudit did not record writing. An audit folder's
    ``cache`` must be a folder and its ``cache/manifest.json`` a file.
    """
    path = Path(path)
    where = arg("out", str(path))
    check_folder(path, where)
    if not path.exists():
        return
    found = output_kind(path)
    held = entries(path)
    if found is None and held:
        raise CacheError(f"{where} holds files fcaudit did not write ({_names(held)}); "
                         "choose an empty or new folder")
    if found not in (None, kind):
        raise CacheError(f"{where} is an fcaudit {found} folder, not {kind} output; choose "
                         "another folder")
    _check_links(path, kind, where)
    cache = path / "cache"
    if kind == "audit" and (cache.exists() or cache.is_symlink()):
        if not cache.is_dir():
            raise CacheError(f"{where}: {cache} is a file, not the cache folder; move it away "
                             "or choose another folder")
        if not _usable(cache):
            raise CacheError(f"{where}: its cache folder {cache} is not writable (or not "
                             "readable); fix its permissions or choose another folder")
        manifest = cache / "manifest.json"
        if (manifest.exists() or manifest.is_symlink()) and not manifest.is_file():
            raise CacheError(f"{where}: {manifest} is not a file; move it away or choose "
                             "another folder")
    if found == kind:
        _check_results(path, RESULTS.get(kind, ()), where)


def _links(path: Path) -> Iterator[Path]:
    """``path`` if it is a symbolic link, else every link under it (links not followed)."""
    if path.is_symlink():
        yield path
        return
    for folder, dirs, files in os.walk(path):
        for name in sorted([*dirs, *files]):
            if (Path(folder) / name).is_symlink():
                yield Path(folder) / name


def _check_links(path: Path, kind: str, where: str) -> None:
    """fcaudit never writes through a symbolic link it did not make (it makes none): a link
    among its bookkeeping files, its ``.previous/`` results, or at or under a folder it
    writes inside an output folder of ``kind`` (:data:`OWN_FOLDERS`: an audit's cache with
    its replay and round folders, a study's runs, a demo's parts) is refused, touching
    nothing. The results themselves are :func:`_check_results`'."""
    for name in (*sorted(BOOKKEEPING), PREVIOUS, *OWN_FOLDERS.get(kind, ())):
        link = next(_links(path / name), None)
        if link is not None:
            raise CacheError(f"{where}: {link.relative_to(path)} is a symbolic link (to "
                             f"{os.readlink(link)}), which fcaudit did not make, and it never "
                             "writes through a link it did not make; move the link away or "
                             "choose another folder")


def _check_results(path: Path, results: Sequence[str], where: str) -> None:
    """Each result name must be free or hold fcaudit's own unchanged file (``figures``: a
    real folder; files of the user's in it stay, one edited since fcaudit wrote it is
    refused now, and any other in a figure's way when that figure is written)."""
    files = recorded(path)
    for name in results:
        item = path / name
        if item.is_symlink():
            raise CacheError(f"{where}: {name} is a symbolic link, which fcaudit did not "
                             "write; move it away or choose another folder")
        if not item.exists() or (name == FIGURES and item.is_dir()):
            continue
        if name == FIGURES or item.is_dir() or not owns(path, name, files):
            raise CacheError(f"{where} holds {name}{'/' if item.is_dir() else ''}, which "
                             "fcaudit did not record writing (a file of yours, one edited "
                             "since, or one an fcaudit version without digests wrote); move "
                             "it away or choose another folder")
    edited = [rel for rel in files if PurePosixPath(rel).parts[0] == FIGURES
              and (path / rel).exists() and not owns(path, rel, files)]
    if edited:
        raise CacheError(f"{where}: {edited[0]} was changed since fcaudit wrote it, and a "
                         "rerun would replace it; move it away or choose another folder")


def check_output_file(path: str | Path, schema: str, option: str) -> None:
    """Refuse, in one line, a result file fcaudit may not write (touches nothing): a
    folder, a symbolic link, an existing file that is not fcaudit's own (its JSON
    ``schema`` is not ``schema``), or a new path with no writable folder."""
    path = Path(path)
    where = arg(option, str(path))
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise CacheError(f"{where} is not a plain file; choose a new file name")
    if not path.exists():
        _check_new(path, where)
        return
    if not _has_schema(path, schema):
        raise CacheError(f"{where} exists and is not a file fcaudit wrote ({schema}); "
                         "fcaudit replaces only its own: choose a new file name")
    if not os.access(path, os.W_OK) or not _usable(path.parent):
        raise CacheError(f"{where} is not writable; fix its permissions or choose another "
                         "file")

# ------------------------------------------------------------------------ manifest

def _marker(folder: Path) -> dict[str, Any]:
    data = _json(folder / MARKER)
    return data if isinstance(data, dict) else {}


def _safe(rel: str) -> bool:
    """A plain relative path inside the folder (a forged entry may name ``../x``)."""
    parts = PurePosixPath(rel).parts
    return bool(parts) and not rel.startswith("/") and ".." not in parts and "\\" not in rel


def recorded(folder: str | Path) -> dict[str, str]:
    """The files the marker records fcaudit writing in ``folder``: path inside it -> SHA-256."""
    files = _marker(Path(folder)).get("files")
    if not isinstance(files, dict):
        return {}
    return {k: v for k, v in files.items() if isinstance(v, str) and _safe(k)}


def save_recorded(folder: Path, files: Mapping[str, str]) -> None:
    write_json(folder / MARKER, {**_marker(folder), "files": dict(sorted(files.items()))})


def owns(folder: str | Path, rel: str, files: Mapping[str, str] | None = None) -> bool:
    """Whether ``folder/rel`` is a file fcaudit wrote, unchanged since: its current
    SHA-256 equals the recorded one (a symbolic link never is)."""
    folder = Path(folder)
    files = recorded(folder) if files is None else files
    path = folder / rel
    return rel in files and _safe(rel) and path.is_file() and not path.is_symlink() \
        and sha256_file(path) == files[rel]


def record_files(folder: str | Path, names: Collection[str]) -> None:
    """Record the digests of files fcaudit has just written in ``folder`` (by name)."""
    folder = Path(folder)
    files = recorded(folder)
    save_recorded(folder, {**files, **{n: sha256_file(folder / n) for n in names
                                        if (folder / n).is_file()}})


def check_unchanged(path: str | Path, what: str) -> None:
    """Refuse, in one line, a result file whose bytes differ from the SHA-256 its folder's
    marker recorded when fcaudit wrote it: its numbers may no longer be the run's. A file
    no marker records (copied out of its folder, or written before digests) is not
    checked here; its content is still checked when it is parsed."""
    path = Path(path)
    digest = recorded(path.parent).get(path.name)
    if digest is None or not path.is_file() or sha256_file(path) == digest:
        return
    raise CacheError(f"{what} {path} was changed after fcaudit wrote it (its SHA-256 differs "
                     f"from the one {path.parent / MARKER} recorded), so its numbers may not "
                     "be the run's: rerun it, or restore the file")


def owned_under(folder: Path, names: Sequence[str], files: Mapping[str, str]) -> list[str]:
    """fcaudit's unchanged files among ``names`` (a name, or a path inside a named folder)."""
    return sorted(rel for rel in files
                  if PurePosixPath(rel).parts[0] in names and owns(folder, rel, files))


# ---------------------------------------------------------------------- claim, lock

def claim_output(path: str | Path, kind: str) -> None:
    """Create the output folder (and parents) and mark it as fcaudit's output of ``kind``;
    a folder an earlier version wrote is recognised as it is and left unchanged."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if output_kind(path) != kind:
        write_json(path / MARKER, {"schema": MARKER_SCHEMA, "kind": kind,
                                   "fcaudit_version": __version__})


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (not removed or replaced)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _holder(fd: int) -> str:
    """Who holds a lock, from the lock file (it may be a moment before the holder writes)."""
    for _ in range(20):
        info = _parse(os.pread(fd, 4096, 0))
        if info:
            since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(info["since"]))
            return (f"fcaudit pid {info.get('pid')} on {info.get('host')} since {since} "
                    f"({info.get('command')})")
        time.sleep(0.05)
    return "another fcaudit run"


def _parse(blob: bytes) -> dict[str, Any] | None:
    try:
        data = json.loads(blob.decode("utf-8"))
    except ValueError:
        return None
    ok = isinstance(data, dict) and isinstance(data.get("since"), (int, float))
    return data if ok else None


class OutputLock:
    """``with OutputLock(folder, command):`` holds an exclusive ``flock`` on
    ``folder/.fcaudit-lock`` for the block, or stops at once naming the holder."""

    def __init__(self, folder: str | Path, command: str | None = None) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK
        self.command = command or shlex.join(sys.argv)
        self.fd = -1

    def __enter__(self) -> OutputLock:
        where = arg("out", str(self.folder))
        for _ in range(10):
            try:  # never through a link: the lock file is truncated and written
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
            except OSError as exc:
                raise CacheError(f"cannot lock {where} ({exc.strerror or exc}); check its "
                                 "permissions") from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                holder = _holder(fd)
                os.close(fd)
                raise CacheError(f"{where} is in use by {holder}; wait for it to finish or "
                                 f"choose another {arg('out')}") from exc
            except OSError as exc:  # e.g. a network file system without locks
                os.close(fd)
                raise CacheError(f"cannot lock {where} ({exc.strerror or exc}); choose a "
                                 "folder on a local disk") from exc
            if _same_file(fd, self.path):
                break
            os.close(fd)  # the previous holder removed or replaced it meanwhile: lock anew
        else:
            raise CacheError(f"could not lock {where}: its lock file keeps changing; retry")
        self.fd = fd
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                "command": self.command}
        with contextlib.suppress(OSError):  # only informs a refused run; a full disk shows later
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
        return self

    def __exit__(self, *exc: object) -> None:
        """Remove the lock file (if it is still this lock's), then unlock."""
        if _same_file(self.fd, self.path):  # not if the folder was swapped for another
            self.path.unlink(missing_ok=True)
        os.close(self.fd)


@contextlib.contextmanager
def hold_output(path: str | Path, kind: str, command: str | None = None) -> Iterator[Path]:
    """Check, create, mark and lock an output folder for the block; then release it.

    A folder this call created that holds nothing but its marker on exit (a run that
    failed or was interrupted before writing anything) is removed again, with the
    parent folders this call created.
    """
    path = Path(path)
    check_output(path, kind)
    created = topmost_missing(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CacheError(f"cannot create {arg('out', str(path))} ({exc.strerror or exc}); check "
                         "the path and its permissions") from exc
    empty = False
    try:
        with OutputLock(path, command):
            try:
                claim_output(path, kind)
                yield path
            finally:
                empty = created is not None and path.is_dir() and not entries(path)
                if empty:
                    (path / MARKER).unlink(missing_ok=True)
    finally:
        if empty and created is not None:  # after the lock file went with the lock
            remove_created(path, created)


def topmost_missing(path: Path) -> Path | None:
    """The outermost folder that creating ``path`` makes (None: ``path`` exists)."""
    missing = None
    for folder in (path, *path.parents):
        if folder.exists():
            break
        missing = folder
    return missing


def remove_created(path: Path, created: Path) -> None:
    """Remove the empty folder ``path`` and its parents up to ``created`` (the outermost one
    fcaudit made, :func:`topmost_missing`); stop at the first that holds anything, so
    nothing fcaudit did not create is ever removed."""
    with contextlib.suppress(OSError):  # not empty: another run or the user put files there
        for folder in (path, *path.parents):
            folder.rmdir()
            if folder == created:
                break


# --------------------------------------------------------------- replace and clean

def prune_empty(folder: Path, start: Path) -> None:
    """Remove ``start`` and its parents below ``folder`` while they are empty."""
    with contextlib.suppress(OSError):  # not empty: something else lives there
        while start != folder and folder in start.parents:
            start.rmdir()
            start = start.parent


def drop_owned(folder: Path, rels: Sequence[str]) -> None:
    """Delete fcaudit's own unchanged files ``rels`` (checked again now), then their
    entries and the folders they emptied; anything else stays."""
    files = recorded(folder)
    gone = [rel for rel in rels if owns(folder, rel, files)]
    for rel in gone:
        (folder / rel).unlink()
        prune_empty(folder, (folder / rel).parent)
    if gone:
        save_recorded(folder, {k: v for k, v in files.items() if k not in gone})


def remove_output(folder: Path, names: Collection[str]) -> None:
    """Remove the named files fcaudit wrote in ``folder`` (unchanged since: by recorded
    digest), its bookkeeping files, then the folder if that emptied it. Anything else in it
    stays, and so does the folder."""
    drop_owned(folder, sorted(names))
    if entries(folder):
        return
    for name in BOOKKEEPING:
        (folder / name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        folder.rmdir()


