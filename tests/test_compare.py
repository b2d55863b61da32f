"""`fcaudit compare`: several audits side by side (docs/compare.md). Every number in
compare.json and compare.md is checked against each audit's own audit.json (read as
plain JSON here, not through compare's code); refusals are one line, before anything is
written; a rerun replaces only compare's own files."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import toys
from conftest import FAST, run_inprocess, toy_data

import fcaudit
from fcaudit.api import audit
from fcaudit.engine.result import AuditResult
from fcaudit.io.data import AuditData
from fcaudit.report.format import fmt_ci, fmt_count, fmt_num, fmt_pct, fmt_with_ci
from fcaudit.report.markdown import md_text

SAME = ("gate", "position", "router")  # audits of the same data


@pytest.fixture(scope="module")
def audits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny audits on the same toy data (a gate model with its execution measured, a
    position model, a router), and one gate model on other evaluation windows."""
    root = tmp_path_factory.mktemp("audits")
    executed = dataclasses.replace(FAST, execution=True, timing_pairs=10)
    audit(toys.content_model(), root / "gate", sites=["gates.*"], data=toy_data(),
          dense=toys.constant_model(), blocks="gates.*", options=executed, report=False)
    audit(toys.position_model(), root / "position", sites=["gates.*"], data=toy_data(),
          options=FAST, report=False)
    audit(toys.token_router_model(), root / "router", data=toy_data(),
          options=dataclasses.replace(FAST, expert_ablation=True), report=False)
    other = AuditData(toys.pair_sequences(12, 16, 5), toys.pair_sequences(12, 16, 2),
                      {"source": "tokens"})
    audit(toys.content_model(), root / "other-data", sites=["gates.*"], data=other,
          options=FAST, report=False)
    return {p.name: p for p in root.iterdir()}


@pytest.fixture(scope="module")
def compared(audits: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cmp") / "cmp"
    fcaudit.compare([audits[name] for name in SAME], out)
    return out


def _raw(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "audit.json").read_text(encoding="utf-8"))


def _md_rows(markdown: str, section: str) -> dict[str, list[str]]:
    """The table rows of one ``## section``: first cell -> the other cells."""
    rows = {}
    body = next(part for part in markdown.split("\n## ") if part.startswith(section + "\n"))
    for line in body.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows.setdefault(cells[0], cells[1:])
    return rows


def test_every_model_and_quantity_equals_its_audit(audits: dict[str, Path],
                                                   compared: Path) -> None:
    result = json.loads((compared / "compare.json").read_text(encoding="utf-8"))
    md = (compared / "compare.md").read_text(encoding="utf-8")
    rows = _md_rows(md, "Penalties and retentions")
    answers = _md_rows(md, "The three answers per model")
    assert result["labels"] == list(SAME) and result["schema"] == "fcaudit.compare/1"
    quantities = {(q["kind"], q["name"]): q["models"] for q in result["tables"]["quantities"]}
    header = rows["quantity"][1:]
    assert header == list(SAME)
    checked = 0
    for col, label in enumerate(SAME, start=1):
        raw = _raw(audits[label])
        for name, c in raw["conditions"].items():
            if name == "correct":
                assert quantities[("nll", "correct")][label] == {"value": c["nll"], "ci95": None}
                assert rows["NLL of correct replay (nats)"][col] == fmt_num(c["nll"])
                continue
            assert quantities[("penalty", name)][label] == {"value": c["delta"],
                                                            "ci95": c["ci95"]}
            assert rows[f"Δ `{name}` (nats)"][col] == fmt_with_ci(c["delta"], c["ci95"])
            checked += 1
        for name, ret in raw["retention"].items():
            cell = quantities[("retention", name)][label]
            assert (cell["value"], cell["ci95"]) == (ret["value"], ret["ci95"])
            shown = "undefined" if ret["value"] is None else \
                f"{fmt_pct(ret['value'])} {fmt_ci(ret['ci95'], 2)}"
            assert rows[f"retention `{name}`"][col] == shown
            checked += 1
        i = raw["interaction"]
        assert quantities[("interaction", "interaction")][label] == {"value": i["value"],
                                                                     "ci95": i["ci95"]}
        assert rows["interaction I (nats)"][col] == fmt_with_ci(i["value"], i["ci95"])
        answer = next(a for a in result["tables"]["answers"] if a["model"] == label)
        for key in ("variation", "dependence", "execution"):
            assert answer[key] == raw["verdict"][key]
            assert md_text(raw["verdict"][key]) in answers[label]
        for name, entries in raw["per_layer"].items():  # audits of two families: "label: family"
            drawn = result["per_layer"][f"{name}@layer"][f"{label}: {entries[0]['family']}"]
            assert drawn == [[e["layer"], e["delta"], *e["ci95"]] for e in entries]
    assert checked == 3 * (len(_raw(audits["gate"])["conditions"]) - 1 + 3)


