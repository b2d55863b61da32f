"""``fcaudit reproduce --preset ssm``: Mamba and its LTI twin on the corpus and on
selective copying, on a tiny setting (3 training steps, 1 seed): the runs, the twins'
scores beside Mamba's, the table cells against each audit.json, the findings."""

from __future__ import annotations

import json

import pytest

from fcaudit.study.reproduce import StudySettings, reproduce, study, study_options


@pytest.fixture(scope="module")
def ssm_study(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("ssm-study")
    settings = StudySettings(study_options(repeats=1, bootstrap=50, batch_size=8,
                                           per_layer=False, timing_pairs=0, progress=False),
                             steps=3, max_eval=8, max_calib=8)
    return out, reproduce("ssm", out, seeds=1, settings=settings)


def test_ssm_preset_groups():
    groups = {g.name: (g.seeds, g.dense_arch, g.task) for g in study("ssm", None)}
    assert groups == {"mamba-tiny": (3, "s4d", None),
                      "mamba-selective-copy-tiny": (3, "s4d", "selective-copy")}
    corpus = next(g for g in study("ssm", None) if g.task is None)
    assert corpus.schedule is not None and corpus.schedule.steps == 300


def _read(path):
    return json.loads(path.read_text())


def _share(ret):
    return ("undefined (no clear gap)" if ret["value"] is None else
            f"{ret['value']:.1f}% [{ret['ci95'][0]:.1f}, {ret['ci95'][1]:.1f}]")


def _token_cell(var):
    """Δ's share beyond chance, (share - chance) / (1 - chance), the share and its chance
    level beside it (one seed: its own numbers)."""
    share, chance = var.get("eta2_token_id"), var["eta2_token_id_chance"]
    if share is None:
        return "n/a"
    beyond = (share - chance) / (1 - chance)
    said = f"{100 * beyond:.1f}% beyond chance" if beyond > 0 else \
        f"no more than chance ({100 * beyond:.1f}% beyond it)"
    return f"{said} ({100 * share:.1f}% against a chance level of {100 * chance:.1f}%)"


def test_ssm_study_trains_each_twin_on_its_task_and_tabulates(ssm_study):
    out, result = ssm_study
    runs = {p.name for p in (out / "runs").iterdir() if not p.name.startswith(".")}
    assert runs == {"mamba-tiny-s0", "s4d-tiny-s0", "mamba-selective-copy-tiny-s0",
                    "s4d-selective-copy-tiny-s0"}
    for twin, task in (("s4d-tiny-s0", None), ("s4d-selective-copy-tiny-s0", "selective-copy")):
        config = _read(out / "runs" / twin / "config.json")
        assert config["arch"] == "s4d" and config.get("task") == task
    corpus, copy = (result["groups"][n]["per_seed"][0]
                    for n in ("mamba-tiny", "mamba-selective-copy-tiny"))
    assert corpus["twin_nll"] == _read(out / "runs/s4d-tiny-s0/config.json")["results"]["eval_nll"]
    assert copy["twin_accuracy"] == \
        _read(out / "runs/s4d-selective-copy-tiny-s0/config.json")["results"]["eval_accuracy"]
    rows = {r["task"]: r for r in result["ssm"]}
    assert set(rows) == {"built-in corpus", "selective copying"}
    for label, name in (("built-in corpus", "mamba-tiny"),
                        ("selective copying", "mamba-selective-copy-tiny")):
        audit = _read(out / "audits" / f"{name}-s0" / "audit.json")
        assert audit["identity_replay_max_abs_diff"] == 0.0
        row = rows[label]
        reassign = audit["conditions"]["reassign"]
        assert row["reassign"] == (f"{reassign['delta']:+.3f} [{reassign['ci95'][0]:+.3f}, "
                                   f"{reassign['ci95'][1]:+.3f}]")
        for profile in ("static-layer", "static-layer-position", "static-layer-token"):
            ret = audit["retention"].get(profile)
            if profile not in audit["conditions"]:
                assert row[f"{profile} retention"] == "not applicable"
                continue
            expected = _share(ret)
            if "accuracy" in ret:  # the copying task is scored by accuracy too
                expected += f"; on accuracy {_share(ret['accuracy'])}"
            assert row[f"{profile} retention"] == expected
        assert row["token-id share of Δ"] == _token_cell(audit["variance"]["dt"])
        ex = audit["execution"]
        assert ex["blocks_executed"] == ex["blocks_present"]
        assert "chunked selective scan" in row["execution"]
        assert "causal convolution by FFT" in row["execution"]
        assert row["execution"].startswith("every block for every token")
    findings = dict(result["findings"])
    assert len(findings) == 6  # three on copying, two on the corpus, one on execution
    corpus_audit = _read(out / "audits/mamba-tiny-s0/audit.json")
    kept = corpus_audit["retention"]["static-layer"]["value"]
    assert any(("undefined" in v) if kept is None else (f"keeps {kept:.1f}% with an LTI" in v)
               for v in findings.values())
    text = (out / "reproduction.md").read_text()
    assert "Mamba and its LTI twin (S4D)" in text and "selective copying" in text
