"""Expert importance: each routed expert removed from every token's
choice, one replay per layer and expert. Planted toys give known answers (a dead expert
costs exactly 0, a critical one a hand-computed penalty); the tiny MoE and Hugging Face
routers are checked against independent top-k references: the ablated expert never
runs, the next one takes its place, weighted as the family's rule weights it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from toys import TOY_EXPERTS, V, biased_moe, pair_sequences, planted_moe

from fcaudit.api import audit
from fcaudit.core.errors import FcauditError
from fcaudit.core.recording import record
from fcaudit.core.replaying import replay
from fcaudit.core.routers import ABLATION_MARGIN, ablate_expert
from fcaudit.engine.result import AuditResult
from fcaudit.engine.run import AuditOptions
from fcaudit.io.data import AuditData
from fcaudit.models.moe import MoEConfig, MoEGPT

N, T = 8, 16
OPTIONS = AuditOptions(repeats=1, bootstrap=200, batch_size=4, execution=False,
                       per_layer=False, progress=False)


def _data() -> AuditData:
    return AuditData(pair_sequences(N, T, 0), pair_sequences(N, T, 1), {})


def _f(a: float) -> float:
    """NLL of a target whose logit is ``a`` while the other V - 1 logits are 0."""
    return math.log(math.exp(a) + V - 1) - a


def critical_penalty(ids: np.ndarray, weight: float, scale: float = 8.0) -> float:
    """By hand: the critical expert predicts even positions holding a token below V / 2
    with logit ``scale * weight``; without it those positions score log V (zero logits).
    Mean over sequences of the per-sequence mean over the T - 1 scored positions."""
    scored = ids[:, :-1]
    low_even = ((scored < V // 2) & (np.arange(T - 1) % 2 == 0)).sum(axis=1)
    per_seq = low_even * (math.log(V) - _f(scale * weight)) / (T - 1)
    return float(per_seq.mean())


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> tuple[AuditResult, Path]:
    out = tmp_path_factory.mktemp("planted")
    return audit(planted_moe(), out, data=_data(), options=OPTIONS), out


def test_ablated_logit_is_below_every_other_and_leaves_them_bitwise() -> None:
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        logits = (torch.randn(3, 5, 6) * 20).to(dtype)
        logits[0, 0] = -6e4 if dtype == torch.float16 else -1e30  # the dtype's floor
        for e in range(6):
            out = ablate_expert(logits, e)
            others = [j for j in range(6) if j != e]
            assert torch.equal(out[..., others], logits[..., others])
            assert torch.isfinite(out).all()
            assert (out[..., e] < out[..., others].amin(-1)).all()
            probs = out.double().softmax(-1)[..., e]
            assert (probs == 0).all() and (out.double().sigmoid()[..., e][1:] == 0).all()
    assert ablate_expert(torch.zeros(1, 1, 1), 0).item() == torch.finfo(torch.float32).min


def test_planted_dead_and_critical_experts(planted) -> None:
    """Every expert of the planted layer: 0 (never picked) and 3 (never picked) cost
    exactly nothing, 1 costs the hand-computed penalty, 2's removal lets 3 in with a
    smaller weight for 1 (softmax over {1, 3} instead of {1, 2}): a known gain."""
    result, _ = planted
    ids = _data().eval_ids
    base = sigmoid(1.0)  # softmax([3, 2])[0]
    expected = {0: 0.0, 1: critical_penalty(ids, base),
                2: critical_penalty(ids, base) - critical_penalty(ids, sigmoid(2.0)), 3: 0.0}
    summary = result.expert_importance["toy"]
    (layer,) = summary.per_layer
    assert summary.replays == TOY_EXPERTS and [x.expert for x in layer.experts] == [0, 1, 2, 3]
    assert [x.load for x in layer.experts] == [0.0, 0.5, 0.5, 0.0]
    for x in layer.experts:
        assert x.selected_after == 0 and x.reason is None
        assert x.delta == pytest.approx(expected[x.expert], abs=1e-5)
        assert x.ci95[0] - 1e-5 <= expected[x.expert] <= x.ci95[1] + 1e-5
    dead, critical = layer.experts[0], layer.experts[1]
    assert dead.delta == 0.0 and dead.ci95 == [0.0, 0.0]  # importance 0 within its CI
    assert critical.ci95[0] > 0 and layer.experts[2].ci95[1] < 0  # clearly critical, a gain
    assert result.settings["expert_ablation"] is True  # on by default here: the effective value
    assert result.settings["expert_ablation_runs"] == TOY_EXPERTS


def test_importance_in_audit_json_frame_and_report(planted) -> None:
    from fcaudit.report.figures import expert_importance_figure
    result, out = planted
    saved = json.loads((out / "audit.json").read_text())
    assert AuditResult.from_json(saved).expert_importance == result.expert_importance
    items = result.expert_importance["toy"].per_layer[0].experts
    frame = result.to_frame("experts")
    assert list(frame["expert"]) == [0, 1, 2, 3]
    assert list(frame["delta"]) == [x.delta for x in items]
    assert list(frame["ci_low"]) == [x.ci95[0] for x in items]
    assert list(frame["selected_after"]) == [0] * 4
    report = (out / "report.md").read_text()
    assert "## Expert importance" in report and "4 ablation replays" in report
    rows = [line for line in report.splitlines() if line.startswith(("| most", "| least"))]
    # top 3 by delta (1, then 0 and 3 at 0), bottom: the one left, 2
    assert [r.split("|")[4].strip() for r in rows] == ["1", "0", "3", "2"]
    assert (out / "figures" / "expert-importance.png").exists()
    fig = expert_importance_figure({"toy": [[x.delta for x in items]]})
    (ax,) = [a for a in fig.axes if a.images]
    assert np.array_equal(np.asarray(ax.images[0].get_array()), [[x.delta for x in items]])
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("expert", "layer")


def test_an_expert_the_rule_still_picks_is_reported_not_measured() -> None:
    """A score bias (DeepSeek-V3's e_score_correction_bias) picks expert 3 whatever its
    logit: its ablation is said to remove nothing, and no importance is given for it."""
    result = audit(biased_moe(), None, data=_data(), options=OPTIONS)
    (layer,) = result.expert_importance["toy"].per_layer
    assert [x.load for x in layer.experts] == [0.0, 0.5, 0.0, 0.5]
    expected = {0: 0.0, 1: critical_penalty(_data().eval_ids, sigmoid(3.0)), 2: 0.0}
    for x in layer.experts:
        if x.expert == 3:
            assert x.delta is None and x.ci95 is None and x.selected_after == N * T
            assert "still picked it" in x.reason
        else:
            assert x.selected_after == 0 and x.delta == pytest.approx(expected[x.expert],
                                                                      abs=1e-5)


def test_option_is_validated_and_auto_follows_the_expert_count(tmp_path: Path) -> None:
    with pytest.raises(FcauditError, match=r"AuditOptions\(expert_ablation=1\)"):
        AuditOptions(expert_ablation=1).validate()
    off = audit(planted_moe(), None, data=_data(),
                options=AuditOptions(**{**OPTIONS.__dict__, "expert_ablation": False}))
    assert off.expert_importance is None and off.settings["expert_ablation_runs"] == 0
    from toys import content_model
    with pytest.raises(FcauditError, match=r"AuditOptions\(expert_ablation=True\): the "
                                           "audited sites have no router"):
        audit(content_model(), tmp_path / "out", sites=["gates.*"], data=_data(),
              options=AuditOptions(**{**OPTIONS.__dict__, "expert_ablation": True}))
    assert not (tmp_path / "out").exists()  # refused before anything was written
    with pytest.raises(FcauditError, match="give a new name"):  # a run key of the audit's own
        audit(planted_moe(), None, data=_data(), options=OPTIONS,
              interventions={"expert-ablation:1@router": lambda fed, ctx: fed})
    from fcaudit.engine.analyses.expert_importance import ablation_experts
    from fcaudit.models.moe import PRESETS
    sites = MoEGPT(PRESETS["tiny"]).controller_sites()
    auto = AuditOptions()
    assert ablation_experts(sites, auto, {s.name: 64 for s in sites}) == {s: 64 for s in sites}
    assert ablation_experts(sites, auto, {s.name: 65 for s in sites}) == {}
    assert ablation_experts(sites, AuditOptions(expert_ablation=True),
                            {s.name: 65 for s in sites}) == {s: 65 for s in sites}


# ---- the tiny MoE: the ablated expert never runs, the next takes its place ----

def reference_route(logits: torch.Tensor, removed: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Experts and weights with expert ``removed`` deleted: numpy argsort over the other
    experts' logits, a softmax over the k kept (the tiny MoE's renormalised top-k)."""
    flat = logits.detach().double().reshape(-1, logits.shape[-1]).numpy()
    keep = np.array([e for e in range(flat.shape[1]) if e != removed])
    order = np.argsort(-flat[:, keep], axis=-1, kind="stable")[:, :k]
    experts = keep[order]
    top = np.take_along_axis(flat, experts, axis=-1)
    weights = np.exp(top - top.max(-1, keepdims=True))
    return experts, weights / weights.sum(-1, keepdims=True)


def observed_replay(model: torch.nn.Module, block: torch.nn.Module, experts: tuple[str, ...],
                    ids: torch.Tensor, fed: dict) -> dict[str, Any]:
    """Replay ``fed``; the block's input ``h`` and output ``out``, and the tokens entering
    each expert module (by path), counted by hooks."""
    seen: dict[str, Any] = {p: 0 for p in experts}
    handles = [block.register_forward_hook(lambda _m, args, out: seen.update(h=args[0], out=out))]
    handles += [model.get_submodule(p).register_forward_pre_hook(
        lambda _m, args, p=p: seen.__setitem__(p, seen[p] + args[0].shape[0])) for p in experts]
    try:
        with torch.no_grad(), replay(model, fed):
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return seen


def test_tiny_moe_ablation_runs_the_next_expert_with_renormalised_weights() -> None:
    torch.manual_seed(0)
    model = MoEGPT(MoEConfig(vocab_size=97, block_size=32, n_layer=2, n_head=2,
                             n_embd=16)).eval()
    for block in model.blocks:
        torch.nn.init.normal_(block.router.weight, std=1.0)
    ids = torch.randint(0, 97, (2, 12))
    sites = model.controller_sites()
    with torch.no_grad():
        cached = record(model, ids, sites)
    for site, block, layer in zip(sites, model.blocks, model.expert_layers(), strict=True):
        for e in range(len(block.experts)):
            fed = {s: ablate_expert(cached[s.name], e) if s == site else cached[s.name]
                   for s in sites}
            seen = observed_replay(model, block, layer.experts, ids, fed)
            experts, weights = reference_route(cached[site.name], e, block.top_k)
            counts = [seen[p] for p in layer.experts]
            assert counts[e] == 0  # the ablated expert ran on no token
            assert counts == [int((experts == j).sum()) for j in range(len(block.experts))]
            with torch.no_grad():  # the block's output with the reference routing
                h = seen["h"] + block.attn(block.ln_1(seen["h"]))
                x = block.ln_2(h)
                want = h + block.mixture(x, torch.from_numpy(weights).float().view(
                    *x.shape[:2], -1), torch.from_numpy(experts).view(*x.shape[:2], -1))
            torch.testing.assert_close(seen["out"], want, rtol=1e-5, atol=1e-6)


# ---- Hugging Face routers: the family's own rule on the ablated logits ----

def hf_reference(logits: torch.Tensor, removed: int, k: int, renormalise: bool
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over the other experts (the removed one has probability 0), their top-k,
    renormalised over the k when the family does (Mixtral; Qwen3-MoE by default not)."""
    flat = logits.detach().double().reshape(-1, logits.shape[-1]).numpy()
    keep = np.array([e for e in range(flat.shape[1]) if e != removed])
    probs = np.exp(flat[:, keep] - flat[:, keep].max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    order = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    top = np.take_along_axis(probs, order, axis=-1)
    return keep[order], top / top.sum(-1, keepdims=True) if renormalise else top


@pytest.mark.parametrize(("family", "renormalise"), [("mixtral", True), ("qwen3_moe", False)])
def test_hf_router_ablation_follows_the_family_rule(family: str, renormalise: bool,
                                                    tmp_path: Path) -> None:
    from conftest import optional_extra
    optional_extra("transformers")
    from conftest import FAMILIES, save, token_batches

    from fcaudit.core.contract import SiteCall
    from fcaudit.core.replaying import replaying
    from fcaudit.core.routers import counting_experts, moe_expert_layers, moe_router_sites
    from fcaudit.io.hf import load_hf_folder
    model, tokenizer, _ = load_hf_folder(save(FAMILIES[family][0](), tmp_path))
    x, _ = token_batches(tokenizer)
    sites = [s for s in moe_router_sites(model) if s.family == "router"]
    calls: dict[str, SiteCall] = {}
    handles = [model.get_submodule(s.path).register_forward_pre_hook(
        lambda m, args, kwargs, s=s: calls.__setitem__(s.name, SiteCall(m, args, kwargs, *x.shape)),
        with_kwargs=True) for s in sites]
    with torch.no_grad():
        cached = record(model, x, sites)
        model(x)
    for h in handles:
        h.remove()
    for site, layer in zip(sites, moe_expert_layers(model), strict=True):
        for e in range(layer.num_experts):
            ablated = ablate_expert(cached[site.name], e)
            with torch.no_grad():
                _, scores, indices = site.adapter.rebuild(ablated, calls[site.name])
            experts, weights = hf_reference(cached[site.name], e, layer.top_k, renormalise)
            assert np.array_equal(indices.numpy(), experts)
            np.testing.assert_allclose(scores.float().numpy(), weights, rtol=1e-5, atol=1e-6)
            with torch.no_grad(), counting_experts(model, [layer]) as counts, \
                    replaying(model, {s: (ablated if s == site else cached[s.name])
                                      for s in sites}):
                model(x)
            executed = counts[layer.name].per_expert
            assert executed[e] == 0  # never run, on any token
            assert executed.tolist() == [int((experts == j).sum())
                                         for j in range(layer.num_experts)]
    assert ABLATION_MARGIN >= 1e4
