"""--target-ci: evaluation batches added in rounds until every counted penalty's interval
reaches the target; stopping at N gives exactly the fixed audit of those N sequences."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import toys
from conftest import FAST, FAST_ARGS, run_inprocess, strip_nondeterministic, toy_data

from fcaudit.api import audit
from fcaudit.core.errors import FcauditError
from fcaudit.engine.result import AuditResult
from fcaudit.io.data import AuditData, load_tokenizer, resolve_data
from fcaudit.models.moe import MoEConfig, MoEGPT

COUNTED = ["reassign", "shuffle", "reassign+shuffle", "static-layer", "static-layer-position",
           "static-layer-token"]  # docs/method.md: the counted penalties (not the floor)


def first_n(pool: AuditData, n: int, seed: int = 0) -> AuditData:
    """The first ``n`` sequences of the audit order, computed here from the documented
    formula (numpy default_rng(seed * 1000 + 500).permutation), not by fcaudit."""
    order = np.random.default_rng(seed * 1000 + 500).permutation(len(pool.eval_ids))
    return AuditData(pool.eval_ids[order[:n]], pool.calib_ids, dict(pool.sources))


def half_width(delta: float, ci: list[float]) -> float:
    return max(delta - ci[0], ci[1] - delta)


def without_stopping(result: AuditResult) -> dict:
    out = strip_nondeterministic(result.to_json())
    out.pop("stopping", None)
    return out


def run(model, tmp_path, name: str, data: AuditData, sites=("gates.*",),
        **options) -> AuditResult:
    """An audit of the toys' gates (``sites``) or, with ``sites=None``, a model's own."""
    opts = dataclasses.replace(FAST, **options)
    return audit(model, tmp_path / name, sites=list(sites) if sites else None, data=data,
                 options=opts, report=False)


def test_a_model_without_dependence_stops_at_the_floor(tmp_path):
    pool = toy_data(24)
    r = run(toys.constant_model(), tmp_path, "t", pool, target_ci=0.01, min_sequences=8)
    s = r.stopping
    assert s.reached and len(s.rounds) == 1 and s.sequences_used == 8 < s.pool_sequences == 24
    assert s.reason.startswith("target reached") and "8 of 24" in s.reason
    assert r.data["eval_sequences"] == 8 and s.conditions == COUNTED
    for name in COUNTED:  # constant gates: every sequence loses the same
        width = half_width(r.conditions[name].delta, r.conditions[name].ci95)
        assert width < 1e-6 and s.rounds[0].half_widths[name] == width, name
    assert "target_ci" not in r.settings and "min_sequences" not in r.settings


class FloorOnlyNoise(toys.ToyModel):
    """Constant gates 0.9 and 0.1 (every counted penalty 0 for every sequence), plus a term
    ``g0 * g1`` that only global-mean's shared value wakes (0.09 under the model's own
    gates and every per-layer profile, 0.25 under the family's mean) and that hurts half
    the sequences (those whose first token is odd): a wide interval on the floor alone."""

    def __init__(self) -> None:
        super().__init__("constant")

    def forward(self, ids):
        g0, g1 = (gate(ids) for gate in self.gates)
        even = (torch.arange(ids.shape[1]) % 2 == 0).float().view(1, -1, 1)
        target = torch.nn.functional.one_hot((ids + 1) % toys.V, toys.V).float()
        odd = (ids[:, :1] % 2).float().unsqueeze(-1)
        noise = torch.nn.functional.one_hot((3 * ids + 5) % toys.V, toys.V).float()
        woken = (g0 * g1 - 0.09).clamp(min=0)
        return self.scale * target * (g0 - g1) * even + 200 * woken * odd * noise


def test_the_floor_s_interval_never_holds_the_audit_up(tmp_path):
    """global-mean is the retention's floor, not an answer: an audit whose counted
    penalties are exact stops at the floor however wide global-mean's interval is, and
    says which interval stopped it."""
    r = run(FloorOnlyNoise(), tmp_path, "t", toy_data(24), target_ci=0.01, min_sequences=8)
    s = r.stopping
    floor = half_width(r.conditions["global-mean"].delta, r.conditions["global-mean"].ci95)
    assert floor > 1.0  # the floor alone is wide
    assert s.reached and s.sequences_used == 8 and "global-mean" not in s.conditions
    widest = max(COUNTED, key=lambda c: half_width(r.conditions[c].delta,
                                                   r.conditions[c].ci95))
    assert s.reason.endswith(f"the widest, which stopped it, {widest}'s "
                             f"{s.rounds[-1].half_widths[widest]:.4g} nats")


def test_stops_early_after_rounds_and_equals_the_fixed_audit(tmp_path):
    pool = toy_data(24)
    r = run(toys.content_model(), tmp_path, "t", pool, target_ci=0.15, min_sequences=8)
    s = r.stopping
    assert s.reached and len(s.rounds) >= 2 and s.sequences_used < 24
    assert [x.met for x in s.rounds] == [False] * (len(s.rounds) - 1) + [True]
    for name in COUNTED:  # the final numbers meet the target, read off the conditions
        assert half_width(r.conditions[name].delta, r.conditions[name].ci95) <= 0.15, name
    fixed = run(toys.content_model(), tmp_path, "f", first_n(pool, s.sequences_used))
    assert fixed.stopping is None
    assert without_stopping(r) == without_stopping(fixed)
    assert s.pool_rows == [int(i) for i in np.random.default_rng(500).permutation(24)[
        :s.sequences_used]]
    # the round before the stop, audited alone, had not met the target (the stop is not late)
    before = run(toys.content_model(), tmp_path, "b", first_n(pool, s.rounds[-2].sequences))
    assert max(half_width(before.conditions[c].delta, before.conditions[c].ci95)
               for c in COUNTED) > 0.15


def test_a_high_variance_model_runs_until_the_data_runs_out(tmp_path):
    pool = toy_data(20)
    r = run(toys.content_model(), tmp_path, "t", pool, target_ci=1e-4, min_sequences=6)
    s = r.stopping
    assert not s.reached and s.sequences_used == 20 and r.data["eval_sequences"] == 20
    assert s.reason.startswith("the data ran out") and s.rounds[-1].widest in s.reason
    sizes = [x.sequences for x in s.rounds]
    assert sizes[0] == 8  # the floor of 6, rounded up to whole batches of 4
    for a, b in zip(sizes, sizes[1:], strict=False):  # growth: whole batches, at most double
        assert a < b <= min(2 * a, 20) and (b % 4 == 0 or b == 20)
    assert sizes[-1] == 20
    assert s.replay_passes_total == sum(x.replay_passes for x in s.rounds) > \
        s.replay_passes_fixed == math.ceil(20 / 4) * s.rounds[-1].replay_passes // \
        s.rounds[-1].batches
    fixed = run(toys.content_model(), tmp_path, "f", first_n(pool, 20))
    assert without_stopping(r) == without_stopping(fixed)


def test_the_floor_is_respected_and_rounded_to_whole_batches(tmp_path):
    pool = toy_data(24)
    for floor, first in ((12, 12), (5, 8), (2, 4)):
        r = run(toys.constant_model(), tmp_path, f"t{floor}", pool, target_ci=0.5,
                min_sequences=floor)
        assert r.stopping.min_sequences == floor
        assert r.stopping.sequences_used == first == r.data["eval_sequences"], floor
    default = run(toys.constant_model(), tmp_path, "d", pool, target_ci=0.5)
    assert default.stopping.min_sequences == 16 and default.stopping.sequences_used == 16
    small = run(toys.constant_model(), tmp_path, "s", toy_data(10), target_ci=0.5)
    assert small.stopping.min_sequences == 10 and small.stopping.sequences_used == 10


def test_rerun_reuses_every_round_and_gives_the_same_audit(tmp_path):
    pool = toy_data(24)
    first = run(toys.content_model(), tmp_path, "t", pool, target_ci=0.15, min_sequences=8)
    again = run(toys.content_model(), tmp_path, "t", pool, target_ci=0.15, min_sequences=8)
    assert strip_nondeterministic(first.to_json()) == strip_nondeterministic(again.to_json())
    cost = first.runtime.rounds
    assert [c["sequences"] for c in cost] == [x.sequences for x in first.stopping.rounds]
    assert cost[0]["record_batches_recorded"] == 1  # batch 0 came from the probe
    per_batch = first.stopping.rounds[0].replay_passes // first.stopping.rounds[0].batches
    for before, c in zip(cost, cost[1:], strict=False):  # earlier batches' record passes reused
        assert c["record_batches_reused"] == before["sequences"] // 4
        # of an earlier batch's runs, the 4 static conditions and the 2 per-layer
        # static-layer runs are fed the same tensors again; the random ones (the
        # derangement and permutations depend on n), and correct, are replayed
        assert c["runs_reused"] == before["sequences"] // 4 * (4 + 2)
        assert c["runs_reused"] + c["runs_recomputed"] == c["sequences"] // 4 * per_batch
    for c in again.runtime.rounds:  # nothing recomputed on the rerun
        assert c["record_batches_recorded"] == 0 and c["batches_recomputed"] == 0
        assert c["runs_reused"] == c["sequences"] // 4 * per_batch


def test_an_interrupted_audit_resumes_in_its_round(tmp_path):
    pool, calls = toy_data(24), []

    def interrupt(stage: str, done: int, total: int, info: str = "") -> None:
        calls.append(stage)
        if calls.count("replay") == 3:  # round 1 has 2 batches: stop after round 2's first
            raise KeyboardInterrupt
    opts = dataclasses.replace(FAST, target_ci=0.15, min_sequences=8)
    with pytest.raises(KeyboardInterrupt):
        audit(toys.content_model(), tmp_path / "t", sites=["gates.*"], data=pool,
              options=opts, report=False, progress=interrupt)
    resumed = run(toys.content_model(), tmp_path, "t", pool, target_ci=0.15, min_sequences=8)
    fresh = run(toys.content_model(), tmp_path, "fresh", pool, target_ci=0.15, min_sequences=8)
    assert strip_nondeterministic(resumed.to_json()) == strip_nondeterministic(fresh.to_json())
    one, two = resumed.runtime.rounds[:2]
    assert one["batches_reused"] == 2 and one["batches_recomputed"] == 0
    assert two["batches_reused"] == 1 and two["batches_recomputed"] == two["sequences"] // 4 - 1


def test_shards_of_another_plan_in_the_folder_are_not_taken(tmp_path):
    """A rerun into the same folder with other options: every earlier round's shards hold
    another plan's rows, which must not leak into this audit (compare a fresh folder)."""
    pool = toy_data(24)
    run(toys.content_model(), tmp_path, "t", pool, target_ci=0.15, min_sequences=8, repeats=1)
    again = run(toys.content_model(), tmp_path, "t", pool, target_ci=0.15, min_sequences=8)
    fresh = run(toys.content_model(), tmp_path, "fresh", pool, target_ci=0.15, min_sequences=8)
    assert strip_nondeterministic(again.to_json()) == strip_nondeterministic(fresh.to_json())
    assert [c["runs_reused"] for c in again.runtime.rounds] == \
        [c["runs_reused"] for c in fresh.runtime.rounds]


