"""Objectives: classification loss and accuracy against numpy, a user callable
against a hand computation, the CLI with --inputs/--targets end to end, and bad inputs
refused in one line before any work."""

from __future__ import annotations

import json
import re
import threading

import numpy as np
import pytest
import torch
import vision_toys as vt
from conftest import FAST_ARGS, run_inprocess

import fcaudit
from fcaudit import AuditData, AuditOptions
from fcaudit.core.errors import FcauditError

FAST = dict(bootstrap=100, repeats=1, execution=False, progress=False, batch_size=8,
            per_layer=False)


def images(n: int = 16, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """8x8 images and 10 classes (tiny_condconv's), balanced."""
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 1, 8, 8)).astype(np.float32), np.arange(n) % vt.CLASSES


def reference_logits(x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return vt.tiny_condconv()(torch.from_numpy(x)).double().numpy()


def test_classification_loss_and_accuracy_match_numpy() -> None:
    x, y = images()
    xc, _ = images(seed=1)
    r = fcaudit.audit(vt.tiny_condconv(), data=AuditData(inputs=x, targets=y, calib_inputs=xc),
                      options=AuditOptions(objective="classification", **FAST))
    logits = reference_logits(x)
    shifted = logits - logits.max(1, keepdims=True)
    ce = np.log(np.exp(shifted).sum(1)) - shifted[np.arange(len(y)), y]
    for name in ("original", "correct"):
        assert r.conditions[name].nll == pytest.approx(ce.mean(), rel=1e-6)
        assert r.conditions[name].accuracy == float((logits.argmax(1) == y).mean())
    assert r.settings["objective"] == "classification"
    for name, c in r.conditions.items():  # accuracy is a share of examples: k / 16
        assert c.accuracy is not None and (16 * c.accuracy).is_integer(), name


def test_user_callable_objective_matches_a_hand_computation() -> None:
    """``1 - p(target)`` per example, and a two-unit [B, 2] loss whose per-example mean
    the audit must average (units, then examples)."""
    x, y = images()
    xc, _ = images(seed=1)
    data = AuditData(inputs=x, targets=y, calib_inputs=xc)

    def miss(output, batch):
        p = torch.softmax(output.double(), -1)
        return (1 - p[torch.arange(len(batch.targets)), batch.targets]).float()

    def two_units(output, batch):
        return torch.stack([output[:, 0], output[:, 1] ** 2], dim=1)

    logits = reference_logits(x)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    for fn, expected in ((miss, (1 - p[np.arange(len(y)), y]).mean()),
                         (two_units, ((logits[:, 0] + logits[:, 1] ** 2) / 2).mean())):
        r = fcaudit.audit(vt.tiny_condconv(), data=data,
                          options=AuditOptions(objective=fn, **FAST))
        assert r.conditions["correct"].nll == pytest.approx(expected, rel=1e-5)
        assert r.conditions["correct"].accuracy is None
        assert r.settings["objective"].startswith("callable:")
        assert r.identity_replay_max_abs_diff == 0.0


def cross_entropy(output: torch.Tensor, batch) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output, batch.targets, reduction="none")


def test_constant_coefficient_under_a_callable_objective_is_exactly_unchanged() -> None:
    x, y = vt.mixer_data(16, 0)
    xc, _ = vt.mixer_data(16, 1)
    r = fcaudit.audit(vt.constant_mixer(), data=AuditData(inputs=x, targets=y, calib_inputs=xc),
                      options=AuditOptions(objective=cross_entropy, **FAST))
    assert r.conditions["reassign"].delta == 0.0
    assert r.retention["static-layer"].value == 100.0


