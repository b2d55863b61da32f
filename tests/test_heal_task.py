"""Healing the fold of a run trained on a synthetic task (selective copying, study/heal.py):
fresh sequences of its task, scored by the task's objective on the audit's evaluation
examples, with the task's accuracy at every point. The references are computed here from
the task's generator and the models' logits at the answer positions, not by fcaudit's
scorers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from conftest import run_inprocess

import fcaudit
from fcaudit import AuditOptions
from fcaudit.core.errors import UsageError
from fcaudit.io import selective_copy as sc
from fcaudit.io.data import DataSpec
from fcaudit.io.loading import load_run

TASK = "selective-copy"
N = 16
OPTIONS = AuditOptions(bootstrap=50, repeats=1, execution=False, progress=False, batch_size=8,
                       per_layer=False)


@pytest.fixture(scope="module")
def folded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, object]:
    """A Mamba trained 40 steps on selective copying, audited, folded at static-layer."""
    from fcaudit.engine.actions.fold import fold
    from fcaudit.study.train import train
    root = tmp_path_factory.mktemp("heal-task")
    run = train("mamba", "tiny", 0, root / "run", steps=40, progress=False, task=TASK)
    data = DataSpec(max_eval=N, max_calib=N)
    fcaudit.audit(str(run), root / "audit", data=data, options=OPTIONS)
    done = fold(root / "audit", "static-layer", root / "folded", data=data, timing_pairs=0)
    return root, run, done


def _by_hand(model: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Mean cross-entropy of the answers (one at each of the last ``copies`` positions) and
    the share of examples with every answer right."""
    with torch.no_grad():
        logits = model.eval()(torch.from_numpy(x))[:, -y.shape[1]:].double()
    target = torch.from_numpy(y)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    right = logits.argmax(-1).eq(target).all(-1).double().mean()
    return float(loss), float(right)


def test_a_task_fold_heals_on_its_task_scored_by_loss_and_accuracy(folded, tmp_path) -> None:
    from fcaudit.study.heal import heal
    root, run, done = folded
    x, y, _, _ = sc.audit_sets(sc.PRESETS["tiny"], N, N)
    assert np.array_equal(done.eval_ids, x) and np.array_equal(done.eval_targets, y)
    healed = heal(root / "folded", run, 4, done.eval_ids, eval_targets=done.eval_targets,
                  out=tmp_path / "healed", progress=False)
    assert [p.step for p in healed.curve] == [0, 1, 2, 3, 4]
    assert "selective-copy" in healed.data and healed.seq_len == sc.PRESETS["tiny"].length
    first, last = healed.curve[0], healed.curve[-1]
    for model, point, which in ((load_run(run).model, first, "original"),
                                (load_run(root / "folded").model, first, "folded"),
                                (load_run(tmp_path / "healed").model, last, "folded")):
        loss, accuracy = _by_hand(model, x, y)
        assert abs(getattr(point, f"{which}_nll") - loss) <= 1e-5, which
        assert getattr(point, f"{which}_accuracy") == pytest.approx(accuracy, abs=1e-12)
    assert abs(healed.penalty_before.value - (first.folded_nll - first.original_nll)) <= 1e-9
    assert last.original_nll != first.original_nll  # the control trained on the task too
    assert json.loads((tmp_path / "healed" / "config.json").read_text())["heal"]["curve"][-1][
        "folded_accuracy"] == last.folded_accuracy


def test_a_task_run_takes_no_heal_text_and_needs_the_answers(folded, tmp_path) -> None:
    from fcaudit.study.heal import heal
    root, run, done = folded
    text = tmp_path / "t.txt"
    text.write_text("some text " * 50)
    with pytest.raises(UsageError, match="heals on fresh sequences of its task; drop data"):
        heal(root / "folded", run, 2, done.eval_ids, eval_targets=done.eval_targets,
             data=text, progress=False)
    with pytest.raises(UsageError, match="give the answers of the evaluation examples"):
        heal(root / "folded", run, 2, done.eval_ids, progress=False)


def test_the_command_line_prints_the_task_accuracy_and_refuses_text_before_folding(
        folded, tmp_path, capsys) -> None:
    root, _, _ = folded
    argv = ["fold", "--audit", str(root / "audit"), "--profile", "static-layer", "--out",
            str(tmp_path / "f"), "--max-eval", str(N), "--max-calib", str(N),
            "--timing-pairs", "0", "--quiet", "--heal-steps", "2", "--json",
            str(tmp_path / "fold.json")]
    res = run_inprocess(argv, capsys)
    assert res.returncode == 0, res.stderr
    curve = json.loads((tmp_path / "fold.json").read_text())["heal"]["curve"]
    assert "folded accuracy | original accuracy |" in res.stdout
    for p in curve:
        assert (f"| {p['step']} | {p['folded_nll']:.4f} | {p['original_nll']:.4f} | "
                f"{p['folded_accuracy']:.3f} | {p['original_accuracy']:.3f} |") in res.stdout
    text = tmp_path / "t.txt"
    text.write_text("some text " * 50)
    bad = run_inprocess([*argv[:6], str(tmp_path / "g"), *argv[7:-2], "--heal-data",
                         str(text)],
                        capsys)
    assert bad.returncode == 2 and "drop --heal-data" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and not (tmp_path / "g").exists()
