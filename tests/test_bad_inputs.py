"""Bad inputs through the command line (docs/reliability.md, the catalogue): token
arrays, run folders, text, options, sites and pickles a user can get wrong.

Every user-facing failure must be one stderr line that names the input and says what
to do, with exit status 2, no traceback (unless ``--debug``) and nothing half-written:
no audit.json and no stray temporary file (``conftest.assert_clean_failure``). The wide
table runs through ``fcaudit.cli.main`` in this process (the same code path as the
console script, ~50x faster); a representative subset and ``--debug`` run
``python -m fcaudit.cli`` in a subprocess.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import toys
from conftest import (
    FAST_ARGS,
    TOY,
    assert_clean_failure,
    run_inprocess,
    run_subprocess,
)

TESTS = Path(__file__).parent


# ------------------------------------------------------------------ bad inputs, table

def _tokens_case(tmp: Path, name: str, toks: dict[str, Path]) -> tuple[list, str | tuple]:
    ev, ca = toks["eval"], toks["calib"]
    bad = tmp / f"{name}.npy"
    if name == "float":
        np.save(bad, np.zeros((4, 16)))
    elif name == "ragged":
        np.save(bad, np.array([[1, 2, 3], [4, 5]], dtype=object), allow_pickle=True)
    elif name == "pickled":
        bad.write_bytes(pickle.dumps(np.load(ev).tolist()))
    elif name == "npz":
        bad = tmp / "bad.npz"
        np.savez(bad, ids=np.load(ev))
    elif name == "truncated":
        raw = (ev.read_bytes())
        bad.write_bytes(raw[: len(raw) - 100])
    elif name == "out_of_vocab":
        arr = np.load(ev)
        arr[3, 5] = toys.V + 10
        np.save(bad, arr)
    elif name == "negative":
        arr = np.load(ev)
        arr[0, 0] = -1
        np.save(bad, arr)
    elif name == "no_rows":
        np.save(bad, np.zeros((0, 16), dtype=np.int64))
    elif name == "no_columns":
        np.save(bad, np.zeros((4, 0), dtype=np.int64))
    elif name == "one_token":
        np.save(bad, np.zeros((4, 1), dtype=np.int64))
    elif name == "one_dimensional":
        np.save(bad, np.arange(16))
    elif name == "one_sequence":
        np.save(bad, np.load(ev)[:1])
    elif name == "missing":
        bad = tmp / "missing.npy"
    if name == "calib_equals_eval":
        return ["--tokens", ev, "--calib-tokens", ev], "share 16 identical"
    if name == "calib_short":
        short = tmp / "short.npy"
        np.save(short, np.load(ca)[:, :8])
        return ["--tokens", ev, "--calib-tokens", short], "calibration sequences have length 8"
    if name == "seq_len_mismatch":
        return ["--tokens", ev, "--calib-tokens", ca, "--seq-len", "8"], "--seq-len 8"
    if name == "only_eval_tokens":
        return ["--tokens", ev], "--calib-tokens"
    return ["--tokens", bad, "--calib-tokens", ca], (bad.name, BAD_TOKENS_SAY[name])


# What the one line says about each bad array (besides naming the file): the check is the
# message, not the file name, which alone would match any message naming the file.
BAD_TOKENS_SAY = {
    "float": "has dtype float64; token ids must be integers",
    "ragged": "needs pickle to load (object or ragged array)",
    "pickled": "is not a .npy file",
    "npz": "is a .npz archive",
    "truncated": "is truncated: its header promises 2048 bytes of [16, 16] int64 ids, the file "
                 "holds 1948",
    "out_of_vocab": f"span [0, {toys.V + 10}] but the model's vocabulary has {toys.V} entries",
    "negative": "span [-1, ",
    "no_rows": "needs at least 2 evaluation sequences of 16 tokens",
    "no_columns": "has shape [4, 0]; expected [N, T] (sequences x tokens) with T >= 2",
    "one_token": "has shape [4, 1]; expected [N, T] (sequences x tokens) with T >= 2",
    "one_dimensional": "has shape [16]; expected [N, T] (sequences x tokens) with T >= 2 "
                       "(one sequence: ids[None])",
    "one_sequence": "gives 1: reassignment has no derangement of one sequence",
    "missing": "evaluation tokens file not found",
}


TOKEN_CASES = ["float", "ragged", "pickled", "npz", "truncated", "out_of_vocab", "negative",
               "no_rows", "no_columns", "one_token", "one_dimensional", "one_sequence",
               "missing", "calib_equals_eval", "calib_short", "seq_len_mismatch",
               "only_eval_tokens"]


@pytest.mark.parametrize("case", TOKEN_CASES)
def test_bad_token_arrays(case: str, tmp_path: Path, tokens: dict[str, Path],
                          capsys: pytest.CaptureFixture[str]) -> None:
    extra, needle = _tokens_case(tmp_path, case, tokens)
    out = tmp_path / "out"
    res = run_inprocess(["audit", *TOY, "--out", out, *FAST_ARGS, *extra], capsys)
    assert_clean_failure(res, tmp_path, out, needle)
    assert not out.exists()  # refused before anything was written


def test_token_pickle_is_never_unpickled(tmp_path: Path, tokens: dict[str, Path],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "code-ran"
    payload = tmp_path / "evil.npy"
    payload.write_bytes(pickle.dumps(_RunsCode(marker)))
    res = run_inprocess(["audit", *TOY, "--out", tmp_path / "out", *FAST_ARGS, "--tokens", payload,
                         "--calib-tokens", tokens["calib"]], capsys)
    assert_clean_failure(res, tmp_path, tmp_path / "out", "evil.npy")
    assert not marker.exists()


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def test_sites_matching_nothing(tmp_path: Path, tokens: dict[str, Path],
                                capsys: pytest.CaptureFixture[str]) -> None:
    res = run_inprocess(["audit", "--model", "toys:content_model", "--sites", "blocks.*.gate",
                         "--out", tmp_path / "out", *FAST_ARGS, "--tokens", tokens["eval"],
                         "--calib-tokens", tokens["calib"]], capsys)
    assert_clean_failure(res, tmp_path, tmp_path / "out", "'blocks.*.gate' matched no module")


def test_bad_option_values(tmp_path: Path, tokens: dict[str, Path],
                           capsys: pytest.CaptureFixture[str]) -> None:
    for extra, needle in ((["--max-eval", "1"], "--max-eval 1"),
                          (["--repeats", "0"], "--repeats")):
        res = run_inprocess(["audit", *TOY, "--out", tmp_path / "out", *FAST_ARGS, *extra,
                             "--tokens", tokens["eval"], "--calib-tokens", tokens["calib"]],
                            capsys)
        assert_clean_failure(res, tmp_path, tmp_path / "out", needle)


def _run_case(root: Path, name: str, tmp: Path) -> tuple[list, str]:
    """A damaged copy of the hand-made run folder (or bad text for the intact one)."""
    import shutil
    text = root / "text.txt"
    run = tmp / "run"
    shutil.copytree(root / "run", run)
    if name == "config_garbled":
        (run / "config.json").write_text('{"fcaudit_run": 1, "arch": "featu')
        return ["--model", run, "--data", text], "config.json is not valid JSON"
    if name == "config_missing":
        (run / "config.json").unlink()
        return ["--model", run, "--data", text], "has no config.json"
    if name == "config_wrong_fields":
        (run / "config.json").write_text(json.dumps({"fcaudit_run": 1, "arch": "featuregate",
                                                     "model_config": {"width": 3}}))
        return ["--model", run, "--data", text], "config.json is missing or has wrong fields"
    if name == "config_not_utf8":
        (run / "config.json").write_bytes(b'{"fcaudit_run": 1, "arch": "\xff"}')
        return ["--model", run, "--data", text], "config.json is not valid JSON"
    if name == "weights_truncated":
        raw = (run / "model.safetensors").read_bytes()
        (run / "model.safetensors").write_bytes(raw[: len(raw) // 2])
        return ["--model", run, "--data", text], "model.safetensors is not a readable"
    if name == "weights_missing":
        (run / "model.safetensors").unlink()
        return ["--model", run, "--data", text], "weights file not found"
    if name == "weights_other_model":
        cfg = json.loads((run / "config.json").read_text())
        cfg["model_config"]["n_layer"] = 3
        (run / "config.json").write_text(json.dumps(cfg))
        return ["--model", run, "--data", text], "come from different models"
    if name == "tokenizer_garbled":
        (run / "tokenizer.json").write_text("{not json")
        return ["--model", run, "--data", text], "tokenizer.json"
    if name == "text_empty":
        (tmp / "empty.txt").write_text("  \n")
        return ["--model", run, "--data", tmp / "empty.txt"], "empty.txt holds no text"
    if name == "text_not_utf8":
        (tmp / "latin1.txt").write_bytes("café au lait".encode("latin-1"))
        return ["--model", run, "--data", tmp / "latin1.txt"], "latin1.txt is not UTF-8"
    if name == "text_folder_without_txt":
        (tmp / "nothing").mkdir()
        return ["--model", run, "--data", tmp / "nothing"], "no .txt files found"
    if name == "text_too_short":
        (tmp / "short.txt").write_text("king queen crown")
        return ["--model", run, "--data", tmp / "short.txt"], "short.txt gives 0"
    if name == "text_missing":
        return ["--model", run, "--data", tmp / "absent.txt"], "absent.txt"
    if name == "seq_len_above_context":
        return ["--model", run, "--data", text, "--seq-len", "64"], "context of 32 tokens"
    if name == "seq_len_below_2":
        return ["--model", run, "--data", text, "--seq-len", "1"], "--seq-len 1: must be"
    if name == "model_missing":
        return ["--model", tmp / "nowhere", "--data", text], "model not found"
    if name == "factory_missing":
        return ["--model", "no_such_pkg.mod:build", "--data", text], "cannot import"
    raise AssertionError(name)


RUN_CASES = ["config_garbled", "config_missing", "config_wrong_fields", "config_not_utf8",
             "weights_truncated", "weights_missing", "weights_other_model", "tokenizer_garbled",
             "text_empty", "text_not_utf8", "text_folder_without_txt", "text_too_short",
             "text_missing", "seq_len_above_context", "seq_len_below_2", "model_missing",
             "factory_missing"]


@pytest.mark.parametrize("case", RUN_CASES)
def test_bad_run_folders_and_text(case: str, run_folder: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    extra, needle = _run_case(run_folder, case, tmp_path)
    out = tmp_path / "out"
    res = run_inprocess(["audit", "--out", out, *FAST_ARGS, *extra], capsys)
    assert_clean_failure(res, tmp_path, out, needle)
    assert not out.exists()


def test_intact_run_folder_audits(run_folder: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Positive control for the table above: the undamaged folder and text work."""
    res = run_inprocess(["audit", "--model", run_folder / "run", "--data",
                         run_folder / "text.txt", "--out", tmp_path / "out", *FAST_ARGS,
                         "--max-eval", "8", "--max-calib", "8"], capsys)
    assert res.returncode == 0, res.stderr
    audit = json.loads((tmp_path / "out" / "audit.json").read_text())
    assert audit["identity_replay_max_abs_diff"] == 0.0
    assert audit["data"]["seq_len"] == 16 and audit["data"]["eval_sequences"] >= 2


