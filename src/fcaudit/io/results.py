"""Results replaced as a whole, written through an explicit writer.

A command that writes an output folder's results (an audit, a comparison, a study) is
handed a :class:`ResultWriter` by :func:`replacing_results`: every result file goes
through it, so its digest is in the folder's marker before it takes its name, and a file
fcaudit did not write is never replaced. The previous results wait in ``.previous/``
until the new completion file is in place (:mod:`fcaudit.io.outdir` owns the marker, the
lock and the cleaning).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path, PurePosixPath

from fcaudit.core.errors import CacheError
from fcaudit.io.fileio import FileWriter, sha256_file
from fcaudit.io.outdir import (
    AUDIT_RESULTS,
    PREVIOUS,
    drop_owned,
    owned_under,
    owns,
    prune_empty,
    recorded,
    save_recorded,
)


class ResultWriter(FileWriter):
    """Writes the results ``results`` of the folder ``out``: a file fcaudit did not write
    (or one edited since) in the way of a result is refused; every result written has its
    digest recorded in the marker before it takes its name."""

    def __init__(self, out: Path, results: tuple[str, ...]) -> None:
        self.out, self.results = out, results

    def _result(self, final: Path) -> str | None:
        """``final``'s path in the folder when it is one of the results, else None."""
        try:
            rel = Path(os.path.abspath(final)).relative_to(self.out)
        except ValueError:
            return None
        return rel.as_posix() if rel.parts and rel.parts[0] in self.results else None

    def check(self, tmp: Path, final: Path) -> None:
        key = self._result(final)
        if key is None:
            return
        files = recorded(self.out)
        if (final.exists() or final.is_symlink()) and not owns(self.out, key, files):
            raise CacheError(f"{final} is in the way of a result: fcaudit did not write it "
                             "(or it was changed since); move it away and rerun (the cache "
                             "is kept, the previous results are put back)")
        save_recorded(self.out, {**files, key: sha256_file(tmp)})


def _move(folder: Path, moves: Sequence[tuple[str, str]]) -> None:
    """Rename fcaudit's files inside ``folder``; the marker lists both names meanwhile, so a
    kill at any moment leaves every file recognisable."""
    files = recorded(folder)
    moves = [(src, dst) for src, dst in moves if owns(folder, src, files)]
    if not moves:
        return
    save_recorded(folder, {**files, **{dst: files[src] for src, dst in moves}})
    for src, dst in moves:
        (folder / dst).parent.mkdir(parents=True, exist_ok=True)
        os.replace(folder / src, folder / dst)
        prune_empty(folder, (folder / src).parent)
    sources = {src for src, _ in moves}
    save_recorded(folder, {k: v for k, v in recorded(folder).items() if k not in sources})


def _retired(folder: Path) -> list[str]:
    """fcaudit's unchanged files in ``.previous/``."""
    return owned_under(folder, [PREVIOUS], recorded(folder))


def retire_results(out: str | Path, results: Sequence[str] = AUDIT_RESULTS) -> None:
    """Move the previous results (fcaudit's own unchanged files only) into
    ``out/.previous/``, before new ones are written.

    ``results[0]`` is the completion file (``audit.json``): it moves first, so from
    then on no result in ``out`` claims to be whole. A ``.previous/`` left by a killed
    run is sorted out first: stale if the completion file is back in ``out`` (that run
    finished), else it holds the last finished results, which stay while the
    half-written ones in ``out`` are dropped. Files of the user's are never moved.
    """
    out = Path(out)
    files = recorded(out)
    if _retired(out):
        if owns(out, results[0], files):
            drop_owned(out, _retired(out))
        else:
            drop_owned(out, owned_under(out, results, files))
            return
    held = owned_under(out, results, files)
    held.sort(key=lambda rel: rel != results[0])
    _move(out, [(rel, f"{PREVIOUS}/{rel}") for rel in held])


def restore_retired_results(out: str | Path, results: Sequence[str] = AUDIT_RESULTS) -> None:
    """Drop half-written new results and put the retired ones back (completion file last)."""
    out = Path(out)
    retired = _retired(out)
    if not retired:
        return
    drop_owned(out, owned_under(out, results, recorded(out)))
    back = [(rel, rel.removeprefix(PREVIOUS + "/")) for rel in retired]
    back.sort(key=lambda move: PurePosixPath(move[1]).parts[0] == results[0])
    _move(out, back)
    prune_empty(out, out / PREVIOUS)


@contextlib.contextmanager
def replacing_results(out: str | Path,
                      results: Sequence[str] = AUDIT_RESULTS) -> Iterator[ResultWriter]:
    """Replace a folder's results as a whole: never a mix of old and new files.

    The block writes the new results (``audit.json``, ``report.md``, ``report.html``,
    ``figures/``; ``results`` names them, the completion file first), the completion
    file last, through the :class:`ResultWriter` it is given: each file's digest is
    recorded in the marker before it takes its name, and a file in its way that fcaudit
    did not write stops the block. The previous results wait in ``.previous/``
    meanwhile: removed on success, put back if the block raises. After a ``kill -9`` the
    next call keeps the last finished results and drops the half-written ones.
    """
    out = Path(os.path.abspath(out))
    retire_results(out, results)
    try:
        yield ResultWriter(out, tuple(results))
    except BaseException:
        restore_retired_results(out, results)
        raise
    drop_owned(out, _retired(out))  # the new completion file is in place
    prune_empty(out, out / PREVIOUS)
