"""The audit as typed steps (issue 29): one seed plan, run targets that say their key and
digest identity, one AuditResult constructor call, lines through the progress callback,
one hook lifetime, and results written through the output folder's writer."""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from pathlib import Path
from typing import Any

import pytest
import torch
import toys
from conftest import FAST, toy_data
from torch import nn

from fcaudit.api import audit as api_audit
from fcaudit.core.contract import Site
from fcaudit.core.hooks import hooks
from fcaudit.core.interventions import Intervention
from fcaudit.engine import measure
from fcaudit.engine import run as engine
from fcaudit.engine.analyses import ANALYSES
from fcaudit.engine.analyses.expert_importance import ExpertAblation
from fcaudit.engine.options import NOTE, SeedPlan
from fcaudit.engine.plan import (
    ALL_SITES,
    OneSite,
    Run,
    UserIntervention,
    run_digest,
)
from fcaudit.engine.stages import plan_digest
from fcaudit.io.outdir import recorded


def test_every_seed_derives_from_one_plan() -> None:
    """seed 3, 2 repeats: draws 3*1000+17+k, bootstrap 3*1000+7, pool order 3*1000+500."""
    plan = SeedPlan(3, 2)
    assert plan.draws == [3017, 3018]
    assert (plan.bootstrap, plan.order, plan.interventions, plan.dense_twin) == (3007, 3500, 3, 3)


def test_audit_json_seeds_come_from_the_plan() -> None:
    result = engine.audit(engine.AuditRequest(
        toys.content_model(), sites=["gates.*"], data=toy_data(),
        options=dataclasses.replace(FAST, seed=5, repeats=3)))
    assert result is not None
    assert (result.seeds.master, result.seeds.reassign, result.seeds.bootstrap) == \
        (5, [5017, 5018, 5019], 5007)


SITE = Site("gate", "gates.0", "gate", 0)


def test_targets_say_their_keys_and_identities() -> None:
    """Keys and digest identities as the optional fields spelled them before."""
    runs = [Run("correct"), Run("reassign", 1, OneSite(SITE)),
            Run("expert-ablation", 0, ExpertAblation(SITE, 0))]
    assert [r.key for r in runs] == ["correct", "reassign@gate", "expert-ablation:0@gate"]
    assert [r.target.identity() for r in runs] == [
        (None, False, None, None), ("gate", False, None, None), ("gate", False, 0, None)]
    assert Run("correct").target is ALL_SITES and ALL_SITES.only_site is None
    assert runs[2].target.only_site == SITE


def test_run_digests_are_the_ones_the_optional_fields_gave() -> None:
    """The digest of an expert ablation of expert 0 names the expert (0 is not dropped)
    exactly as ``repr((condition, repeat, site, custom, expert))`` did; a plan digest lists
    six fields per run."""
    import hashlib
    t = torch.arange(4, dtype=torch.float32)
    run = Run("expert-ablation", 0, ExpertAblation(SITE, 0))
    hasher = hashlib.sha256(b"ctx" + repr(("expert-ablation", 0, "gate", False, 0)).encode())
    hasher.update(repr(("gate", "torch.float32", (4,))).encode())
    hasher.update(t.view(torch.uint8).numpy())
    assert run_digest(run, {SITE: t}, b"ctx") == hasher.digest()
    user = Run("mine", 2, UserIntervention(Intervention("mine", lambda x, c: x)))
    names = repr([("mine", 2, None, True, None, None)]).encode()
    expected = hashlib.sha256(names).digest()
    assert bytes(plan_digest([user]).tolist()) == expected


def test_the_result_is_constructed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = measure.AuditResult

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(measure, "AuditResult", counted)
    engine.audit(engine.AuditRequest(toys.content_model(), sites=["gates.*"], data=toy_data(),
                                     options=FAST))
    assert len(calls) == 1


def _result_classes() -> set[type]:
    """AuditResult and every mutable dataclass its fields nest, by type hint (subclasses
    too), and the analyses' section types (held by name under ``analyses``): the classes
    a late assignment could patch (frozen ones already refuse one)."""
    found: set[type] = set()

    def walk(tp: object) -> None:
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            if tp not in found:
                found.add(tp)
                for sub in tp.__subclasses__():
                    walk(sub)
                for hint in typing.get_type_hints(tp).values():
                    walk(hint)
            return
        for arg in typing.get_args(tp):
            walk(arg)
    walk(measure.AuditResult)
    for analysis in ANALYSES.values():
        walk(analysis.section_type)
    return {c for c in found if not c.__dataclass_params__.frozen}  # type: ignore[attr-defined]


