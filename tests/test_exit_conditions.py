"""The exit conditions (fixed exit, per-position fixed exit, oracle exit) and the share of
the fixed-to-oracle gap the learned exit controller closes: each reference worked out by
hand, fed through the audit, and the refusals of rules and twins that cannot be read."""

from __future__ import annotations

import copy
import dataclasses
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fcaudit
from fcaudit import AuditData, AuditOptions
from fcaudit.core.errors import FcauditError, ModelError
from fcaudit.core.exits import (
    exit_depth,
    exit_layers,
    exit_scores,
    exit_unit,
    fixed_layer,
    oracle_layers,
)
from fcaudit.core.recording import record
from fcaudit.core.replaying import replay
from fcaudit.engine.analyses.exits import degenerate, gap_closed
from fcaudit.engine.metrics import Bootstrap
from fcaudit.models.earlyexit import EarlyExitConfig, EarlyExitGPT, ExitBlock
from fcaudit.models.featuregate import GPT, GPTConfig
from fcaudit.models.skipgate import Route
from fcaudit.report.sections.exits import exits_section

CFG = EarlyExitConfig(vocab_size=61, block_size=16, n_layer=4, n_head=2, n_embd=16,
                      exit_threshold=0.5)
RNG = np.random.default_rng(0)
EVAL, CALIB = RNG.integers(0, 61, (8, 16)), RNG.integers(0, 61, (8, 16))
OPTS = AuditOptions(repeats=1, bootstrap=50, batch_size=4, progress=False, per_layer=False,
                    timing_pairs=0)


def spread(model: EarlyExitGPT, std: float = 2.0) -> EarlyExitGPT:
    for name, p in model.named_parameters():
        if ".score." in name and name.endswith("proj.weight"):
            torch.nn.init.normal_(p, std=std)
    return model.eval()


def make(threshold: float = 0.5, cls: type[EarlyExitGPT] = EarlyExitGPT,
         std: float = 2.0) -> EarlyExitGPT:
    torch.manual_seed(0)
    return spread(cls(EarlyExitConfig(**{**CFG.__dict__, "exit_threshold": threshold})), std)


def audit(model: torch.nn.Module, **kw) -> dict:
    data = AuditData(EVAL, CALIB, {"source": "tokens"})
    return fcaudit.audit(model, None, data=data, options=OPTS, report=False, **kw).to_json()


def nll(model: torch.nn.Module, ids: np.ndarray) -> float:
    x = torch.from_numpy(ids)
    with torch.no_grad():
        logits = model(x)
    return float(F.cross_entropy(logits[:, :-1].reshape(-1, 61), x[:, 1:].reshape(-1)))


def test_oracle_layer_is_the_first_layer_agreeing_with_the_last():
    preds = torch.tensor([[[5, 1, 2]], [[5, 3, 2]], [[7, 3, 9]], [[5, 3, 9]]])  # [L=4, 1, 3]
    # token 0: layer 0 already says 5; token 1: layer 1 says 3; token 2: only the last
    assert oracle_layers(preds).tolist() == [[0, 1, 2]]
    stops = torch.tensor([[[False, True, False]], [[True, True, False]], [[False, True, False]]])
    assert exit_layers(stops).tolist() == [[1, 0, 3]]  # first stop; never: n = 3


@pytest.mark.parametrize(("mean", "layers", "expected"),
                         [(2.1, 4, 1), (2.5, 4, 2), (0.3, 4, 0), (9.0, 4, 3), (1.5, 2, 1)])
def test_fixed_layer_is_closest_depth_ties_deeper(mean, layers, expected):
    assert fixed_layer(mean, layers) == expected


def test_calibration_depth_per_position_by_hand():
    # two sequences, three positions, exit layers of 4 layers
    depth = exit_depth([torch.tensor([[0, 3, 1]]), torch.tensor([[0, 2, 2]])], 4)
    # depths 1,4,2 and 1,3,3: means per position 1, 3.5, 2.5 (ties go deeper); overall
    # 14/6 = 2.33, closest to depth 2 (exit layer 1)
    assert depth.mean == pytest.approx(14 / 6) and depth.fixed() == 1
    assert depth.fixed_per_position().tolist() == [0, 3, 2]


def test_exit_scores_continue_before_exit_from_the_layer_on():
    model = make()
    sites = model.controller_sites()
    like = {s.name: torch.full((1, 3, 1), 0.3) for s in sites}
    fed = exit_scores(sites, torch.tensor([[0, 2, 3]]), like)
    assert [fed[s.name][0, :, 0].tolist() for s in sites] == \
        [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]


