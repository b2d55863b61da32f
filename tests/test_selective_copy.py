"""The selective-copying task (io/selective_copy.py), its objective ``selective-copy``
(engine/losses.py) and ``fcaudit train --task`` (study/tasks.py): the generator against
the task's definition read back from each sequence, the sets' disjointness proven by
content, the objective's refusals of targets it cannot score, and a run of the task
audited without being told its data or objective. Fast; the planted truth on trained
models is in tests/test_selective_copy_truth.py (slow)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import toys
from conftest import FAST_ARGS, assert_clean_failure, run_inprocess

import fcaudit
from fcaudit import AuditData, AuditOptions
from fcaudit.core.errors import DataError, ModelError, UsageError
from fcaudit.engine.objectives import TASKS, check_targets, resolve
from fcaudit.io import selective_copy as sc

TASK = "selective-copy"
FAST = dict(bootstrap=100, repeats=1, execution=False, progress=False, batch_size=8,
            per_layer=False)


def test_each_target_is_the_data_tokens_in_order() -> None:
    """Read back from every sequence: the data tokens (ids above the noise alphabet) of
    the first L - K positions, in order, are the targets; the last K are markers; the
    rest is noise from its own alphabet, never a data token."""
    task = sc.CopyTask(length=20, copies=3, data=4, noise=2)
    assert task.vocab_size == 7  # marker 0, noise 1..2, data 3..6
    x, y = task.sample(np.random.default_rng(5), 500)
    assert x.shape == (500, 20) and y.shape == (500, 3)
    assert x.dtype == y.dtype == np.int64
    assert (x[:, 17:] == 0).all() and (x[:, :17] != 0).all()
    for row, answers in zip(x, y, strict=True):
        data = [t for t in row[:17] if t >= 3]
        noise = [t for t in row[:17] if t < 3]
        assert data == list(answers)
        assert len(noise) == 14 and set(noise) <= {1, 2}
    assert set(np.unique(y)) == {3, 4, 5, 6} and set(np.unique(x[:, :17][x[:, :17] < 3])) == \
        {1, 2}


def test_positions_are_random() -> None:
    """Where the data tokens sit varies: every body position holds one in some sequence,
    no position always does, and sequences do not share one placement."""
    task = sc.CopyTask(length=20, copies=3, data=8, noise=2)
    x, _ = task.sample(np.random.default_rng(1), 2000)
    placed = x[:, :17] >= 3
    share = placed.mean(0)
    assert (share > 0).all() and (share < 0.5).all()  # 3 of 17 each: about 0.18
    assert np.allclose(share, 3 / 17, atol=0.05)
    assert len({tuple(np.flatnonzero(p)) for p in placed}) > 500  # of C(17, 3) = 680


def test_generation_is_seeded_and_its_first_rows_do_not_depend_on_the_count() -> None:
    task = sc.PRESETS["tiny"]
    a = sc.audit_sets(task, 10, 5)
    b = sc.audit_sets(task, 300, 5)
    for short, long in zip(a, b, strict=True):
        assert np.array_equal(short, long[:len(short)])
    x1, _ = task.sample(np.random.default_rng(0), 8)
    x2, _ = task.sample(np.random.default_rng(0), 8)
    x3, _ = task.sample(np.random.default_rng(1), 8)
    assert np.array_equal(x1, x2) and not np.array_equal(x1, x3)


def test_calibration_evaluation_and_training_share_no_sequence() -> None:
    """The evaluation set holds none of the calibration sequences, and training draws
    none of either (compared by content, as the audit compares windows); a draw told to
    leave sequences out leaves them out."""
    task = sc.PRESETS["tiny"]
    ex, _, cx, _ = sc.audit_sets(task, sc.POOL, sc.POOL)
    assert not sc.keys(ex) & sc.keys(cx) and len(sc.keys(ex)) == sc.POOL
    assert sc.held_out(task) == sc.keys(ex) | sc.keys(cx)
    trained, _ = sc.draw(task, np.random.default_rng(0), 512, sc.held_out(task), 64)
    assert not sc.keys(trained) & (sc.keys(ex) | sc.keys(cx))
    first, _ = sc.draw(task, np.random.default_rng(7), 64, frozenset(), 64)
    again, _ = sc.draw(task, np.random.default_rng(7), 64, sc.keys(first), 64)
    assert not sc.keys(first) & sc.keys(again)


@pytest.mark.parametrize("fields, fragment", [
    (dict(copies=0), "copies=0 must be an integer of at least 1"),
    (dict(length=7, copies=4), "length=7 leaves no room for copies=4"),
    (dict(data=2.5), "data=2.5 must be an integer"),
    (dict(length=8, copies=2, data=4, noise=1),  # C(6, 2) * 4**2 = 240 sequences
     "has 240 distinct sequences, fewer than 524288, too few to keep the audit sets and "
     "training apart"),
])
def test_a_task_that_cannot_be_built_is_one_line(fields: dict, fragment: str) -> None:
    with pytest.raises(DataError, match=fragment):
        sc.CopyTask(**fields)


def test_the_objective_is_the_task_of_its_registry_entry() -> None:
    assert list(TASKS) == [TASK] and TASKS[TASK].task == sc.__name__
    assert resolve(TASK).unit == "answer token" and resolve(TASK).accuracy
    assert not resolve(TASK).tokens and resolve(TASK).checks_targets


LOGITS = torch.zeros(2, 6, 5)  # 2 sequences of 6 tokens over a vocabulary of 5


@pytest.mark.parametrize("targets, kind, fragment", [
    (None, DataError, "objective 'selective-copy' needs targets: pass evaluation targets"),
    (torch.tensor([1, 2]), DataError,
     "evaluation targets are int64 [2]; selective-copy needs integer answer tokens [N, K] "
     "(np.int64) with 1 <= K <= 6, the sequence length"),
    (torch.zeros(2, 2), DataError, "evaluation targets are float32 [2, 2]"),
    (torch.zeros(2, 7, dtype=torch.int64), DataError, "evaluation targets are int64 [2, 7]"),
    (torch.tensor([[1, 5], [0, 2]]), DataError,
     "evaluation targets span [0, 5] but the model's logits have 5 token ids; targets must "
     "be token ids in [0, 5)"),
    (torch.tensor([[1, -1], [0, 2]]), DataError, "evaluation targets span [-1, 2]"),
])
def test_targets_it_cannot_score_are_refused(targets, kind, fragment) -> None:
    with pytest.raises(kind) as caught:
        check_targets(resolve(TASK), LOGITS, targets, "evaluation")
    assert fragment in str(caught.value) and "\n" not in str(caught.value)
    check_targets(resolve(TASK), LOGITS, torch.tensor([[1, 4], [0, 2]]), "evaluation")


def test_an_output_without_token_logits_is_refused() -> None:
    with pytest.raises(ModelError, match=r"needs token logits \[batch, tokens, vocabulary\] "
                       r"\(or an object with .logits\); the model returned Tensor\[2, 5\]"):
        check_targets(resolve(TASK), torch.zeros(2, 5), torch.tensor([[1], [2]]), "evaluation")


def _ids(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequences of a toy's vocabulary and answers [N, 2]."""
    task = sc.CopyTask(length=12, copies=2, data=8, noise=3)
    return task.sample(np.random.default_rng(seed), n)