def test_tiny_featuregate_and_moe_equal_their_fixed_audits(run_folder, tmp_path):
    tok = load_tokenizer(run_folder / "run" / "tokenizer.json")
    from fcaudit.io.data import DataSpec
    text_pool = resolve_data(tok, DataSpec(text=run_folder / "text.txt", seq_len=16,
                                           max_eval=12, max_calib=8), 16)
    rng = np.random.default_rng(3)
    moe_pool = AuditData(rng.integers(0, 97, (12, 16)), rng.integers(0, 97, (8, 16)),
                         {"source": "tokens"})
    cfg = MoEConfig(vocab_size=97, block_size=32, n_layer=2, n_head=2, n_embd=16)
    cases = [(str(run_folder / "run"), text_pool, {}),
             (None, moe_pool, {"execution": True, "timing_pairs": 0, "frontier": True,
                               "frontier_points": 2})]
    for model, pool, extra in cases:
        net = model or MoEGPT(cfg).eval()
        r = run(net, tmp_path, f"t{id(pool)}", pool, None, target_ci=1e-6, min_sequences=4,
                **extra)
        assert not r.stopping.reached and len(r.stopping.rounds) >= 2
        fixed = run(net, tmp_path, f"f{id(pool)}", first_n(pool, r.stopping.sequences_used),
                    None, **extra)
        assert without_stopping(r) == without_stopping(fixed)
        assert r.runtime.rounds[1]["runs_reused"] > 0  # rows kept from round 1 were used
        if extra:
            assert r.expert_importance and r.frontier and r.execution.measured