def test_mudd_bin_pickle_that_runs_code_is_refused_by_the_cli(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "mudd"
    folder.mkdir()
    (folder / "config.json").write_bytes((TESTS / "fixtures" / "mudd_tiny" /
                                          "config.json").read_bytes())
    marker = tmp_path / "code-ran"
    torch.save({"payload": _RunsCode(marker)}, folder / "pytorch_model.bin")
    res = run_inprocess(["audit", "--model", folder, "--out", tmp_path / "out", *FAST_ARGS], capsys)
    assert_clean_failure(res, tmp_path, tmp_path / "out", "refused to load")
    assert not marker.exists()


# ------------------------------------------------------------- the real command line

@pytest.mark.parametrize("case", ["ragged", "out_of_vocab", "calib_equals_eval"])
def test_subprocess_errors_are_one_line(case: str, tmp_path: Path,
                                        tokens: dict[str, Path]) -> None:
    extra, needle = _tokens_case(tmp_path, case, tokens)
    res = run_subprocess(["audit", *TOY, "--out", tmp_path / "out", *FAST_ARGS, *extra], tmp_path)
    assert_clean_failure(res, tmp_path, tmp_path / "out", needle)


def test_subprocess_run_folder_error_is_one_line(run_folder: Path, tmp_path: Path) -> None:
    extra, needle = _run_case(run_folder, "weights_truncated", tmp_path)
    res = run_subprocess(["audit", "--out", tmp_path / "out", *FAST_ARGS, *extra], tmp_path)
    assert_clean_failure(res, tmp_path, tmp_path / "out", needle)


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback(where: str, tmp_path: Path, tokens: dict[str, Path]) -> None:
    extra, _ = _tokens_case(tmp_path, "float", tokens)
    argv = ["audit", *TOY, "--out", tmp_path / "out", *FAST_ARGS, *extra]
    argv = ["--debug", *argv] if where == "before" else [*argv, "--debug"]
    res = run_subprocess(argv, tmp_path)
    assert res.returncode != 0
    # the error's kind (a FcauditError subclass) ends the traceback
    assert "Traceback" in res.stderr and "fcaudit.core.errors.DataError: " in res.stderr


def test_unexpected_errors_are_one_line_too(tmp_path: Path, tokens: dict[str, Path],
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A failure that is not a known user error (a bug in fcaudit, here in its calibration
    stage; a model that crashes on every input is said as the model's error on the first
    batch, tests/test_input_arrays.py) is still one line, says how to get the traceback,
    and exits non-zero."""
    def boom(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied\n(second line)")
    monkeypatch.setattr("fcaudit.engine.measure.record_calibration", boom)
    res = run_inprocess(["audit", *TOY, "--out", tmp_path / "out", *FAST_ARGS, "--tokens",
                         tokens["eval"], "--calib-tokens", tokens["calib"]], capsys)
    assert_clean_failure(res, tmp_path, tmp_path / "out", "--debug", code=1)
    assert "RuntimeError (mat1 and mat2 shapes cannot be multiplied (second line))" in res.stderr
