"""FeatureGate and Dense: shapes, the exact gates-at-1 equivalence, preset sizes."""

from __future__ import annotations

import pytest
import torch

from fcaudit.core.recording import record
from fcaudit.core.replaying import replaying
from fcaudit.models.featuregate import GPT, PRESETS, GPTConfig

CFG = GPTConfig(vocab_size=97, block_size=32, n_layer=3, n_head=2, n_embd=16)


def test_shapes_and_sites():
    torch.manual_seed(0)
    model = GPT(CFG).eval()
    ids = torch.randint(0, 97, (2, 11))
    assert model(ids).shape == (2, 11, 97)
    coeffs = record(model, ids)
    assert list(coeffs) == ["blocks.0.gate", "blocks.1.gate", "blocks.2.gate"]
    assert all(c.shape == (2, 11, 1) for c in coeffs.values())
    assert all(((c > 0) & (c < 1)).all() for c in coeffs.values())
    assert [s.layer for s in model.controller_sites()] == [0, 1, 2]
    assert model.execution_blocks() == ["blocks.0", "blocks.1", "blocks.2"]


def test_gates_forced_to_one_equal_dense_twin_exactly():
    torch.manual_seed(0)
    gated = GPT(CFG).eval()
    dense = gated.dense_counterpart().eval()
    assert not any(".gate." in n for n, _ in dense.named_parameters())
    shared = {k: v for k, v in gated.state_dict().items() if ".gate." not in k}
    dense.load_state_dict(shared, strict=True)
    ids = torch.randint(0, 97, (3, 20))
    ones = {s: torch.ones(3, 20, 1) for s in gated.controller_sites()}
    with torch.no_grad(), replaying(gated, ones):
        a = gated(ids)
    with torch.no_grad():
        b = dense(ids)
    assert torch.equal(a, b)


@pytest.mark.parametrize("name, target", [("76m", 76e6), ("504m", 504e6)])
def test_paper_presets_have_the_paper_sizes(name, target):
    with torch.device("meta"):
        model = GPT(PRESETS[name])
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - target) / target < 0.05, n


@pytest.mark.slow
@pytest.mark.parametrize("name", ["76m", "504m"])
def test_paper_presets_run_a_forward_pass(name):
    torch.manual_seed(0)
    model = GPT(PRESETS[name]).eval()
    with torch.no_grad():
        out = model(torch.randint(0, PRESETS[name].vocab_size, (1, 8)))
    assert out.shape == (1, 8, PRESETS[name].vocab_size) and torch.isfinite(out).all()