def test_gap_share_formula_by_hand():
    fixed = np.array([3.0, 3.2, 2.9, 3.1])
    learned = np.array([2.6, 2.9, 2.7, 2.8])
    oracle = np.array([2.0, 2.2, 2.1, 2.3])
    boot = Bootstrap(4, 200, 0)
    share = gap_closed({"fixed-exit": fixed, "correct": learned, "oracle-exit": oracle}, boot)
    assert share.value == pytest.approx(100 * (3.05 - 2.75) / (3.05 - 2.15))  # 33.33%
    assert share.defined and share.ci95[0] <= share.value <= share.ci95[1]
    flat = gap_closed({"fixed-exit": fixed, "correct": learned,
                       "oracle-exit": fixed + np.array([0.1, -0.1, 0.1, -0.1])}, boot)
    assert flat.value is None and "not above 0" in flat.reason


def test_audit_feeds_fixed_and_oracle_exits_worked_out_by_hand():
    model = make()
    j = audit(model)
    e = j["exits"]
    # the model's own depth by hand: its recorded scores against the threshold
    def own_depth(ids: np.ndarray) -> torch.Tensor:
        scores = torch.stack([v[..., 0] for v in record(model, torch.from_numpy(ids)).values()])
        return exit_layers(scores >= 0.5) + 1
    calib_mean = float(own_depth(CALIB).double().mean())
    assert e["calibration_mean_depth"] == pytest.approx(calib_mean)
    fixed = min(range(4), key=lambda k: (abs(k + 1 - calib_mean), -k))
    assert e["fixed_exit_depth"] == fixed + 1
    assert e["evaluation_mean_depth"] == pytest.approx(float(own_depth(EVAL).double().mean()))
    assert j["execution"]["blocks_executed"] == pytest.approx(e["evaluation_mean_depth"])
    x = torch.from_numpy(EVAL)
    with replay(model, exit_scores(model.controller_sites(), torch.full((8, 16), fixed),
                                   record(model, x))):
        assert j["conditions"]["fixed-exit"]["nll"] == pytest.approx(nll(model, EVAL))
    # the oracle by hand: per layer argmax of the shared head on the full-depth states
    h, argmaxes = model.wte(x) + model.wpe(torch.arange(16)), []
    with torch.no_grad():
        for block in model.blocks:
            h = block.full(h)
            argmaxes.append(model.lm_head(model.ln_f(h)).argmax(-1))
    oracle = torch.tensor([[min(i for i in range(4) if argmaxes[i][b, t] == argmaxes[3][b, t])
                            for t in range(16)] for b in range(8)])
    assert e["oracle_mean_depth"] == pytest.approx(float((oracle + 1).double().mean()))
    with replay(model, exit_scores(model.controller_sites(), oracle, record(model, x))):
        assert j["conditions"]["oracle-exit"]["nll"] == pytest.approx(nll(model, EVAL))
    fc, lc, oc = (j["conditions"][c]["nll"] for c in ("fixed-exit", "correct", "oracle-exit"))
    share = e["gap_closed"]
    assert share["gap"] == pytest.approx(fc - oc)
    if share["value"] is not None:
        assert share["value"] == pytest.approx(100 * (fc - lc) / (fc - oc))


@pytest.mark.parametrize(("threshold", "words"), [
    (1.0, "no token exits before the last layer"),
    (1e-30, "every token exits after the first layer")])
def test_degenerate_thresholds_are_said_not_counted_as_savings(threshold, words):
    e = audit(make(threshold, std=0.02))["exits"]  # scores near 0.5: neither 1 nor 0
    assert words in e["note"]
    assert e["evaluation_mean_depth"] == (4.0 if threshold == 1.0 else 1.0)


def test_exit_conditions_do_not_apply_without_exit_sites():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=16)).eval()
    data = AuditData(EVAL, CALIB, {"source": "tokens"})
    opts = AuditOptions(**{**OPTS.__dict__, "conditions": ("fixed-exit", "oracle-exit")})
    j = fcaudit.audit(model, None, data=data, options=opts, report=False).to_json()
    assert "has no exit sites" in j["not_applicable"]["fixed-exit"]
    assert "oracle-exit" in j["not_applicable"] and "exits" not in j