def test_execution_and_routing_rows_equal_their_audits(audits: dict[str, Path],
                                                       compared: Path) -> None:
    result = json.loads((compared / "compare.json").read_text(encoding="utf-8"))
    execution = {r["model"]: r for r in result["tables"]["execution"]}
    for label in SAME:
        ex = _raw(audits[label])["execution"]
        row = execution[label]
        assert row["measured"] == ex["measured"]
        assert row["unit"] == "token"  # token windows: what blocks and FLOPs count per
        for key in ("blocks_executed", "blocks_present", "flops_per_token", "flops_ratio",
                    "conditional_execution"):
            assert row[key] == ex.get(key)
        timing = ex.get("timing")
        assert row["speed_ratio_vs_dense"] == (timing and timing["speed_ratio_vs_dense"]["value"])
        assert row["speed_ratio_ci95"] == (timing and timing["speed_ratio_vs_dense"]["ci95"])
    assert execution["gate"]["measured"] and execution["gate"]["speed_ratio_ci95"]
    shares = _raw(audits["gate"])["execution"]["blocks_executed_per_layer"]
    assert result["per_layer"]["blocks executed"] == {
        "gate": [[k, share, None, None] for k, share in enumerate(shares)]}
    md = _md_rows((compared / "compare.md").read_text(encoding="utf-8"), "Execution")
    ratio = _raw(audits["gate"])["execution"]["timing"]["speed_ratio_vs_dense"]
    assert fmt_with_ci(ratio["value"], ratio["ci95"], sign=False) in md["gate"]
    gate = _raw(audits["gate"])["execution"]
    assert md["model"][:3] == ["unit", "blocks executed per unit", "FLOPs per unit"]
    assert md["gate"][:3] == ["token", f"{fmt_num(gate['blocks_executed'], 2)} of "
                              f"{fmt_num(gate['blocks_present'])}",
                              fmt_count(gate["flops_per_token"])]
    routing = _raw(audits["router"])["routing"]["router"]
    (row,) = result["tables"]["routing"]
    entropy = [x["entropy_normalized"] for x in routing["per_layer"]]
    assert (row["model"], row["num_experts"], row["rerouted"]) == \
        ("router", routing["num_experts"], routing["changed"])
    assert row["load_entropy_normalized_mean"] == pytest.approx(sum(entropy) / len(entropy))
    experts = [(layer["layer"], x) for layer in
               _raw(audits["router"])["expert_importance"]["router"]["per_layer"]
               for x in layer["experts"] if x["delta"] is not None]
    top = max(experts, key=lambda item: item[1]["delta"])
    assert row["top_expert"] == {"layer": top[0], "expert": top[1]["expert"],
                                 "delta": top[1]["delta"], "ci95": top[1]["ci95"]}
    md_text_all = (compared / "compare.md").read_text(encoding="utf-8")
    assert "No routers in: gate, position." in md_text_all


def test_a_quantity_one_audit_lacks_is_a_dash(audits: dict[str, Path], tmp_path: Path) -> None:
    """An audit of inputs that are not token ids lacks static-layer-token (not applicable,
    so its retention is undefined): made here by editing a copy as such an audit writes it."""
    lacking = tmp_path / "lacking"
    lacking.mkdir()
    raw = _raw(audits["gate"])
    del raw["conditions"]["static-layer-token"]
    raw["not_applicable"] = {"static-layer-token": "the inputs are not token ids"}
    raw["retention"]["static-layer-token"].update(value=None, ci95=None, defined=False,
                                                  reason="not applicable")
    (lacking / "audit.json").write_text(json.dumps(raw), encoding="utf-8")
    comparison = fcaudit.compare([audits["position"], lacking], tmp_path / "out")
    quantities = {(q["kind"], q["name"]): q["models"]
                  for q in comparison.to_json()["tables"]["quantities"]}
    assert quantities[("penalty", "static-layer-token")]["lacking"] is None
    assert quantities[("retention", "static-layer-token")]["lacking"]["defined"] is False
    rows = _md_rows((tmp_path / "out" / "compare.md").read_text(encoding="utf-8"),
                    "Penalties and retentions")
    assert rows["Δ `static-layer-token` (nats)"][-1] == "—"
    assert rows["retention `static-layer-token`"][-1] == "undefined"


