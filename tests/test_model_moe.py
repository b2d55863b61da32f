"""MoE: top-k routing really dispatches, replay drives it, the active size is Dense's."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fcaudit.core.discovery import declared_experts
from fcaudit.core.recording import record
from fcaudit.core.replaying import replay
from fcaudit.io.loading import load
from fcaudit.models.moe import PRESETS, MoEConfig, MoEGPT, load_balance, route
from fcaudit.study.train import train

CFG = MoEConfig(vocab_size=97, block_size=32, n_layer=3, n_head=2, n_embd=16)
B, T = 2, 12


@pytest.fixture
def model() -> MoEGPT:
    torch.manual_seed(0)
    m = MoEGPT(CFG).eval()
    for block in m.blocks:  # spread the routers so that routing depends on the input
        torch.nn.init.normal_(block.router.weight, std=1.0)
    return m


def tokens_per_expert(model: MoEGPT) -> tuple[dict[str, int], list]:
    """Counts of tokens entering each expert module (forward pre-hooks), and the handles."""
    counts: dict[str, int] = {}
    handles = []
    for layer in model.expert_layers():
        for path in layer.experts:
            counts[path] = 0

            def hook(_module: torch.nn.Module, args: tuple, path: str = path) -> None:
                counts[path] += args[0].shape[0]
            handles.append(model.get_submodule(path).register_forward_pre_hook(hook))
    return counts, handles


def counted_forward(model: MoEGPT, ids: torch.Tensor) -> dict[str, int]:
    counts, handles = tokens_per_expert(model)
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return counts


def reference_top_k(logits: torch.Tensor, k: int) -> np.ndarray:
    """The experts of each token with the k largest logits, by numpy sorting (an
    independent reference for the model's own ``route``); ties do not occur here."""
    flat = logits.detach().double().reshape(-1, logits.shape[-1]).numpy()
    return np.argsort(-flat, axis=-1, kind="stable")[:, :k]


def reference_load_balance(logits: torch.Tensor, chosen: np.ndarray) -> float:
    """E * sum_e f_e * P_e by explicit loops: f_e the share of the assignment slots that
    go to expert e, P_e the mean over tokens of the softmax probability of e."""
    flat = logits.detach().double().reshape(-1, logits.shape[-1]).numpy()
    num, slots = flat.shape[1], chosen.size
    f = [sum(int(c == e) for c in chosen.flatten()) / slots for e in range(num)]
    probs = [np.exp(row - row.max()) / np.exp(row - row.max()).sum() for row in flat]
    p = [sum(row[e] for row in probs) / len(probs) for e in range(num)]
    return num * sum(fe * pe for fe, pe in zip(f, p, strict=True))


def expected_counts(model: MoEGPT, logits: dict[str, torch.Tensor]) -> dict[str, int]:
    """Tokens per expert that top-k routing assigns from the given router logits."""
    out = {}
    for layer in model.expert_layers():
        chosen = reference_top_k(logits[layer.name], layer.top_k)
        out.update({path: int((chosen == e).sum()) for e, path in enumerate(layer.experts)})
    return out


def test_shapes_sites_and_declarations(model):
    ids = torch.randint(0, 97, (B, T))
    assert model(ids).shape == (B, T, 97)
    coeffs = record(model, ids)
    assert list(coeffs) == ["blocks.0.router", "blocks.1.router", "blocks.2.router"]
    assert all(c.shape == (B, T, 8) for c in coeffs.values())
    assert {s.family for s in model.controller_sites()} == {"moe"}
    assert model.execution_blocks() == ["blocks.0", "blocks.1", "blocks.2"]
    layers = declared_experts(model)
    assert [(x.name, x.num_experts, x.top_k) for x in layers] == [
        (f"blocks.{i}.router", 8, 2) for i in range(3)]
    assert layers[1].experts == tuple(f"blocks.1.experts.{e}" for e in range(8))


def test_each_token_runs_exactly_top_k_experts(model):
    ids = torch.randint(0, 97, (B, T))
    logits = record(model, ids)
    counts = counted_forward(model, ids)
    for i in range(CFG.n_layer):
        assert sum(n for p, n in counts.items() if p.startswith(f"blocks.{i}.")) == 2 * B * T
    assert counts == expected_counts(model, logits)
    assert 0 in counts.values() or len(set(counts.values())) > 1  # routing is not uniform


def test_mixture_equals_brute_force_dense_top2(model):
    torch.manual_seed(1)
    block = model.blocks[0]
    x = torch.randn(B, T, CFG.n_embd)
    logits = torch.randn(B, T, 8)
    with torch.no_grad():
        block.expert_bias.normal_()
        got = block.mixture(x, *route(logits, 2))
        every = torch.stack([expert(x) for expert in block.experts], dim=-2)  # [B, T, E, C]
    top = logits.softmax(-1).topk(2, dim=-1)  # Mixtral: full softmax, top-2, renormalise
    probs = torch.zeros_like(logits).scatter(-1, top.indices,
                                             top.values / top.values.sum(-1, keepdim=True))
    want = (probs.unsqueeze(-1) * every).sum(-2) + block.expert_bias
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)


