"""Execution audit: block counts, FLOPs, timing arithmetic, the SkipGate reference model,
and the MoE expert-execution keys."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from fcaudit.core.errors import FcauditError
from fcaudit.core.recording import record
from fcaudit.core.replaying import replaying
from fcaudit.engine.execution import (
    execution_pass,
    measure_execution,
    ratio_interval,
    side_summary,
    time_interleaved,
)
from fcaudit.engine.result import Estimate, Execution
from fcaudit.engine.verdicts import verdict_execution
from fcaudit.models.featuregate import GPT, GPTConfig, Update
from fcaudit.models.skipgate import SkipGateConfig, SkipGateGPT

SIZES = dict(vocab_size=50, block_size=16, n_layer=3, n_head=2, n_embd=32)
B, T = 4, 16


def ids(seed: int = 0, batch: int = B) -> torch.Tensor:
    return torch.randint(0, SIZES["vocab_size"], (batch, T), generator=torch.Generator()
                         .manual_seed(seed))


def skipgate(**kw: object) -> SkipGateGPT:
    torch.manual_seed(0)
    return SkipGateGPT(SkipGateConfig(**SIZES, **kw)).eval()


def featuregate() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**SIZES)).eval()


def forced_gates(model: SkipGateGPT, open_mask: list[torch.Tensor]) -> dict:
    """Stub gates: 0.9 where ``open_mask[l]`` ``[B, T]`` is true, 0.1 elsewhere."""
    return {site: torch.where(m, 0.9, 0.1)[..., None]
            for site, m in zip(model.controller_sites(), open_mask, strict=True)}


def pattern(layer: int) -> torch.Tensor:
    """Layer ``l`` runs position ``t`` of sequence ``b`` iff ``(t + b) % (l + 2) == 0``."""
    t, b = torch.arange(T), torch.arange(B)[:, None]
    return (t + b) % (layer + 2) == 0


# --- block execution counts -------------------------------------------------------------

def test_counts_follow_a_known_skip_pattern():
    model = skipgate()
    masks = [pattern(layer) for layer in range(SIZES["n_layer"])]
    with replaying(model, forced_gates(model, masks)):
        counts = execution_pass(model, model.execution_blocks(), [ids()], flops=False)
    expected = [m.float().mean().item() for m in masks]
    assert counts["blocks_executed_per_layer"] == pytest.approx(expected, abs=1e-12)
    assert counts["blocks_executed"] == pytest.approx(sum(expected))
    assert counts["blocks_present"] == 3 and counts["tokens"] == B * T


def test_closed_gates_run_no_block_and_pass_the_residual_stream():
    model = skipgate()
    x = ids()
    closed = [torch.zeros(B, T, dtype=torch.bool)] * SIZES["n_layer"]
    with replaying(model, forced_gates(model, closed)), torch.no_grad():
        counts = execution_pass(model, model.execution_blocks(), [x], flops=False)
        logits = model(x)
        h = model.wte(x) + model.wpe(torch.arange(T))
        assert torch.equal(logits, model.lm_head(model.ln_f(h)))
    assert counts["blocks_executed"] == 0.0


def test_featuregate_and_dense_run_every_block():
    model = featuregate()
    result = measure_execution(model, model.dense_counterpart(), ids(batch=6), batch_size=4,
                               timing=False)
    assert result.blocks_executed == 3.0 and result.dense_blocks_executed == 3.0
    assert result.blocks_executed_per_layer == [1.0, 1.0, 1.0]
    assert 1.0 < result.flops_ratio < 1.01  # the gates' own small matmuls
    assert not result.conditional_execution
    assert result.timing is None and result.speed_ratio_vs_dense is None
    assert verdict_execution(result).startswith("No conditional execution: 3.00 of 3 blocks")


def test_skipgate_saves_blocks_and_flops():
    model = skipgate()  # untrained: the threshold sits at the median of the initial gates
    result = measure_execution(model, model.dense_counterpart(), ids(batch=8), batch_size=4,
                               timing=False)
    assert 0.2 < result.executed_fraction < 0.8
    assert result.flops_ratio < 0.9 and result.conditional_execution
    json.dumps(dataclasses.asdict(result))  # JSON-ready
    again = measure_execution(model, model.dense_counterpart(), ids(batch=8), batch_size=4,
                              timing=False)
    assert (again.blocks_executed, again.blocks_executed_per_layer) == \
        (result.blocks_executed, result.blocks_executed_per_layer)


def test_measuring_restores_training_mode():
    model = skipgate().train()
    execution_pass(model, model.execution_blocks(), [ids()], flops=False)
    assert all(m.training for m in model.modules())


def test_blocks_must_be_named_modules():
    with pytest.raises(FcauditError, match="declares no execution blocks"):
        measure_execution(nn.Embedding(50, 8), featuregate(), ids(), timing=False)
    with pytest.raises(FcauditError, match="not a module"):
        measure_execution(featuregate(), featuregate(), ids(), block_paths=["blocks.9"],
                          timing=False)


class _FourOfFive(nn.Module):
    """The toys' dense gated network holding a fifth block its forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        import toys
        self.blocks = nn.ModuleList(toys.ToyGatedBlock(None, i) for i in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([nn.functional.one_hot(x, 64).float(), torch.zeros(*x.shape, 64)], -1)
        for block in list(self.blocks)[:4]:
            h = block(h)
        return h[..., 64:]


def test_blocks_the_forward_never_calls_are_refused_before_work(tmp_path) -> None:
    """Blocks the forward never calls once counted as skipped by every token ("0.00 of 2
    blocks run per token"); in the model or in the dense counterpart they are refused on
    the first batch, named, and nothing is written. Blocks that run are accepted and
    counted: 4.00 of 4 per token."""
    import toys
    from conftest import toy_data

    from fcaudit import AuditOptions, audit
    options = AuditOptions(repeats=1, bootstrap=100, batch_size=4, per_layer=False,
                           timing_pairs=0, progress=False)
    model = toys.informative_gated_model()
    out = tmp_path / "out"
    for net, sites, dense, glob, said in (
            (toys.spare_model(), ["gates.*"], toys.spare_model(), "spare.*",
             "the model's forward never calls 2 of the 2 modules it names on the first batch "
             "(spare.0, spare.1)"),
            (model, None, _FourOfFive(), "blocks.*", "the dense model's forward never calls 1 "
             "of the 5 modules it names on the first batch (blocks.4)")):
        with pytest.raises(FcauditError) as info:
            audit(net, out, sites=sites, data=toy_data(), dense=dense, blocks=glob,
                  options=options)
        assert said in str(info.value) and str(info.value).startswith(f"blocks={glob!r}")
        assert not out.exists()
    r = audit(model, data=toy_data(), blocks="blocks.*", options=options)
    assert r.execution.blocks_executed == 4.0 and r.execution.blocks_present == 4


# --- FLOPs ------------------------------------------------------------------------------

class MatMul(nn.Module):
    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, k)
        self.weight = nn.Parameter(torch.randn(k, n))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.emb(input_ids) @ self.weight


