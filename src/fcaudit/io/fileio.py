"""Atomic file output: write to a temporary name in the same folder, then rename.

A crash, a kill or a full disk therefore never leaves a partial JSON, report or
tensor file behind under its final name. Files are read as guardedly: only regular
files, at most a bound of bytes, JSON no deeper and no larger in its numbers than
fcaudit's own (:func:`read_json`), each refusal one line naming the file.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from fcaudit.core.errors import DataError, FcauditError

# check(temporary, final), called just before a file takes its final name: a results
# writer (fcaudit.io.results.ResultWriter) refuses a file in the way and records digests
RenameCheck = Callable[[Path, Path], None]


@contextlib.contextmanager
def atomic_path(path: str | Path, check: RenameCheck | None = None) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success (and ``check``) rename it onto
    ``path``."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:  # a read-only folder, a full disk, a file in the way
        raise FcauditError(f"could not write {path}: {exc.strerror or exc}; check free disk "
                           "space and permissions") from exc
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp makes 0600; outputs are for sharing
        _fsync(tmp_path)  # a full disk can surface only here; never rename unflushed data
        if check is not None:
            check(tmp_path, path)
        os.replace(tmp_path, path)
    except OSError as exc:
        tmp_path.unlink(missing_ok=True)
        raise FcauditError(f"could not write {path}: {exc.strerror or exc}; "
                           "check free disk space and permissions") from exc
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


# mkstemp's names in atomic_path: "." + final name + "." + 8 random characters + ".tmp"
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.[a-z0-9_]{8}\.tmp")


def temporary_target(path: Path) -> str | None:
    """The final file name a temporary file of :func:`atomic_path` was for, else None:
    cleanup removes only files that fcaudit itself named."""
    match = _TEMPORARY.fullmatch(path.name)
    return match["name"] if match else None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def make_work_dir(target: Path) -> Path:
    """A hidden sibling folder of ``target`` to assemble it in, then rename into place.

    ``mkdtemp`` makes it 0700; it gets the usual permissions so the result is shareable.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    os.chmod(work, 0o777 & ~_umask())
    return work


