"""No execution answer without a twin, and no hint: before, a Hugging Face model read
"Execution not measured: no dense counterpart: pass --dense SPEC". Now, where the model's
blocks are known, blocks and FLOPs per token are counted on the model itself (the plan
counts those passes), the answer says what a dense twin would be for the sites' kind, or
why none exists (an activation: the coefficients are the MLPs' own computation), and its
label stays honest: no "conditional" without a comparison that shows a saving."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import toys
from conftest import AUDIT_FAST, COMMON, VOCAB, run_inprocess, save

import fcaudit
from fcaudit import AuditData, AuditOptions
from fcaudit.engine.execution import measure_execution
from fcaudit.engine.verdicts import execution_part
from fcaudit.models.skipgate import SkipGateConfig, SkipGateGPT

transformers = pytest.importorskip("transformers")

NO_MLP_WITHOUT_ACTIVATIONS = ("no dense counterpart exists: the coefficients are the MLPs' "
                              "own activations, so there is no model without them to compare")


def llama_flops_per_token(layers: int, d: int, inner: int, vocab: int, tokens: int) -> int:
    """Forward matmul FLOPs per token of a Llama whose key/value heads are its heads, by
    hand: per layer the q, k, v, o projections (4 x 2 d^2), SwiGLU's gate, up and down
    projections (3 x 2 d inner) and attention counted in full over the window (QK^T and
    AV: 2 x 2 T d); then the head (2 d V)."""
    per_layer = 4 * 2 * d * d + 3 * 2 * d * inner + 2 * 2 * tokens * d
    return layers * per_layer + 2 * d * vocab


def test_a_swiglu_model_answers_execution_against_itself(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    folder = save(transformers.LlamaConfig(**COMMON, intermediate_size=64), tmp_path / "m")
    fast = [a for a in AUDIT_FAST if a != "--no-execution"]
    res = run_inprocess(["audit", "--model", folder, "--sites", "model.layers.*.mlp.act_fn",
                         "--out", tmp_path / "out", *fast], capsys)
    assert res.returncode == 0, res.stderr
    result = json.loads((tmp_path / "out" / "audit.json").read_text())
    ex, layers = result["execution"], COMMON["num_hidden_layers"]
    window = result["data"]["seq_len"]
    flops = llama_flops_per_token(layers, COMMON["hidden_size"], 64, VOCAB, window)
    assert ex["measured"] and ex["blocks_present"] == layers
    assert ex["blocks_executed"] == layers and ex["blocks_executed_per_layer"] == [1.0] * layers
    assert ex["flops_per_token"] == pytest.approx(flops, rel=1e-3)
    assert ex["conditional_execution"] is False and "saves_against_dense" not in ex
    assert "dense_blocks_executed" not in ex and "dense_flops_per_token" not in ex
    assert ex["twin_note"] == NO_MLP_WITHOUT_ACTIVATIONS
    verdict = result["verdict"]
    assert verdict["execution_label"] == "unconditional"
    assert verdict["execution"] == (
        f"No conditional execution: every block runs on every token ({layers} of {layers}), "
        f"{flops / 1e3:.3g} kFLOPs per token, counted on the model alone; "
        f"{NO_MLP_WITHOUT_ACTIVATIONS}.")
    eval_batches = 4 // 2  # --max-eval 4 --batch-size 2: the model alone, once per batch,
    # after one uncounted warm pass
    assert result["runtime"]["plan"]["stages"]["execution"]["passes"] == 1 + eval_batches
    report = (tmp_path / "out" / "report.md").read_text()
    assert f"- Blocks and FLOPs counted on the model alone: {NO_MLP_WITHOUT_ACTIVATIONS}." \
        in report


def _data() -> AuditData:
    return AuditData(toys.pair_sequences(8, 16, 1), toys.pair_sequences(8, 16, 2), {})


def test_without_blocks_or_a_twin_the_reason_says_what_a_twin_would_be() -> None:
    """The constant toy's gates [B, T, 1] are scalar gates and it declares no blocks: the
    execution is not measured, and the reason says what its twin would be and what else
    counts it."""
    r = fcaudit.audit(toys.constant_model(), sites=["gates.*"], data=_data(),
                      options=AuditOptions(repeats=1, bootstrap=20, per_layer=False))
    assert not r.execution.measured and r.verdict.label("execution") == "not-measured"
    assert r.execution.reason == (
        "no dense counterpart given (for scalar gate sites, the same model with its gates "
        "fixed open or removed: pass it as --dense SPEC); and the model's blocks are not "
        "known, so none can be counted on the model itself: pass --blocks GLOB (e.g. "
        "'layers.*')")


def test_blocks_skipped_with_nothing_to_compare_are_not_called_conditional() -> None:
    """SkipGate runs a block only on tokens whose gate passes its threshold. Counted alone
    (no dense counterpart), the blocks it skips are said, and neither "conditional" nor
    "unconditional" is claimed: no comparison shows a saving."""
    torch.manual_seed(0)
    model = SkipGateGPT(SkipGateConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2,
                                       n_embd=16)).eval()
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 64, (4, 16)))
    kept = []  # reference: the share of tokens whose gate passes each block's threshold
    for block in model.blocks:
        block.gate.register_forward_hook(
            lambda m, _a, g, block=block: kept.append(float((g >= block.threshold).float()
                                                            .mean())))
    with torch.no_grad():
        model(ids)
    for block in model.blocks:
        block.gate._forward_hooks.clear()
    assert 0 < sum(kept) < len(kept) * 0.99  # the planted skips
    ex = measure_execution(model, None, ids, batch_size=4, block_paths=model.execution_blocks(),
                           timing=False)
    assert ex.blocks_executed == pytest.approx(sum(kept))
    assert ex.conditional_execution is None and ex.saves_against_dense is None
    part = execution_part(ex)
    assert part.label == "not-compared"
    assert part.sentence.startswith(
        f"Execution not compared: {sum(kept):.2f} of 3 blocks run per token, ")
    assert "without a dense counterpart no saving is shown" in part.sentence
    assert "onditional execution" not in part.sentence