def test_flops_of_a_known_matmul():
    k, n = 24, 40
    x = ids()
    m = x.numel()
    assert execution_pass(MatMul(k, n), [], [x])["flops_per_token"] * m == 2 * m * n * k


class KernelCall(nn.Module):
    """A module called with a view of a weight among its inputs, as transformers 5.25's
    hub-kernel wrappers call ``causal_conv1d_fn(x, conv1d.weight.squeeze(1), ...)``."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x @ weight


class HandsItsWeight(MatMul):
    def __init__(self, k: int, n: int) -> None:
        super().__init__(k, n)
        self.weight = nn.Parameter(torch.randn(k, 1, n))
        self.kernel = KernelCall()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.kernel(self.emb(input_ids), self.weight.squeeze(1))


def test_a_weight_handed_to_a_module_call_is_counted_not_a_crash():
    """The FLOP counter's module tracker hooks grad-requiring module inputs; under no_grad
    a view of a weight handed to a module call has no gradient function and the execution
    pass raised "Expected gradient function to be set" (Nemotron-H, Jamba under
    transformers 5.25). Counted as the same matmul written inline (2 m n k), and the
    weight requires grad again after."""
    k, n = 24, 40
    model = HandsItsWeight(k, n)
    x = ids()
    assert execution_pass(model, [], [x])["flops_per_token"] * x.numel() == 2 * x.numel() * n * k
    assert model.weight.requires_grad


def test_cpu_attention_is_counted():
    class Attention(nn.Module):
        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            q = torch.randn(input_ids.shape[0], 2, input_ids.shape[1], 8)
            return nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)

    x = ids()  # QK^T and AV: 2 * (2 * s * s * d) per sequence and head
    flops = execution_pass(Attention(), [], [x])["flops_per_token"]
    assert flops * x.numel() == B * 2 * 2 * (2 * T * T * 8)


# --- timing arithmetic (no timed assertions) --------------------------------------------

def test_ratio_is_the_median_of_pair_ratios_with_a_seeded_interval():
    model_s = [2.0, 3.0, 4.0, 10.0, 1.2]
    dense_s = [1.0, 2.0, 2.0, 2.0, 1.0]  # pair ratios 2, 1.5, 2, 5, 1.2
    r = ratio_interval(model_s, dense_s, seed=3)
    assert r.value == 2.0
    assert 1.2 <= r.ci95[0] <= 2.0 <= r.ci95[1] <= 5.0
    assert ratio_interval(model_s, dense_s, seed=3) == r
    constant = ratio_interval([1.5, 3.0, 0.3], [1.0, 2.0, 0.2])
    assert constant.value == pytest.approx(1.5)
    assert constant.ci95 == pytest.approx([1.5, 1.5])


def test_bootstrap_interval_agrees_with_scipy():
    """scipy's percentile bootstrap of the median (an independent implementation, its own
    random stream) gives the same interval up to Monte Carlo error."""
    from scipy import stats  # the test extra installs scipy
    ratios = np.random.default_rng(0).uniform(1.0, 1.6, size=40)
    r = ratio_interval(ratios, np.ones(40), seed=7, resamples=20000)
    ref = stats.bootstrap((ratios,), np.median, n_resamples=20000, confidence_level=0.95,
                          method="percentile", random_state=np.random.default_rng(1))
    width = ref.confidence_interval.high - ref.confidence_interval.low
    assert r.value == pytest.approx(float(np.median(ratios)))
    assert r.ci95[0] == pytest.approx(ref.confidence_interval.low, abs=0.05 * width)
    assert r.ci95[1] == pytest.approx(ref.confidence_interval.high, abs=0.05 * width)


def test_side_summary():
    s = side_summary([0.3, 0.1, 0.2, 0.5], tokens=1000)
    assert (s.median_s, s.min_s, s.max_s, s.tokens_per_s) == pytest.approx(
        (0.25, 0.1, 0.5, 4000.0))


def test_time_interleaved_records_its_setting():
    model = skipgate()
    before = torch.get_num_threads()
    t = time_interleaved(model, model.dense_counterpart(), ids(), pairs=10, warmup=1, threads=1)
    assert torch.get_num_threads() == before
    assert t.threads == 1 and t.device == "cpu" and len(t.pairs_s) == 10
    assert (t.batch_size, t.seq_len, t.pairs, t.warmup) == (B, T, 10, 1)
    lo, hi = t.speed_ratio_vs_dense.ci95
    assert lo <= t.speed_ratio_vs_dense.value <= hi
    with pytest.raises(FcauditError, match="at least 10 pairs"):
        time_interleaved(model, model.dense_counterpart(), ids(), pairs=3)


def _measured(conditional: bool, ratio: Estimate | None, **extra: object) -> Execution:
    timing = SimpleNamespace(speed_ratio_vs_dense=ratio) if ratio is not None else None
    return Execution(measured=True, conditional_execution=conditional, blocks_executed=2.1,
                     blocks_present=4, dense_blocks_executed=4.0,
                     **{"flops_ratio": 0.61, **extra}, timing=timing)  # type: ignore[arg-type]


def test_verdict_states_the_numbers():
    assert verdict_execution(_measured(True, Estimate(0.72, [0.70, 0.75]))) == (
        "Conditional execution: 2.10 of 4 blocks run per token (Dense 4.00), FLOPs 0.610x "
        "Dense; latency 0.72x Dense [0.70, 0.75], faster.")
    text = verdict_execution(_measured(False, Estimate(1.28, [1.21, 1.35])))
    assert text.startswith("No conditional execution") and text.endswith("slower.")
    unclear = Estimate(1.01, [0.97, 1.05])
    assert verdict_execution(_measured(True, unclear)).endswith("no clear difference.")
    refused = verdict_execution(_measured(True, None, flops_ratio=None,
                                          uncounted_operators=["aten.foo_mm"]))
    assert "FLOPs not compared: the counter cannot count aten.foo_mm" in refused


# --- the SkipGate model -----------------------------------------------------------------

def test_open_skipgate_equals_featuregate_with_the_same_weights():
    fg = featuregate()
    sg = skipgate()
    state = dict(fg.state_dict())  # same key names: both blocks hold ``body`` and ``gate``
    for i in range(SIZES["n_layer"]):
        state[f"blocks.{i}.threshold"] = torch.tensor(0.0)  # every gate is above 0
    sg.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(sg(ids()), fg(ids()))
    counts = execution_pass(sg, sg.execution_blocks(), [ids()], flops=False)
    assert counts["blocks_executed"] == 3.0


def test_routed_block_equals_the_block_run_on_each_sequences_selected_tokens():
    """Attention among the selected tokens only, causal by original position."""
    model = skipgate()
    block = model.blocks[0]
    reference = Update(GPTConfig(**SIZES, gated=False))
    reference.load_state_dict(block.body.state_dict())
    h = torch.randn(B, T, SIZES["n_embd"])
    run = pattern(1) | (torch.arange(B)[:, None] == 3)  # counts differ per sequence
    g = torch.where(run, 0.9, 0.1)[..., None]
    site = model.controller_sites()[0]
    with replaying(model, {site: g}), torch.no_grad():
        out = block(h)
        for b in range(B):
            sel = run[b]
            expected = h[b].clone()
            expected[sel] += 0.9 * reference(h[b, sel][None])[0]
            torch.testing.assert_close(out[b], expected)


def test_skipgate_is_causal_at_inference():
    model = skipgate()
    x = ids()
    y = x.clone()
    y[:, 9] = (y[:, 9] + 1) % SIZES["vocab_size"]
    with torch.no_grad():
        torch.testing.assert_close(model(x)[:, :9], model(y)[:, :9])


def test_identity_replay_of_skipgate_is_bitwise():
    model = skipgate()
    x = ids()
    with torch.no_grad():
        original = model(x)
        coefficients = record(model, x)
        sites = {s: coefficients[s.name] for s in model.controller_sites()}
        with replaying(model, sites):
            assert torch.equal(model(x), original)
    assert all(c.shape == (B, T, 1) for c in coefficients.values())


def test_training_runs_the_capacity_fraction_and_trains_the_gate():
    model = skipgate(capacity=0.25).train()
    seen: list[int] = []
    model.blocks[0].body.register_forward_pre_hook(lambda _m, args: seen.append(len(args[0])))
    start = model.blocks[0].threshold.clone()
    logits = model(ids())
    assert seen == [round(0.25 * B * T)]
    assert not torch.equal(model.blocks[0].threshold, start)  # running threshold moved
    logits.square().mean().backward()
    assert model.blocks[0].gate.proj.weight.grad.abs().sum() > 0


def test_skipgate_contract():
    model = skipgate()
    assert [s.path for s in model.controller_sites()] == ["blocks.0.gate", "blocks.1.gate",
                                                          "blocks.2.gate"]
    assert {s.family for s in model.controller_sites()} == {"skipgate"}
    dense = model.dense_counterpart()
    assert type(dense) is GPT and dense.config == GPTConfig(**SIZES, gated=False)
    assert "blocks.0.threshold" in model.state_dict()


def test_bench_command_writes_json(tmp_path):
    from fcaudit.cli import main
    from fcaudit.io.loading import save_run_model
    from fcaudit.study.train import TRAIN_PRESETS

    run = tmp_path / "run"
    run.mkdir()
    model = featuregate()
    save_run_model(run, model)
    (run / "config.json").write_text(json.dumps({
        "fcaudit_run": 1, "arch": "featuregate", "preset": "tiny", "seed": 0,
        "model_config": dataclasses.asdict(model.config),
        "train": dataclasses.asdict(TRAIN_PRESETS["tiny"])}))
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", str(run), "--batch-size", "2", "--seq-len", "8",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["blocks_executed"] == result["blocks_present"] == SIZES["n_layer"]
    assert result["timing"]["pairs"] == 10 and "verdict" in result


class GroupedExperts(nn.Module):
    """Experts run through torch._grouped_mm, as Hugging Face MoE kernels do; tokens are
    sorted by expert and ``offs`` marks where each expert's rows end."""

    def __init__(self, experts: int = 4, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(experts, dim, hidden, dtype=torch.bfloat16))
        self.experts = experts

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = torch.randn(ids.numel(), self.w.shape[1], dtype=torch.bfloat16)
        per = ids.numel() // self.experts
        offs = torch.arange(1, self.experts + 1, dtype=torch.int32) * per
        return torch._grouped_mm(x, self.w, offs=offs)


