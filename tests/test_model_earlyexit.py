"""Early exit (CALM-style) and Ponder (PonderNet halting): exits are real, follow the fed
scores, and match an independent loop-by-loop reference."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from fcaudit.core.contract import DeclaresExits, Exit
from fcaudit.core.exits import (
    exit_layers,
    exit_scores,
    head_predictions,
    oracle_layers,
    own_exits,
)
from fcaudit.core.interventions import reassign, shuffle
from fcaudit.core.recording import record
from fcaudit.core.replaying import replay
from fcaudit.io.arches import get_arch
from fcaudit.io.loading import load
from fcaudit.models.earlyexit import EarlyExitConfig, EarlyExitGPT
from fcaudit.models.featuregate import GPT
from fcaudit.models.ponder import PonderConfig, PonderGPT
from fcaudit.study.train import train

CFG = EarlyExitConfig(vocab_size=61, block_size=16, n_layer=4, n_head=2, n_embd=16,
                      exit_threshold=0.5)
PCFG = PonderConfig(vocab_size=61, block_size=16, n_layer=1, n_head=2, n_embd=16, max_steps=4)
B, T = 3, 10


def spread(model: torch.nn.Module) -> torch.nn.Module:
    """Large classifier weights, so that scores straddle the threshold token by token."""
    for name, p in model.named_parameters():
        if (".score." in name or name.startswith("unit.")) and name.endswith("proj.weight"):
            torch.nn.init.normal_(p, std=2.0)
    return model.eval()


@pytest.fixture
def model() -> EarlyExitGPT:
    torch.manual_seed(0)
    return spread(EarlyExitGPT(CFG))


@pytest.fixture
def ponder() -> PonderGPT:
    torch.manual_seed(1)
    return spread(PonderGPT(PCFG))


def ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def entering(model: torch.nn.Module, x: torch.Tensor) -> list[int]:
    """Tokens entering each execution block (forward pre-hooks, rows of the packed input)."""
    counts = [0] * len(model.execution_blocks())

    def count(i: int, x: torch.Tensor) -> None:
        counts[i] += x.numel() // x.shape[-1]
    handles = [model.get_submodule(p).register_forward_pre_hook(
        lambda _m, args, i=i: count(i, args[0])) for i, p in enumerate(model.execution_blocks())]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return counts


def reference_forward(model: EarlyExitGPT, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token with explicit loops: a running token attends to every earlier
    position, an exited one's keys and values are those of its frozen state (CALM); it
    exits after layer l where its score reaches the threshold. Logits and exit layers."""
    cfg, C, H = model.config, CFG.n_embd, CFG.n_head
    d = C // H
    h = (model.wte(x) + model.wpe(torch.arange(x.shape[1]))).double()
    L = len(model.blocks)
    exit_at = torch.full(x.shape, L - 1)
    running = torch.ones(x.shape, dtype=torch.bool)
    for layer, block in enumerate(model.blocks):
        body = block.body.double()
        new = h.clone()
        for b in range(x.shape[0]):
            kv = body.attn.qkv(body.ln_1(h[b]))[:, C:]
            for t in range(x.shape[1]):
                if not running[b, t]:
                    continue
                q = body.attn.qkv(body.ln_1(h[b, t]))[:C]
                heads = []
                for j in range(H):
                    k, v = kv[:t + 1, j * d:(j + 1) * d], kv[:t + 1, C + j * d:C + (j + 1) * d]
                    w = torch.softmax(k @ q[j * d:(j + 1) * d] / d ** 0.5, 0)
                    heads.append(w @ v)
                a = body.attn.proj(torch.cat(heads))
                new[b, t] = h[b, t] + a + body.mlp(body.ln_2(h[b, t] + a))
        h = new
        if block.score is not None:
            score = block.score.double()(h)[..., 0]
            stop = running & (score >= cfg.exit_threshold)
            exit_at[stop] = layer
            running &= ~stop
    model.float()
    return model.lm_head(model.ln_f(h.float())), exit_at


def test_sites_heads_rules_and_twin(model):
    assert isinstance(model, DeclaresExits) and isinstance(PonderGPT(PCFG), DeclaresExits)
    sites = model.controller_sites()
    assert [s.name for s in sites] == ["blocks.0.score", "blocks.1.score", "blocks.2.score"]
    assert {s.family for s in sites} == {"exit"} and {s.role for s in sites} == {Exit(0.0, 1.0)}
    assert model.exit_heads() == [f"heads.{i}" for i in range(4)]
    assert model.exit_rules() == [f"blocks.{i}.halt" for i in range(3)]
    coeffs = record(model, ids())
    assert [tuple(v.shape) for v in coeffs.values()] == [(B, T, 1)] * 3
    twin = model.dense_counterpart()
    score_params = sum(p.numel() for b in model.blocks if b.score for p in b.score.parameters())
    assert sum(p.numel() for p in twin.parameters()) == \
        sum(p.numel() for p in model.parameters()) - score_params