def test_an_audit_scores_the_answers_by_hand() -> None:
    """A token toy audited on the task's sequences: the unperturbed loss is the mean
    cross-entropy of its logits at the last two positions against the answers (numpy),
    accuracy the share of examples with both argmaxes right."""
    x, y = _ids(16, 0)
    xc, _ = _ids(16, 1)
    r = fcaudit.audit(toys.content_model(), sites=["gates.*"],
                      data=AuditData(inputs=x, targets=y, calib_inputs=xc),
                      options=AuditOptions(objective=TASK, **FAST))
    with torch.no_grad():
        logits = toys.content_model()(torch.from_numpy(x)).double().numpy()[:, -2:]
    shifted = logits - logits.max(-1, keepdims=True)
    lp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    ce = -np.take_along_axis(lp, y[..., None], -1)[..., 0]
    assert r.conditions["original"].nll == pytest.approx(ce.mean(), rel=1e-5)
    assert r.conditions["original"].accuracy == pytest.approx(
        (logits.argmax(-1) == y).all(1).mean())
    assert r.identity_replay_max_abs_diff == 0.0


def test_wrong_answer_shape_through_the_command_line(tmp_path: Path, capsys) -> None:
    """--targets [N] for selective-copy: one line, exit 2, nothing written."""
    x, y = _ids(8, 0)
    xc, _ = _ids(8, 1)
    for name, arr in (("x", x), ("y", y[:, 0]), ("xc", xc)):
        np.save(tmp_path / f"{name}.npy", arr)
    out = tmp_path / "out"
    res = run_inprocess(["audit", "--model", "toys:content_model", "--sites", "gates.*",
                         "--inputs", tmp_path / "x.npy", "--targets", tmp_path / "y.npy",
                         "--calib-inputs", tmp_path / "xc.npy", "--objective", TASK,
                         "--out", out, *FAST_ARGS], capsys)
    assert_clean_failure(res, tmp_path, out, "evaluation targets are int64 [8]; "
                         "selective-copy needs integer answer tokens [N, K]")