class IgnoresFedScores(EarlyExitGPT):
    """A broken rule: it recomputes the score from a copy of the classifier, so fed scores
    never reach it."""

    def __init__(self, cfg: EarlyExitConfig) -> None:
        super().__init__(cfg)
        spread(self)
        for block in self.blocks:
            # a copy kept outside the module tree: replay cannot swap it, hooks never see it
            block.__dict__["own_score"] = copy.deepcopy(block.score)
            block.step = lambda h, running, b=block: _recomputing_step(b, h, running)


def _recomputing_step(block: ExitBlock, h: torch.Tensor, running: torch.Tensor):
    if running.any():
        route = Route.from_mask(running)
        h = route.scatter_add(h, block.body(route.gather(h), route, h))
    if block.halt is None:
        return h, running
    block.score(h)  # the site runs (and is recorded) but its output is not read
    return h, running & ~block.halt(block.own_score(h)[..., 0])


class DriftingThreshold(EarlyExitGPT):
    """A broken rule: its threshold moves on every call (state kept between calls)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if block.halt is not None:
                block.halt.threshold = 0.3 + (block.halt.threshold + 0.07) % 0.4
        return super().forward(input_ids)


def test_rule_that_ignores_fed_scores_is_refused_naming_the_site():
    with pytest.raises(ModelError, match=r"exit site blocks\.0\.score: feeding scores that "
                                         r"stop every token after exit layer 0") as err:
        audit(make(cls=IgnoresFedScores))
    assert err.value.site == "blocks.0.score"


def test_rule_whose_replay_moves_the_exits_is_refused_naming_the_site():
    """Checked on the exit check's probe: 2 rows of 16 tokens."""
    with pytest.raises(ModelError, match=r"exit site blocks\.\d\.score: replaying the "
                                         r"recorded scores, the model's exit rule stops \d+ "
                                         r"of 32 tokens at another layer") as err:
        audit(make(cls=DriftingThreshold))
    assert err.value.site in {"blocks.0.score", "blocks.1.score", "blocks.2.score"}


@pytest.mark.parametrize(("layers", "width"), [(3, 16), (4, 32)])
def test_twin_of_another_depth_or_width_is_refused(tmp_path, layers, width):
    torch.manual_seed(0)
    twin = GPT(GPTConfig(vocab_size=61, block_size=16, n_layer=layers, n_head=2,
                         n_embd=width)).eval()
    differs = "it has 3 blocks, the model 4" if layers == 3 else \
        "block 0 maps per-token shapes [16] -> [16] in the model (blocks.0.body), [32] -> [32] " \
        "in the twin (blocks.0)"
    with pytest.raises(FcauditError, match=re.escape(
            "exit site blocks.0.score: the dense twin is not the model's network at full depth: "
            f"{differs}; executed depth and FLOPs are read against the twin")):
        audit(make(), dense=twin)


@pytest.mark.parametrize(("exit", "words"), [
    (fcaudit.Exit(0.0, 1.0), "the model declares no exit_heads(), exit_rules() and full_depth"),
    (fcaudit.Exit(1.0, 1.0), "Exit(go=1.0, stop=1.0) gives one value for continue and exit")])
def test_exit_sites_the_model_cannot_serve_are_refused_naming_the_site(exit, words):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=16)).eval()
    sites = [fcaudit.Site(f"blocks.{i}.gate", f"blocks.{i}.gate", "gate", i,
                          axes=("example", "token"), role=exit) for i in range(2)]
    with pytest.raises(ModelError, match=re.escape(f"exit site blocks.0.gate: {words}")) as err:
        audit(model, sites=sites)
    assert err.value.site == "blocks.0.gate"


def test_the_evaluation_mean_depth_has_its_bootstrap_interval_over_examples():
    """The mean executed depth's interval: each example's mean depth from its recorded
    scores against the threshold (by hand), resampled with numpy as the audit's paired
    bootstrap resamples examples (its seed, its number of resamples)."""
    from fcaudit.engine.options import SeedPlan
    model = make()
    e = audit(model)["exits"]
    scores = torch.stack([v[..., 0] for v in record(model, torch.from_numpy(EVAL)).values()])
    per_example = (exit_layers(scores >= 0.5) + 1).double().mean(1).numpy()  # [8]
    assert e["evaluation_mean_depth"] == pytest.approx(per_example.mean())
    rng = np.random.default_rng(SeedPlan(OPTS.seed).bootstrap)
    means = per_example[rng.integers(0, 8, size=(OPTS.bootstrap, 8))].mean(1)
    assert e["evaluation_mean_depth_ci95"] == pytest.approx(np.percentile(means, [2.5, 97.5]))


