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
import sys
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
    the prefix schedule went, or ``error: LINE`` (the one line fcaudit printed). A model
    transformers' own ``save_pretrained`` cannot save (a shrunk config its weight
    conversion does not fit) is audited in memory, with the same defaults, and
    ``folder`` says why."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rng = np.random.default_rng(0)
        tokens = (root / "eval.npy", root / "calib.npy")
        for path in tokens:
            np.save(path, rng.integers(3, vocab, (ROWS, seq_len)))
        folder = _saved(model, root / "model")
        argv = audit_argv(root / "model" if folder == "saved" else root / "none",
                          root / "out", tokens)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = cli.main(argv) if folder == "saved" else _in_memory(model, argv)
        if code != 0:
            lines = [ln for ln in err.getvalue().splitlines() if ln.startswith("fcaudit:")]
            line = (lines or err.getvalue().strip().splitlines() or ["no message"])[-1]
            line = line.removeprefix("fcaudit: ").removeprefix("error: ").replace("|", "/")
            return {"audit": f"error: {line if len(line) <= 160 else line[:157] + '...'}"}
        result = json.loads((root / "out" / "audit.json").read_text(encoding="utf-8"))
    schedule = result["runtime"]["schedule"]
    return {"audit": "yes", "execution": result["verdict"]["execution_label"],
            "prefix": "fell back" if schedule["batches_fell_back_to_full_passes"] else
            "reused" if schedule["batches_prefix_reused"] else "not used", "folder": folder}


def _saved(model: nn.Module, folder: Path) -> str:
    """``saved``, or why transformers could not save the model (not fcaudit's doing)."""
    try:
        model.save_pretrained(folder)
    except Exception as err:  # noqa: BLE001 - transformers' own failure, said in the row
        text = f"{type(err).__name__}: {err}".splitlines()[0][:120]
        return f"in memory (transformers' save_pretrained fails: {text})"
    return "saved"


def _in_memory(model: nn.Module, argv: list[str]) -> int:
    """The audit of ``argv``'s options and data on ``model`` itself, as the command line
    runs it (its errors as one line, exit 2)."""
    from fcaudit.api import audit
    from fcaudit.cli.parser import audit_options, build_parser
    from fcaudit.core.errors import FcauditError
    from fcaudit.io.data import AuditData
    args = build_parser().parse_args(argv)
    data = AuditData(np.load(args.tokens), np.load(args.calib_tokens), {"source": "tokens"})
    try:
        audit(model, args.out, data=data, options=audit_options(args))
    except FcauditError as exc:
        print(f"fcaudit: error: {exc.for_cli()}", file=sys.stderr)
        return 2
    return 0