class FileWriter:
    """Writes files atomically; :meth:`check` runs just before each takes its name (here:
    nothing; a folder's results writer, :class:`fcaudit.io.results.ResultWriter`, checks
    and records them). Whoever writes results is handed the writer to use."""

    def check(self, tmp: Path, final: Path) -> None:
        """Called as ``check(temporary, final)`` before ``final`` is replaced."""

    def write_text(self, path: str | Path, text: str) -> None:
        with atomic_path(path, self.check) as tmp:
            tmp.write_text(text, encoding="utf-8")

    def write_bytes(self, path: str | Path, data: bytes) -> None:
        with atomic_path(path, self.check) as tmp:
            tmp.write_bytes(data)

    def write_json(self, path: str | Path, obj: Any) -> None:
        """Deterministic JSON (sorted keys, fixed indent) written atomically."""
        self.write_text(path, json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n")


PLAIN_FILES = FileWriter()  # files that are no folder's results: a cache, a run, a marker


def write_text(path: str | Path, text: str) -> None:
    PLAIN_FILES.write_text(path, text)


def write_bytes(path: str | Path, data: bytes) -> None:
    PLAIN_FILES.write_bytes(path, data)


def write_json(path: str | Path, obj: Any) -> None:
    """Deterministic JSON (sorted keys, fixed indent) written atomically."""
    PLAIN_FILES.write_json(path, obj)


def write_safetensors(path: str | Path, tensors: dict[str, Any]) -> None:
    """Save tensors with safetensors, atomically; its I/O errors (a full disk) become
    one-line :class:`FcauditError` like every other write."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        try:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
        except SafetensorError as exc:  # the Rust writer reports ENOSPC etc. this way
            raise OSError(errno.EIO, str(exc)) from exc


def sha256_file(path: str | Path) -> str:
    """SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


MAX_JSON_BYTES = 256 << 20  # far above any JSON fcaudit writes or reads: a bound, not a size
MAX_JSON_DEPTH = 100  # nesting levels: fcaudit's own files nest fewer than 10


_FLOAT_DIGITS = len(str(int(sys.float_info.max)))  # 309


class _Unreadable(ValueError):
    """A JSON text refused while it is parsed: a number no float can hold."""


def _bounded_int(text: str) -> int:
    """A JSON integer, refused beyond the float range (every number fcaudit reads may become
    a float; ``int`` of a long digit string is itself slow)."""
    if len(text.lstrip("-")) > _FLOAT_DIGITS or \
            abs(value := int(text)) > sys.float_info.max:
        raise _Unreadable(f"holds an integer of {len(text.lstrip('-'))} digits, beyond the "
                          "range of a float")
    return value


def _bounded_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _Unreadable(f"holds the number {text[:20]}, beyond the range of a float")
    return value


def _depth(value: Any) -> int:
    """How deeply arrays and objects nest in a parsed JSON value (iteratively)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        node, level = todo.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, level)
            todo.extend((v, level + 1) for v in (node.values() if isinstance(node, dict)
                                                 else node))
    return deepest


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"))
    return next((words for test, words in kinds if test(mode)), "not a regular file")


def read_bounded(path: str | Path, what: str, limit: int) -> bytes:
    """A regular file's bytes, or a one-line error naming ``what`` the file is: a FIFO, a
    device or a socket is refused before it is opened (reading one can block for ever, or
    never end: ``/dev/zero``), and a file above ``limit`` bytes before it is read (only
    ``limit + 1`` bytes are ever read, should it grow meanwhile)."""
    path = Path(path)
    too_large = DataError(f"{what} {path} holds more than {limit} bytes, more than any {what} "
                          "fcaudit reads; check the path", path=str(path))
    try:
        status = path.stat()
        if not stat.S_ISREG(status.st_mode):
            raise DataError(f"{what} {path} is {_file_kind(status.st_mode)}, not a file; give "
                            "the path of the file itself", path=str(path))
        if status.st_size > limit:
            raise too_large
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):  # swapped meanwhile
                raise DataError(f"{what} {path} is not a file; give the path of the file "
                                "itself", path=str(path))
            data = fh.read(limit + 1)
    except FileNotFoundError as exc:
        raise DataError(f"{what} not found: {path}; check the path", path=str(path)) from exc
    except OSError as exc:  # no permission, I/O error
        raise DataError(f"cannot read {what} {path} ({exc.strerror or exc}); check that it "
                        "is a readable file", path=str(path)) from exc
    if len(data) > limit:  # it grew since
        raise too_large
    return data


def read_json(path: str | Path, what: str) -> Any:
    """Read JSON or raise a one-line error naming ``what`` the file is: besides a missing,
    unreadable or malformed file, one that is not a regular file or too large
    (:func:`read_bounded`), nests deeper than :data:`MAX_JSON_DEPTH` or holds a number
    beyond the float range (a raw RecursionError or OverflowError, never)."""
    path = Path(path)
    text = read_bounded(path, what, MAX_JSON_BYTES)
    redo = "restore or regenerate the file"
    deep = DataError(f"{what} {path} nests arrays or objects more than {MAX_JSON_DEPTH} levels "
                     f"deep, which no file fcaudit reads does; {redo}", path=str(path))
    try:
        value = json.loads(text.decode("utf-8"), parse_int=_bounded_int,
                           parse_float=_bounded_float)
    except _Unreadable as exc:
        raise DataError(f"{what} {path} {exc}; {redo}", path=str(path)) from exc
    except RecursionError as exc:  # deeper than the parser's stack
        raise deep from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{what} {path} is not valid JSON ({exc}); {redo}",
                        path=str(path)) from exc
    if _depth(value) > MAX_JSON_DEPTH:
        raise deep
    return value


def read_npy(path: str | Path, what: str, expected: str, unit: str) -> Any:
    """One ``.npy`` array, read without pickle. A missing file, a ``.npz`` archive or a
    pickle under a ``.npy`` name, an unreadable or truncated file and an object array
    are each refused in one line that says to save ``expected`` (``unit``: what its
    entries are). The header is read first, so only an object array is ever called one
    that "needs pickle"."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{what} file not found: {path}; check the path", path=str(path))
    with open(path, "rb") as fh:
        magic = fh.read(6)
    if magic != b"\x93NUMPY":  # refuses archives and pickles before np.load sees them
        kind = "a .npz archive" if magic.startswith(b"PK") else "not a .npy file"
        raise DataError(f"{what} {path} is {kind}; save {expected} with np.save", path=str(path))
    if _check_npy_size(path, what, unit).hasobject:
        raise DataError(f"{what} {path} needs pickle to load (object or ragged array); "
                        f"save {expected} with np.save", path=str(path))
    try:
        return np.load(path, allow_pickle=False)
    except Exception as exc:  # the header promised what the file holds: numpy's own limits
        raise DataError(f"{what} {path} is not a readable .npy file ({exc}); save it again "
                        "with np.save", path=str(path)) from exc


_NPY_HEADERS = {1: np.lib.format.read_array_header_1_0, 2: np.lib.format.read_array_header_2_0,
                3: np.lib.format.read_array_header_2_0}  # 3.0 differs in its encoding only


def _check_npy_size(path: Path, what: str, unit: str) -> np.dtype:
    """The dtype a ``.npy`` header declares, after comparing the data size it promises
    (in Python integers: a product of huge axes must not wrap) with the file's, so a
    truncated file is called truncated (``np.load`` says only that it cannot reshape)."""
    with open(path, "rb") as fh:
        try:
            major, _ = np.lib.format.read_magic(fh)
            if major not in _NPY_HEADERS:
                raise ValueError(f"format version {major} is not one numpy writes")
            shape, _, dtype = _NPY_HEADERS[major](fh, max_header_size=1 << 20)
        except Exception as exc:  # numpy's header parser raises many kinds
            raise DataError(f"{what} {path} has an unreadable .npy header ({exc}); it may "
                            "be truncated: save it again with np.save", path=str(path)) from exc
        start = fh.tell()
    if any(n < 0 for n in shape):
        raise DataError(f"{what} {path} has an invalid .npy header (shape {list(shape)}); "
                        "save it again with np.save", path=str(path))
    promised = math.prod(shape) * dtype.itemsize
    held = path.stat().st_size - start
    if not dtype.hasobject and held < promised:
        raise DataError(f"{what} {path} is truncated: its header promises {promised} bytes "
                        f"of {list(shape)} {dtype} {unit}, the file holds {held}; save it "
                        "again with np.save", path=str(path))
    return dtype