@pytest.mark.parametrize(("options", "message"), [
    ({"target_ci": 0}, "must be a number of nats above 0"),
    ({"target_ci": -0.1}, "must be a number of nats above 0"),
    ({"target_ci": float("nan")}, "must be a number of nats above 0"),
    ({"target_ci": float("inf")}, "must be a number of nats above 0"),
    ({"target_ci": "0.1"}, "must be a number of nats above 0"),
    ({"target_ci": True}, "must be a number of nats above 0"),
    ({"target_ci": 1e-300}, "target_ci=1e-300.: below 1e-06 nats is finer than an audit "
                            "resolves"),
    ({"target_ci": 5e-324}, "below 1e-06 nats"),  # the smallest float above 0
    ({"target_ci": 9.9e-7}, "give at least 1e-06"),
    ({"target_ci": 0.1, "min_sequences": 1}, "at least 2"),
    ({"target_ci": 0.1, "min_sequences": 4.0}, "at least 2"),
    ({"min_sequences": 4}, r"min_sequences=4\) is read only with AuditOptions\(target_ci="),
    ({"target_ci": 0.1, "min_sequences": 13}, "exceeds the 12 evaluation sequences"),
])
def test_bad_values_are_refused_before_any_work(options, message, tmp_path):
    with pytest.raises(FcauditError, match=message) as info:
        run(toys.content_model(), tmp_path, "x", toy_data(12), **options)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "x").exists()


