"""Branchy (BranchyNet-style early exit on the digits): per-example exits are real, follow
the fed scores, and match a block-by-block reference; the exit references apply, the
per-position ones are said not to."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fcaudit
from fcaudit import AuditData, AuditOptions
from fcaudit.core.contract import DeclaresExits
from fcaudit.core.errors import FcauditError
from fcaudit.core.exits import exit_scores, head_predictions, oracle_layers, own_exits
from fcaudit.core.recording import record
from fcaudit.core.replaying import replay
from fcaudit.io.digits import digits
from fcaudit.models.branchy import BranchyCNN, BranchyConfig
from fcaudit.models.condconv import CNN, CNNConfig
from fcaudit.report.sections.exits import exits_section

THRESHOLD = 0.5
B = 8


def make(threshold: float = THRESHOLD) -> BranchyCNN:
    """Random weights, heads scaled up so that confidences straddle the threshold."""
    torch.manual_seed(0)
    model = BranchyCNN(BranchyConfig(exit_threshold=threshold))
    with torch.no_grad():
        for head in model.heads:
            head.proj.weight.mul_(40.0)
    return model.eval()


def images(n: int = B, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 1, 8, 8, generator=torch.Generator().manual_seed(seed))


def reference(model: BranchyCNN, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Every block and head on every example, by hand: ``[L, B, C]`` logits per block and
    the per-block feature maps."""
    h, logits = x, []
    with torch.no_grad():
        for layer, head in zip(model.layers, model.heads, strict=True):
            h = F.relu(F.conv2d(h, layer.conv.weight, layer.conv.bias, stride=layer.conv.stride,
                                padding=1))
            logits.append(h.flatten(1) @ head.proj.weight.T + head.proj.bias)
    return torch.stack(logits), logits


def hand_exits(model: BranchyCNN, x: torch.Tensor) -> torch.Tensor:
    """``[B]``: the first block whose head's maximum softmax probability reaches the
    threshold (the last block where none does)."""
    logits, _ = reference(model, x)
    conf = logits.softmax(-1).amax(-1)  # [L, B]
    L = len(logits)
    return torch.tensor([next((i for i in range(L - 1) if conf[i, b] >= THRESHOLD), L - 1)
                         for b in range(x.shape[0])])


def entering(model: BranchyCNN, x: torch.Tensor) -> list[int]:
    """Examples entering each execution block (forward pre-hooks)."""
    counts = [0] * len(model.execution_blocks())
    handles = [model.get_submodule(p).register_forward_pre_hook(
        lambda _m, args, i=i: counts.__setitem__(i, counts[i] + args[0].shape[0]))
        for i, p in enumerate(model.execution_blocks())]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return counts


def test_exits_logits_and_executed_blocks_match_the_hand_loop():
    model, x = make(), images()
    expected = hand_exits(model, x)
    assert 0 < int((expected == 0).sum()) < B  # the threshold splits the examples
    got = own_exits(model, lambda: model(x))
    assert got.shape == (B, 1) and torch.equal(got[:, 0], expected)
    logits, _ = reference(model, x)
    with torch.no_grad():
        out = model(x)
    torch.testing.assert_close(out, logits[expected, torch.arange(B)])
    # real savings: block l runs only on the examples that have not exited before it
    assert entering(model, x) == [int((expected >= i).sum()) for i in range(3)]


def test_oracle_layer_per_example_from_per_block_argmaxes():
    model, x = make(), images()
    argmax = reference(model, x)[0].argmax(-1)  # [L, B]
    hand = [min(i for i in range(3) if argmax[i, b] == argmax[2, b]) for b in range(B)]
    preds = head_predictions(model, lambda: model(x))
    assert preds.shape == (3, B, 1) and isinstance(model, DeclaresExits)
    assert oracle_layers(preds)[:, 0].tolist() == hand


def test_exits_follow_fed_scores():
    model, x = make(), images()
    rec = record(model, x)
    layers = torch.tensor([[2], [0], [1], [2], [1], [0], [0], [2]])
    with replay(model, exit_scores(model.controller_sites(), layers, rec)):
        assert torch.equal(own_exits(model, lambda: model(x)), layers)
        with torch.no_grad():
            out = model(x)
    logits, _ = reference(model, x)
    torch.testing.assert_close(out, logits[layers[:, 0], torch.arange(B)])


def test_identity_replay_is_bitwise_and_sites_are_per_example():
    model, x = make(), images()
    rec = record(model, x)
    assert [s.name for s in model.controller_sites()] == ["layers.0.score", "layers.1.score"]
    assert all(v.shape == (B, 1) for v in rec.values())
    with torch.no_grad():
        plain = model(x)
    with replay(model, rec), torch.no_grad():
        assert torch.equal(model(x), plain)
    # an exited example keeps the score it left with
    exits = own_exits(model, lambda: model(x))[:, 0]
    gone = exits == 0
    assert torch.equal(rec["layers.1.score"][gone], rec["layers.0.score"][gone])


