"""The Mamba paper's selective-copying task (arXiv 2312.00752, section 3.1), scaled to a CPU.

A sequence of ``length`` token ids: its first ``length - copies`` positions hold
``copies`` data tokens at random positions among noise tokens, its last ``copies``
positions hold the marker token. The targets are the data tokens in order, one predicted
at each marker position. Where the data tokens sit changes from sequence to sequence,
so a recurrence must decide per token what to keep: a time-invariant one (S4, an LTI
profile) cannot, a selective one (S6) can.

Vocabulary: id 0 is the marker, ids ``1..noise`` the noise alphabet, the next ``data``
ids the data alphabet; noise never equals a data token. Generation is numpy only and
seeded: the calibration and evaluation sets come from fixed seeds of their own, the same
for every run, and training batches from the run's seed with every calibration and
evaluation sequence left out, so the three never share a sequence (the audit checks the
first two again, as it does for every data set).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fcaudit.core.errors import DataError
from fcaudit.core.registry import refusal

if TYPE_CHECKING:
    from fcaudit.io.data import AuditData, DataSpec

MARKER = 0
SEEDS = {"calib": 1_000_003, "eval": 1_000_033}  # the audit sets' own generators
BLOCK = 256  # sequences drawn per generator call: any count's first rows are the same
DEFAULT_EXAMPLES = 256  # per audit set, unless max_eval / max_calib say otherwise
POOL = 4096  # sequences each audit set holds at most; training never sees any of them
# distinct sequences a task must have, so that leaving both audit sets out of training
# rejects at most one draw in 64 (and the sets can always be filled)
LEAST_SEQUENCES = 64 * 2 * POOL


@dataclass(frozen=True)
class CopyTask:
    """One selective-copying setup: sequence length, tokens to copy, alphabet sizes."""

    length: int = 64
    copies: int = 8
    data: int = 8
    noise: int = 1

    def __post_init__(self) -> None:
        for name in ("length", "copies", "data", "noise"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DataError(f"selective copying: {name}={value!r} must be an integer of "
                                "at least 1")
        if 2 * self.copies > self.length:
            raise DataError(f"selective copying: length={self.length} leaves no room for "
                            f"copies={self.copies} data tokens and as many markers; give a "
                            f"length of at least {2 * self.copies}")
        if self.sequences < LEAST_SEQUENCES:
            raise DataError(f"selective copying: {self} has {self.sequences} distinct "
                            f"sequences, fewer than {LEAST_SEQUENCES}, too few to keep the "
                            "audit sets and training apart; give a longer length or more "
                            "data tokens")

    @property
    def sequences(self) -> int:
        """How many distinct sequences the task has."""
        return math.comb(self.body, self.copies) * self.data ** self.copies \
            * self.noise ** (self.body - self.copies)

    @property
    def vocab_size(self) -> int:
        return 1 + self.noise + self.data

    @property
    def body(self) -> int:
        """Positions before the markers (data tokens among noise)."""
        return self.length - self.copies

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``n`` sequences ``[n, length]`` int64 and their targets ``[n, copies]`` int64."""
        where = np.sort(rng.random((n, self.body)).argsort(axis=1)[:, :self.copies], axis=1)
        targets = rng.integers(1 + self.noise, self.vocab_size, size=(n, self.copies))
        body = rng.integers(1, 1 + self.noise, size=(n, self.body))
        np.put_along_axis(body, where, targets, axis=1)
        inputs = np.concatenate([body, np.full((n, self.copies), MARKER)], axis=1)
        return inputs.astype(np.int64), targets.astype(np.int64)

    def record(self) -> dict[str, Any]:
        """What a run's ``config.json`` says about its data (read back by :func:`from_record`)."""
        return {"source": "selective copying (arXiv 2312.00752, section 3.1)",
                **dataclasses.asdict(self), "vocab_size": self.vocab_size,
                "marker": MARKER, "seeds": dict(SEEDS)}


PRESETS: dict[str, CopyTask] = {"tiny": CopyTask()}


def preset(name: str) -> CopyTask:
    if name not in PRESETS:
        raise refusal(f"unknown preset {name!r} for selective copying", name, list(PRESETS),
                      option="preset")
    return PRESETS[name]


def from_record(record: Any, run: str) -> CopyTask:
    """The task a run trained on, from its ``config.json``; a damaged record in one line."""
    fields = [f.name for f in dataclasses.fields(CopyTask)]
    if not isinstance(record, dict) or not all(name in record for name in fields):
        raise DataError(f"{run}/config.json: its data record lacks the selective-copying "
                        f"settings {', '.join(fields)}; retrain the run", path=run)
    return CopyTask(**{name: record[name] for name in fields})


def keys(inputs: np.ndarray) -> set[bytes]:
    """One key per sequence, to leave sequences of one set out of another."""
    return {row.tobytes() for row in np.ascontiguousarray(inputs, dtype=np.int64)}


def draw(task: CopyTask, rng: np.random.Generator, n: int,
         exclude: set[bytes] | frozenset[bytes] = frozenset(),
         block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """``n`` sequences and targets from ``rng``, drawn ``block`` at a time (so the first
    rows do not depend on ``n``), any sequence in ``exclude`` left out."""
    xs, ys, held = [], [], 0
    while held < n:
        x, y = task.sample(rng, block)
        keep = np.array([row.tobytes() not in exclude for row in x], dtype=bool)
        xs.append(x[keep])
        ys.append(y[keep])
        held += int(keep.sum())
    return np.concatenate(xs)[:n], np.concatenate(ys)[:n]


def audit_sets(task: CopyTask, n_eval: int, n_calib: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The evaluation (inputs, targets) and calibration (inputs, targets) sets: each from
    its own seed, no evaluation sequence in the calibration set."""
    calib_x, calib_y = draw(task, np.random.default_rng(SEEDS["calib"]), n_calib)
    eval_x, eval_y = draw(task, np.random.default_rng(SEEDS["eval"]), n_eval, keys(calib_x))
    return eval_x, eval_y, calib_x, calib_y


def held_out(task: CopyTask) -> set[bytes]:
    """Every sequence training must not see: all that either audit set can hold."""
    eval_x, _, calib_x, _ = audit_sets(task, POOL, POOL)
    return keys(eval_x) | keys(calib_x)


def run_audit_data(spec: DataSpec | None, run: str, record: Any,
                   tokens: bool = False) -> AuditData:
    """The data a selective-copying run folder is audited on: its task's evaluation and
    calibration sets (``max_eval`` / ``max_calib`` of ``spec``, default
    :data:`DEFAULT_EXAMPLES` each, at most :data:`POOL`); text or token options are
    refused, since they would be ignored. ``tokens``: the same sequences as token windows
    (an objective that scores token ids, asked for explicitly), without the answers."""
    from fcaudit.io.data import AuditData, DataSpec
    spec = spec or DataSpec()
    spec.own_data_only(run, "selective-copying", "its task's", "sequences")
    task = from_record(record, run)
    n_eval, n_calib = (min(n or DEFAULT_EXAMPLES, POOL) for n in (spec.max_eval,
                                                                     spec.max_calib))
    eval_x, eval_y, calib_x, calib_y = audit_sets(task, n_eval, n_calib)
    if tokens:
        return AuditData(eval_x, calib_x, {**task.record(), "seq_len_source": WINDOW})
    return AuditData(inputs=eval_x, targets=eval_y, calib_inputs=calib_x,
                     calib_targets=calib_y, sources={**task.record(), "eval_examples": n_eval,
                                                     "calib_examples": n_calib})


WINDOW = "the selective-copying task's sequence length"
