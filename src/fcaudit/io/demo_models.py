"""The demo's two tiny models, shipped inside the package and pinned by SHA-256.

Training rounds as a CPU's kernels and its thread count do, so a demo that trained its
models gave other numbers on every other machine. ``fcaudit demo`` audits these files
instead, and the README quotes what they give. Every file is checked against the digests
of :mod:`fcaudit.io.demo_pins` before use: an altered or corrupted file is refused in one
line. ``python -m fcaudit.study.demo`` retrains them and rewrites the pins.
"""

from __future__ import annotations

from pathlib import Path

from fcaudit.core.errors import ModelError
from fcaudit.io.demo_pins import PINNED
from fcaudit.io.fileio import sha256_file

DEMO_ARCHES = ("featuregate", "dense")
SHIPPED = Path(__file__).resolve().parent.parent / "demo_models"


def shipped_folder(arch: str) -> Path:
    """The package's folder of the demo model ``arch``, checked against its pins."""
    folder = SHIPPED / arch
    mismatch = pin_mismatch(folder, arch)
    if mismatch:
        raise ModelError(f"{mismatch}: fcaudit's shipped demo model was altered or corrupted; "
                         "reinstall fcaudit, or run `fcaudit demo --train` to train the demo's "
                         "models afresh")
    return folder


def pin_mismatch(folder: Path, arch: str) -> str | None:
    """The first file of ``folder`` that differs from the shipped ``arch`` model's pinned
    digest (or is missing), said in words; None when every pinned file matches."""
    for name, digest in PINNED[arch].items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        found = sha256_file(path)
        if found != digest:
            return f"{path} has SHA-256 {found[:12]}..., not the pinned {digest[:12]}..."
    return None
