"""Run folders fcaudit writes (``fcaudit train``, ``fcaudit fold``): assembled in a
temporary sibling folder and renamed into place only when complete, so an interrupted
write leaves nothing under the final name. A run folder holds ``config.json`` (fcaudit's
run marker, the architecture, its config, the weights' SHA-256), ``model.safetensors``,
``tokenizer.json`` and, for a trained run, ``train_log.jsonl``. An existing folder is
replaced only when asked, and only when it holds nothing but a run's files fcaudit
recorded writing: a folder of the user's own files is never touched.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn

from fcaudit.core.errors import UsageError, arg
from fcaudit.io.fileio import make_work_dir, sha256_file, write_json, write_text
from fcaudit.io.loading import save_run_model
from fcaudit.io.outdir import (
    RUN_FILES,
    check_output,
    claim_output,
    entries,
    owns,
    record_files,
    remove_output,
)
from fcaudit.io.runtime import versions


def check_run_out(out: Path, force: bool) -> None:
    """Refuse an ``--out`` that may not be replaced by a run; touches nothing.

    Only a run folder fcaudit wrote may be replaced, with ``--force``, and only when it
    holds nothing but a run's files: a folder of the user's own files is never touched.
    """
    check_output(out, "run")
    if not out.is_dir():
        return
    held = entries(out)
    if held and not force:
        raise UsageError(f"output folder {out} holds a run; choose another "
                         f"{arg('out')} or pass {arg('force', py='force=True')} to replace it")
    other = [p.name for p in held if p.name not in RUN_FILES]
    if other:
        raise UsageError(f"{arg('out', str(out))} is a run folder but also holds "
                         f"{', '.join(other)}, which fcaudit did not write; move them "
                         f"out or choose another {arg('out')}")
    unrecorded = [p.name for p in held if not owns(out, p.name)]
    if unrecorded:
        raise UsageError(f"{arg('out', str(out))}: fcaudit did not record writing "
                         f"{', '.join(unrecorded)} (files of yours, edited since, or a run of "
                         f"an fcaudit version without digests), so {arg('force')} will not "
                         f"replace them; move them out or choose another {arg('out')}")


@contextlib.contextmanager
def building(out: Path) -> Iterator[Path]:
    """A fresh work folder to assemble a run in, swapped in for ``out`` (held by the
    caller) when the body finished; removed, and ``out`` untouched, when it failed."""
    work = make_work_dir(out)
    try:
        claim_output(work, "run")
        yield work
        record_files(work, RUN_FILES)
        _swap_in(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # this call's own mkdtemp folder


def write_run(work: Path, model: nn.Module, log: list[dict[str, Any]] | None,
              config: dict[str, Any]) -> None:
    """The weights, ``config.json`` (``config`` plus the run marker, the weights' digest
    and the versions) and, for a trained model, its training log."""
    save_run_model(work, model.cpu())
    if log is not None:
        write_text(work / "train_log.jsonl", "".join(json.dumps(e) + "\n" for e in log))
    write_json(work / "config.json", {
        "fcaudit_run": 1, **config,
        # load_run refuses weights changed after this
        "weights_sha256": sha256_file(work / "model.safetensors"),
        "versions": versions(),
    })


def _swap_in(work: Path, out: Path) -> None:
    """Put the finished run folder ``work`` at ``out``, which only ever holds a run."""
    check_run_out(out, force=True)  # files may have been added to out while writing
    # move the old folder aside (a rename, not a delete) before the new one takes its
    # name, so no moment exists where a kill loses both
    old = work.with_name(work.name + ".old")
    out.rename(old)
    try:
        work.rename(out)
    except BaseException:
        if not out.exists():
            old.rename(out)
        raise
    remove_output(old, RUN_FILES)
