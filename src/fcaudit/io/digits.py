"""The vision families' images: scikit-learn's bundled handwritten digits, split by index.

``sklearn.datasets.load_digits`` ships 1,797 grey 8x8 images of the digits 0-9 inside
the scikit-learn package (UCI "Optical Recognition of Handwritten Digits", test part),
so nothing is downloaded. Pixels (integers 0..16) are divided by 16 into float32
``[N, 1, 8, 8]`` in [0, 1]; targets are int64 class ids ``[N]``.

The split is fixed by index in the order ``load_digits`` returns them, the same on every
machine, run and seed: images ``0..1196`` train, ``1197..1496`` calibrate (the audit's
static profiles only) and ``1497..1796`` evaluate (everything the audit measures, and
each run's reported accuracy). The three never share an image.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

import numpy as np

from fcaudit.core.errors import DataError, install_extra
from fcaudit.core.registry import refusal

if TYPE_CHECKING:
    import torch

    from fcaudit.io.data import AuditData, DataSpec

SPLITS: dict[str, range] = {"train": range(0, 1197), "calib": range(1197, 1497),
                            "eval": range(1497, 1797)}
IMAGE_SHAPE = (1, 8, 8)


@cache
def _all() -> tuple[np.ndarray, np.ndarray]:
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise DataError("the vision families read scikit-learn's bundled digits: install "
                        f"scikit-learn with {install_extra('vision')}") from exc
    bunch = load_digits()
    images = (bunch.images.astype(np.float32) / 16.0).reshape(-1, *IMAGE_SHAPE)
    return images, bunch.target.astype(np.int64)


def digits(split: str) -> tuple[np.ndarray, np.ndarray]:
    """``(images [N, 1, 8, 8] float32 in [0, 1], targets [N] int64)`` of one split
    (``train``, ``calib`` or ``eval``); copies, so a caller may edit them."""
    if split not in SPLITS:
        raise refusal(f"unknown digits split {split!r}", split, list(SPLITS), option="split")
    images, targets = _all()
    rows = SPLITS[split]
    return images[rows.start:rows.stop].copy(), targets[rows.start:rows.stop].copy()


def split_record() -> dict[str, object]:
    """What a run's ``config.json`` says about its data."""
    return {"source": "sklearn.datasets.load_digits", "pixels": "x / 16, float32 [N, 1, 8, 8]",
            **{f"{name}_indices": [r.start, r.stop - 1] for name, r in SPLITS.items()}}


def audit_data(max_eval: int | None, max_calib: int | None,
               dtype: torch.dtype | None = None) -> AuditData:
    """The evaluation and calibration splits (their first ``max_*`` images) to audit on,
    in ``dtype`` when given (a run loaded in bfloat16: the pixels k/16 are exact in it)."""
    import torch

    from fcaudit.io.data import AuditData
    x, y = digits("eval")
    xc, _ = digits("calib")
    if dtype is not None:
        x, xc = (torch.from_numpy(a).to(dtype) for a in (x, xc))
    x, y, xc = x[:max_eval], y[:max_eval], xc[:max_calib]
    return AuditData(inputs=x, targets=y, calib_inputs=xc, sources={
        **split_record(), "eval_images": len(x), "calib_images": len(xc)})


def run_audit_data(spec: DataSpec | None, run: str,
                   dtype: torch.dtype | None = None) -> AuditData:
    """The data a vision run folder is audited on when none is given: its own digits
    splits (``max_eval`` / ``max_calib`` of ``spec``, in the model's ``dtype``); text or
    token options are refused, since they would be ignored."""
    from fcaudit.io.data import DataSpec
    spec = spec or DataSpec()
    spec.own_data_only(run, "vision", "the digits'", "images")
    return audit_data(spec.max_eval, spec.max_calib, dtype)
