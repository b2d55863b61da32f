"""``fcaudit reproduce --preset tasks``: the tiny FeatureGate, MoE and Mamba audited with
benchmark tasks built from the evaluation plays. The tasks are checked against the plays
themselves (every passage's answer is the word that follows it there; distractors are
other words the plays use often); the study is run on a tiny setting (3 training steps, 1
seed, 10 examples per task) and every table cell is checked against the seed's
audit.json, read here, and every finding against its numbers."""

from __future__ import annotations

import json
from collections import Counter

import pytest

pytest.importorskip("lm_eval")

from fcaudit.io.data import builtin_documents  # noqa: E402
from fcaudit.study import lm_tasks  # noqa: E402
from fcaudit.study.reproduce import StudySettings, reproduce, study_options  # noqa: E402

LABELS = {"featuregate-tiny": "FeatureGate", "moe-tiny": "MoE", "mamba-tiny": "Mamba"}


def test_every_passage_is_followed_by_its_answer_in_a_play() -> None:
    works = [" ".join(doc.text.split()) for doc in builtin_documents("eval")]
    counts = Counter(w for text in works for w in text.split())
    passages = lm_tasks.passages()
    assert len(passages) == lm_tasks.EXAMPLES and passages == lm_tasks.passages()
    for p in passages:
        choices, label = p["choices"], p["label"]
        assert len(p["context"].split()) == lm_tasks.CONTEXT_WORDS
        assert len(set(choices)) == lm_tasks.CHOICES
        assert any(f" {p['context']} {choices[label]} " in f" {text} " for text in works)
        others = [c for i, c in enumerate(choices) if i != label]
        assert all(counts[w] >= lm_tasks.MIN_COUNT for w in others)


def test_the_task_folder_is_written_once_and_never_over_other_bytes(tmp_path) -> None:
    folder = lm_tasks.write_tasks(tmp_path / "t")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert set(before) == {"passages.jsonl", f"{lm_tasks.NEXT_WORD}.yaml",
                           f"{lm_tasks.CLOZE}.yaml"}
    lm_tasks.write_tasks(folder)  # the same bytes: left as they are
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    (folder / "passages.jsonl").write_text("mine\n")
    with pytest.raises(Exception, match="holds other tasks than this study writes"):
        lm_tasks.write_tasks(folder)
    assert (folder / "passages.jsonl").read_text() == "mine\n"


@pytest.fixture(scope="module")
def tasks_study(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("tasks-study")
    settings = StudySettings(study_options(repeats=1, bootstrap=50, batch_size=8,
                                           per_layer=False, timing_pairs=0, progress=False,
                                           frontier=False, expert_ablation=False,
                                           lm_eval_limit=10),
                             steps=3, max_eval=8, max_calib=8)
    return out, reproduce("tasks", out, seeds=1, settings=settings)


def _cell(est: dict | None, spec: str, unit: str = "") -> str:
    if est is None:
        return "undefined"
    lo, hi = est["ci95"]
    return f"{est['value']:{spec}}{unit} [{lo:{spec}}, {hi:{spec}}]"


def test_every_cell_is_the_seed_s_audit(tasks_study) -> None:
    out, summary = tasks_study
    rows = summary["tasks"]
    assert [r["family"] for r in rows] == list(LABELS.values())
    for row, name in zip(rows, LABELS, strict=True):
        audit = json.loads((out / "audits" / f"{name}-s0" / "audit.json").read_text())
        tasks = audit["tasks"]["tasks"]
        assert tasks[lm_tasks.NEXT_WORD]["examples"] == 10
        acc = tasks[lm_tasks.NEXT_WORD]["metrics"]["acc"]
        ppl = tasks[lm_tasks.CLOZE]["metrics"]["perplexity"]
        assert row["next word: accuracy"] == _cell(acc["values"]["correct"], ".3f")
        assert row["under static-layer"] == _cell(acc["values"]["static-layer"], ".3f")
        assert row["retention"] == _cell(acc["retention"]["static-layer"], ".1f", "%")
        assert row["cloze: perplexity"] == _cell(ppl["values"]["correct"], ".1f")
        assert row["cloze under static-layer"] == _cell(ppl["values"]["static-layer"], ".1f")
        assert row["cloze retention"] == _cell(ppl["retention"]["static-layer"], ".1f", "%")


def test_each_finding_says_what_its_numbers_say(tasks_study) -> None:
    out, summary = tasks_study
    said = dict(summary["findings"])
    assert len(said) == 4 * len(LABELS)
    for name, label in LABELS.items():
        audit = json.loads((out / "audits" / f"{name}-s0" / "audit.json").read_text())
        nll = audit["retention"]["static-layer"]["value"]
        for task, metric, what, side in (
                (lm_tasks.NEXT_WORD, "acc", "next-word accuracy", "below"),
                (lm_tasks.CLOZE, "perplexity", "cloze perplexity", "above")):
            m = audit["tasks"]["tasks"][task]["metrics"][metric]
            lo, hi = m["penalty"]["global-mean"]["ci95"]
            moved = int(hi < 0 if side == "below" else lo > 0)
            claim = next(c for c in said if c.startswith(f"{label}: {what} needs"))
            assert said[claim] == (
                f"{'holds' if moved else 'does not hold'}: "
                f"{m['values']['correct']['value']:.3f} with its own coefficients, "
                f"{m['values']['global-mean']['value']:.3f} under global-mean (means over "
                f"seeds; {side} 0 in {moved} of 1 seeds)")
            claim = next(c for c in said if c.startswith(f"{label}: its NLL retention")
                         and what in c)
            kept = m["retention"]["static-layer"]
            if nll is None or kept is None:
                assert said[claim].startswith("undefined"), said[claim]
                continue
            holds = abs(nll - kept["value"]) <= 25
            assert said[claim] == (f"{'holds' if holds else 'does not hold'}: NLL {nll:.1f}%, "
                                   f"{what} {kept['value']:.1f}%")