def audit_refused(tmp_path, data: AuditData, model=None, sites=None, **options) -> str:
    out = tmp_path / "out"
    with pytest.raises(FcauditError) as info:
        fcaudit.audit(model or vt.tiny_condconv(), out, data=data, sites=sites,
                      options=AuditOptions(**{"objective": "classification", **FAST,
                                              **options}))
    assert not out.exists()  # refused before any file was written
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(("case", "expected"), [
    ("short targets", "holds 16 examples but AuditData.targets 15"),
    ("class 10 of 10", r"targets span \[0, 10\] but the model's logits have 10 classes"),
    ("negative class", r"targets span \[-1, 9\]"),
    ("float targets", "classification needs integer class indices"),
    ("2-d targets", "classification needs integer class indices"),
    ("object inputs", "not objects or strings"),
    ("no targets", "needs targets"),
    ("calib out of range", r"calibration targets span \[0, 12\]"),
    ("one example", "at least 2 evaluation examples"),
    ("calib shape", "differ in shape or dtype"),
    ("shared example", "share 1 identical example"),
])
def test_bad_inputs_are_refused_before_work(tmp_path, case: str, expected: str) -> None:
    x, y = images()
    xc, yc = images(seed=1)
    data = {"inputs": x, "targets": y, "calib_inputs": xc}
    if case == "short targets":
        data["targets"] = y[:-1]
    elif case == "class 10 of 10":
        data["targets"] = np.where(np.arange(16) == 5, 10, y)
    elif case == "negative class":
        data["targets"] = np.where(np.arange(16) == 5, -1, y)
    elif case == "float targets":
        data["targets"] = y.astype(np.float32)
    elif case == "2-d targets":
        data["targets"] = y[:, None]
    elif case == "object inputs":
        data["inputs"] = x.astype(object)
    elif case == "no targets":
        data["targets"] = None
    elif case == "calib out of range":
        data["calib_targets"] = np.where(np.arange(16) == 0, 12, yc)
    elif case == "one example":
        data["inputs"], data["targets"] = x[:1], y[:1]
    elif case == "calib shape":
        data["calib_inputs"] = xc[:, :, :4]
    elif case == "shared example":
        data["calib_inputs"] = np.concatenate([xc, x[3:4]])
    message = audit_refused(tmp_path, AuditData(**data))
    assert re.search(expected, message), message


@pytest.mark.parametrize(("options", "data", "expected"), [
    ({"objective": "token-nll"}, "arrays", "scores token ids"),
    ({"objective": "bogus"}, "arrays", "choose one of token-nll, classification, selective-copy"),
    ({"objective": "classification"}, "tokens", "token ids are scored by next-token NLL"),
    ({"objective": "classification", "frontier": True, "execution": True}, "arrays",
     "token inputs only"),
])
def test_objective_and_data_must_fit(tmp_path, options, data, expected) -> None:
    from conftest import toy_data
    x, y = images()
    given = toy_data() if data == "tokens" else AuditData(inputs=x, targets=y,
                                                          calib_inputs=images(seed=1)[0])
    model = __import__("toys").content_model() if data == "tokens" else None
    sites = ["gates.*"] if data == "tokens" else None
    assert expected in audit_refused(tmp_path, given, model, sites, **options)


def test_cli_audit_with_inputs_and_targets(tmp_path, capsys) -> None:
    x, y = images()
    xc, yc = images(seed=1)
    paths = {}
    for name, arr in (("x", x), ("y", y), ("xc", xc), ("yc", yc)):
        paths[name] = tmp_path / f"{name}.npy"
        np.save(paths[name], arr)
    out = tmp_path / "audit"
    argv = ["audit", "--model", "vision_toys:tiny_condconv", "--inputs", paths["x"],
            "--targets", paths["y"], "--calib-inputs", paths["xc"], "--calib-targets",
            paths["yc"], "--objective", "classification", "--out", out, *FAST_ARGS]
    res = run_inprocess(argv, capsys)
    assert res.returncode == 0, res.stderr
    audit = json.loads((out / "audit.json").read_text())
    logits = reference_logits(x)
    assert audit["conditions"]["correct"]["accuracy"] == float((logits.argmax(1) == y).mean())
    assert set(audit["not_applicable"]) == {"shuffle", "reassign+shuffle",
                                            "static-layer-position", "static-layer-token"}
    assert audit["data"]["eval_examples"] == 16 and audit["data"]["source"] == "arrays"
    assert "not applicable" in (out / "report.md").read_text()
    assert "accuracy" in res.stdout