def test_identical_data_is_said_and_labels_come_from_folders_or_label(
        audits: dict[str, Path], compared: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    md = (compared / "compare.md").read_text(encoding="utf-8")
    assert md.startswith("# Comparison of 3 audits: gate, position, router\n")
    assert "**Identical evaluation data.**" in md and "not paired" not in md
    out = tmp_path / "named"
    res = run_inprocess(["compare", audits["gate"], audits["position"], "--label", "G one",
                         "--label", "P two", "--out", out], capsys)
    assert res.returncode == 0, res.stderr
    result = json.loads((out / "compare.json").read_text(encoding="utf-8"))
    assert result["labels"] == ["G one", "P two"] and result["data"]["identical"] is True
    assert {r["model"] for r in result["tables"]["answers"]} == {"G one", "P two"}
    assert "| quantity | coefficients fed | G one | P two |" in \
        (out / "compare.md").read_text(encoding="utf-8")


def _schema_copy(audits: dict[str, Path], root: Path) -> Path:
    folder = root / "old"
    folder.mkdir()
    raw = _raw(audits["gate"])
    raw["schema"] = "fcaudit.audit/0"
    (folder / "audit.json").write_text(json.dumps(raw), encoding="utf-8")
    return folder


def _twin(audits: dict[str, Path], root: Path) -> Path:
    shutil.copytree(audits["gate"], root / "elsewhere" / "gate")
    return root / "elsewhere" / "gate"


REFUSALS = {  # name -> (CLI arguments after `compare`, words in the one line)
    "schema": (lambda a, root: [a["gate"], _schema_copy(a, root)], "schema 'fcaudit.audit/0'"),
    "data": (lambda a, root: [a["gate"], a["other-data"]],
             "'gate' and 'other-data' were measured on different evaluation data "
             "(eval_fingerprint"),
    "not an audit": (lambda a, root: [a["gate"], root], "is not an audit folder"),
    "missing": (lambda a, root: [a["gate"], root / "nope"], "does not exist"),
    "one audit": (lambda a, root: [a["gate"]], "at least two audits, got 1"),
    "label count": (lambda a, root: [a["gate"], a["position"], "--label", "x"],
                    "1 --label for 2 audits"),
    "same names": (lambda a, root: [a["gate"], _twin(a, root)],
                   "the same name 'gate' (their folder names); name each audit with --label"),
    "same labels": (lambda a, root: [a["gate"], a["position"], "--label", "x", "--label", "x"],
                    "the same name 'x' (their labels)"),
    "out is an audit": (lambda a, root: [a["gate"], a["position"], "--out", a["router"]],
                        "is an fcaudit audit folder, not compare output"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_are_one_line_and_write_nothing(case: str, audits: dict[str, Path],
                                                 tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    build, words = REFUSALS[case]
    root = tmp_path / "in"
    root.mkdir()
    before = {p: p.stat().st_mtime_ns for p in audits["router"].rglob("*")}
    argv = ["compare", *build(audits, root)]
    out = tmp_path / "out"
    res = run_inprocess([*argv, *([] if "--out" in argv else ["--out", out])], capsys)
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1 and words in res.stderr, res.stderr
    assert not out.exists()
    assert {p: p.stat().st_mtime_ns for p in audits["router"].rglob("*")} == before


def test_python_refusals_name_the_arguments(audits: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(fcaudit.FcauditError) as raised:
        fcaudit.compare([audits["gate"], audits["position"]], tmp_path / "o", labels=["x"])
    assert "1 labels= for 2 audits" in str(raised.value) and "--" not in str(raised.value)
    with pytest.raises(fcaudit.FcauditError) as raised:
        fcaudit.compare([audits["gate"], audits["other-data"]], tmp_path / "o")
    assert "allow_different_data=True" in str(raised.value)
    assert "--" not in str(raised.value)
    assert not (tmp_path / "o").exists()


def test_allow_different_data_says_so_first(audits: dict[str, Path], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cmp"
    res = run_inprocess(["compare", audits["gate"], audits["other-data"], "--out", out,
                         "--allow-different-data"], capsys)
    assert res.returncode == 0, res.stderr
    assert "different data; their numbers are not paired" in res.stderr
    md = (out / "compare.md").read_text(encoding="utf-8")
    first = md.split("\n\n")[1]
    assert first.startswith("> **Warning: these audits were measured on different data; "
                            "their numbers are not paired**")
    assert "Identical evaluation data" not in md
    data = json.loads((out / "compare.json").read_text(encoding="utf-8"))["data"]
    assert data["identical"] is False
    differs = {d["field"]: d["values"] for d in data["differs"]}
    assert differs["eval_fingerprint"] == {
        label: _raw(audits[label])["data"]["eval_fingerprint"]
        for label in ("gate", "other-data")}
    assert "calib_fingerprint" not in differs  # the calibration windows are the same


def test_rerun_replaces_only_its_own_files(audits: dict[str, Path], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cmp"
    first = run_inprocess(["compare", audits["gate"], audits["router"], "--out", out], capsys)
    assert first.returncode == 0, first.stderr
    assert (out / "figures" / "per-layer-load-entropy.png").is_file()
    (out / "notes.txt").write_text("mine", encoding="utf-8")
    (out / "figures" / "mine.png").write_bytes(b"mine")
    again = run_inprocess(["compare", audits["gate"], audits["position"], "--out", out],
                          capsys)
    assert again.returncode == 0, again.stderr
    assert (out / "notes.txt").read_text(encoding="utf-8") == "mine"
    assert (out / "figures" / "mine.png").read_bytes() == b"mine"
    assert not (out / "figures" / "per-layer-load-entropy.png").exists()  # the old run's
    assert json.loads((out / "compare.json").read_text())["labels"] == ["gate", "position"]
    assert not (out / ".previous").exists()
    (out / "compare.md").write_text("edited by hand", encoding="utf-8")
    refused = run_inprocess(["compare", audits["gate"], audits["position"], "--out", out],
                            capsys)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "compare.md" in refused.stderr
    assert (out / "compare.md").read_text(encoding="utf-8") == "edited by hand"


def test_html_embeds_every_figure_and_links_its_svg(compared: Path) -> None:
    html = (compared / "compare.html").read_text(encoding="utf-8")
    pngs = sorted((compared / "figures").glob("*.png"))
    stems = {p.stem for p in pngs}
    assert {"penalties-retentions", "profile", "per-layer-reassign",
            "per-layer-static-layer", "per-layer-load-entropy", "per-layer-blocks-executed",
            "per-layer-sd-across-inputs", "per-layer-sd-across-positions"} <= stems
    assert html.count('src="data:image/png;base64,') == len(pngs)
    for png in pngs:
        assert f'href="figures/{png.stem}.svg"' in html
        assert (compared / "figures" / f"{png.stem}.svg").is_file()
    assert "<script" not in html


def test_python_api_compares_results_in_memory(audits: dict[str, Path],
                                               tmp_path: Path) -> None:
    results = [AuditResult.read(audits[name] / "audit.json") for name in ("gate", "position")]
    comparison = fcaudit.compare(results, labels=["a", "b"])
    assert comparison.files == [] and list(tmp_path.iterdir()) == []
    content = comparison.to_json()
    assert content["labels"] == ["a", "b"] and content["data"]["identical"]
    assert comparison.to_markdown().startswith("# Comparison of 2 audits: a, b")
    written = fcaudit.compare([audits["gate"], results[1]], tmp_path / "cmp", labels=["a", "b"])
    assert written.files[-1] == tmp_path / "cmp" / "compare.json"
    assert all(p.is_file() for p in written.files)
    assert json.loads(written.files[-1].read_text())["tables"]["quantities"] == \
        content["tables"]["quantities"]


def test_the_loss_row_is_named_by_each_objective(audits: dict[str, Path],
                                                 tmp_path: Path) -> None:
    """Two selective-copy audits: the correct replay's row is their answer loss (the
    registry's name for it), never NLL, in compare.md's table, compare.json and the
    figures' axes; beside a token-NLL audit both names are said."""
    from fcaudit.io import selective_copy as sc
    task = sc.CopyTask(length=12, copies=2, data=8, noise=3)
    (x, y), (xc, _) = task.sample(np.random.default_rng(0), 16), \
        task.sample(np.random.default_rng(1), 8)
    data = AuditData(inputs=x, targets=y, calib_inputs=xc)
    options = dataclasses.replace(FAST, objective="selective-copy", repeats=1)
    copies = [audit(model, sites=["gates.*"], data=data, options=options, report=False)
              for model in (toys.content_model(), toys.position_model())]
    out = tmp_path / "copy"
    comparison = fcaudit.compare(copies, out, labels=["content", "position"])
    (row,) = [q for q in comparison.to_json()["tables"]["quantities"] if q["kind"] == "nll"]
    assert row["loss"] == "answer loss"
    assert row["models"]["content"] == {"value": copies[0].conditions["correct"].nll,
                                        "ci95": None}
    md = (out / "compare.md").read_text(encoding="utf-8")
    rows = _md_rows(md, "Penalties and retentions")
    assert rows["answer loss of correct replay (nats)"][1:] == \
        [fmt_num(r.conditions["correct"].nll) for r in copies]
    assert "NLL" not in md.split("\n## Penalties and retentions\n")[1].split("\n## ")[0]
    svg = (out / "figures" / "penalties-retentions.svg").read_text(encoding="utf-8")
    assert "answer loss vs correct" in svg and "NLL" not in svg
    mixed = fcaudit.compare([copies[0], audits["gate"]], labels=["copy", "gate"],
                            allow_different_data=True)
    assert mixed.loss == "answer loss / NLL"


def test_exit_audits_show_their_threshold_and_mean_executed_depth() -> None:
    """Two exit models at thresholds 0.5 and 0.7: rows for the exit threshold and the
    mean executed depth with its interval, each equal to its audit.json; an audit
    without exits gets a dash."""
    import torch

    from fcaudit.models.earlyexit import EarlyExitConfig, EarlyExitGPT
    rng = np.random.default_rng(0)
    data = AuditData(rng.integers(0, 61, (8, 16)), rng.integers(0, 61, (8, 16)),
                     {"source": "tokens"})
    options = dataclasses.replace(FAST, repeats=1, bootstrap=50)
    results = []
    for threshold in (0.5, 0.7):
        torch.manual_seed(0)
        model = EarlyExitGPT(EarlyExitConfig(vocab_size=61, block_size=16, n_layer=4,
                                             n_head=2, n_embd=16, exit_threshold=threshold))
        for name, p in model.named_parameters():
            if ".score." in name and name.endswith("proj.weight"):
                torch.nn.init.normal_(p, std=2.0)
        results.append(audit(model.eval(), data=data, options=options, report=False))
    plain = audit(toys.content_model(), sites=["gates.*"], data=data, options=options,
                  report=False)
    comparison = fcaudit.compare([*results, plain], labels=["t0.5", "t0.7", "plain"])
    rows = {q["name"]: q["models"] for q in comparison.to_json()["tables"]["quantities"]
            if q["kind"] == "exit"}
    md = _md_rows(comparison.to_markdown(), "Penalties and retentions")
    for label, r, threshold in (("t0.5", results[0], 0.5), ("t0.7", results[1], 0.7)):
        e = r.to_json()["exits"]
        depth = {"value": e["evaluation_mean_depth"], "ci95": e["evaluation_mean_depth_ci95"]}
        assert rows["exit_threshold"][label] == {"value": threshold, "ci95": None}
        assert rows["exit_mean_depth"][label] == depth
        col = 1 + ["t0.5", "t0.7"].index(label)
        assert md["exit threshold"][col] == fmt_num(threshold)
        assert md["mean executed depth (layers)"][col] == \
            fmt_with_ci(depth["value"], depth["ci95"], sign=False)
    assert results[0].exits.evaluation_mean_depth < results[1].exits.evaluation_mean_depth
    assert rows["exit_threshold"]["plain"] is None and md["exit threshold"][-1] == "—"