class PatchExits(EarlyExitGPT):
    """The exit model with its exit sites' position axis named ``patch`` (as a vision
    model's would be): what exits is a patch."""

    def controller_sites(self):
        return [dataclasses.replace(s, axes=("example", "patch"))
                for s in super().controller_sites()]


def test_what_exits_is_named_by_the_exit_sites_axes():
    """A token for the token model, a patch where the sites call their positions patches,
    an example where they have no position axis; the audit records it and says it in the
    degenerate rule's words and the report's Exits section."""
    assert exit_unit(make().controller_sites()) == "token"
    assert exit_unit(PatchExits(CFG).controller_sites()) == "patch"
    assert exit_unit([dataclasses.replace(s, positions=())
                      for s in make().controller_sites()]) == "example"
    assert degenerate(torch.zeros(2, 3, dtype=torch.long), 4, "patch").startswith(
        "every patch exits after the first layer")
    assert degenerate(torch.full((2, 1), 3), 4, "example").startswith(
        "no example exits before the last layer: the threshold is never reached, so every "
        "example runs all 4 layers")
    torch.manual_seed(0)
    model = spread(PatchExits(CFG))
    result = fcaudit.audit(model, None, data=AuditData(EVAL, CALIB, {"source": "tokens"}),
                           options=OPTS, report=False)
    assert result.exits.unit == "patch"
    section = "\n".join(exits_section(result))
    assert "Layers executed per patch (of 4)" in section
    assert "of the evaluation patches stop after the first layer" in section
    assert "| `fixed-exit-position` | one layer per patch position |" in section
    assert "token" not in section and "window" not in section


def test_an_exit_model_answers_where_it_stops_and_what_stopping_costs_first():
    """The exits answer leads: the mean depth, the cost of exiting against the model run
    to full depth (its NLL by hand: the model with full_depth on), and fixed exit at the
    learned rule's mean depth, whose interval decides the label."""
    model = make()
    result = fcaudit.audit(model, None, data=AuditData(EVAL, CALIB, {"source": "tokens"}),
                           options=OPTS, report=False)
    parts = result.verdict_parts()
    assert list(parts)[0] == "exits" and list(parts)[1:] == ["variation", "dependence",
                                                            "execution"]
    exits = parts["exits"]
    model.full_depth = True
    full = nll(model, EVAL)  # every layer on every token, by hand
    model.full_depth = False
    correct = result.conditions["correct"].nll
    assert exits.numbers["exits.exiting_cost"] == pytest.approx(correct - full, abs=1e-5)
    lo, hi = (exits.numbers[f"exits.exiting_cost_ci_{end}"] for end in ("low", "high"))
    assert lo <= correct - full <= hi
    depth = result.exits.evaluation_mean_depth
    assert exits.sentence.startswith(f"Tokens stop after {depth:.2f} of 4 layers on average")
    assert f"({correct:.4f} with exits, {full:.4f} at full depth)" in exits.sentence
    gap = result.exits.frontier.matched_depth.gap
    expected = "adaptive" if gap.ci95[0] > 0 else "static-better" if gap.ci95[1] < 0 else \
        "static-as-good"
    assert exits.label == expected and result.verdict.exits_label == expected
    said = {"adaptive": "the learned rule beats a static depth",
            "static-better": "a static depth beats the learned rule",
            "static-as-good": "a static depth is as good"}[expected]
    assert exits.sentence.endswith(said + ".")
    full_point = [p for p in result.exits.frontier.points
                  if p.rule == "fixed" and p.mean_depth == 4]
    assert len(full_point) == 1  # full depth is always one of fixed exit's points


def test_the_exit_plan_travels_with_the_exit_runs_not_the_public_context():
    """A user intervention's context holds no exit plan (it is not part of the public
    InterventionContext); the built-in exit conditions still get theirs."""
    from fcaudit.core.interventions import ConditionContext, Intervention, InterventionContext
    assert "exits" not in {f.name for f in dataclasses.fields(InterventionContext)}
    seen: list[type] = []

    def keep(coefficients: dict, context: InterventionContext) -> dict:
        seen.append(type(context))
        return coefficients

    j = audit(make(), interventions=[Intervention("keep", keep)])
    assert seen and set(seen) == {InterventionContext}
    assert not issubclass(InterventionContext, ConditionContext)
    from fcaudit.core.conditions import FIXED_EXIT, ORACLE_EXIT
    assert {FIXED_EXIT, ORACLE_EXIT} <= set(j["conditions"])  # fed from their plan
