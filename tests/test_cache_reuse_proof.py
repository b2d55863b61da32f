"""Reuse is proven by recomputation, never by a fingerprint: a rerun into the same ``--out``
recomputes every cached record batch's original pass and uses the cache only where it is
bitwise equal. Each case below changes state that no fingerprint of code and weights sees
(an environment variable, a file read in ``forward``, a setting a factory stored in a list,
a module imported inside ``forward``, an objective reading the environment), and confines
the change to data outside the first batch, which the old probe alone rechecked."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import toys
import vision_toys as vt
from conftest import FAST_ARGS, run_inprocess

import fcaudit
from fcaudit import AuditData, AuditOptions
from fcaudit.core.errors import FcauditError

MARK = toys.V - 1  # first token of the rows whose gates the knob scales

KNOBBED = '''
import os
import pathlib

import torch
import toys

MARK = {mark}
HERE = pathlib.Path(__file__).parent


def knob(source, setting):
    if source == "env":
        return float(os.environ.get("FCAUDIT_TEST_KNOB", "1"))
    if source == "file":  # read on every call
        return float((HERE / "knob.txt").read_text())
    if source == "list":  # read once, by the factory, into a list attribute
        return setting[0]
    import knobvalue  # a module imported inside forward
    return knobvalue.VALUE


class KnobGate(toys.ToyGate):
    def __init__(self, layer, source, setting):
        super().__init__("content", layer)
        self.source, self.setting = source, setting

    def forward(self, ids):
        g = super().forward(ids)
        marked = (ids[:, 0] == MARK).view(-1, 1, 1)
        return torch.where(marked, g * knob(self.source, self.setting), g)


def build():
    model = toys.ToyModel("content")
    source = os.environ["FCAUDIT_TEST_SOURCE"]
    setting = [float((HERE / "knob.txt").read_text())] if source == "list" else []
    model.gates = torch.nn.ModuleList(KnobGate(i, source, setting) for i in range(2))
    return model
'''


def _set_knob(root: Path, source: str, value: float, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FCAUDIT_TEST_KNOB", str(value))
    (root / "knob.txt").write_text(str(value))
    (root / "knobvalue.py").write_text(f"VALUE = {value}\n")
    for name in ("knobbed", "knobvalue"):
        sys.modules.pop(name, None)  # a new process would import them afresh


def _data(root: Path, marked: str) -> list[str]:
    """8 evaluation and 8 calibration sequences (batches of 4); the rows of batch 1 of
    ``marked`` data start with MARK, no other row does."""
    arrays = {}
    for name, seed in (("evaluation", 1), ("calibration", 2)):
        ids = toys.pair_sequences(8, 16, seed)
        ids[:, 0] = np.where(ids[:, 0] == MARK, 0, ids[:, 0])
        if name == marked:
            ids[4:, 0] = MARK
        arrays[name] = ids
        np.save(root / f"{name}.npy", ids)
    assert (arrays["evaluation"][:4, 0] != MARK).all()  # batch 0 never sees the knob
    return ["--tokens", str(root / "evaluation.npy"), "--calib-tokens",
            str(root / "calibration.npy")]


def _without_runtime(path: Path) -> dict:
    return {k: v for k, v in json.loads(path.read_text()).items() if k != "runtime"}


@pytest.mark.parametrize("marked", ["evaluation", "calibration"])
@pytest.mark.parametrize("source", ["env", "file", "list", "import"])
def test_state_read_outside_the_code_never_reuses_a_stale_batch(
        source: str, marked: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("FCAUDIT_TEST_SOURCE", source)
    (tmp_path / "knobbed.py").write_text(KNOBBED.format(mark=MARK))
    _set_knob(tmp_path, source, 1.0, monkeypatch)
    argv = ["audit", "--model", "knobbed:build", "--sites", "gates.*",
            *_data(tmp_path, marked), *FAST_ARGS]
    out = tmp_path / "out"
    assert run_inprocess([*argv, "--out", out], capsys).returncode == 0
    first = _without_runtime(out / "audit.json")

    _set_knob(tmp_path, source, 1.0, monkeypatch)  # unchanged: resumed, every batch proven
    assert run_inprocess([*argv, "--out", out], capsys).returncode == 0
    again = json.loads((out / "audit.json").read_text())
    assert {k: v for k, v in again.items() if k != "runtime"} == first
    reuse = again["runtime"]["reuse"]
    assert (reuse["evaluation_batches_proven"], reuse["evaluation_batches_recorded"]) == (2, 0)
    assert (reuse["calibration_batches_proven"], reuse["calibration_batches_recorded"]) == (2, 0)
    assert reuse["batches_reused"] == 2 and reuse["batches_recomputed"] == 0

    _set_knob(tmp_path, source, 3.0, monkeypatch)  # the change, outside batch 0
    res = run_inprocess([*argv, "--out", out], capsys)
    assert res.returncode == 2, res.stderr
    assert f"a fresh pass over {marked} batch 1 (rows 5-8) gives other coefficients of site " \
           "gates." in res.stderr, res.stderr
    assert _without_runtime(out / "audit.json") == first  # the old result is left as it was

    _set_knob(tmp_path, source, 3.0, monkeypatch)
    assert run_inprocess([*argv, "--out", tmp_path / "fresh"], capsys).returncode == 0
    fresh = _without_runtime(tmp_path / "fresh" / "audit.json")
    assert fresh["conditions"] != first["conditions"]  # what the stale cache would have hidden


def _objective(knob: Callable[[], float]) -> Callable:
    def units(out: torch.Tensor, batch: Any) -> torch.Tensor:
        loss = torch.nn.functional.cross_entropy(out, batch.targets, reduction="none")
        marked = batch.inputs[:, -1] > 0  # only the second batch's examples
        return torch.where(marked, loss * knob(), loss)
    return units


def _env_knob() -> float:
    return float(os.environ["FCAUDIT_TEST_KNOB"])


def test_an_objective_reading_the_environment_is_proven_by_its_losses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    x, y = vt.mixer_data(16, 0)
    x[:8, -1], x[8:, -1] = -1 - np.arange(8), 1 + np.arange(8)
    data = AuditData(inputs=x, targets=y, calib_inputs=vt.mixer_data(16, 1)[0])
    options = AuditOptions(objective=_objective(_env_knob), bootstrap=50, repeats=1,
                           execution=False, progress=False, batch_size=8, per_layer=False)
    out = tmp_path / "audit"
    monkeypatch.setenv("FCAUDIT_TEST_KNOB", "1")
    first = fcaudit.audit(vt.class_mixer(), out, data=data, options=options)
    again = fcaudit.audit(vt.class_mixer(), out, data=data, options=options)
    assert again.conditions["correct"].nll == first.conditions["correct"].nll
    assert again.runtime.reuse["evaluation_batches_proven"] == 2
    monkeypatch.setenv("FCAUDIT_TEST_KNOB", "2")
    with pytest.raises(FcauditError, match=r"a fresh pass over evaluation batch 1 \(rows "
                                           r"9-16\) gives other losses than its cached record "
                                           "while every coefficient is bitwise equal"):
        fcaudit.audit(vt.class_mixer(), out, data=data, options=options)
    fresh = fcaudit.audit(vt.class_mixer(), tmp_path / "fresh", data=data, options=options)
    # by hand: the second half of the examples' losses doubled
    with torch.no_grad():
        losses = torch.nn.functional.cross_entropy(
            vt.class_mixer()(torch.from_numpy(x)), torch.from_numpy(y), reduction="none")
    expected = float((losses[:8].sum() + 2 * losses[8:].sum()) / 16)
    assert fresh.conditions["correct"].nll == pytest.approx(expected, rel=1e-5)
    assert first.conditions["correct"].nll == pytest.approx(float(losses.mean()), rel=1e-5)