def test_identity_replay_is_bitwise_exact(model):
    ids = torch.randint(0, 97, (B, T))
    with torch.no_grad():
        live = model(ids)
    coeffs = record(model, ids)
    with torch.no_grad(), replay(model, coeffs):
        replayed = model(ids)
    assert torch.equal(live.view(torch.uint8), replayed.view(torch.uint8))


def test_replayed_logits_of_another_sequence_decide_the_experts(model):
    ids = torch.randint(0, 97, (2, 1, T))
    own, donor = record(model, ids[0]), record(model, ids[1])
    with replay(model, donor):
        counts = counted_forward(model, ids[0])
    assert counts == expected_counts(model, donor)
    assert counts != expected_counts(model, own)
    with torch.no_grad():
        live = model(ids[0])
        with replay(model, donor):
            assert not torch.allclose(model(ids[0]), live)


def test_load_balance_formula_on_hand_made_routing():
    # 4 tokens, 4 experts, top-2; f = assignment shares, P = mean softmax probabilities
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0], [2.0, 0.0, 1.0, 0.0],
                           [0.0, 2.0, 1.0, 0.0], [2.0, 1.0, 0.0, -1.0]])
    chosen = route(logits, 2)[1]
    assert np.array_equal(np.sort(chosen.numpy(), 1), np.sort(reference_top_k(logits, 2), 1))
    want = reference_load_balance(logits, reference_top_k(logits, 2))
    assert load_balance(logits, chosen).item() == pytest.approx(want, rel=1e-6)
    assert load_balance(logits, chosen) >= 1
    uniform = torch.zeros(4, 4)
    assert torch.allclose(load_balance(uniform, torch.tensor([[0, 1], [2, 3]] * 2)),
                          torch.tensor(1.0))
    # all assignments and all probability on experts 0 and 1: E / 2
    peaked = torch.tensor([[30.0, 30.0, 0.0, 0.0]] * 4)
    assert torch.allclose(load_balance(peaked, route(peaked, 2)[1]), torch.tensor(2.0))


def test_aux_loss_is_weighted_mean_in_training_and_zero_in_eval(model):
    ids = torch.randint(0, 97, (B, T))
    logits = record(model, ids)
    model.train()
    model(ids)
    layers = [reference_load_balance(v, reference_top_k(v, 2)) for v in logits.values()]
    assert all(x >= 1 for x in layers)  # seeded: >= 1 is typical, not a theorem
    assert model.aux_loss.item() == pytest.approx(CFG.aux_loss_coef * np.mean(layers),
                                                  rel=1e-5)
    model.aux_loss.backward()
    assert model.blocks[0].router.weight.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad():
        model(ids)
    assert model.aux_loss == 0.0


@pytest.mark.parametrize("preset", ["tiny", "76m"])
def test_dense_twin_has_the_active_parameters(preset):
    with torch.device("meta"):
        model = MoEGPT(PRESETS[preset])
        dense = model.dense_counterpart()
    cfg = model.config
    expert = sum(p.numel() for p in model.blocks[0].experts[0].parameters())
    router = sum(p.numel() for p in model.blocks[0].router.parameters())
    total = sum(p.numel() for p in model.parameters())
    active = total - cfg.n_layer * (router + (cfg.num_experts - cfg.top_k) * expert)
    assert sum(p.numel() for p in dense.parameters()) == active
    assert type(dense.config).__name__ == "GPTConfig" and not dense.config.gated


def test_run_folder_round_trips(tmp_path):
    folder = train("moe", "tiny", 0, tmp_path / "run", steps=2, progress=False)
    assert json.loads((folder / "config.json").read_text())["model_config"]["num_experts"] == 8
    loaded = load(str(folder))
    assert isinstance(loaded.model, MoEGPT) and not loaded.model.training
    ids = torch.randint(0, loaded.model.config.vocab_size, (1, 16))
    coeffs = record(loaded.model, ids)
    assert coeffs["blocks.3.router"].shape == (1, 16, 8)


@pytest.mark.slow
def test_short_training_lowers_the_loss(tmp_path):
    folder = train("moe", "tiny", 0, tmp_path / "run", steps=60, progress=False)
    log = [json.loads(line) for line in (folder / "train_log.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in log if "loss" in row]
    assert losses[-1] < losses[0] - 1.0
    results = json.loads((folder / "config.json").read_text())["results"]
    assert results["eval_nll"] < results["unigram_nll"]
