"""The audit a user runs, for the Hugging Face sweeps: the family's model saved with
``save_pretrained`` to a folder and ``fcaudit audit`` run on it with every option at its
default (prefix schedule, per-layer runs, expert ablation where routed, execution with
timing); only the data is given, as token arrays. The sweeps' own checks (identity,
donor, experts) call fcaudit's functions directly with reduced inputs; this is the one
that runs what ``fcaudit audit --model FOLDER`` runs, so a family that crashes there
(a Nemotron-H once did, after the record stage) cannot be listed as passing.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from fcaudit import cli

ROWS = 8  # evaluation and calibration windows each: one batch at the default batch size


def audit_argv(folder: Path, out: Path, tokens: tuple[Path, Path]) -> list[str]:
    """``fcaudit audit`` of ``folder`` with no option set but the data (and --quiet, which
    changes no number)."""
    return ["audit", "--model", str(folder), "--out", str(out), "--tokens", str(tokens[0]),
            "--calib-tokens", str(tokens[1]), "--quiet"]


def default_audit(model: nn.Module, vocab: int, seq_len: int) -> dict[str, Any]:
    """The audit cell of a sweep row: ``yes`` with the execution verdict's label and how
    the prefix schedule went, or ``error: LINE`` (the one line fcaudit printed)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model.save_pretrained(root / "model")
        rng = np.random.default_rng(0)
        tokens = (root / "eval.npy", root / "calib.npy")
        for path in tokens:
            np.save(path, rng.integers(3, vocab, (ROWS, seq_len)))
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = cli.main(audit_argv(root / "model", root / "out", tokens))
        if code != 0:
            lines = [ln for ln in err.getvalue().splitlines() if ln.startswith("fcaudit:")]
            line = (lines or err.getvalue().strip().splitlines() or ["no message"])[-1]
            line = line.removeprefix("fcaudit: ").removeprefix("error: ").replace("|", "/")
            return {"audit": f"error: {line if len(line) <= 160 else line[:157] + '...'}"}
        result = json.loads((root / "out" / "audit.json").read_text(encoding="utf-8"))
    schedule = result["runtime"]["schedule"]
    return {"audit": "yes", "execution": result["verdict"]["execution_label"],
            "prefix": "fell back" if schedule["batches_fell_back_to_full_passes"] else
            "reused" if schedule["batches_prefix_reused"] else "not used"}