def _nested(value: object) -> list[object]:
    """Every dataclass instance inside ``value`` (itself included)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [value, *(x for f in dataclasses.fields(value)
                         for x in _nested(getattr(value, f.name)))]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _nested(v)]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _nested(v)]
    return []


_EXECUTED = dataclasses.replace(FAST, execution=True, timing_pairs=10)
TINY_AUDITS = {  # among them every optional section: routing, ablation, frontier, stopping
    "gate": lambda: api_audit(toys.content_model(), sites=["gates.*"], data=toy_data(),
                              dense=toys.constant_model(), blocks="gates.*",
                              options=_EXECUTED, report=False),
    "router": lambda: api_audit(toys.token_router_model(), data=toy_data(), report=False,
                                options=dataclasses.replace(FAST, expert_ablation=True)),
    "frontier": lambda: api_audit(toys.informative_gated_model(), data=toy_data(),
                                  report=False, options=dataclasses.replace(
                                      _EXECUTED, frontier=True, timing_pairs=0)),
    "stop": lambda: api_audit(toys.content_model(), sites=["gates.*"], data=toy_data(24),
                              report=False, options=dataclasses.replace(
                                  FAST, target_ci=0.5, min_sequences=8)),
}


def _record_late_assignments(monkeypatch: pytest.MonkeyPatch
                             ) -> tuple[dict[int, object], list[str]]:
    """Wrap every result class: instances whose ``__init__`` returned (by id, held so that
    no id is reused), and each assignment to one of them, as ``Class.field``."""
    built: dict[int, object] = {}
    late: list[str] = []
    for cls in _result_classes():
        assert "__setattr__" not in vars(cls)  # object's: nothing to wrap but that

        def init(self: object, *args: object, _init: Any = cls.__init__,
                 **kwargs: object) -> None:
            _init(self, *args, **kwargs)
            built[id(self)] = self

        def record(self: object, field: str, value: object) -> None:
            if id(self) in built:
                late.append(f"{type(self).__name__}.{field}")
            object.__setattr__(self, field, value)
        monkeypatch.setattr(cls, "__init__", init)
        monkeypatch.setattr(cls, "__setattr__", record)
    return built, late


@pytest.mark.parametrize("name", TINY_AUDITS)
def test_no_field_of_a_built_result_is_set_after_construction(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One constructor call is the whole build only if nothing patches the parts later;
    reading audit.json back builds its result the same way."""
    built, late = _record_late_assignments(monkeypatch)
    result = TINY_AUDITS[name]()
    assert isinstance(result, measure.AuditResult)
    read = measure.AuditResult.from_json(json.loads(json.dumps(result.to_json())))
    assert read.to_json() == result.to_json()
    # the recorder saw every part of both being built, and nothing set afterwards
    assert [type(p).__name__ for p in [*_nested(result), *_nested(read)]
            if id(p) not in built] == []
    assert sorted(set(late)) == []