def test_grouped_mm_flops_are_counted_by_formula():
    model, tokens = GroupedExperts(), torch.zeros(4, 8, dtype=torch.long)
    flops = execution_pass(model, [], [tokens])
    assert flops["uncounted"] == []
    assert flops["flops_per_token"] == 2 * 8 * 16  # each token meets exactly one expert


def test_an_uncounted_matrix_operator_refuses_the_flops_ratio(monkeypatch):
    import fcaudit.core.flops as flops
    monkeypatch.setattr(flops, "EXTRA_FLOP_FORMULAS", {
        k: v for k, v in flops.EXTRA_FLOP_FORMULAS.items() if "grouped" not in str(k)})
    result = measure_execution(GroupedExperts(), GroupedExperts(), torch.zeros(4, 8).long(),
                               block_paths=[""], dense_block_paths=[""], timing=False)
    assert result.uncounted_operators == ["aten._grouped_mm"]
    assert result.flops_ratio is None and not result.conditional_execution


# ---------------------------------------------------------------- MoE execution keys


@pytest.mark.parametrize("top_k", [2, 8])
def test_moe_execution_keys_have_one_meaning_and_agree_with_the_verdict(top_k: int) -> None:
    import dataclasses

    from fcaudit.engine.execution import measure_execution
    from fcaudit.engine.verdicts import verdict_execution
    from fcaudit.models.moe import PRESETS as MOE_PRESETS
    from fcaudit.models.moe import MoEGPT
    torch.manual_seed(0)
    model = MoEGPT(dataclasses.replace(MOE_PRESETS["tiny"], top_k=top_k)).eval()
    ids = torch.randint(0, 2048, (4, 16), generator=torch.Generator().manual_seed(0))
    routers = {s.name: s for s in model.controller_sites()}
    ex = measure_execution(model, None, ids, batch_size=4, timing=False,
                           block_paths=model.execution_blocks(),
                           experts=model.expert_layers(), routers=routers)
    x = ex.experts
    layers = len(model.blocks)
    assert x.num_experts_per_layer == [8] * layers and x.top_k_per_layer == [top_k] * layers
    assert x.experts_per_token_per_layer == [float(top_k)] * layers  # each token: its top-k
    assert x.experts_per_token_summed_over_layers == top_k * layers
    assert x.experts_per_token_mean_over_layers == top_k
    assert x.experts_present_summed_over_layers == 8 * layers
    skipped = top_k < 8
    assert x.routing_changes_computation is skipped
    assert ex.conditional_execution is skipped  # expert granularity: skipped experts count
    assert ex.saves_against_dense is None  # no dense counterpart given
    verdict = verdict_execution(ex)
    head = "Conditional execution: routing changes" if skipped else \
        "No conditional execution: routing does not change"
    assert verdict.startswith(head), verdict
    assert f"each token runs {top_k:.2f} of 8 experts per routed layer" in verdict
    assert "no dense counterpart to compare with" in verdict
    raw = ex.experts.__dict__
    assert "experts_per_token" not in raw and "num_experts" not in raw


