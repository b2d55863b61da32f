"""The demo's models: the shipped pair copied into the demo folder, or trained afresh.

``fcaudit demo`` audits the tiny FeatureGate and its Dense twin shipped in
``fcaudit/demo_models/`` (pinned by SHA-256 in :mod:`fcaudit.io.demo_pins`), so its
numbers are the README's on any machine; ``fcaudit demo --train`` trains the pair as the
shipped one was trained, which on another CPU or thread count gives a slightly different
model. One demo folder holds one kind: the shipped copies or trained runs, never a mix.

Retrain the shipped pair (then regenerate the README's demo numbers, see
docs/results/README.md)::

    python -m fcaudit.study.demo
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from fcaudit.core.errors import UsageError
from fcaudit.io.demo_models import DEMO_ARCHES, SHIPPED, pin_mismatch, shipped_folder
from fcaudit.io.fileio import sha256_file, write_text
from fcaudit.io.loading import is_run_folder
from fcaudit.io.outdir import RUN_FILES, hold_output, owns
from fcaudit.io.runs import building
from fcaudit.study.train import train

SEED = 0  # the shipped models' training seed
# one thread: the same bytes again on the same CPU model, and the fastest count on a
# machine shared with other jobs
TRAIN_THREADS = 1
PINS = Path(__file__).resolve().parent.parent / "io" / "demo_pins.py"


def demo_runs(out: Path, *, train_afresh: bool, seed: int, progress: bool) -> dict[str, Path]:
    """``out/featuregate`` and ``out/dense``: reused when the folder already holds the
    kind this call asks for, else copied from the package or trained (``train_afresh``)."""
    runs = {}
    for arch in DEMO_ARCHES:
        folder = out / arch
        if is_run_folder(folder):
            check_kind(folder, arch, train_afresh)
            print(f"reusing {folder}")
        elif train_afresh:
            train(arch, "tiny", seed, folder, force=True, progress=progress)
        else:
            copy_shipped(arch, folder)
        runs[arch] = folder
    return runs


def check_kind(folder: Path, arch: str, train_afresh: bool) -> None:
    """Refuse a run whose files changed since fcaudit wrote them, trained runs audited as
    the shipped demo, or the shipped copies as a fresh training: each would print numbers
    the command does not promise."""
    changed = sorted(name for name in RUN_FILES if not owns(folder, name))
    if changed:
        raise UsageError(f"{folder}: {', '.join(changed)} changed since fcaudit wrote "
                         f"{'them' if len(changed) > 1 else 'it'}; remove {folder} to copy or "
                         "train that model again, or choose another --out")
    mismatch = pin_mismatch(folder, arch)
    if train_afresh and mismatch is None:
        raise UsageError(f"{folder} holds fcaudit's shipped demo model, and --train trains "
                         "afresh: choose another --out, or drop --train to audit the shipped "
                         "models")
    if not train_afresh and mismatch is not None:
        raise UsageError(f"{folder} is not fcaudit's shipped demo model ({mismatch}) but a "
                         "run of `fcaudit demo --train`: pass --train to resume that demo, or "
                         "choose another --out")


def copy_shipped(arch: str, folder: Path) -> None:
    """The shipped ``arch`` model, checked against its pins, as a run folder at ``folder``."""
    source = shipped_folder(arch)
    with hold_output(folder, "run"), building(folder) as work:
        for name in sorted(RUN_FILES):
            shutil.copyfile(source / name, work / name)
    mismatch = pin_mismatch(folder, arch)  # what was read is what the pins promise
    if mismatch:
        raise UsageError(f"{mismatch}: the shipped demo model changed while it was copied; "
                         "rerun the command")


def retrain(progress: bool = True) -> dict[str, dict[str, str]]:
    """Train the demo pair at :data:`TRAIN_THREADS` thread, put their run files in the
    package (:data:`~fcaudit.io.demo_models.SHIPPED`) and rewrite :data:`PINS`."""
    before = torch.get_num_threads()
    torch.set_num_threads(TRAIN_THREADS)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for arch in DEMO_ARCHES:
                run = train(arch, "tiny", SEED, Path(tmp) / arch, progress=progress,
                            device="cpu")
                (SHIPPED / arch).mkdir(parents=True, exist_ok=True)
                for name in sorted(RUN_FILES):
                    shutil.copyfile(run / name, SHIPPED / arch / name)
    finally:
        torch.set_num_threads(before)
    pins = {arch: {name: sha256_file(SHIPPED / arch / name) for name in sorted(RUN_FILES)}
            for arch in DEMO_ARCHES}
    write_text(PINS, pins_module(pins))
    return pins


def pins_module(pins: dict[str, dict[str, str]]) -> str:
    """The source of :mod:`fcaudit.io.demo_pins` for ``pins``."""
    rows = "".join(f"    {arch!r}: {{\n" + "".join(f"        {name!r}:\n            {digest!r},\n"
                                                 for name, digest in files.items()) + "    },\n"
                   for arch, files in pins.items())
    return ('"""SHA-256 of every file of the demo\'s shipped models (fcaudit/demo_models/).\n\n'
            "Written by ``python -m fcaudit.study.demo`` with the files; checked by\n"
            ":mod:`fcaudit.io.demo_models` before every use. Do not edit by hand.\n"
            '"""\n\nPINNED: dict[str, dict[str, str]] = {\n' + rows + "}\n")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    args = parser.parse_args(argv)
    for arch, files in retrain(progress=not args.quiet).items():
        print(arch, ", ".join(f"{name} {digest[:12]}" for name, digest in files.items()))
    print(f"wrote {SHIPPED} and {PINS}")


if __name__ == "__main__":
    main()