def test_cli_max_eval_and_max_calib_pick_rows_of_the_inputs(tmp_path, capsys) -> None:
    """--max-eval/--max-calib with --inputs take that many rows spread evenly over the
    arrays: the audit equals one given exactly those rows (picked here by hand)."""
    x, y = images()
    xc = images(seed=1)[0]
    rows, calib_rows = [0, 3, 6, 9, 12, 15], [0, 5, 10, 15]  # 6 and 4 of 16, evenly spread
    for name, arr in (("x", x), ("y", y), ("xc", xc), ("x6", x[rows]), ("y6", y[rows]),
                      ("xc4", xc[calib_rows])):
        np.save(tmp_path / f"{name}.npy", arr)
    audits = {}
    for case, inputs, extra in (
            ("picked", ("x", "y", "xc"), ["--max-eval", "6", "--max-calib", "4"]),
            ("by hand", ("x6", "y6", "xc4"), [])):
        out = tmp_path / case
        argv = ["audit", "--model", "vision_toys:tiny_condconv", "--out", out, *FAST_ARGS,
                *[str(v) for flag, name in zip(("--inputs", "--targets", "--calib-inputs"),
                                               inputs, strict=True)
                  for v in (flag, tmp_path / f"{name}.npy")], *extra]
        res = run_inprocess(argv, capsys)
        assert res.returncode == 0, res.stderr
        audits[case] = json.loads((out / "audit.json").read_text())
    picked, by_hand = audits["picked"], audits["by hand"]
    assert picked["data"]["eval_examples"] == 6 and picked["data"]["eval_picked"] == \
        "6 of 16, spread evenly" and picked["data"]["calib_picked"] == "4 of 16, spread evenly"
    logits = reference_logits(x[rows])
    assert picked["conditions"]["correct"]["accuracy"] == \
        float((logits.argmax(1) == y[rows]).mean())
    for key in ("conditions", "static_profiles", "identity_replay_max_abs_diff"):
        assert picked.get(key) == by_hand.get(key), key


@pytest.mark.parametrize(("change", "expected"), [
    ("max eval 1", "--max-eval 1"),
    ("scalar", "--inputs has shape []"),
    ("object", "needs pickle to load"),
    ("truncated", "is truncated: its header promises 4096 bytes of [16, 1, 8, 8] float32 "
                  "values, the file holds 4000"),
    ("also tokens", "--inputs and --tokens both given"),
    ("token-nll", "--objective token-nll scores token ids"),
    ("no calib", "pass both --inputs (evaluation) and --calib-inputs"),
    ("targets alone", "--targets needs --inputs and --calib-inputs"),
    ("short", "--inputs holds 16 examples but --targets 15"),
])
def test_cli_refuses_bad_arrays_in_one_line(tmp_path, capsys, change: str,
                                            expected: str) -> None:
    x, y = images()
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "xc.npy", images(seed=1)[0])
    np.save(tmp_path / "y.npy", y[:-1] if change == "short" else y)
    if change == "object":
        np.save(tmp_path / "x.npy", x.astype(object), allow_pickle=True)
    if change == "truncated":  # 16 x 64 float32 = 4096 data bytes, 96 of them cut off
        whole = (tmp_path / "x.npy").read_bytes()
        (tmp_path / "x.npy").write_bytes(whole[:-96])
    out = tmp_path / "audit"
    args = {"--inputs": tmp_path / "x.npy", "--targets": tmp_path / "y.npy",
            "--calib-inputs": tmp_path / "xc.npy", "--objective": "classification"}
    if change == "also tokens":
        args["--tokens"] = tmp_path / "x.npy"
    elif change == "max eval 1":
        args["--max-eval"] = 1
    elif change == "scalar":  # a 0-d array with a count to pick: refused, not a crash
        np.save(tmp_path / "x.npy", np.float32(1.0))
        args["--max-eval"] = 4
    elif change == "token-nll":
        args["--objective"] = "token-nll"
    elif change == "no calib":
        del args["--calib-inputs"]
    elif change == "targets alone":
        del args["--inputs"], args["--calib-inputs"]
    argv = ["audit", "--model", "vision_toys:tiny_condconv", "--out", out, *FAST_ARGS,
            *[str(v) for kv in args.items() for v in kv]]
    res = run_inprocess(argv, capsys)
    assert res.returncode == 2
    line = res.stderr.strip()
    assert line.startswith("fcaudit: error: ") and "\n" not in line and expected in line, line
    assert not out.exists()