def test_the_execution_section_is_measured_or_not_measured_never_half(tmp_path) -> None:
    """An audit that measures no execution holds a NotMeasured (its reason, nothing else),
    written as {measured: false, reason} and read back as one; a measured section needs
    its blocks, and one that lacks them is refused naming the field."""
    import toys
    from conftest import FAST, toy_data

    import fcaudit
    from fcaudit.engine.result import AuditResult, NotMeasured
    from fcaudit.io.typedjson import SchemaError
    result = fcaudit.audit(toys.content_model(), tmp_path / "a", sites=["gates.*"],
                           data=toy_data(), options=FAST, report=False)
    assert isinstance(result.execution, NotMeasured) and not result.execution.measured
    written = json.loads((tmp_path / "a" / "audit.json").read_text())
    assert written["execution"] == {"measured": False, "reason": result.execution.reason}
    back = AuditResult.from_json(written)
    assert isinstance(back.execution, NotMeasured) and back.execution == result.execution
    assert not hasattr(back.execution, "flops_ratio")  # nothing a measurement would hold
    half = {**written, "execution": {"measured": True, "blocks_present": 4}}
    with pytest.raises(Exception, match=r"execution\.blocks_executed is missing") as caught:
        AuditResult.from_json(half)
    assert isinstance(caught.value, (SchemaError, FcauditError))