# ---- fcaudit train --task and the audit of its run


@pytest.fixture(scope="module")
def copy_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """FeatureGate and its Dense twin, 3 steps each on the task (fast, not trained)."""
    from fcaudit.study.train import train
    root = tmp_path_factory.mktemp("copy-runs")
    return {arch: train(arch, "tiny", 0, root / arch, steps=3, progress=False, task=TASK)
            for arch in ("featuregate", "dense")}


def test_a_task_run_records_its_task_and_settings(copy_runs: dict[str, Path]) -> None:
    cfg = json.loads((copy_runs["featuregate"] / "config.json").read_text())
    tiny = sc.PRESETS["tiny"]
    assert cfg["task"] == TASK and cfg["model_config"]["vocab_size"] == tiny.vocab_size
    assert {k: cfg["data"][k] for k in ("length", "copies", "data", "noise")} == \
        {"length": tiny.length, "copies": tiny.copies, "data": tiny.data, "noise": tiny.noise}
    assert cfg["train"]["seq_len"] == tiny.length and cfg["train"]["steps"] == 3
    assert 0.0 <= cfg["results"]["eval_accuracy"] <= cfg["results"]["eval_answer_accuracy"]
    assert not (copy_runs["featuregate"] / "tokenizer.json").exists()
    log = [json.loads(line) for line in
           (copy_runs["featuregate"] / "train_log.jsonl").read_text().splitlines()]
    assert "accuracy" in log[0] and log[-1]["event"] == "eval"


def test_a_task_run_is_audited_on_its_task_without_flags(copy_runs: dict[str, Path],
                                                          tmp_path: Path, capsys) -> None:
    """No --objective, no data flags: the run's own task sets and objective; --dense with
    the twin trained alongside prices execution against it."""
    out = tmp_path / "audit"
    res = run_inprocess(["audit", "--model", copy_runs["featuregate"], "--dense",
                         copy_runs["dense"], "--out", out, "--max-eval", "16",
                         "--max-calib", "12", "--quiet", "--repeats", "1", "--bootstrap",
                         "10", "--no-per-layer", "--timing-pairs", "10"], capsys)
    assert res.returncode == 0, res.stderr
    audit = json.loads((out / "audit.json").read_text())
    assert audit["settings"]["objective"] == TASK
    assert audit["data"]["eval_examples"] == 16 and audit["data"]["calib_examples"] == 12
    assert audit["data"]["length"] == sc.PRESETS["tiny"].length
    ex, ey, cx, cy = sc.audit_sets(sc.PRESETS["tiny"], 16, 12)
    expected = AuditData(inputs=ex, targets=ey, calib_inputs=cx, calib_targets=cy).checked()
    assert audit["data"]["eval_fingerprint"] == expected.summary()["eval_fingerprint"]
    assert audit["conditions"]["original"]["accuracy"] is not None