def test_non_exact_identity_and_a_bad_objective_stop_before_work(tmp_path) -> None:
    x, y = vt.mixer_data(16, 0)
    data = AuditData(inputs=x, targets=y, calib_inputs=vt.mixer_data(16, 1)[0])
    message = audit_refused(tmp_path, data, vt.NoisyMixer(constant=False).eval())
    assert "identity replay is not exact" in message and "classification loss" in message
    for bad, got in ((lambda out, b: out.argmax(1), "int64 [8]"),
                     (lambda out, b: out.sum(1)[:3], "float32 [3]"),
                     (lambda out, b: out[..., None], "float32 [8, 4, 1]"),
                     (lambda out, b: 0.5, "float")):
        message = audit_refused(tmp_path, data, vt.class_mixer(), objective=bad)
        name = ("callable:test_objectives.test_non_exact_identity_and_a_bad_objective_stop_"
                "before_work.<locals>.<lambda>")  # the objective by name, not "the objective"
        assert message == (f"objective {name} must return per-unit losses, a float tensor [B] "
                           f"or [B, T] with B=8 examples; it returned {got}"), message


def test_token_ids_with_a_site_without_token_axis_are_refused(tmp_path) -> None:
    from conftest import toy_data

    from fcaudit.core.contract import Site
    site = Site("g0", "gates.0", "gate", 0, axes=("example", "kernel"), positions=())
    message = audit_refused(tmp_path, toy_data(), __import__("toys").content_model(), [site],
                            objective="token-nll")
    assert message.startswith("token ids are scored by next-token NLL on sites") and \
        "AuditData(inputs=..., targets=..., calib_inputs=...)" in message


class LockedLoss:
    """Cross-entropy behind a lock, beside an open file: state that cannot be pickled or
    deep-copied (the objective runs, but never resumes: see core/codestate.py)."""

    def __init__(self, path) -> None:
        self.lock = threading.Lock()
        self.log = open(path, "w")  # noqa: SIM115 (held open on purpose)

    def __call__(self, output: torch.Tensor, batch) -> torch.Tensor:
        with self.lock:
            return cross_entropy(output, batch)


def test_an_objective_holding_a_lock_and_an_open_file_finishes_its_audit(tmp_path) -> None:
    """Assembling the result once deep-copied the options, objective included: the audit
    ran to the end and died in a TypeError with no audit.json. It must finish, with the
    numbers of the same loss as a plain function (numpy cross-entropy)."""
    x, y = images()
    xc, _ = images(seed=1)
    objective = LockedLoss(tmp_path / "log.txt")
    try:
        r = fcaudit.audit(vt.tiny_condconv(), tmp_path / "out",
                          data=AuditData(inputs=x, targets=y, calib_inputs=xc),
                          options=AuditOptions(objective=objective, **FAST))
    finally:
        objective.log.close()
    logits = reference_logits(x)
    shifted = logits - logits.max(1, keepdims=True)
    ce = np.log(np.exp(shifted).sum(1)) - shifted[np.arange(len(y)), y]
    assert r.conditions["correct"].nll == pytest.approx(ce.mean(), rel=1e-6)
    saved = json.loads((tmp_path / "out" / "audit.json").read_text())
    assert saved["settings"]["objective"] == r.settings["objective"] == \
        "callable:test_objectives.LockedLoss"
