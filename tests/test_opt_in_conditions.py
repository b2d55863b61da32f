"""Opt-in built-in conditions in an audit (AuditOptions.conditions, ``--condition``):
static-layer-token-position run end to end on the planted toys, its NLL and retention
computed by hand (a pair calibration saw: the token's own gates; a pair it never saw: the
static-layer mean), its flag, its refusals, its calibration sums in the cache, and where
it does not apply."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import toys
import vision_toys as vt
from conftest import audit_argv, run_inprocess
from safetensors.torch import load_file

import fcaudit
from fcaudit import AuditData, AuditOptions
from fcaudit.core.errors import UsageError
from fcaudit.engine.cache import CoefficientCache

NEW = "static-layer-token-position"
V = toys.V
OPTS = AuditOptions(repeats=1, bootstrap=50, batch_size=4, execution=False, progress=False,
                    per_layer=False, conditions=(NEW,))
EVAL, CALIB = toys.pair_sequences(8, 16, 1), toys.pair_sequences(12, 16, 2)
UNIFORM = math.log(V)  # a position whose logits are all 0


def _nll(logit: float) -> float:
    """Next-token NLL when the target's logit is ``logit`` and the other 63 are 0."""
    return math.log(math.exp(logit) + V - 1) - logit


def _audit(model, calib: np.ndarray = CALIB, out: Path | None = None,
           options: AuditOptions = OPTS) -> fcaudit.AuditResult:
    data = AuditData(EVAL, calib, {"source": "tokens"})
    return fcaudit.audit(model, out, sites="gates.*", data=data, options=options,
                         report=out is not None)


def _unseen(calib: np.ndarray) -> np.ndarray:
    """[N, 8] per evaluation sequence and scored even position (0, 2, ..., 14): True where
    no calibration token had that id at that position."""
    seen = {(int(i), t) for row in calib for t, i in enumerate(row)}
    return np.array([[(int(row[t]), t) not in seen for t in range(0, 15, 2)] for row in EVAL])


def test_position_toy_feeds_the_position_profile_where_the_pair_was_seen(tmp_path):
    """Gates depend on the position only (layer 0: 1 at even positions; layer 1: 0), so a
    seen (id, position) pair is fed its exact gate and the target's logit stays 8; an unseen
    one gets the static-layer mean, 0.5, and logit 4. Odd positions score 0 logits either
    way. Global-mean (0.25 for both layers) zeroes every logit: the gap's far end."""
    unseen = _unseen(CALIB)
    assert 0 < unseen.sum() < unseen.size  # both cases happen
    correct = (8 * _nll(8.0) + 7 * UNIFORM) / 15
    per_seq = correct + unseen.sum(1) * (_nll(4.0) - _nll(8.0)) / 15
    result = _audit(toys.position_model(), out=tmp_path / "audit")
    c = result.conditions[NEW]
    assert result.conditions["correct"].nll == pytest.approx(correct, rel=1e-6)
    assert c.nll == pytest.approx(per_seq.mean(), rel=1e-6)
    assert c.delta == pytest.approx(per_seq.mean() - correct, rel=1e-5)
    expected = 100 * (UNIFORM - per_seq.mean()) / (UNIFORM - correct)
    assert result.retention[NEW].value == pytest.approx(expected, rel=1e-5)
    written = json.loads((tmp_path / "audit" / "audit.json").read_text())
    assert written["settings"]["conditions"] == [NEW]
    assert written["conditions"][NEW]["nll"] == c.nll
    report = (tmp_path / "audit" / "report.md").read_text()
    assert f"| `{NEW}` |" in report and "per-site, per-token-id-and-position" in report


def test_content_toy_keeps_every_seen_pair_and_falls_back_to_static_layer():
    """Gates are one_hot(x_t): a seen pair is fed exactly that (retention 100% when the
    calibration holds every evaluation token at an even position, the only ones the
    model reads); an unseen one gets the static-layer mean, the
    calibration's id frequencies f, so the target x_t + 1 has logit 8 f[x_t] against
    8 f[v - 1] for every v (the model rolls the gate by one)."""
    covering = EVAL.copy()
    covering[:, 1::2] = (covering[:, 1::2] + 2) % V  # other windows, the same even pairs
    everything = _audit(toys.content_model(), calib=covering)
    assert everything.conditions[NEW].delta == 0.0
    assert everything.retention[NEW].value == pytest.approx(100.0, abs=1e-9)

    freq = np.bincount(CALIB.reshape(-1), minlength=V) / CALIB.size
    logits = 8 * np.roll(freq, 1)  # logit of v: 8 f[v - 1]
    fallback = np.log(np.exp(logits).sum()) - logits[(EVAL[:, 0:15:2] + 1) % V]  # [N, 8]
    unseen = _unseen(CALIB)
    per_seq = (np.where(unseen, fallback, _nll(8.0)).sum(1) + 7 * UNIFORM) / 15
    result = _audit(toys.content_model())
    assert result.conditions[NEW].nll == pytest.approx(per_seq.mean(), rel=1e-6)


def test_a_default_audit_runs_and_reports_no_opt_in_condition():
    result = _audit(toys.position_model(), options=AuditOptions(
        repeats=1, bootstrap=50, batch_size=4, execution=False, progress=False,
        per_layer=False))
    assert NEW not in result.conditions and NEW not in result.retention
    assert result.settings["conditions"] == []