def test_cli_refuses_a_non_number_in_one_line(tmp_path, capsys):
    out = tmp_path / "x"
    for value, shown in (("abc", "--target-ci abc"), ("0", "--target-ci 0.0")):
        res = run_inprocess(["audit", *toys_cli(), "--out", out, "--target-ci", value], capsys)
        assert res.returncode == 2 and res.stderr.count("\n") == 1
        assert res.stderr.startswith(f"fcaudit: error: {shown}: must be a number of nats")
    assert not out.exists()


def test_cli_refuses_an_absurdly_small_target_before_any_work(tmp_path, capsys):
    """1e-300 once ran a first round, then overflowed projecting the next (exit 1, "a bug")."""
    out = tmp_path / "x"
    res = run_inprocess(["audit", *toys_cli(), "--out", out, "--target-ci", "1e-300"], capsys)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("fcaudit: error: --target-ci 1e-300: below 1e-06 nats is "
                                 "finer than an audit resolves"), res.stderr
    assert "give at least 1e-06 (e.g. 0.02)" in res.stderr
    assert not out.exists()


def test_the_smallest_target_is_accepted_and_reached_without_dependence(tmp_path):
    """1e-06 itself runs: constant gates lose the same on every sequence, so every counted
    half-width is below it (float32 rounding, about 1e-08 here) at the first round."""
    r = run(toys.constant_model(), tmp_path, "t", toy_data(24), target_ci=1e-6,
            min_sequences=8)
    assert r.stopping.reached and r.stopping.sequences_used == 8
    assert max(r.stopping.rounds[0].half_widths.values()) <= 1e-6


def test_cli_audit_states_its_stop_and_writes_the_stopping_section(tmp_path, capsys):
    pool = toy_data(24)
    np.save(tmp_path / "eval.npy", pool.eval_ids)
    np.save(tmp_path / "calib.npy", pool.calib_ids)
    out = tmp_path / "cli"
    res = run_inprocess(["audit", *toys_cli(), "--tokens", tmp_path / "eval.npy",
                         "--calib-tokens", tmp_path / "calib.npy", *FAST_ARGS, "--out", out,
                         "--target-ci", "0.15", "--min-sequences", "8"], capsys)
    assert res.returncode == 0, res.stderr
    saved = AuditResult.read(out / "audit.json")
    assert saved.stopping is not None and saved.stopping.target_ci == 0.15
    assert saved.stopping.min_sequences == 8 and saved.data["eval_sequences"] == \
        saved.stopping.sequences_used
    assert f"--target-ci: {saved.stopping.reason}" in " ".join(res.stdout.split())
    assert "## Stopping rule (--target-ci)" in (out / "report.md").read_text(encoding="utf-8")


def toys_cli() -> list[str]:
    return ["--model", "toys:content_model", "--sites", "gates.*"]


def test_report_states_rule_cost_and_caveat(tmp_path):
    r = audit(toys.content_model(), tmp_path / "t", sites=["gates.*"], data=toy_data(24),
              options=dataclasses.replace(FAST, target_ci=0.15, min_sequences=8))
    text = (tmp_path / "t" / "report.md").read_text(encoding="utf-8")
    s = r.stopping
    assert "## Stopping rule (--target-ci)" in text and "optional stopping" in text
    assert f"{len(s.rounds)} round(s), {s.replay_passes_total} replay passes" in text
    for i, x in enumerate(s.rounds, start=1):  # every round's row
        assert f"| {i} | {x.sequences} | {x.batches} |" in text
    on_disk = AuditResult.read(tmp_path / "t" / "audit.json")
    assert on_disk.stopping == s


