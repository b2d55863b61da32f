"""The planted truth of selective copying (issue 30): a Mamba trained on the task solves
it, and the audit sees that it needs its selection matched to the input: the LTI profile
(``static-layer``: every layer's calibration-mean Δ, B, C, a time-invariant recurrence)
keeps close to none of the gap it closes over the global mean, and reassigning another
sequence's selection costs strongly. Its LTI twin S4D, trained alike on the same
batches, stays far below it: the Mamba paper's S4-versus-S6 result, at CPU scale.

The reference is the task itself, not the audit: a model that copies must read which
positions hold data, so no input-independent profile can copy, and an S4D cannot learn
to. Slow: trains both models of the ``tiny`` task preset (minutes on one core)."""

from __future__ import annotations

import json
import math

import pytest

import fcaudit
from fcaudit import AuditOptions, DataSpec

pytestmark = pytest.mark.slow

TASK = "selective-copy"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Mamba and S4D trained on the task (seed 0), the Mamba audited against the S4D."""
    from fcaudit.study.train import train
    root = tmp_path_factory.mktemp("copy-truth")
    runs = {arch: train(arch, "tiny", 0, root / arch, progress=False, task=TASK)
            for arch in ("mamba", "s4d")}
    results = {arch: json.loads((run / "config.json").read_text())["results"]
               for arch, run in runs.items()}
    audit = fcaudit.audit(str(runs["mamba"]), dense=str(runs["s4d"]),
                          data=DataSpec(max_eval=128, max_calib=128),
                          options=AuditOptions(bootstrap=1000, repeats=1, progress=False,
                                               timing_pairs=0))
    return {"runs": runs, "results": results, "audit": audit}


def test_the_selective_model_copies(trained: dict) -> None:
    """At least 90% of the evaluation sequences copied whole (every answer right)."""
    audit = trained["audit"]
    assert trained["results"]["mamba"]["eval_accuracy"] >= 0.9
    assert audit.conditions["correct"].accuracy == pytest.approx(
        trained["results"]["mamba"]["eval_accuracy"])
    assert audit.identity_replay_max_abs_diff == 0.0


def test_its_lti_twin_stays_far_below(trained: dict) -> None:
    """S4D copies at most a quarter as many sequences whole, and gets far fewer answers
    right."""
    mamba, s4d = trained["results"]["mamba"], trained["results"]["s4d"]
    assert s4d["eval_accuracy"] <= 0.25 * mamba["eval_accuracy"]
    assert s4d["eval_answer_accuracy"] < mamba["eval_answer_accuracy"] - 0.2


def test_the_lti_profile_keeps_next_to_nothing(trained: dict) -> None:
    """static-layer copies no more than a tenth of what the model copies: on the accuracy
    scale it retains at most 10% of the correct-to-global-mean gap (hand formula), and
    its loss is worse than a uniform guess over the vocabulary.

    Why accuracy and not the loss retention: the global mean is so far off (its loss is
    several times a uniform guess's) that a profile worse than guessing still sits partway
    between it and the correct replay, so the loss retention of ``static-layer`` is far
    from 0 although it copies nothing; the report gives both, and this test bounds what
    the task defines, copying."""
    audit = trained["audit"]
    acc = {c: audit.conditions[c].accuracy for c in ("correct", "static-layer", "global-mean")}
    kept = (acc["static-layer"] - acc["global-mean"]) / (acc["correct"] - acc["global-mean"])
    assert kept <= 0.1 and acc["static-layer"] <= 0.1 * acc["correct"]
    reported = audit.retention["static-layer"].accuracy  # the engine's, against the hand one
    assert reported.value is not None and reported.value == pytest.approx(100 * kept)
    vocab = json.loads((trained["runs"]["mamba"] / "config.json").read_text())["data"][
        "vocab_size"]
    assert audit.conditions["static-layer"].nll > math.log(vocab)
    assert audit.conditions["static-layer"].ci95[0] > 0
    assert audit.retention["static-layer"].value is None or \
        audit.retention["static-layer"].value < 100


def test_reassigning_the_selection_costs_strongly(trained: dict) -> None:
    """Another sequence's Δ, B, C: a penalty of at least one nat per answer, its interval
    above 0, and the copying gone."""
    reassign = trained["audit"].conditions["reassign"]
    assert reassign.delta >= 1.0 and reassign.ci95[0] > 0
    assert reassign.accuracy <= 0.1 * trained["audit"].conditions["correct"].accuracy


def test_the_run_folder_is_audited_on_its_task(trained: dict) -> None:
    settings, data = trained["audit"].settings, trained["audit"].data
    assert settings["objective"] == TASK and data["eval_examples"] == 128
