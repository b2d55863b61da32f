"""Two kinds of audit data, one protocol: token ids (TokenData) and other inputs
(ExampleData) answer the engine's questions themselves, and a user's AuditData,
built as before, reaches the engine as one of them (AuditData.checked, Prepared.inputs).
Every expected value below is counted by hand from the arrays the test builds."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
import torch

from fcaudit import AuditData, AuditOptions
from fcaudit.core.errors import DataError
from fcaudit.engine.options import Prepared
from fcaudit.io.data import fingerprint_array, window_hashes
from fcaudit.io.inputs import AuditInputs, ExampleData, TokenData

MEMBERS = ("sources", "execution_unit", "n_eval", "n_calib", "eval_source", "calib_source",
           "token_ids", "summary", "validate", "position_counts", "routed_units",
           "calibration_token_sums", "batch_context", "targets", "execution_inputs")


def _never() -> int:
    raise AssertionError("token data know their own units and objective-free context")


def token_data() -> AuditData:
    """3 evaluation windows of 5 tokens (ids 0..14), 2 calibration windows (ids 20..29),
    int32 as a user may give them, built the old way: positional, with sources."""
    ev = np.arange(15, dtype=np.int32).reshape(3, 5)
    ca = np.arange(20, 30, dtype=np.int32).reshape(2, 5)
    return AuditData(ev, ca, {"source": "mine"})


def example_data(calib_targets: bool = True) -> AuditData:
    """4 evaluation examples of 3 float32 features, 2 calibration examples."""
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    xc = np.arange(100, 106, dtype=np.float32).reshape(2, 3)
    return AuditData(inputs=x, targets=np.array([0, 1, 1, 0]), calib_inputs=xc,
                     calib_targets=np.array([1, 0]) if calib_targets else None)


def _sha(arr: np.ndarray) -> str:
    return hashlib.sha256(arr.astype(np.int64).tobytes()).hexdigest()


@pytest.mark.parametrize("make", [token_data, example_data])
def test_both_kinds_satisfy_the_protocol(make) -> None:
    view = make().checked()
    assert isinstance(view, AuditInputs)
    assert all(hasattr(view, name) for name in MEMBERS)
    assert all(hasattr(AuditInputs, name) or name in AuditInputs.__annotations__
               for name in MEMBERS)


def test_token_view_counts_ids_and_summary() -> None:
    data = token_data()
    view = data.checked()
    assert isinstance(view, TokenData)
    ids = np.arange(15).reshape(3, 5)
    assert view.eval_ids.dtype == np.int64 and data.eval_ids.dtype == np.int64
    assert (view.n_eval, view.n_calib) == (3, 2)
    assert np.array_equal(view.token_ids, ids) and view.eval_source is view.token_ids
    assert np.array_equal(view.calib_source, np.arange(20, 30).reshape(2, 5))
    assert view.position_counts([4, 4, 2]) == [5, 4, 4, 2]  # the window first, no dedup
    assert view.routed_units(_never) == 15  # 3 windows x 5 tokens
    assert view.execution_unit is None and view.targets() == []
    assert view.summary() == {
        "eval_sequences": 3, "calib_sequences": 2, "seq_len": 5, "eval_tokens": 15,
        "eval_fingerprint": _sha(ids), "calib_fingerprint": _sha(np.arange(20, 30)),
        "source": "mine"}
    named, head = view.batch_context(1, 3, "batch-outer", _never)
    assert head == b"batch-outer" and [n for n, _ in named] == ["ids"]
    assert torch.equal(named[0][1], torch.arange(5, 15).reshape(2, 5))
    sums = view.calibration_token_sums({"s": torch.ones(1, 5, 2)},
                                       torch.tensor([[7, 7, 8, 9, 9]]))
    assert sums is not None and sums.ids.tolist() == [7, 8, 9]
    assert sums.counts.tolist() == [2, 1, 2]


def test_example_view_counts_and_summary() -> None:
    view = example_data().checked()
    assert isinstance(view, ExampleData)
    assert (view.n_eval, view.n_calib) == (4, 2)
    assert view.token_ids is None and view.execution_unit == "example"
    assert view.position_counts([7, 7, 2, 7]) == [7, 2]  # each site count once, in order
    assert view.routed_units(lambda: 6) == 24  # 4 examples x 6 positions
    assert view.calibration_token_sums({"s": torch.ones(2, 3)}, None) is None
    [(w1, t1), (w2, t2)] = view.targets()
    assert (w1, t1.tolist(), w2, t2.tolist()) == ("evaluation", [0, 1, 1, 0],
                                                  "calibration", [1, 0])
    summary = view.summary()
    assert (summary["eval_examples"], summary["calib_examples"]) == (4, 2)
    assert summary["inputs"] == {"inputs": [[3], "float32"]}
    named, head = view.batch_context(1, 3, "batch-outer", lambda: "classification")
    assert head == b"batch-outer\nclassification"
    assert [n for n, _ in named] == ["inputs", "targets"]
    assert named[0][1].tolist() == [[3.0, 4.0, 5.0], [6.0, 7.0, 8.0]]
    assert view.execution_inputs(torch.device("cpu")) is view.eval_source


def test_example_targets_without_calibration_targets() -> None:
    [(where, targets)] = example_data(calib_targets=False).checked().targets()
    assert where == "evaluation" and targets.tolist() == [0, 1, 1, 0]


def test_dataset_reaches_the_same_view() -> None:
    pairs = [(np.full(2, i, dtype=np.float32), i % 2) for i in range(5)]
    calib = [(np.full(2, 10 + i, dtype=np.float32), 0) for i in range(3)]
    view = AuditData(dataset=pairs, calib_dataset=calib).checked()
    assert isinstance(view, ExampleData) and (view.n_eval, view.n_calib) == (5, 3)
    assert view.examples.targets.tolist() == [0, 1, 0, 1, 0]


def test_old_style_audit_data_still_works() -> None:
    data = token_data()
    assert data.tokens and (data.n_eval, data.n_calib) == (3, 2)
    assert data.summary()["eval_tokens"] == 15 and data.summary()["source"] == "mine"
    data.validate(30, 8)  # ids 0..29 within 30, windows of 5 within 8
    with pytest.raises(DataError, match="span \\[20, 29\\] but the model's vocabulary has 25"):
        data.validate(25, None)
    shared = AuditData(np.arange(10).reshape(2, 5), np.arange(5).reshape(1, 5))
    with pytest.raises(DataError, match="share 1 identical window"):
        shared.validate(None, None)
    assert fingerprint_array(np.arange(4).reshape(2, 2)) == _sha(np.arange(4))
    assert len(window_hashes(np.arange(4).reshape(2, 2))) == 2
    ex = example_data()
    assert not ex.tokens
    ex.validate(None, None)
    assert ex.n_eval == 4 and ex.summary()["eval_examples"] == 4


def test_example_rules_in_their_old_words() -> None:
    one = AuditData(inputs=np.ones((1, 3), np.float32), calib_inputs=np.zeros((2, 3),
                                                                               np.float32))
    with pytest.raises(DataError, match="at least 2 evaluation examples, AuditData gives 1"):
        one.validate(None, None)


def _prepared(data: AuditData) -> Prepared:
    return Prepared(None, [], None, None, data, AuditOptions(), [], (), None,  # type: ignore[arg-type]
                    data.checked().summary())


def test_the_engine_sees_one_view_per_prepared() -> None:
    tokens = _prepared(token_data())
    assert isinstance(tokens.inputs, TokenData) and tokens.inputs is tokens.inputs
    assert tokens.eval_source.shape == (3, 5) and tokens.calib_source.shape == (2, 5)
    prefix = dataclasses.replace(tokens, data=dataclasses.replace(
        tokens.data, eval_ids=tokens.data.eval_ids[:2]))  # a --target-ci round
    assert prefix.inputs.n_eval == 2 and prefix.inputs.routed_units(_never) == 10
    assert tokens.inputs.n_eval == 3
    examples = _prepared(example_data())
    assert isinstance(examples.inputs, ExampleData)
    assert examples.eval_source is examples.data.examples
    assert len(examples.calib_source) == 2