@pytest.mark.parametrize(("n", "widest", "target", "pool", "expected"), [
    (16, 0.03, 0.02, 64, 32),  # projection 36, capped at twice the last round
    (16, 0.021, 0.02, 64, 24),  # projection 17.6: at least one batch of 8 more
    (16, 0.025, 0.02, 64, 32),  # projection 25, rounded up to whole batches
    (32, 1.0, 0.01, 40, 40),  # capped at the pool (its last batch may be partial)
    (16, float("nan"), 0.02, 64, 32),  # no width to project from: double
    (16, 1e200, 1e-6, 64, 32),  # (widest / target)^2 overflows a float: still doubles
    (16, float("inf"), 0.02, 64, 32),
])
def test_growth_rule_by_hand(n, widest, target, pool, expected):
    from fcaudit.engine.run import first_size, next_size
    assert next_size(n, widest, target, 8, pool) == expected
    assert first_size(5, 8, pool) == 8 and first_size(16, 8, pool) == 16
    assert first_size(16, 8, 10) == 10


def _token_files(tmp_path, n_eval: int) -> list:
    np.save(tmp_path / "eval.npy", toys.pair_sequences(n_eval, 8, 1))
    np.save(tmp_path / "calib.npy", toys.pair_sequences(16, 8, 2))
    return ["--tokens", tmp_path / "eval.npy", "--calib-tokens", tmp_path / "calib.npy"]


def test_the_max_eval_cap_is_said_and_named_where_the_pool_ends(tmp_path, capsys):
    """--tokens holding 128 sequences audited 64 (the --max-eval default) without a word,
    and --target-ci then said "the data ran out". The cap is said in the console, the
    report and audit.json; the rows audited are the 64 spread evenly over the 128 (picked
    here by hand: round(i * 127 / 63)); the stop names the cap and --max-eval."""
    import hashlib
    out = tmp_path / "cap"
    res = run_inprocess(["audit", *toys_cli(), *_token_files(tmp_path, 128), *FAST_ARGS,
                         "--out", out, "--target-ci", "1e-4"], capsys)
    assert res.returncode == 0, res.stderr
    said = "evaluation sequences: 64 of 128, spread evenly (--max-eval to change)"
    assert said in " ".join(res.stdout.split())
    assert said[:1].upper() + said[1:] in (out / "report.md").read_text(encoding="utf-8")
    saved = AuditResult.read(out / "audit.json")
    assert (saved.data["eval_picked"], saved.data["eval_available"]) == \
        ("64 of 128, spread evenly", 128)
    rows = [round(i * 127 / 63) for i in range(64)]
    picked = toys.pair_sequences(128, 8, 1)[rows].astype(np.int64)
    s = saved.stopping  # the pool, in its own order, is the 64 rows picked by hand
    assert s.pool_fingerprint == hashlib.sha256(picked.tobytes()).hexdigest()
    assert not s.reached and s.sequences_used == s.pool_sequences == 64
    assert "the data ran out" not in s.reason and s.reason.startswith(
        "the pool ran out at the max_eval cap (--max-eval): all 64 sequences it picked of "
        "the 128 the data holds audited")
    assert f"--target-ci: {s.reason}" in " ".join(res.stdout.split())


def test_a_max_eval_beyond_the_data_is_said(tmp_path, capsys):
    """--max-eval 200 on 40 sequences silently audited the 40: the shortfall is said in the
    console, the report and audit.json (a fixed audit of all 40)."""
    out = tmp_path / "short"
    res = run_inprocess(["audit", *toys_cli(), *_token_files(tmp_path, 40), *FAST_ARGS,
                         "--out", out, "--max-eval", "200"], capsys)
    assert res.returncode == 0, res.stderr
    said = "evaluation sequences: all 40, fewer than the 200 --max-eval asked for"
    assert said in " ".join(res.stdout.split())
    assert said[:1].upper() + said[1:] in (out / "report.md").read_text(encoding="utf-8")
    saved = AuditResult.read(out / "audit.json")
    assert saved.data["eval_sequences"] == saved.data["eval_available"] == 40
    assert saved.data["eval_picked"] == "all 40, fewer than the 200 --max-eval asked for"
    assert "calib_picked" not in saved.data  # 16 calibration sequences, the default cap 64
