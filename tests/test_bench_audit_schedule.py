"""The schedule's cost account (benchmarks/audit_schedule.py): the forward passes and
block evaluations each schedule performs, against a hand count for 4-layer models, with
both schedules' results equal."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fcaudit.engine.options import AuditOptions
from fcaudit.io.data import AuditData

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import audit_schedule  # noqa: E402

L, K, N_EVAL, N_CALIB, BATCH = 4, 1, 8, 8, 4
OPTIONS = AuditOptions(repeats=K, bootstrap=10, batch_size=BATCH, execution=False,
                       progress=False)


def _model(family: str) -> nn.Module:
    from fcaudit.models.featuregate import GPT, GPTConfig
    from fcaudit.models.mudd import PRESETS, MuddModel
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=L, n_head=2, n_embd=32)) \
        if family == "featuregate" else \
        MuddModel(dataclasses.replace(PRESETS["tiny"], vocab_size=64, n_layer=L, dim=32))
    for p in model.parameters():  # weights large enough that every coefficient matters
        nn.init.normal_(p, std=0.2)
    return model.eval()


def hand_count(family: str, schedule: str) -> dict[str, float]:
    """Per evaluation batch: the record pass, the correct replay, 3K random and 4 static
    main conditions, L(K + 1) per-layer runs, the correct replay again at the end; on top,
    the calibration's record passes (N_CALIB / N_EVAL evaluation-set passes), the probe's
    identity replay of the first batch before anything is written (BATCH / N_EVAL) and the
    look at the first batch that judges each site's kind, which these declarations do not
    say (BATCH / N_EVAL). Block passes: block evaluations over L (a full pass evaluates
    all L blocks)."""
    main = 3 * K + 4
    full = 1 + 1 + main + 1  # always full passes, both schedules
    extra = (N_CALIB + 2 * BATCH) / N_EVAL
    repeat = {"repeat_passes": 1, "repeat_block_passes": 1}
    if schedule == "naive":
        passes = full + L * (K + 1) + extra
        return {"passes": passes, "block_passes": passes, **repeat,
                "proof_passes": 0, "proof_block_passes": 0}
    # prefix: a site's K + 1 runs and its proof (the correct feed on the same suffix)
    # recompute the blocks after its prefix; a site with no prefix runs in full, unproven
    if family == "mudd":  # site i (dynamic_dense.i) runs after block i: L - 1 - i blocks
        suffixes, unproven = [L - 1 - i for i in range(L)], 0
    else:  # site i (blocks.i.gate) runs inside block i: L - i blocks; site 0 has no prefix
        suffixes, unproven = [L - i for i in range(1, L)], 1
    runs = (K + 1) * (len(suffixes) + unproven)
    blocks = full * L + (K + 1) * (sum(suffixes) + unproven * L) + sum(suffixes)
    return {"passes": full + runs + len(suffixes) + extra, "block_passes": blocks / L + extra,
            **repeat, "proof_passes": len(suffixes), "proof_block_passes": sum(suffixes) / L}


@pytest.mark.parametrize("family", ["featuregate", "mudd"])
def test_block_evaluations_match_a_hand_count_and_results_are_equal(family: str):
    model = _model(family)
    rng = np.random.default_rng(0)
    data = AuditData(rng.integers(0, 64, (N_EVAL, 16)), rng.integers(0, 64, (N_CALIB, 16)), {})
    results = {}
    for schedule in ("naive", "prefix"):
        options = dataclasses.replace(OPTIONS, schedule=schedule)
        _, results[schedule], counts = audit_schedule.audit_seconds(model, data, options)
        assert counts.in_passes(N_EVAL) == hand_count(family, schedule), schedule
    assert results["naive"] == results["prefix"]


def test_ideal_ratio_is_the_cost_formula():
    """Passes pay the fixed part and the NLL, block evaluations their share of the rest."""
    shares = {"full": 2.0, "fixed": 0.5, "nll": 0.1}
    account = {"passes": 10.0, "block_passes": 6.0}
    # (10 x (0.5 + 0.1) + 6 x 1.5) / (8 x 2.0) = (6 + 9) / 16
    assert audit_schedule.ideal_ratio(account, shares, 8) == pytest.approx(15 / 16)


@pytest.mark.parametrize("family", ["featuregate", "mudd"])
def test_pass_shares_time_the_stubbed_pass_below_the_full_one(family: str):
    """The stubbed pass (no block computed) and the NLL alone each take less time than the
    full pass (about 3x less on these models: min over 3 keeps a busy core from flipping it)."""
    model = _model(family)
    ids = np.random.default_rng(0).integers(0, 64, (4, 16))
    shares = audit_schedule.pass_shares(model, ids, 4, model.execution_blocks(), repeats=3)
    assert set(shares) == {"full", "fixed", "nll"}
    assert all(v > 0 for v in shares.values())
    assert {k: v < shares["full"] for k, v in shares.items() if k != "full"} == \
        {"fixed": True, "nll": True}, shares