def test_the_condition_flag_runs_it_from_the_command_line(tmp_path, tokens, capsys):
    out = tmp_path / "audit"
    done = run_inprocess(audit_argv(out, tokens, "toys:position_model",
                                    ("--condition", NEW)), capsys)
    assert done.returncode == 0, done.stderr
    written = json.loads((out / "audit.json").read_text())
    assert written["settings"]["conditions"] == [NEW]
    assert NEW in written["conditions"] and NEW in written["retention"]
    row = next(line for line in done.stdout.splitlines() if f" {NEW} " in line)
    assert f"{written['conditions'][NEW]['nll']:.4f}" in row  # the CLI's conditions table


@pytest.mark.parametrize("name, why", [
    ("bogus", "not an opt-in condition"),
    ("static-layer", "every audit runs it already"),
])
def test_a_name_that_is_no_opt_in_condition_is_refused_in_one_line(tmp_path, tokens, capsys,
                                                                   name, why):
    out = tmp_path / "audit"
    done = run_inprocess(audit_argv(out, tokens, extra=("--condition", name)), capsys)
    assert done.returncode == 2
    # the opt-in conditions: this one and the exit references (exit models only)
    choices = f"{NEW}, fixed-exit, fixed-exit-position, oracle-exit"
    assert done.stderr.strip() == (f"fcaudit: error: --condition {name}: {why}; choose from "
                                f"{choices}")
    assert not (out / "audit.json").exists()
    with pytest.raises(UsageError, match=f"^AuditOptions\\(conditions='{name}'\\): {why}; "
                                         f"choose from {choices}$"):
        AuditOptions(conditions=(name,)).validate()


def test_a_bare_name_instead_of_a_tuple_is_refused():
    with pytest.raises(UsageError, match="must be a tuple of condition names") as caught:
        AuditOptions(conditions=NEW).validate()  # type: ignore[arg-type]
    assert caught.value.option == "conditions" and "\n" not in str(caught.value)


def _calib_keys(out: Path) -> set[str]:
    return set(load_file(out / "cache" / CoefficientCache.calib_name(0)))


def test_a_cached_calibration_without_its_sums_is_recomputed_not_reused(tmp_path):
    """A cache recorded by a default audit holds no per-(id, position) sums: an audit that
    asks for them recomputes the calibration (proven equal on the sums both hold) and
    writes shards that hold them, with the numbers of an audit in a fresh folder; a later
    default audit again writes only what it recomputed."""
    out = tmp_path / "audit"
    default = AuditOptions(repeats=1, bootstrap=50, batch_size=4, execution=False,
                           progress=False, per_layer=False)
    _audit(toys.position_model(), out=out, options=default)
    assert not any(k.startswith("+") for k in _calib_keys(out))
    reused = _audit(toys.position_model(), out=out)
    assert {"+cells_keys", "+cells_counts", "+cells::gates.0"} <= _calib_keys(out)
    fresh = _audit(toys.position_model(), out=tmp_path / "fresh")
    assert reused.conditions[NEW] == fresh.conditions[NEW]
    assert reused.retention[NEW] == fresh.retention[NEW]
    again = _audit(toys.position_model(), out=out, options=default)
    assert not any(k.startswith("+") for k in _calib_keys(out)) and NEW not in again.conditions


def test_a_cached_shard_differing_in_its_default_sums_is_still_refused(tmp_path):
    """Only the opt-in collections may differ: a shard whose default sums differ is
    another model's, whatever collections it holds."""
    import torch
    cache = CoefficientCache(tmp_path / "cache", {}, 4, 8)
    name = CoefficientCache.calib_name(0)
    cache.write(name, {"site::g": torch.ones(2)})
    with pytest.raises(fcaudit.FcauditError, match="gives other coefficients of site g than its "
                                                   "cached record"):
        cache.settle(name, {"site::g": torch.zeros(2), "+cells_keys": torch.ones(1)}, "batch 0")
    with pytest.raises(fcaudit.FcauditError, match="gives other entries than its cached record "
                                                   r"\(token ids in only one of them\)"):
        cache.settle(name, {"site::g": torch.ones(2), "token_ids": torch.ones(1)}, "batch 0")


def test_it_is_not_applicable_without_positions_like_the_others():
    """The mixer's coefficients are [example, kernel]: no position, no token id."""
    x, y = vt.mixer_data(16, 0)
    data = AuditData(inputs=x, targets=y, calib_inputs=vt.mixer_data(16, 1)[0])
    result = fcaudit.audit(vt.class_mixer(), data=data, options=AuditOptions(
        bootstrap=50, repeats=1, execution=False, progress=False, batch_size=8,
        per_layer=False, objective="classification", conditions=(NEW,)))
    reason = ("the coefficients ([example, kernel]) have no position axis, one value set "
              "per example: there are no positions to permute")
    assert result.not_applicable[NEW] == reason and NEW not in result.conditions
    assert not result.retention[NEW].defined
    assert result.retention[NEW].reason == f"not applicable: {reason}"


def test_an_audit_json_missing_an_opted_in_condition_is_refused(tmp_path):
    """audit.json's settings say which opt-in conditions ran: one of them neither measured
    nor declared not applicable is a damaged file."""
    out = tmp_path / "audit"
    _audit(toys.position_model(), out=out)
    assert fcaudit.AuditResult.read(out / "audit.json").conditions[NEW].nll > 0
    written = json.loads((out / "audit.json").read_text())
    del written["conditions"][NEW]
    (out / "audit.json").write_text(json.dumps(written))
    with pytest.raises(fcaudit.FcauditError, match=f"conditions.{NEW}.*is missing"):
        fcaudit.AuditResult.read(out / "audit.json")
