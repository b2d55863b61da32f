"""The savings frontier: NLL penalty against FLOPs that could be
skipped, dynamic rule vs static rules. Planted toys give known answers computed here by
hand (numpy), not by the code under test: a per-layer constant gate (static-layer curve =
dynamic curve), an informative gate (dynamic beats static), top-p routing against a numpy
reference, FLOPs equal to the execution audit's counts, SkipGate on its own curve, resume
and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_inprocess
from toys import (
    TOY_GATE_CONSTANTS,
    TOY_GATE_LAYERS,
    TOY_UPDATE,
    V,
    constant_gated_model,
    informative_gated_model,
    inverted_gated_model,
    pair_sequences,
)

from fcaudit.api import audit
from fcaudit.core.errors import FcauditError
from fcaudit.core.recording import record
from fcaudit.core.routers import drop_experts, top_p_keep
from fcaudit.engine.frontier import levels
from fcaudit.engine.result import AuditResult
from fcaudit.engine.run import AuditOptions
from fcaudit.io.data import AuditData
from fcaudit.report.figures import Span

N, T = 8, 16
OPTIONS = AuditOptions(repeats=1, bootstrap=200, batch_size=4, per_layer=False, timing_pairs=0,
                       progress=False, frontier=True, expert_ablation=False)
BLOCK_FLOPS = 2 * (2 * V) ** 2  # one 2V x 2V matmul per token


def _data() -> AuditData:
    return AuditData(pair_sequences(N, T, 1), pair_sequences(N, T, 2), {})


def hand_nll(ids: np.ndarray, logit: np.ndarray) -> np.ndarray:
    """Per-sequence mean NLL when the logit of ``x_t + 1`` is ``logit[n, t]`` and every other
    logit 0 (the toys' output), scored on positions 0..T-2."""
    a, hit = logit[:, :-1], ids[:, 1:] == (ids[:, :-1] + 1) % V
    return (np.log(np.exp(a) + V - 1) - a * hit).mean(axis=1)


def penalty_of(ids: np.ndarray, gates: np.ndarray) -> float:
    """``gates [L, N, T]`` fed to the toy, against its recorded gates."""
    return float((hand_nll(ids, TOY_UPDATE * gates.sum(0)) - hand_nll(ids, TOY_UPDATE * full(
        ids)).mean()).mean())


def full(ids: np.ndarray) -> np.ndarray:
    return np.stack([np.full(ids.shape, c) for c in TOY_GATE_CONSTANTS]).sum(0)


@pytest.fixture(scope="module")
def constant(tmp_path_factory: pytest.TempPathFactory) -> tuple[AuditResult, Path]:
    out = tmp_path_factory.mktemp("constant")
    return audit(constant_gated_model(), out, data=_data(), options=OPTIONS), out


def test_constant_gate_static_layer_curve_is_the_dynamic_curve(constant) -> None:
    """Per-layer constants: thresholds between them zero whole layers, lowest gate first,
    as static-layer does; every point's penalty is the hand-computed one, and the
    static-layer curve equals the dynamic one wherever both reach."""
    result, _ = constant
    fam = result.frontier["toygate"]
    ids = _data().eval_ids
    pooled = np.repeat(TOY_GATE_CONSTANTS, N * T)  # calibration gates (same constants)
    order = np.argsort(TOY_GATE_CONSTANTS, kind="stable")
    for p in fam.points:
        if p.rule == "dynamic":
            tau = float(np.quantile(pooled, p.level))
            assert p.threshold == pytest.approx(tau)
            zeroed = [i for i, c in enumerate(TOY_GATE_CONSTANTS) if c < tau]
        elif p.rule == "static-layer":
            zeroed = sorted(order[:max(1, round(p.level * TOY_GATE_LAYERS))].tolist())
            assert p.layers == zeroed
        else:
            continue
        gates = np.stack([np.full(ids.shape, 0.0 if i in zeroed else c)
                          for i, c in enumerate(TOY_GATE_CONSTANTS)])
        expected = float((hand_nll(ids, TOY_UPDATE * gates.sum(0))
                          - hand_nll(ids, TOY_UPDATE * sum(TOY_GATE_CONSTANTS)
                                     * np.ones(ids.shape))).mean())
        assert p.delta == pytest.approx(expected, abs=1e-6)
        assert p.flops_saved_fraction == pytest.approx(len(zeroed) / TOY_GATE_LAYERS)
        assert p.skipped_fraction == pytest.approx(len(zeroed) / TOY_GATE_LAYERS)
    assert [p.level for p in fam.points if p.rule == "static-layer"] == [levels(6)[i]
                                                                          for i in (0, 2, 4, 5)]
    for m in fam.matched:
        if m.dynamic is not None and m.static["static-layer"] is not None:
            assert m.static["static-layer"].value == pytest.approx(m.dynamic.value, abs=1e-12)
            assert m.gap["static-layer"].value == pytest.approx(0.0, abs=1e-12)
            assert m.gap["static-layer"].ci95 == pytest.approx([0.0, 0.0], abs=1e-12)
    assert fam.area["static-layer"].value == pytest.approx(0.0, abs=1e-12)
    assert "matches the dynamic one" in fam.sentence


def test_frontier_flops_equal_the_execution_audits_counts(constant) -> None:
    result, _ = constant
    fam, ex = result.frontier["toygate"], result.execution
    assert ex.dense_flops_per_block == [BLOCK_FLOPS] * TOY_GATE_LAYERS  # by hand
    assert fam.flops_per_unit == ex.dense_flops_per_block
    assert fam.total_flops_per_token == ex.dense_flops_per_token == BLOCK_FLOPS * TOY_GATE_LAYERS
    for p in fam.points:
        assert p.flops_saved_per_token == pytest.approx(
            p.skipped_fraction * TOY_GATE_LAYERS * BLOCK_FLOPS)
        assert p.flops_saved_fraction == pytest.approx(
            p.flops_saved_per_token / ex.dense_flops_per_token)
    assert fam.check is None  # every block runs: nothing measured to check


def test_frontier_in_audit_json_frame_and_report(constant) -> None:
    result, out = constant
    saved = json.loads((out / "audit.json").read_text())
    assert AuditResult.from_json(saved).frontier == result.frontier
    assert set(saved["frontier"]["toygate"]) >= {"points", "matched", "area", "sentence"}
    frame = result.to_frame("frontier")
    points = result.frontier["toygate"].points
    assert list(frame["rule"]) == [p.rule for p in points]
    assert list(frame["delta"]) == [p.delta for p in points]
    assert list(frame["flops_saved_fraction"]) == [p.flops_saved_fraction for p in points]
    assert result.settings["frontier_runs"] == len(points)
    report = (out / "report.md").read_text()
    assert "## Savings frontier" in report and result.frontier["toygate"].sentence in report
    assert report.count("| dynamic |") == sum(p.rule == "dynamic" for p in points)
    assert (out / "figures" / "frontier.png").exists()
    from fcaudit.report.figures import frontier_figure
    fig = frontier_figure({"toygate": {"dynamic": [(0.5, Span(0.1, 0.0, 0.2))]}})
    (ax,) = fig.axes
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("FLOPs saved (%)", "Δ NLL vs correct (nats)")
    assert list(ax.lines[0].get_xdata()) == [0.0, 50.0]


def test_informative_gate_dynamic_beats_static(tmp_path: Path) -> None:
    """Gates are 1 for tokens below V / 2 and exactly 0 elsewhere: the dynamic rule skips
    the zero-gate half for nothing; zeroing whole layers costs the hand-computed penalty."""
    result = audit(informative_gated_model(), None, data=_data(), options=OPTIONS)
    fam = result.frontier["toygate"]
    ids = _data().eval_ids
    on = (ids < V // 2).astype(float)
    for p in fam.points:
        if p.rule == "dynamic" and p.threshold == 1.0:
            assert p.delta == 0.0 and p.ci95 == [0.0, 0.0]
            assert p.flops_saved_fraction == pytest.approx(1 - on.mean())
        if p.rule == "static-layer":
            kept = TOY_GATE_LAYERS - len(p.layers)
            expected = float((hand_nll(ids, TOY_UPDATE * kept * on)
                              - hand_nll(ids, TOY_UPDATE * TOY_GATE_LAYERS * on)).mean())
            assert p.delta == pytest.approx(expected, abs=1e-6)
    head = next(m for m in fam.matched if m.saved == 0.25)
    assert head.dynamic.value == 0.0
    for rule in ("static-layer", "static-layer-position"):
        assert head.gap[rule].ci95[0] > 0, rule  # static loses
        assert fam.area[rule].value > 0
    assert fam.gap_at_25.ci95[0] > 0 and "loses to the dynamic one" in fam.sentence


def test_inverted_gate_switches_off_the_smallest_update_first() -> None:
    """Gates declared ``Gate(off=1.0)`` scale ``1 - g``: the layers' updates are 0.1, 0.7,
    0.3 and 0.5 (gates 0.9, 0.3, 0.7, 0.5). Every rule switches off the smallest update
    first (layer 0, the largest gate), never the smallest gate (layer 1, the largest
    update); thresholds, layers and penalties are the ones worked out here by hand."""
    result = audit(inverted_gated_model(), None, data=_data(), options=OPTIONS)
    fam = result.frontier["toygate"]
    assert fam.reason is None
    ids = _data().eval_ids
    updates = [0.1, 0.7, 0.3, 0.5]  # 1 - gate, per layer

    def delta(off: list[int]) -> float:
        kept = sum(u for i, u in enumerate(updates) if i not in off)
        return float((hand_nll(ids, TOY_UPDATE * kept * np.ones(ids.shape))
                      - hand_nll(ids, TOY_UPDATE * sum(updates) * np.ones(ids.shape))).mean())
    # level -> (threshold on |g - 1|, layers below it): quantiles of 4 equal groups of
    # N*T calibration gates; the 0.45 level repeats 0.3's threshold and is dropped
    dynamic = {0.15: (0.1, []), 0.3: (0.3, [0]), 0.6: (0.5, [0, 2]), 0.75: (0.55, [0, 2, 3]),
               0.9: (0.7, [0, 2, 3])}
    static = {0.15: [0], 0.45: [0, 2], 0.75: [0, 2, 3], 0.9: [0, 1, 2, 3]}  # round(4 q)
    got = {(p.rule, round(p.level, 2)): p for p in fam.points}
    assert sorted(k for r, k in got if r == "dynamic") == sorted(dynamic)
    assert sorted(k for r, k in got if r == "static-layer") == sorted(static)
    for level, (tau, off) in dynamic.items():
        p = got["dynamic", level]
        assert p.threshold == pytest.approx(tau, rel=1e-6)
        assert p.flops_saved_fraction == pytest.approx(len(off) / TOY_GATE_LAYERS)
        assert p.delta == pytest.approx(delta(off), abs=1e-6)
    for level, off in static.items():
        assert got["static-layer", level].layers == off
        assert got["static-layer", level].delta == pytest.approx(delta(off), abs=1e-6)
    head = next(m for m in fam.matched if m.saved == 0.25)  # layer 0 off: update 0.1 gone
    assert head.dynamic.value == pytest.approx(delta([0]), abs=1e-6)
    # the other order (smallest gate first) removed the 0.7 update: +0.3476 against +0.0480
    assert (round(delta([0]), 4), round(delta([1]), 4)) == (0.0480, 0.3476)
    assert "matches the dynamic one" in fam.sentence


# ---- routers: top-p against numpy; the extra picked expert weighs exactly 0 ----

def numpy_top_p(logits: np.ndarray, k: int, p: float) -> tuple[np.ndarray, np.ndarray]:
    """Per token: the kept experts (top logits, -1 padded to k) and their renormalised
    weights (softmax over the kept logits)."""
    flat = logits.reshape(-1, logits.shape[-1]).astype(np.float64)
    order = np.argsort(-flat, axis=-1, kind="stable")[:, :k]
    top = np.take_along_axis(flat, order, axis=-1)
    w = np.exp(top - top.max(-1, keepdims=True))
    cum = np.cumsum(w / w.sum(-1, keepdims=True), axis=-1)
    experts, weights = np.full_like(order, -1), np.zeros_like(top)
    for i in range(len(flat)):
        n = min(k, int(np.argmax(cum[i] >= p - 1e-12)) + 1 if (cum[i] >= p - 1e-12).any() else k)
        kw = np.exp(top[i, :n] - top[i, :n].max())
        experts[i, :n], weights[i, :n] = order[i, :n], kw / kw.sum()
    return experts, weights


def test_tiny_moe_top_p_routing_matches_numpy() -> None:
    from fcaudit.core.replaying import replay
    from fcaudit.models.moe import MoEConfig, MoEGPT, route
    torch.manual_seed(0)
    model = MoEGPT(MoEConfig(vocab_size=97, block_size=32, n_layer=2, n_head=2, n_embd=24,
                             num_experts=4, top_k=3)).eval()
    for block in model.blocks:
        torch.nn.init.normal_(block.router.weight, std=1.0)
    ids = torch.randint(0, 97, (2, 12))
    sites = model.controller_sites()
    with torch.no_grad():
        cached = record(model, ids, sites)
    for p in (0.5, 0.8, 0.95):
        fed = {s: drop_experts(cached[s.name], top_p_keep(cached[s.name], 3, p)) for s in sites}
        seen: dict = {}
        hooks = [b.register_forward_hook(lambda _m, a, o, i=i, seen=seen: seen.update(
            {i: (a[0], o)}))
                 for i, b in enumerate(model.blocks)]
        with torch.no_grad(), replay(model, fed):
            model(ids)
        for h in hooks:
            h.remove()
        for i, (site, block) in enumerate(zip(sites, model.blocks, strict=True)):
            experts, weights = numpy_top_p(cached[site.name].numpy(), 3, p)
            got_w, got_e = route(fed[site], 3)
            got_w, got_e = got_w.reshape(-1, 3).double().numpy(), got_e.reshape(-1, 3).numpy()
            kept = experts >= 0
            assert np.array_equal(got_e[kept], experts[kept])  # the kept ones, in order
            assert (got_w[~kept] == 0).all()  # every extra pick weighs exactly 0
            np.testing.assert_allclose(got_w, weights, rtol=1e-6, atol=1e-7)
            h_in, out = seen[i]
            with torch.no_grad():
                h = h_in + block.attn(block.ln_1(h_in))
                x = block.ln_2(h)
                e = torch.from_numpy(np.where(kept, experts, 0)).view(*x.shape[:2], 3)
                want = h + block.mixture(x, torch.from_numpy(weights).float().view(
                    *x.shape[:2], 3), e)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_tiny_moe_frontier_uses_the_per_slot_expert_flops() -> None:
    from fcaudit.models.moe import MoEConfig, MoEGPT
    torch.manual_seed(0)
    model = MoEGPT(MoEConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16,
                             num_experts=4, top_k=2))
    result = audit(model, None, data=_data(), options=OPTIONS)
    fam, ex = result.frontier["moe"], result.execution.experts
    assert fam.kind == "router" and fam.flops_per_unit == ex.flops_per_slot_per_layer
    assert sum(x * k for x, k in zip(fam.flops_per_unit, ex.experts_per_token_per_layer,
                                     strict=True)) == pytest.approx(
        ex.active_expert_flops_per_token)
    assert {p.rule for p in fam.points} == {"dynamic", "static-k"}
    for p in fam.points:
        assert p.flops_saved_fraction == pytest.approx(
            p.flops_saved_per_token / result.execution.flops_per_token)
        if p.rule == "static-k":
            saved = sum((2 - k) * c for k, c in zip(p.layers, fam.flops_per_unit, strict=True))
            assert p.flops_saved_per_token == pytest.approx(saved)


# ---- SkipGate, which really skips: its own point sits on its dynamic curve ----

def _skipgate(shares: tuple[float, ...]) -> torch.nn.Module:
    """A 2-layer SkipGate whose blocks skip ``shares`` of the evaluation tokens, each by
    its own threshold (so no single pooled threshold reproduces its skips)."""
    from fcaudit.models.skipgate import SkipGateConfig, SkipGateGPT
    torch.manual_seed(0)
    model = SkipGateGPT(SkipGateConfig(vocab_size=64, block_size=16, n_layer=len(shares),
                                       n_head=2, n_embd=16)).eval()
    sites = model.controller_sites()
    for block in model.blocks:
        torch.nn.init.normal_(block.gate.proj.weight, std=1.0)
    gates = record(model, torch.from_numpy(_data().eval_ids), sites)
    for block, site, q in zip(model.blocks, sites, shares, strict=True):
        g = np.sort(gates[site.name].double().numpy().reshape(-1))
        j = int(q * g.size)
        block.threshold.fill_(float((g[j - 1] + g[j]) / 2))  # between two recorded gates
    return model


def test_skipgate_sits_on_its_own_dynamic_curve() -> None:
    shares = (0.3, 0.6)
    model = _skipgate(shares)
    result = audit(model, None, data=_data(), options=OPTIONS)
    fam, ex = result.frontier["skipgate"], result.execution
    gates = record(model, torch.from_numpy(_data().eval_ids), model.controller_sites())
    g = [gates[f"blocks.{i}.gate"].double().numpy().reshape(-1) for i in range(2)]
    own = [g[i] < float(model.blocks[i].threshold) for i in range(2)]
    assert [float(m.mean()) for m in own] == pytest.approx(list(shares), abs=0.05)
    assert [1 - e for e in ex.blocks_executed_per_layer] == \
        pytest.approx([float(m.mean()) for m in own])
    point = next(p for p in fam.points if p.own_thresholds)
    assert point.delta == 0.0 and point.ci95 == [0.0, 0.0]  # zeroing = skipping, bit for bit
    assert point.skipped_fraction == pytest.approx(float(np.mean(own)))
    per_block = ex.dense_flops_per_block
    accounted = sum(c * m.mean() for c, m in zip(per_block, own, strict=True))
    assert point.flops_saved_fraction == pytest.approx(accounted / ex.dense_flops_per_token)
    check = fam.check
    assert check is not None and check.on_curve, check
    assert check.accounted_flops_saved_fraction == pytest.approx(point.flops_saved_fraction)
    assert (check.delta, check.ci95) == (0.0, [0.0, 0.0])
    measured = (ex.dense_flops_per_token - ex.flops_per_token) / ex.dense_flops_per_token
    assert check.measured_flops_saved_fraction == pytest.approx(measured)
    assert abs(measured - point.flops_saved_fraction) <= 0.05
    assert check.pooled_curve_delta is not None
    # no rule saves less than the model does on its own: the curves start at its point
    assert all(p.flops_saved_fraction >= point.flops_saved_fraction - 1e-12 for p in fam.points)
    below = [m for m in fam.matched if m.saved < point.flops_saved_fraction]
    assert below and all(m.dynamic is None and set(m.gap.values()) == {None} for m in below)
    # every other point skips, beside what its rule zeroes, what the model skips anyway
    for p in fam.points:
        if p.rule == "dynamic" and not p.own_thresholds:
            union = [(x < p.threshold) | m for x, m in zip(g, own, strict=True)]
            assert p.skipped_fraction == pytest.approx(float(np.mean(union))), p
        if p.rule == "static-layer":
            union = [np.ones_like(m) if i in p.layers else m for i, m in enumerate(own)]
            assert p.skipped_fraction == pytest.approx(float(np.mean(union))), p


def test_a_model_that_skips_by_no_threshold_on_its_gate_gets_no_curves(monkeypatch) -> None:
    """A block that skips every other token whatever its gate: no threshold on the recorded
    gate reproduces its counts, so the FLOPs a rule would save cannot be counted."""
    from fcaudit.models.skipgate import SkipBlock
    model = _skipgate((0.5, 0.5))
    monkeypatch.setattr(SkipBlock, "select", lambda self, g: torch.arange(
        g.shape[1]).expand_as(g) % 2 == 0)
    result = audit(model, None, data=_data(), options=OPTIONS)
    fam = result.frontier["skipgate"]
    assert fam.points == [] and fam.check is None
    assert "its skips are not a threshold on the recorded gate" in fam.reason


# ---- resumable, digest-checked; options and the CLI ----

def test_rerun_reuses_frontier_runs_only_when_digests_match(constant) -> None:
    result, out = constant
    again = audit(constant_gated_model(), out, data=_data(), options=OPTIONS)
    reuse = again.runtime.reuse
    assert reuse["batches_recomputed"] == 0 and reuse["batches_reused"] == N // 4
    assert again.frontier == result.frontier
    fewer = audit(constant_gated_model(), out, data=_data(),
                  options=AuditOptions(**{**OPTIONS.__dict__, "frontier_points": 3}))
    assert fewer.runtime.reuse["batches_reused"] == 0  # other points: other feeds
    assert [p.level for p in fewer.frontier["toygate"].points
            if p.rule == "dynamic"] == pytest.approx([0.3, 0.6, 0.9])


def test_options_are_validated_before_work(tmp_path: Path) -> None:
    for bad, fragment in ((dict(frontier_points=1), "frontier_points=1"),
                          (dict(frontier_points=21), "frontier_points=21"),
                          (dict(frontier="yes"), "frontier='yes'"),
                          (dict(execution=False), "is read only with the execution audit")):
        with pytest.raises(FcauditError, match=fragment):
            AuditOptions(**{**OPTIONS.__dict__, **bad}).validate()
    import toys
    with pytest.raises(FcauditError, match=r"AuditOptions\(frontier=True\): the audited sites"):
        audit(toys.content_model(), tmp_path / "out", sites=["gates.*"], data=_data(),
              options=OPTIONS)
    assert not (tmp_path / "out").exists()


def test_cli_frontier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.save(tmp_path / "eval.npy", _data().eval_ids)
    np.save(tmp_path / "calib.npy", _data().calib_ids)
    base = ["audit", "--model", "toys:constant_gated_model", "--tokens", tmp_path / "eval.npy",
            "--calib-tokens", tmp_path / "calib.npy", "--quiet", "--repeats", "1",
            "--bootstrap", "50", "--no-per-layer", "--batch-size", "4", "--timing-pairs", "0"]
    bad = run_inprocess([*base, "--out", tmp_path / "bad", "--frontier", "--frontier-points",
                         "0"], capsys)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "--frontier-points 0: must be an integer between 2 and 20" in bad.stderr
    assert not (tmp_path / "bad").exists()
    res = run_inprocess([*base, "--out", tmp_path / "out", "--frontier", "--frontier-points",
                         "3"], capsys)
    assert res.returncode == 0, res.stderr
    saved = json.loads((tmp_path / "out" / "audit.json").read_text())
    assert saved["settings"]["frontier"] is True and saved["settings"]["frontier_points"] == 3
    assert "toygate" in saved["frontier"]


# ---- Qwen2-MoE's shared-expert gates: a pre-sigmoid logit, switched off at -inf ----

def test_shared_expert_gates_are_switched_off_at_minus_inf(tmp_path: Path) -> None:
    """The shared-expert gate is a logit passed through a sigmoid: 'gate = 0' would keep
    half the shared expert. The frontier feeds -inf (checked on the first batch to remove
    exactly the shared expert's update), and counts the shared expert's own FLOPs."""
    pytest.importorskip("transformers")
    from conftest import FAMILIES, save, token_batches

    from fcaudit.io.data import folder_tokenizer
    folder = save(FAMILIES["qwen2_moe"][0](), tmp_path / "qwen2-moe")
    x, calib = token_batches(folder_tokenizer(folder))
    data = AuditData(x.numpy(), calib.numpy(), {})
    result = audit(str(folder), None, data=data, options=OPTIONS)
    fam = result.frontier["shared_expert_gate"]
    assert fam.reason is None and fam.kind == "gate"
    hidden, inter = 32, 32  # the config's hidden_size and shared_expert_intermediate_size
    swiglu = 3 * 2 * hidden * inter  # gate, up and down projections, 2 FLOPs per MAC
    assert fam.flops_per_unit == [swiglu, swiglu]
    assert fam.total_flops_per_token == result.execution.flops_per_token
    everything = next(p for p in fam.points if p.rule == "static-layer" and p.layers == [0, 1])
    assert everything.flops_saved_per_token == pytest.approx(2 * swiglu)
    # reference: the same model with the shared experts' outputs zeroed by hand
    import transformers
    net = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    handles = [net.get_submodule(f"model.layers.{i}.mlp.shared_expert").register_forward_hook(
        lambda m, a, out: torch.zeros_like(out)) for i in range(2)]
    with torch.no_grad():
        logp = torch.log_softmax(net(x).logits.double(), -1)
    for h in handles:
        h.remove()
    nll = -logp[:, :-1].gather(-1, x[:, 1:, None]).squeeze(-1).mean(1).numpy()
    assert everything.nll == pytest.approx(float(nll.mean()), rel=1e-5)


def test_a_gate_whose_off_value_does_not_switch_its_module_off_gets_no_curves(
        tmp_path: Path, monkeypatch) -> None:
    """A gate declared to switch its module off at a value that does not (here 0, which
    the sigmoid makes 1/2): refused by the first-batch check, with the reason in place of
    the curves, never a number."""
    pytest.importorskip("transformers")
    from conftest import FAMILIES, save, token_batches

    import fcaudit.core.routers as routers
    from fcaudit.io.data import folder_tokenizer
    monkeypatch.setattr(routers, "SHARED_GATE_OFF", 0.0)  # sigmoid(0) = 1/2: not off
    folder = save(FAMILIES["qwen2_moe"][0](), tmp_path / "qwen2-moe")
    x, calib = token_batches(folder_tokenizer(folder))
    result = audit(str(folder), None, data=AuditData(x.numpy(), calib.numpy(), {}),
                   options=OPTIONS)
    fam = result.frontier["shared_expert_gate"]
    assert fam.points == [] and "does not remove exactly one module per gate" in fam.reason


def test_a_coefficient_that_only_reweights_gets_no_curves(monkeypatch) -> None:
    """One coefficient per token that reweights its block (``h + (1 + c) F(h)``): at 0 the
    block still runs, so zeroing it saves nothing; the first-batch check finds that no
    module is switched off, and the family gets a reason, not a frontier priced as skips."""
    from fcaudit.models.featuregate import GPT, Block, GPTConfig

    def forward(self: Block, h: torch.Tensor) -> torch.Tensor:
        if self.gate is None:
            return h + self.body(h)
        return h + (1 + self.gate(h)) * self.body(h)
    monkeypatch.setattr(Block, "forward", forward)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)).eval()
    result = audit(model, None, data=_data(), options=OPTIONS)
    fam = result.frontier["featuregate"]
    assert fam.points == [] and fam.matched == []
    assert "do not switch a computation off" in fam.reason