def test_the_recorder_sees_a_late_assignment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recorder itself: assignments inside ``__init__`` pass, a later one is caught."""
    from fcaudit.engine.result_parts import Estimate, Execution, Retention
    assert {Estimate, Execution, Retention} <= _result_classes()
    built, late = _record_late_assignments(monkeypatch)
    estimate = Estimate(0.5, (0.25, 0.75))
    assert id(estimate) in built and late == []
    estimate.value = 0.6
    assert late == ["Estimate.value"] and estimate.value == 0.6


def test_the_engine_prints_nothing_its_lines_go_to_the_callback(
        capsys: pytest.CaptureFixture[str]) -> None:
    events: list[tuple[str, str]] = []
    engine.audit(engine.AuditRequest(toys.content_model(), sites=["gates.*"], data=toy_data(),
                                     options=dataclasses.replace(FAST, progress=True)),
                 progress=lambda stage, done, total, info="": events.append((stage, info)))
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""
    notes = [info for stage, info in events if stage == NOTE]
    assert notes[0].startswith("scoring windows of 16 tokens")
    plan = [re.match(r"plan: about (\d+) forward passes, .*[:;] replay (\d+) passes", n)
            for n in notes]
    total, replay = next(m.groups() for m in plan if m)  # 12 sequences, batches of 4
    assert int(replay) % 3 == 0 and int(total) >= int(replay)


def test_fcaudit_audit_still_shows_the_lines_with_a_callback_of_its_own(
        capsys: pytest.CaptureFixture[str]) -> None:
    stages: list[str] = []
    api_audit(toys.content_model(), sites=["gates.*"], data=toy_data(),
              options=dataclasses.replace(FAST, progress=True),
              progress=lambda stage, done, total, info="": stages.append(stage))
    err = capsys.readouterr().err
    assert err.startswith("fcaudit: scoring windows of 16 tokens") and NOTE not in stages


def test_hooks_are_removed_when_registering_or_the_block_fails() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    seen: list[str] = []
    with pytest.raises(AttributeError), hooks(net, {"0": lambda *a: seen.append("0"),
                                                    "nowhere": lambda *a: None}):
        pass
    with pytest.raises(KeyError), hooks(net, {"1": lambda *a: seen.append("1")}, kind="pre"):
        raise KeyError("the block fails")
    net(torch.zeros(1, 2))
    assert seen == [] and not net[0]._forward_hooks and not net[1]._forward_pre_hooks


def test_api_audit_writes_its_report_through_the_folders_writer(tmp_path: Path) -> None:
    api_audit(toys.content_model(), tmp_path / "out", sites=["gates.*"], data=toy_data(),
              options=FAST)
    files = recorded(tmp_path / "out")
    assert {"audit.json", "report.md", "report.html"} <= set(files)


def test_options_are_never_rewritten_what_prepare_decides_is_carried_beside_them() -> None:
    """An exit model's conditions and the data's objective are decided in prepare and held
    by the Prepared audit; the options stay the object the caller gave, field for field."""
    from golden_audits import _built

    from fcaudit.core.conditions import needing
    from fcaudit.engine.prepare import AuditRequest, prepare
    options = FAST
    given = dataclasses.asdict(options)
    setup = prepare(AuditRequest(_built("earlyexit"), data=toy_data(), options=options))
    assert setup.options is options and dataclasses.asdict(setup.options) == given
    assert options.objective is None and setup.objective_spec == "token-nll"
    exits = needing("exits")
    assert exits and setup.conditions == (*options.conditions, *exits)
    plain = prepare(AuditRequest(toys.content_model(), sites=["gates.*"], data=toy_data(),
                                 options=options))
    assert plain.conditions == options.conditions and plain.options is options


def test_the_data_are_hashed_once_and_the_corpus_read_once(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """One SHA-256 per array per audit (the summary, the cache identity, the start line and
    audit.json read the Prepared audit's one summary); one verified read of the corpus for
    its evaluation and calibration windows."""
    from fcaudit.io import data as data_mod
    from fcaudit.io import inputs as inputs_mod
    hashed: list[int] = []
    real_hash = inputs_mod.fingerprint_array
    monkeypatch.setattr(inputs_mod, "fingerprint_array",
                        lambda w: hashed.append(len(w)) or real_hash(w))
    data = toy_data(n_eval=12, n_calib=8)
    api_audit(toys.content_model(), tmp_path / "a", sites=["gates.*"], data=data,
              options=FAST, report=False)
    assert sorted(hashed) == [8, 12]  # the calibration array once, the evaluation array once
    reads: list[int] = []
    real_read = data_mod.corpus_texts
    monkeypatch.setattr(data_mod, "corpus_texts", lambda: reads.append(1) or real_read())
    from fcaudit.io.data import DataSpec, Document, resolve_data, train_tokenizer
    tok = train_tokenizer([Document("text", "to be or not to be " * 50)], 300)
    resolve_data(tok, DataSpec(max_eval=4, max_calib=4), 32)
    assert reads == [1]


def test_the_extra_runs_plans_are_decided_once_per_audit(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The analyses' runs (the expert ablation's among them) and the savings frontier's
    families come from the probe once and travel with it to the cost said before the work
    and to the measurement; the frontier's points are placed once, after recording."""
    from fcaudit.engine import frontier
    from fcaudit.engine import run as run_mod
    from fcaudit.engine.analyses import expert_importance
    from fcaudit.engine.analyses.frontier import FrontierPlan
    from fcaudit.models.moe import MoEConfig, MoEGPT
    calls: dict[str, int] = {"analyses": 0, "ablation": 0, "frontier": 0, "points": 0}

    def counted(name: str, real: Any) -> Any:
        def wrapper(*args: Any, **kw: Any) -> Any:
            calls[name] += 1
            return real(*args, **kw)
        return wrapper

    monkeypatch.setattr(run_mod, "analysis_runs", counted("analyses", run_mod.analysis_runs))
    monkeypatch.setattr(expert_importance, "ablation_experts",
                        counted("ablation", expert_importance.ablation_experts))
    monkeypatch.setattr(frontier, "frontier_families",
                        counted("frontier", frontier.frontier_families))
    monkeypatch.setattr(FrontierPlan, "resolve", counted("points", FrontierPlan.resolve))
    torch.manual_seed(0)
    model = MoEGPT(MoEConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16,
                             num_experts=4, top_k=2))
    result = api_audit(model, tmp_path / "a", data=toy_data(), report=False,
                       options=dataclasses.replace(FAST, frontier=True, expert_ablation=True,
                                                   execution=True, timing_pairs=0))
    assert calls == {"analyses": 1, "ablation": 1, "frontier": 1, "points": 1}
    assert result.settings["expert_ablation_runs"] == 2 * 4  # two routers of four experts
    assert result.settings["frontier_runs"] > 0