def test_matches_loop_reference_with_propagated_keys(model):
    x = ids(1)
    logits, exit_at = reference_forward(model, x)
    assert 0 < int((exit_at < 3).sum()) < B * T  # some tokens exit, some run on
    with torch.no_grad():
        torch.testing.assert_close(model(x), logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(own_exits(model, lambda: model(x)), exit_at)
    # tokens entering block l: those with exit layer >= l, counted by hooks
    assert entering(model, x) == [int((exit_at >= i).sum()) for i in range(4)]


def test_full_depth_is_the_dense_twin_with_the_same_weights(model):
    twin = GPT(model.dense_counterpart().config)
    twin.load_state_dict(model.state_dict(), strict=False)
    x = ids(2)
    model.full_depth = True
    with torch.no_grad():
        torch.testing.assert_close(model(x), twin.eval()(x))
    model.full_depth = False


def test_oracle_layers_from_hand_computed_per_layer_argmax(model):
    x = ids(3)
    h, argmaxes = model.wte(x) + model.wpe(torch.arange(T)), []
    with torch.no_grad():
        for block in model.blocks:
            h = h + block.body.mlp(block.body.ln_2(h + (a := block.body.attn(
                block.body.ln_1(h))))) + a
            argmaxes.append(model.lm_head(model.ln_f(h)).argmax(-1).tolist())
    expected = [[min(i for i in range(4) if argmaxes[i][b][t] == argmaxes[3][b][t])
                 for t in range(T)] for b in range(B)]
    preds = head_predictions(model, lambda: model(x))
    assert oracle_layers(preds).tolist() == expected


@pytest.mark.parametrize("layer", [0, 2, 3])
def test_fed_scores_move_the_exits(model, layer):
    x = ids(4)
    coeffs = record(model, x)
    fed = exit_scores(model.controller_sites(), torch.full((B, T), layer), coeffs)
    with replay(model, fed):
        assert entering(model, x) == [B * T if i <= layer else 0 for i in range(4)]
        assert own_exits(model, lambda: model(x)).eq(layer).all()


def test_identity_replay_is_bitwise_exact(model, ponder):
    for net in (model, ponder):
        x = ids(5)
        coeffs = record(net, x)
        with torch.no_grad(), replay(net, coeffs):
            assert torch.equal(net(x), coeffs.output)


def test_ponder_halts_by_cumulative_probability(ponder):
    x = ids(6)
    lams = [v[..., 0].double() for v in record(ponder, x).values()]
    survive, expected = torch.ones(B, T, dtype=torch.float64), torch.full((B, T), 3)
    for n, lam in enumerate(lams):  # by hand: halted once 1 - prod(1 - lambda) >= 0.5
        halt = (1 - survive * (1 - lam) >= 0.5) & (expected == 3)
        expected[halt] = n
        survive = survive * (1 - lam)
    assert torch.equal(own_exits(ponder, lambda: ponder(x)), expected)
    assert entering(ponder, x) == [int((expected >= i).sum()) for i in range(4)]
    fed = exit_scores(ponder.controller_sites(), torch.full((B, T), 1), record(ponder, x))
    with replay(ponder, fed):
        assert entering(ponder, x) == [B * T, B * T, 0, 0]


def test_ponder_twin_is_the_shared_block_at_full_depth(ponder):
    twin = ponder.dense_counterpart().eval()
    twin.load_state_dict(ponder.state_dict(), strict=False)
    x = ids(7)
    ponder.full_depth = True
    with torch.no_grad():
        torch.testing.assert_close(ponder(x), twin(x))
    ponder.full_depth = False
    assert entering(twin, x) == [B * T] * 4
    unit = sum(p.numel() for p in ponder.unit.parameters())
    assert sum(p.numel() for p in twin.parameters()) == \
        sum(p.numel() for p in ponder.parameters()) - unit


def test_layerskip_loss_by_hand(model):
    model.train()
    x = ids(8)
    final = model(x)
    h, expected = model.wte(x) + model.wpe(torch.arange(T)), 0.0
    states = []
    for block in model.blocks:
        h = block.full(h)
        states.append(h)
    last = model.lm_head(model.ln_f(states[-1])).argmax(-1)
    for i in range(3):
        z = model.lm_head(model.ln_f(states[i]))
        lm = F.cross_entropy(z[:, :-1].reshape(-1, CFG.vocab_size), x[:, 1:].reshape(-1))
        s = model.blocks[i].score(states[i])[..., 0]
        agree = (z.argmax(-1) == last).float()
        expected += (i + 1) / 4 * lm + F.binary_cross_entropy(s, agree) / 3
    torch.testing.assert_close(model.aux_loss, expected)
    assert final.shape == (B, T, CFG.vocab_size)


@pytest.mark.parametrize("arch", ["earlyexit", "ponder"])
def test_registry_builds_the_tiny_preset(arch):
    spec = get_arch(arch)
    net = spec.build(spec.config("tiny")).eval()
    assert isinstance(net, DeclaresExits)
    assert len(net.exit_heads()) == len(net.exit_rules()) + 1 == len(net.execution_blocks())
    assert {s.role for s in net.controller_sites()} == {Exit(0.0, 1.0)}


@pytest.mark.slow
def test_short_training_lowers_the_loss_and_round_trips(tmp_path):
    folder = train("earlyexit", "tiny", 0, tmp_path / "run", steps=60, progress=False)
    log = [json.loads(line) for line in (folder / "train_log.jsonl").read_text().splitlines()]
    steps = [row for row in log if "step" in row]  # the last row is the evaluation's
    assert steps[-1]["step"] == 59 and steps[-1]["loss"] < steps[0]["loss"] - 1.0
    loaded = load(str(folder)).model
    assert isinstance(loaded, EarlyExitGPT) and not loaded.training


def test_reassigned_and_shuffled_scores_decide_the_exits(model):
    x = ids(9)
    own = record(model, x)
    order = torch.stack([torch.randperm(T, generator=torch.Generator().manual_seed(b))
                         for b in range(B)])
    for fed in (reassign(own, [1, 2, 0]), shuffle(own, order.numpy())):
        # by hand: the first fed score at or above the threshold (0.5); none: full depth
        scores = torch.stack([v[..., 0] for v in fed.values()])
        expected = exit_layers(scores >= 0.5)
        with replay(model, fed):
            assert torch.equal(own_exits(model, lambda: model(x)), expected)
            assert entering(model, x) == [int((expected >= i).sum()) for i in range(4)]
