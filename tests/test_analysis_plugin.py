"""An analysis is one registry entry (and a renderer): a toy analysis registered here
plans a run (counted by the plan and replayed once per batch), writes its section to
audit.json under its name (read back by that name), puts its numbers in ``metrics()``
and its section in the report. Its run's loss is checked against the toy's formula,
computed here by hand."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
import toys
from conftest import toy_data
from test_audit_plan import _audit

from fcaudit import AuditResult
from fcaudit.core.errors import DataError
from fcaudit.core.interventions import Intervention
from fcaudit.engine.analyses import ANALYSES, Analysis
from fcaudit.engine.analyses.base import RunStage, Target
from fcaudit.report.audit_report import write_report
from fcaudit.report.sections import RENDERERS, Renderer


def _halve(coefficients, context):
    return {name: t * 0.5 for name, t in coefficients.items()}


def _summarise(measured, analysis):
    return {"halved": measured.condition(analysis.run_key("halved")), "note": "gates x 0.5"}


HALVING = Analysis("halving", plan=lambda setup, probe: [Intervention("halved", _halve)],
                   summarise=_summarise,
                   metrics=lambda section: {"delta": section["halved"]["delta"]})
RENDER = Renderer("halving", lambda r, s: ["## Halving", f"Halved gates cost "
                                                         f"{s['halved']['delta']:+.4f} nats."])


def _nll_by_hand(scale: float) -> float:
    """The content toy's next-token NLL with both gates times ``scale``: its logits are
    8 * scale * one_hot(x + 1) on even positions, 0 on odd ones."""
    ids = torch.from_numpy(toy_data().eval_ids)
    even = (torch.arange(ids.shape[1]) % 2 == 0).float().view(1, -1, 1)
    logits = 8.0 * scale * F.one_hot((ids + 1) % toys.V, toys.V).float() * even
    return float(F.cross_entropy(logits[:, :-1].reshape(-1, toys.V).double(),
                                 ids[:, 1:].reshape(-1)))


def test_a_registered_analysis_runs_end_to_end(tmp_path) -> None:
    plain, _, _ = _audit(toys.content_model(), tmp_path / "plain", ["gates.*"],
                         execution=False)
    with ANALYSES.added(HALVING), RENDERERS.added(RENDER):
        result, line, made = _audit(toys.content_model(), tmp_path, ["gates.*"],
                                    execution=False)
        written = json.loads((tmp_path / "out" / "audit.json").read_text())
        read = AuditResult.read(tmp_path / "out" / "audit.json")
        write_report(read, tmp_path / "report")
        metrics, read_metrics = result.metrics(), read.metrics()
    # planned and replayed: one more run on each of the 3 evaluation batches, all counted
    plan, before = result.runtime.plan, plain.runtime.plan
    assert made == plan["passes"] == before["passes"] + 3
    assert plan["stages"]["replay"]["passes"] == before["stages"]["replay"]["passes"] + 3
    assert result.runtime.reuse["runs_recomputed"] == plain.runtime.reuse["runs_recomputed"] + 3
    # its run's loss is the toy's with halved gates; correct's, the check of the formula
    assert result.conditions["correct"].nll == pytest.approx(_nll_by_hand(1.0), rel=1e-6)
    section = result.analyses["halving"]
    assert section["halved"]["nll"] == pytest.approx(_nll_by_hand(0.5), rel=1e-6)
    assert section["halved"]["delta"] == pytest.approx(
        _nll_by_hand(0.5) - _nll_by_hand(1.0), rel=1e-6)
    assert section["note"] == "gates x 0.5"
    # audit.json: at the top level under its name, read back by it; the rest unchanged
    assert written["halving"] == section and "analyses" not in written
    assert read.analyses == {"token_profile": plain.token_profile, "halving": section}
    assert {k for k in written if k not in json.loads(json.dumps(plain.to_json()))} \
        == {"halving"}
    assert metrics["halving_delta"] == section["halved"]["delta"]
    assert read_metrics == metrics and metrics == {**plain.metrics(), "halving_delta":
                                                   section["halved"]["delta"]}
    assert "halving_delta" not in result.metrics()  # unknown to this fcaudit: no number
    report = (tmp_path / "report" / "report.md").read_text()
    assert f"## Halving\n\nHalved gates cost {section['halved']['delta']:+.4f} nats." in report
    # the registries as the test found them: the section is now an unknown key
    assert "halving" not in ANALYSES and "halving" not in RENDERERS
    with pytest.raises(DataError, match="halving"):
        AuditResult.from_json(written)


def test_a_section_without_a_renderer_is_shown_as_json(tmp_path) -> None:
    with ANALYSES.added(HALVING):
        result, _, _ = _audit(toys.content_model(), tmp_path, ["gates.*"], execution=False)
        write_report(result, tmp_path / "report")
    report = (tmp_path / "report" / "report.md").read_text()
    assert "## halving\n\n```\n{\n \"halved\": {" in report


def test_a_leading_section_is_placed_right_after_the_conditions_table(tmp_path) -> None:
    """A renderer that ``leads`` (its section details an answer the verdict gives first)
    is placed right after the conditions table; without ``leads``, after the core detail
    and the other analyses' sections, before what reproduces the audit."""
    heads = {}
    for leads in (True, False):
        with ANALYSES.added(HALVING), RENDERERS.added(dataclasses.replace(RENDER,
                                                                            leads=leads)):
            result, _, _ = _audit(toys.content_model(), tmp_path / str(leads), ["gates.*"],
                                  execution=False)
            write_report(result, tmp_path / str(leads) / "report")
        md = (tmp_path / str(leads) / "report" / "report.md").read_text()
        heads[leads] = [line[3:] for line in md.splitlines() if line.startswith("## ")]
    first = heads[True]
    assert first[first.index("Conditions") + 1] == "Halving"
    last = heads[False]
    assert last.index("Halving") == len(last) - 2  # the other analyses', then the detail
    assert last[-1] == "Reproducibility" and last.index("Execution") < last.index("Halving")
    assert [h for h in first if h != "Halving"] == [h for h in last if h != "Halving"]