@pytest.mark.parametrize("argv, fragment", [
    (["--arch", "condconv", "--task", TASK],
     "--task selective-copy trains a language arch (token ids to token logits); --arch "
     "condconv takes images"),
    (["--arch", "featuregate", "--task", TASK, "--data", "{text}"],
     "--task selective-copy trains on sequences its generator draws"),
    (["--arch", "featuregate", "--task", TASK, "--preset", "small"],
     "unknown preset 'small' for"),
])
def test_train_task_mistakes_are_one_line(argv: list[str], fragment: str, tmp_path: Path,
                                          capsys) -> None:
    (tmp_path / "t.txt").write_text("words " * 50)
    out = tmp_path / "run"
    res = run_inprocess(["train", *[a.replace("{text}", str(tmp_path / "t.txt"))
                                    for a in argv], "--out", out, "--quiet"], capsys)
    assert_clean_failure(res, tmp_path, out, fragment)
    assert not out.exists()


def test_audit_of_a_task_run_refuses_token_data(copy_runs: dict[str, Path], tmp_path: Path,
                                                capsys) -> None:
    np.save(tmp_path / "t.npy", np.zeros((4, 8), dtype=np.int64))
    out = tmp_path / "audit"
    res = run_inprocess(["audit", "--model", copy_runs["featuregate"], "--tokens",
                         tmp_path / "t.npy", "--calib-tokens", tmp_path / "t.npy", "--out",
                         out, *FAST_ARGS], capsys)
    assert_clean_failure(res, tmp_path, out, "is a selective-copying run, audited on its "
                         "task's evaluation and calibration sequences: drop --tokens, "
                         "--calib-tokens")


@pytest.mark.parametrize("change, kind, fragment", [
    ({"task": "parity"}, UsageError, "the run trained on task 'parity', which this fcaudit "
     "does not know (it knows selective-copy)"),
    ({"data": {"length": 48}}, DataError, "its data record lacks the selective-copying "
     "settings length, copies, data, noise; retrain the run"),
])
def test_a_damaged_task_record_is_one_line(copy_runs: dict[str, Path], tmp_path: Path,
                                           change: dict, kind: type, fragment: str) -> None:
    run = tmp_path / "run"
    shutil.copytree(copy_runs["featuregate"], run)
    cfg = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(kind, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        fcaudit.audit(str(run), options=AuditOptions(**FAST))


def test_the_report_names_the_answer_loss_not_nll() -> None:
    """The report of a selective-copy audit: its conditions table's loss column, the
    identity check and the dependence facts name the answer loss (the registry's word for
    the objective's losses), never NLL; the notebook view's column alike."""
    from fcaudit.report.audit_report import build_markdown
    x, y = _ids(16, 0)
    xc, _ = _ids(16, 1)
    r = fcaudit.audit(toys.content_model(), sites=["gates.*"],
                      data=AuditData(inputs=x, targets=y, calib_inputs=xc),
                      options=AuditOptions(objective=TASK, **FAST))
    _, md = build_markdown(r, [])
    conditions = md.split("\n## Conditions\n")[1].split("\n## ")[0]
    assert "| condition | coefficients fed | answer loss (nats) | Δ vs correct |" in conditions
    assert "max |per-answer-token answer loss(correct) − answer loss(original)|" in conditions
    assert "`reassign`: Δ answer loss " in md
    assert "NLL" not in conditions
    assert "<th>answer loss</th>" in r._repr_html_()
