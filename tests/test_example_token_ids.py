"""Token ids given as example inputs (``AuditData(inputs=int [N, T], targets=...)``, as a
task run's audit feeds them): token-keyed profiles (static-layer-token) and the token-id
share apply as for token windows, while the objective stays the one that scores them and
nothing else treats them as next-token data. Float, image and dict inputs are unchanged.

Expected values are computed with numpy from the toy's definition
(tests/token_gate_toys.py): the gates' values by hand, the token-id share as a one-way
ANOVA per site, static-layer-token's feed as each id's calibration mean."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
import token_gate_toys as tg
import torch
from conftest import FAST_ARGS, assert_clean_failure, run_inprocess

import fcaudit
from fcaudit import AuditData, AuditOptions
from fcaudit.core.errors import DataError, FcauditError
from fcaudit.io.inputs import ExampleData, TokenData

N = 32
FAST = dict(objective="classification", bootstrap=100, repeats=1, execution=False,
            progress=False, batch_size=8, per_layer=False)
NOT_TOKEN_IDS = "the inputs are not token ids: there is no token id to key a profile by"


def data(ev: np.ndarray | None = None, calib: np.ndarray | None = None,
         cast: type = np.int64) -> AuditData:
    ev = tg.evaluation(N, 5) if ev is None else ev
    calib = tg.CALIBRATION if calib is None else calib
    return AuditData(inputs=ev.astype(cast), targets=np.arange(len(ev)) % 2,
                     calib_inputs=calib.astype(cast))


def token_share(ids: np.ndarray, values: list[np.ndarray]) -> float:
    """Within each site, SS between token ids over SS total (about the site's mean),
    pooled over the sites by adding the sums of squares."""
    between = total = 0.0
    flat = ids.reshape(-1)
    for v in values:
        x = v.reshape(-1)
        total += float(((x - x.mean()) ** 2).sum())
        between += sum(float((flat == i).sum() * (x[flat == i].mean() - x.mean()) ** 2)
                       for i in np.unique(flat))
    return between / total


def test_integer_inputs_get_static_layer_token_and_the_token_id_share() -> None:
    ev = tg.evaluation(N, 5)
    r = fcaudit.audit(tg.positional_classifier(), sites=["gates.*"], data=data(ev),
                      options=AuditOptions(**FAST))
    assert "static-layer-token" in r.conditions and not r.not_applicable
    share = token_share(ev, tg.gates(ev, positions=True))
    assert 0.3 < share < 0.99  # the position terms leave part of the variance to positions
    assert r.variance["gates.*"].eta2_token_id == pytest.approx(share, rel=1e-9)
    assert r.metrics()["eta2_token_id"] == r.variance["gates.*"].eta2_token_id
    assert (r.token_profile.calibration_token_ids, r.token_profile.eval_tokens,
            r.token_profile.eval_tokens_unseen) == (4, N * 4, 0)
    # static-layer-token feeds each token its id's calibration mean, per gate
    seen = tg.CALIBRATION
    means = [{i: c[seen == i].mean() for i in range(tg.V)}
             for c in tg.gates(seen, positions=True)]
    fed = [np.vectorize(m.__getitem__)(ev) for m in means]
    score = (fed[0] - fed[1]).sum(1)
    logits = np.stack([score, np.full_like(score, tg.BIAS)], 1)
    targets = np.arange(N) % 2
    ce = np.logaddexp(logits[:, 0], logits[:, 1]) - logits[np.arange(N), targets]
    assert r.conditions["static-layer-token"].nll == pytest.approx(ce.mean(), rel=1e-5)
    assert r.settings["objective"] == "classification"  # still the objective asked for
    assert r.data["eval_examples"] == N and "eval_sequences" not in r.data


@pytest.mark.parametrize("inputs", ["float", "dict"])
def test_float_and_dict_inputs_are_unchanged(inputs: str) -> None:
    """The same ids as float32, or an int array inside a dict: no token ids, as before."""
    ev = tg.evaluation(N, 5)
    if inputs == "float":
        model, given = tg.float_classifier(), data(ev, cast=np.float32)
    else:
        model = tg.classifier()
        given = AuditData(inputs={"ids": ev}, targets=np.arange(N) % 2,
                          calib_inputs={"ids": tg.CALIBRATION})
    r = fcaudit.audit(model, sites=["gates.*"], data=given, options=AuditOptions(**FAST))
    assert r.not_applicable["static-layer-token"] == NOT_TOKEN_IDS
    assert r.variance["gates.*"].eta2_token_id is None and r.token_profile is None
    assert r.retention["static-layer-token"].value is None


def test_sites_without_a_token_axis_say_so() -> None:
    """Token ids, but the audited site has one value per example ([example, channel]):
    no token id keys it, and the reason names the site."""
    r = fcaudit.audit(tg.classifier(), sites=["pool"], data=data(),
                      site_axes={"pool": "example,channel"}, options=AuditOptions(**FAST))
    assert r.not_applicable["static-layer-token"] == (
        "site pool's coefficients [example, channel] have no token axis: no token id keys "
        "them")
    assert r.variance["pool"].eta2_token_id is None and r.token_profile is None


@pytest.mark.parametrize("where, ev, calib, span", [
    ("AuditData.inputs", np.array([[0, 1, 2, 5], [1, 1, 1, 1]]), None, "[0, 5]"),
    ("AuditData.calib_inputs", None, np.array([[0, 1, 2, 3], [-1, 2, 2, 2]]), "[-1, 3]"),
])
def test_ids_beyond_the_vocabulary_are_one_line(where, ev, calib, span) -> None:
    """The gates are embeddings of 4 ids: ids outside [0, 4) are refused before any pass."""
    with pytest.raises(DataError) as caught:
        fcaudit.audit(tg.classifier(), sites=["gates.*"], data=data(ev, calib),
                      options=AuditOptions(**FAST))
    assert f"the token ids of {where} span {span} but the model's vocabulary has 4 " \
           "entries; tokenize with the model's tokenizer" in str(caught.value)


def test_ids_beyond_the_vocabulary_through_the_command_line(tmp_path: Path, capsys) -> None:
    for name, arr in (("x", np.array([[0, 1, 2, 7], [1, 1, 1, 1], [2, 2, 2, 2]])),
                      ("y", np.array([0, 1, 0])), ("xc", tg.CALIBRATION)):
        np.save(tmp_path / f"{name}.npy", arr)
    out = tmp_path / "out"
    res = run_inprocess(["audit", "--model", "token_gate_toys:classifier", "--sites",
                         "gates.*", "--inputs", tmp_path / "x.npy", "--targets",
                         tmp_path / "y.npy", "--calib-inputs", tmp_path / "xc.npy",
                         "--out", out, *FAST_ARGS], capsys)
    assert_clean_failure(res, tmp_path, out, "the token ids of --inputs span [0, 7] but the "
                         "model's vocabulary has 4 entries")


def test_sequences_beyond_a_stated_context_are_one_line() -> None:
    net = tg.classifier()
    net.config = types.SimpleNamespace(vocab_size=tg.V, block_size=3)
    with pytest.raises(DataError, match="AuditData.inputs hold sequences of 4 token ids, "
                                        "beyond the model's context of 3; cut them to at "
                                        "most 3"):
        fcaudit.audit(net, sites=["gates.*"], data=data(), options=AuditOptions(**FAST))


@pytest.mark.parametrize("option, fragment", [
    (dict(objective="token-nll"), "scores token ids, but the data are other inputs"),
    (dict(frontier=True, execution=True), "is measured on token inputs only"),
    (dict(target_ci=0.1), "grows a pool of token windows"),
])
def test_nothing_else_treats_them_as_next_token_data(option: dict, fragment: str) -> None:
    """Next-token NLL, the savings frontier and --target-ci stay token-window only."""
    with pytest.raises(FcauditError, match=fragment):
        fcaudit.audit(tg.classifier(), sites=["gates.*"], data=data(),
                      options=AuditOptions(**{**FAST, **option}))


def test_the_data_protocol_answers_token_ids_for_integer_inputs() -> None:
    view = data(cast=np.int32).checked()
    assert isinstance(view, ExampleData) and not view.next_token and TokenData.next_token
    assert view.token_ids.dtype == np.int64
    assert np.array_equal(view.token_ids, tg.evaluation(N, 5))
    batch = view.examples.rows(0, 2)
    assert torch.equal(view.batch_token_ids(batch), torch.from_numpy(tg.evaluation(N, 5)[:2]))
    sums = view.calibration_token_sums({"s": torch.ones(2, 4, 1)}, batch)
    ids, counts = np.unique(tg.evaluation(N, 5)[:2], return_counts=True)
    assert sums.ids.tolist() == ids.tolist() and sums.counts.tolist() == counts.tolist()
    assert data(cast=np.float32).checked().token_ids is None