OPTS = AuditOptions(objective="classification", repeats=1, bootstrap=50, batch_size=8,
                    progress=False, per_layer=False, timing_pairs=0)


def audit_result(model: torch.nn.Module, **kw) -> fcaudit.AuditResult:
    x, y = digits("eval")
    data = AuditData(inputs=x[:32], targets=y[:32], calib_inputs=digits("train")[0][:32])
    return fcaudit.audit(model, None, data=data, options=OPTS, report=False, **kw)


def audit(model: torch.nn.Module, **kw) -> dict:
    return audit_result(model, **kw).to_json()


def test_audit_runs_fixed_and_oracle_exit_and_says_per_position_does_not_apply():
    model = make()
    result = audit_result(model)
    j = result.to_json()
    x = torch.from_numpy(digits("train")[0][:32])
    calib = float((hand_exits(model, x) + 1).double().mean())
    e = j["exits"]
    assert e["calibration_mean_depth"] == pytest.approx(calib)
    assert e["fixed_exit_depth"] == min(range(3), key=lambda k: (abs(k + 1 - calib), -k)) + 1
    assert {"fixed-exit", "oracle-exit"} <= set(j["conditions"])
    assert "no position axis" in j["not_applicable"]["fixed-exit-position"]
    assert "| `fixed-exit-position` | one layer per position |  | not applicable |" in \
        "\n".join(exits_section(result))
    assert j["execution"]["blocks_executed"] == pytest.approx(e["evaluation_mean_depth"])


def test_twin_of_another_depth_is_refused():
    torch.manual_seed(0)
    twin = CNN(CNNConfig(widths=(16, 32), strides=(1, 2), condconv=False)).eval()
    with pytest.raises(FcauditError, match=re.escape(
            "the dense twin is not the model's network at full depth: it has 2 blocks, the "
            "model 3; executed depth and FLOPs are read against the twin")):
        audit(make(), dense=twin)


def test_twin_is_the_dense_cnn_without_exit_heads():
    model = make()
    twin = model.dense_counterpart()
    # the twin's parameters by hand: three convolutions and the final classifier
    convs = (16 * 1 * 9 + 16) + (32 * 16 * 9 + 32) + (32 * 32 * 9 + 32)
    assert sum(p.numel() for p in twin.parameters()) == convs + 32 * 16 * 10 + 10
    extra = (16 * 64 * 10 + 10) + (32 * 16 * 10 + 10)  # the two earlier exit heads
    assert sum(p.numel() for p in model.parameters()) == convs + 32 * 16 * 10 + 10 + extra


def test_a_short_training_beats_chance_at_every_head():
    from fcaudit.study.vision import evaluate, fit, schedule
    torch.manual_seed(0)
    model = BranchyCNN(BranchyConfig())
    ex, ey = digits("eval")
    fit(model, *digits("train"), schedule("tiny", 60), np.random.default_rng(0), False, "t")
    assert evaluate(model, ex, ey)["eval_accuracy"] > 0.5  # chance is 0.1
    preds = head_predictions(model, lambda: model(torch.from_numpy(ex)))[:, :, 0]
    accuracy = (preds == torch.from_numpy(ey)).double().mean(1)
    assert bool((accuracy > 0.3).all())


def _section(markdown: str, title: str) -> str:
    """The text of one ``## title`` section, up to the next one."""
    return markdown.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_report_of_image_exits_says_example_and_one_bracket_per_interval():
    """Exits of images are the examples' exits: the Exits and Execution sections and the
    exit conditions' rows never say token or window, each says example; every interval
    has one pair of brackets (the gap share's written out from audit.json)."""
    from fcaudit.report.audit_report import build_markdown
    result = audit_result(make())
    _, md = build_markdown(result, [])
    assert "[[" not in md and "]]" not in md
    exits = _section(md, "Exits")
    execution = _section(md, "Execution")
    answers = _section(md, "The four answers").split("\n### ")  # an exit model's exits first
    assert answers[1].startswith("1. Exits:") and "Examples stop after" in answers[1]
    answer = "\n".join(answers[1:2] + answers[4:])  # exits and execution
    rows = [line for line in _section(md, "Conditions").splitlines() if "-exit`" in line]
    assert len(rows) == 2  # fixed-exit and oracle-exit (per position: not applicable)
    routing = "experts skipped per token by routing"  # what routers skip: tokens
    for text in (exits, execution, answer, *rows):
        assert not re.search(r"token|window", text.replace(routing, "")), text
    assert "Layers executed per example (of 3)" in exits
    assert "of the evaluation examples stop after the first layer" in exits
    assert "on the evaluation set" in exits
    assert "| blocks executed per example |" in execution
    assert "| FLOPs per example |" in execution and "Counted on 32 examples" in execution
    g = result.exits.gap_closed
    assert f"{g.value:.2f}% [{g.ci95[0]:.2f}, {g.ci95[1]:.2f}]." in exits