def test_a_model_that_runs_elsewhere_is_timed_against_its_controllers_supplied(
        tmp_path, monkeypatch):
    """A model declaring ``execution_note`` (an engine serves it: its blocks cannot be
    counted here) gets the note as the reason, and one batch timed with its gates
    computing against their recorded outputs supplied: each gate runs once to record and
    once per own-side pass (warm-up and pairs), never on the supplied side. The report
    says it, audit.json reads back, and no timing pairs means no timing."""
    import fcaudit
    from fcaudit.engine.execution import TIMING_WARMUP
    from fcaudit.engine.options import AuditOptions
    from fcaudit.engine.result import AuditResult, NotMeasured
    from fcaudit.io.data import AuditData
    model = featuregate()
    model.execution_note = "served elsewhere: its blocks run in another process"
    rng = np.random.default_rng(0)
    data = AuditData(eval_ids=rng.integers(0, SIZES["vocab_size"], (8, T)).astype(np.int64),
                     calib_ids=rng.integers(0, SIZES["vocab_size"], (8, T)).astype(np.int64))
    gates = [s.path for s in model.controller_sites()]
    calls = dict.fromkeys(gates, 0)

    def counting(path: str):
        def hook(*_: object) -> None:
            calls[path] += 1
        return hook
    # asked for (not the default), and no dense counterpart: a served model's timing is of
    # its controllers, so it is not refused as timing against a twin would be
    options = AuditOptions(repeats=1, bootstrap=50, progress=False, timing_pairs=12)
    import fcaudit.engine.execution as execution
    original = execution.controller_cost

    def watched(*args: object, **kwargs: object):
        handles = [model.get_submodule(p).register_forward_hook(counting(p)) for p in gates]
        try:
            return original(*args, **kwargs)
        finally:
            for h in handles:
                h.remove()
    monkeypatch.setattr(execution, "controller_cost", watched)
    result = fcaudit.audit(model, tmp_path / "out", data=data, options=options)
    ex = result.execution
    assert isinstance(ex, NotMeasured) and ex.reason == model.execution_note
    cost = ex.controller_cost
    assert cost is not None and cost.pairs == 12 and len(cost.pairs_s) == 12
    assert (cost.batch_size, cost.seq_len, cost.warmup) == (options.batch_size, T, TIMING_WARMUP)
    assert calls == dict.fromkeys(gates, 1 + TIMING_WARMUP + 12)
    lo, hi = cost.ratio.ci95
    assert lo <= cost.ratio.value <= hi
    for side, pair in ((cost.own, 0), (cost.supplied, 1)):
        seconds = [p[pair] for p in cost.pairs_s]
        assert side.median_s == pytest.approx(float(np.median(seconds)))
        assert side.tokens_per_s == pytest.approx(options.batch_size * T / side.median_s)
    report = (tmp_path / "out" / "report.md").read_text()
    assert "served elsewhere" in report and f"latency ratio **{cost.ratio.value:.3f}**" in report
    back = AuditResult.read(tmp_path / "out" / "audit.json").execution
    assert back.controller_cost == cost
    untimed = fcaudit.audit(model, None, data=data, report=False,
                            options=dataclasses.replace(options, timing_pairs=0))
    assert untimed.execution.controller_cost is None