def test_an_analysis_named_like_a_key_of_audit_json_is_refused(tmp_path) -> None:
    clash = Analysis("verdict", plan=lambda s, p: [], summarise=lambda m, a: {"x": 1.0})
    with ANALYSES.added(clash), pytest.raises(Exception, match="named like audit.json"):
        _audit(toys.content_model(), tmp_path, ["gates.*"], execution=False)[0].to_json()


def test_replays_of_an_analysis_are_bitwise_the_same_on_a_rerun(tmp_path) -> None:
    """Resumed into the same folder, its runs' cached replays are proven as any other."""
    with ANALYSES.added(HALVING):
        first, _, _ = _audit(toys.content_model(), tmp_path, ["gates.*"], execution=False)
        again, _, _ = _audit(toys.content_model(), tmp_path, ["gates.*"], execution=False)
    assert again.runtime.reuse["batches_reused"] == 3
    assert first.analyses == again.analyses


def test_sections_are_read_back_strictly(tmp_path) -> None:
    """A typed section of the wrong shape, a plain one holding a non-finite number, and an
    ``analyses`` key (never written) are refused in one line naming the place."""
    with ANALYSES.added(HALVING):
        result, _, _ = _audit(toys.content_model(), tmp_path, ["gates.*"], execution=False)
        written = json.loads(json.dumps(result.to_json()))
        assert AuditResult.from_json(written).analyses == result.analyses
        for broken, where in (
                ({**written, "token_profile": {**written["token_profile"], "eval_tokens": "x"}},
                 "token_profile.eval_tokens"),
                ({**written, "halving": {"halved": float("nan")}}, "halving"),
                ({**written, "analyses": {}}, "analyses is not a key")):
            with pytest.raises(DataError, match=where):
                AuditResult.from_json(broken)


class _Halved(Target):
    """An analysis's own target: every gate halved, counted in a plan stage of its own."""

    condition = "halving:own"
    stage = RunStage("halving runs", ("repeats", "AuditOptions(repeats=1)", "--repeats 1"))

    def feed(self, run, b, inputs, correct):
        return {site: t * 0.5 for site, t in correct.items()}


OWN = Analysis("halving", plan=lambda setup, probe: [_Halved()],
               summarise=lambda measured, analysis: {
                   "halved": measured.condition(_Halved.condition)},
               settings=lambda measured, sections: {
                   "halving_runs": sum(r.condition == _Halved.condition for r in measured.runs),
                   "halving_ran": "halving" in sections})


def test_an_analysis_s_own_target_has_its_own_plan_stage_and_settings(tmp_path) -> None:
    """The plan counts an analysis's own runs in the stage its target names (not among
    the main replays), the replay stage replays them, and ``settings`` carries the keys
    the analysis states; its run's loss is the toy's with halved gates (by hand)."""
    plain, _, _ = _audit(toys.content_model(), tmp_path / "plain", ["gates.*"], execution=False)
    with ANALYSES.added(OWN):
        result, _, made = _audit(toys.content_model(), tmp_path, ["gates.*"], execution=False)
    plan, before = result.runtime.plan, plain.runtime.plan
    assert made == plan["passes"] == before["passes"] + 3
    assert plan["stages"]["replay"]["passes"] == before["stages"]["replay"]["passes"]
    assert plan["stages"]["halving runs"]["passes"] == 3
    assert plan["stages"]["halving runs"]["at_most"] is True
    assert result.analyses["halving"]["halved"]["nll"] == pytest.approx(_nll_by_hand(0.5),
                                                                         rel=1e-6)
    assert result.settings["halving_runs"] == 1 and result.settings["halving_ran"] is True
    assert {k: v for k, v in result.settings.items() if not k.startswith("halving_")} == \
        plain.settings
