"""A degenerate exit rule (every unit stops at one and the same layer: none exits early,
all after the first, all after one layer between) is never counted as a saving: its
execution section, verdict, report, comparison and study finding say that the fewer
blocks and FLOPs are a fixed depth's, not conditional execution (issue 37). Reference:
a ponder model whose halting unit is constant, so every token's halting step follows by
hand from PonderNet's rule (halt at the first step n with 1 - (1 - lambda)^n >= 0.5)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import fcaudit
from fcaudit import AuditData, AuditOptions
from fcaudit.engine.analyses.exits import degenerate
from fcaudit.engine.result import AuditResult
from fcaudit.models.ponder import PonderConfig, PonderGPT
from fcaudit.study.presets import PRESETS

STEPS = 4
CFG = PonderConfig(vocab_size=61, block_size=16, n_layer=1, n_head=2, n_embd=16,
                   max_steps=STEPS)
RNG = np.random.default_rng(0)
EVAL, CALIB = RNG.integers(0, 61, (8, 16)), RNG.integers(0, 61, (8, 16))
OPTS = AuditOptions(repeats=1, bootstrap=50, batch_size=4, progress=False, per_layer=False,
                    timing_pairs=0)


def halting_step(lam: float) -> int:
    """PonderNet's deterministic rule by hand: the first step whose cumulative halting
    probability reaches 0.5 (the last step when none does)."""
    return next((n for n in range(1, STEPS) if 1 - (1 - lam) ** n >= 0.5), STEPS)


def ponder(lam: float | None) -> PonderGPT:
    """A ponder model whose halting probability is ``lam`` for every token and step
    (None: a spread halting unit, whose tokens halt at different steps)."""
    torch.manual_seed(0)
    model = PonderGPT(CFG).eval()
    assert model.unit is not None
    with torch.no_grad():
        if lam is None:
            torch.nn.init.normal_(model.unit.proj.weight, std=3.0)
        else:
            model.unit.proj.weight.zero_()
            model.unit.proj.bias.fill_(math.log(lam / (1 - lam)))
    return model


def audit(model: PonderGPT, out: Path | None = None) -> AuditResult:
    data = AuditData(EVAL, CALIB, {"source": "tokens"})
    result = fcaudit.audit(model, out, data=data, options=OPTS, report=out is not None)
    assert result is not None
    return result


@pytest.mark.parametrize(("own", "words"), [
    ([[0, 0], [0, 0]], "every token exits after the first layer"),
    ([[2, 2], [2, 2]], "every token exits after layer 3 of 4"),
    ([[3, 3], [3, 3]], "no token exits before the last layer"),
    ([[0, 1], [3, 3]], None)])
def test_a_rule_is_degenerate_when_every_unit_stops_at_one_layer(own, words):
    note = degenerate(torch.tensor(own), STEPS, "token")
    assert (note is None) if words is None else (words in note)


@pytest.mark.parametrize("lam", [1 - 1e-6, 0.3, 1e-6])  # halts after step 1, 2, never
def test_a_degenerate_rule_claims_no_saving_anywhere(lam, tmp_path: Path):
    step = halting_step(lam)
    r = audit(ponder(lam), tmp_path / "out")
    ex, exits = r.execution, r.exits
    assert exits is not None and exits.evaluation_mean_depth == step and exits.note
    assert ex.blocks_executed == pytest.approx(step) and ex.dense_blocks_executed == STEPS
    assert ex.degenerate_rule == exits.note
    assert ex.conditional_execution is False and ex.saves_against_dense is False
    assert r.verdict.label("execution") == "unconditional"
    sentence = r.verdict.execution
    assert sentence.startswith("No conditional execution: the exit rule is degenerate, ")
    assert "none of it a saving of conditional execution" in sentence
    assert not any(w in sentence for w in ("faster", "savings against", "Conditional exec"))
    report = (tmp_path / "out" / "report.md").read_text(encoding="utf-8")
    assert report.count("a degenerate exit rule's fewer blocks or FLOPs are not counted") == 2
    fcaudit.compare([r, audit(ponder(None))], tmp_path / "cmp", labels=["flat", "spread"])
    compared = (tmp_path / "cmp" / "compare.md").read_text(encoding="utf-8")
    assert "| no (degenerate exit rule: a fixed depth) |" in compared


def test_an_adaptive_rule_is_conditional_execution():
    """The reference point: a spread halting unit stops tokens at different steps, runs
    fewer blocks than the twin and is counted as conditional execution."""
    r = audit(ponder(None))
    assert r.exits is not None and r.exits.note is None
    assert r.execution.degenerate_rule is None and r.execution.conditional_execution
    assert 1 < r.execution.blocks_executed < STEPS


def test_the_exit_study_does_not_count_a_degenerate_seed_as_computing_less():
    audits = [audit(ponder(None)), audit(ponder(1 - 1e-6))]
    flops = float(np.mean([a.execution.flops_ratio for a in audits]))
    assert flops < 0.99  # both run fewer FLOPs than the twin ...
    group = {"audits": audits, "aggregate": {"flops_ratio": {"mean": flops}}}
    found = dict(PRESETS["exit"].judge({"ponder-tiny": group}))
    claim = found["ponder (PonderNet): early exit computes less than the full-depth twin"]
    assert claim.startswith("does not hold")  # ... but one seed's rule does not adapt
    assert "the rule does not adapt in 1 of 2 seeds" in claim
