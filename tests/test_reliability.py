"""Reliability and safety (issue 7): bad inputs, interrupted runs, full disks, corrupted
caches, safe loading, determinism. The catalogue is docs/reliability.md.

Every user-facing failure must be one stderr line that names the input and says what
to do, with exit status 2, no traceback (unless ``--debug``) and nothing half-written:
no audit.json and no stray temporary file. The wide table of bad inputs runs through
``fcaudit.cli.main`` in this process (the same code path as the console script, ~50x
faster); a representative subset, ``--debug``, a real SIGKILL and the determinism check
run ``python -m fcaudit.cli`` in a subprocess.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import toys
from conftest import FAST_ARGS, TOY, Result, run_inprocess, strip_nondeterministic
from torch import nn

from fcaudit.api import audit
from fcaudit.core.errors import FcauditError
from fcaudit.engine.result import NONDETERMINISTIC_KEYS, ConditionResult, Retention
from fcaudit.engine.run import AuditOptions
from fcaudit.io.data import AuditData, Document, train_tokenizer
from fcaudit.io.fileio import write_json
from fcaudit.io.outdir import MARKER, RUN_FILES, record_files

TESTS = Path(__file__).parent


# ---------------------------------------------------------------------------- helpers


def run_subprocess(argv: list[str], cwd: Path, prefix: list[str] | None = None) -> Result:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, *(prefix or ["-m", "fcaudit.cli"]),
                           *map(str, argv)], capture_output=True, text=True, cwd=cwd, env=env)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def temporaries(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.name.endswith(".tmp"))


def assert_clean_failure(res: Result, root: Path, out: Path, needle: str | tuple[str, ...],
                         code: int = 2) -> None:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == code, res.stderr
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("fcaudit: "), lines[0]
    for part in (needle,) if isinstance(needle, str) else needle:
        assert part in lines[0], lines[0]
    assert "Traceback" not in res.stderr
    assert not (out / "audit.json").exists()
    assert not temporaries(root), temporaries(root)


def canonical(path: Path) -> str:
    """audit.json re-serialised like fileio.write_json after removing the
    nondeterministic keys: byte-comparable."""
    audit = strip_nondeterministic(json.loads(path.read_text(encoding="utf-8")))
    return json.dumps(audit, indent=2, sort_keys=True, allow_nan=False) + "\n"


@pytest.fixture
def tokens(tmp_path: Path) -> dict[str, Path]:
    """Evaluation and calibration token files for the toy model (16 x 16 tokens each)."""
    files = {"eval": toys.pair_sequences(16, 16, 1), "calib": toys.pair_sequences(12, 16, 2)}
    out = {}
    for name, arr in files.items():
        out[name] = tmp_path / f"{name}.npy"
        np.save(out[name], arr)
    return out


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
    assert "Traceback" in res.stderr and "FcauditError" in res.stderr


def test_unexpected_errors_are_one_line_too(tmp_path: Path, tokens: dict[str, Path],
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A failure that is not a known user error (a bug, a model that crashes) is still
    one line, says how to get the traceback, and exits non-zero."""
    def boom(self, ids):  # noqa: ANN001, ANN202
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied\n(second line)")
    monkeypatch.setattr(toys.ToyModel, "forward", boom)
    res = run_inprocess(["audit", *TOY, "--out", tmp_path / "out", *FAST_ARGS, "--tokens",
                         tokens["eval"], "--calib-tokens", tokens["calib"]], capsys)
    assert_clean_failure(res, tmp_path, tmp_path / "out", "--debug", code=1)
    assert "RuntimeError (mat1 and mat2 shapes cannot be multiplied (second line))" in res.stderr


# ---------------------------------------------------------------- disks and kills

def _audit_argv(out: Path, tokens: dict[str, Path], model: str = "toys:content_model",
                extra: tuple = ()) -> list:
    return ["audit", "--model", model, "--sites", "gates.*", "--out", out, *FAST_ARGS, *extra,
            "--tokens", tokens["eval"], "--calib-tokens", tokens["calib"]]


def _enospc(*_args: object, **_kw: object) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("how", ["oserror", "safetensors_error"])
def test_disk_full_while_writing_the_cache(how: str, tmp_path: Path, tokens: dict[str, Path],
                                           monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    import safetensors.torch
    from safetensors import SafetensorError
    real = safetensors.torch.save_file
    calls = []

    def save_file(tensors, path, *args, **kw):  # noqa: ANN001, ANN202
        if "eval-" in Path(path).name:
            calls.append(path)
            if len(calls) == 2:
                real(tensors, path, *args, **kw)  # a partial file under the temporary name
                if how == "oserror":
                    _enospc()
                # what safetensors really raises on a full disk (checked on a 64 KiB tmpfs)
                raise SafetensorError("Error while serializing: I/O error: No space left on "
                                      "device (os error 28)")
        return real(tensors, path, *args, **kw)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    out = tmp_path / "out"
    res = run_inprocess(_audit_argv(out, tokens), capsys)
    assert_clean_failure(res, tmp_path, out, "eval-00001.safetensors")
    assert "No space left on device" in res.stderr and "free disk space" in res.stderr
    cache = out / "cache"
    assert not (cache / "eval-00001.safetensors").exists()
    assert sorted(p.name for p in cache.glob("eval-*.sha256")) == ["eval-00000.safetensors.sha256"]
    # space freed: the rerun resumes and finishes
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    assert run_inprocess(_audit_argv(out, tokens), capsys).returncode == 0


@pytest.mark.parametrize("target", ["audit.json", "manifest.json", "report.md"])
def test_disk_full_at_rename_leaves_no_partial_file(target: str, tmp_path: Path,
                                                    tokens: dict[str, Path],
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    real = os.replace

    def replace(src, dst, *args, **kw):  # noqa: ANN001, ANN202
        if Path(dst).name == target:
            _enospc()
        return real(src, dst, *args, **kw)

    monkeypatch.setattr(os, "replace", replace)
    out = tmp_path / "out"
    res = run_inprocess(_audit_argv(out, tokens), capsys)
    assert_clean_failure(res, tmp_path, out, target)
    assert "No space left on device" in res.stderr
    assert not (out / target).exists() and not (out / "cache" / target).exists()


def test_disk_full_at_fsync_is_caught_before_rename(tmp_path: Path, tokens: dict[str, Path],
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Some file systems report a full disk only when data is flushed."""
    real = os.fsync
    monkeypatch.setattr(os, "fsync", _enospc)
    out = tmp_path / "out"
    res = run_inprocess(_audit_argv(out, tokens), capsys)
    monkeypatch.setattr(os, "fsync", real)
    assert_clean_failure(res, tmp_path, out, "No space left on device")
    assert not (out / "cache" / "manifest.json").exists()


def test_interrupt_during_record_then_resume_gives_identical_results(
        tmp_path: Path, tokens: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from fcaudit.engine import cache as cache_mod
    reference = tmp_path / "reference"
    assert run_inprocess(_audit_argv(reference, tokens), capsys).returncode == 0

    real = cache_mod.CoefficientCache.write
    written: list[str] = []

    def write(self: cache_mod.CoefficientCache, name: str, tensors: dict) -> None:
        if name.startswith("eval-"):
            if len(written) == 2:
                raise KeyboardInterrupt
            written.append(name)
        real(self, name, tensors)

    monkeypatch.setattr(cache_mod.CoefficientCache, "write", write)
    out = tmp_path / "out"
    res = run_inprocess(_audit_argv(out, tokens), capsys)
    assert res.returncode == 130 and "rerun the same command to resume" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    assert not (out / "audit.json").exists() and not temporaries(tmp_path)
    shards = sorted(p.name.removesuffix(".sha256") for p in (out / "cache").glob("eval-*.sha256"))
    assert shards == ["eval-00000.safetensors", "eval-00001.safetensors"]

    monkeypatch.setattr(cache_mod.CoefficientCache, "write", real)
    stamps = {n: (out / "cache" / n).stat().st_mtime_ns for n in shards}
    assert run_inprocess(_audit_argv(out, tokens), capsys).returncode == 0
    assert {n: (out / "cache" / n).stat().st_mtime_ns for n in stamps} == stamps  # reused
    assert canonical(out / "audit.json") == canonical(reference / "audit.json")


KILLER = """
import os, signal, sys
import safetensors.torch as st
real, count = st.save_file, []
def save_file(tensors, path, *args, **kw):
    if "eval-" in os.path.basename(str(path)):
        count.append(path)
        if len(count) == 3:  # the third shard: half-written, then killed outright
            with open(path, "wb") as fh:
                fh.write(b"partial")
            os.kill(os.getpid(), signal.SIGKILL)
    return real(tensors, path, *args, **kw)
st.save_file = save_file
from fcaudit.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigkill_during_record_then_resume_gives_identical_results(
        tmp_path: Path, tokens: dict[str, Path]) -> None:
    out, reference = tmp_path / "out", tmp_path / "reference"
    killed = run_subprocess(_audit_argv(out, tokens), tmp_path, prefix=["-c", KILLER])
    assert killed.returncode == -9
    cache = out / "cache"
    assert not (out / "audit.json").exists() and not (cache / "eval-00002.safetensors").exists()
    assert len(temporaries(cache)) == 1  # a SIGKILL runs no cleanup: left under a temp name
    assert run_subprocess(_audit_argv(out, tokens), tmp_path).returncode == 0
    assert not temporaries(cache)  # ... and the rerun removes it
    assert run_subprocess(_audit_argv(reference, tokens), tmp_path).returncode == 0
    assert canonical(out / "audit.json") == canonical(reference / "audit.json")


# ------------------------------------------------------------------ the cache itself

@pytest.fixture
def recorded(tmp_path: Path, tokens: dict[str, Path],
             capsys: pytest.CaptureFixture[str]) -> Path:
    out = tmp_path / "out"
    assert run_inprocess(_audit_argv(out, tokens), capsys).returncode == 0
    (out / "audit.json").unlink()
    return out


@pytest.mark.parametrize("pattern", ["eval-00001.safetensors", "calib-00000.safetensors",
                                     "replay-*/replay-00001.safetensors"])
def test_corrupted_cache_file_fails_its_checksum(pattern: str, recorded: Path, tmp_path: Path,
                                                 tokens: dict[str, Path],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    (path,) = (recorded / "cache").glob(pattern)
    name = path.name
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte deep in the tensor data, same size
    path.write_bytes(bytes(raw))
    res = run_inprocess(_audit_argv(recorded, tokens), capsys)
    assert_clean_failure(res, tmp_path, recorded, f"{name} fails its checksum")
    assert "delete" in res.stderr


def test_garbled_manifest_is_reported(recorded: Path, tmp_path: Path, tokens: dict[str, Path],
                                      capsys: pytest.CaptureFixture[str]) -> None:
    (recorded / "cache" / "manifest.json").write_text('{"schema": "fcaudit.ca')
    res = run_inprocess(_audit_argv(recorded, tokens), capsys)
    assert_clean_failure(res, tmp_path, recorded, "manifest.json is not valid JSON")
    assert f"delete {recorded / 'cache'}" in res.stderr


@pytest.mark.parametrize("change, needle", [
    ({"model": "toys:constant_model"}, "different model"),
    ({"extra": ("--batch-size", "8")}, "different batch_size"),
], ids=["other_model", "other_batch_size"])
def test_cache_from_another_model_or_setup_is_refused(change: dict, needle: str,
                                                      recorded: Path, tmp_path: Path,
                                                      tokens: dict[str, Path],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    res = run_inprocess(_audit_argv(recorded, tokens, **change), capsys)
    assert_clean_failure(res, tmp_path, recorded, needle)


def test_cache_from_other_data_is_refused(recorded: Path, tmp_path: Path,
                                          tokens: dict[str, Path],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    other = dict(tokens, eval=tmp_path / "other.npy")
    np.save(other["eval"], toys.pair_sequences(16, 16, 9))
    res = run_inprocess(_audit_argv(recorded, other), capsys)
    assert_clean_failure(res, tmp_path, recorded, "different eval_data")


def test_empty_cache_of_a_failed_start_is_not_in_the_way(
        tmp_path: Path, tokens: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A first attempt that recorded nothing (here: writing its first shard failed) holds
    nothing to lose, so a rerun into the same --out with another model just starts afresh;
    one that recorded a shard is kept and another model is refused."""
    from fcaudit.engine import cache as cache_mod
    out = tmp_path / "out"

    def fail(self: cache_mod.CoefficientCache, name: str, tensors: dict) -> None:
        raise FcauditError(f"could not write {name}")

    monkeypatch.setattr(cache_mod.CoefficientCache, "write", fail)
    assert run_inprocess(_audit_argv(out, tokens), capsys).returncode == 2
    assert (out / "cache" / "manifest.json").exists()
    monkeypatch.undo()
    assert run_inprocess(_audit_argv(out, tokens, model="toys:constant_model"),
                         capsys).returncode == 0
    res = run_inprocess(_audit_argv(out, tokens), capsys)
    assert res.returncode == 2 and "different model" in res.stderr


# -------------------------------------------------------------------- non-finite values

def test_non_finite_nll_is_refused(tmp_path: Path) -> None:
    model = toys.content_model()
    with torch.no_grad():
        model.scale.fill_(float("nan"))
    data = AuditData(toys.pair_sequences(8, 16, 1), toys.pair_sequences(8, 16, 2), {})
    with pytest.raises(FcauditError, match="NLL is not finite .* record pass"):
        audit(model, tmp_path / "out", sites=["gates.*"], data=data, report=False,
              options=AuditOptions(bootstrap=10, repeats=1, execution=False, progress=False))
    assert not (tmp_path / "out" / "audit.json").exists()


# ----------------------------------------------------------------------- determinism

def test_two_audits_are_byte_identical_outside_the_runtime_section(
        tmp_path: Path, tokens: dict[str, Path]) -> None:
    audits = []
    for name in ("a", "b"):
        res = run_subprocess(_audit_argv(tmp_path / name, tokens), tmp_path)
        assert res.returncode == 0, res.stderr
        audits.append(tmp_path / name / "audit.json")
    a, b = (json.loads(p.read_text()) for p in audits)
    assert a["nondeterministic_keys"] == list(NONDETERMINISTIC_KEYS) == [
        "runtime", "command", "execution.timing", "execution.speed_ratio_vs_dense"]
    assert set(a["runtime"]) == {"host", "timings", "schedule", "cache", "reuse"}
    assert "host" not in a and "timings" not in a
    assert a["command"] != b["command"]  # it names --out; that is why it is listed
    assert canonical(audits[0]) == canonical(audits[1])
    # the file itself is written in the canonical form: only the listed keys differ
    assert audits[0].read_text() == json.dumps(a, indent=2, sort_keys=True) + "\n"
    differing = {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    assert differing <= {k.split(".")[0] for k in a["nondeterministic_keys"]}


# --------------------------------------------------------------- interrupted training

def test_interrupted_training_leaves_no_run_folder(tmp_path: Path, run_folder: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from fcaudit.study import train as train_mod

    def interrupt(*_args: object, **_kw: object) -> None:
        raise KeyboardInterrupt

    # a small corpus instead of the built-in one (tokenizing that takes most of a minute)
    text = (run_folder / "text.txt").read_text()
    tok = train_tokenizer([Document("text", text)], 300)
    monkeypatch.setattr(train_mod, "builtin_documents", lambda split: [Document(split, text)])
    monkeypatch.setattr(train_mod, "builtin_tokenizer", lambda vocab_size: tok)
    monkeypatch.setattr(train_mod, "write_json", interrupt)  # the last file of the folder
    shutil.copytree(run_folder / "run", tmp_path / "keep")  # an earlier run, for --force
    record_files(tmp_path / "keep", RUN_FILES)  # as `fcaudit train` records its files
    before = {p.name: p.read_bytes() for p in (tmp_path / "keep").iterdir()}
    for out, force in ((tmp_path / "new", False), (tmp_path / "keep", True)):
        with pytest.raises(KeyboardInterrupt):
            train_mod.train("dense", "tiny", 0, out, steps=1, force=force, progress=False,
                            device="cpu")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"]  # no partial, no temp
    assert {p.name: p.read_bytes() for p in (tmp_path / "keep").iterdir()} == before
    # not interrupted: --force swaps the new folder in and leaves nothing else behind
    monkeypatch.setattr(train_mod, "write_json", write_json)
    train_mod.train("dense", "tiny", 0, tmp_path / "keep", steps=1, force=True, progress=False,
                    device="cpu")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"]
    assert sorted(p.name for p in (tmp_path / "keep").iterdir()) == [
        MARKER, "config.json", "model.safetensors", "tokenizer.json", "train_log.jsonl"]


# ------------------------------------------------------------------------ verdicts

def _cond(delta: float, lo: float, hi: float) -> ConditionResult:
    return ConditionResult(nll=3.0 + delta, delta=delta, ci95=(lo, hi), repeats=[3.0 + delta],
                           repeat_deltas=[delta])


ZERO = (0.0, -0.01, 0.01)  # an interval that holds 0
KEPT_UNDEFINED = Retention(gap=0.0, gap_ci95=(-0.1, 0.1), value=None, ci95=None, defined=False)


def _kept(value: float, lo: float, hi: float) -> Retention:
    return Retention(gap=0.5, gap_ci95=(0.4, 0.6), value=value, ci95=(lo, hi), defined=True)


# (case, reassign, shuffle, reassign+shuffle, static-layer, static-layer-position, retention,
#  the verdict's label, by hand from the rules in docs/method.md)
VERDICTS = [
    ("all above", (0.3, 0.2, 0.4), (0.25, 0.15, 0.3), (0.5, 0.4, 0.6), (0.2, 0.1, 0.3),
     (0.1, 0.05, 0.2), _kept(30.0, 20.0, 40.0), "Strong dependence"),
    ("some above", (0.02, 0.01, 0.03), ZERO, ZERO, ZERO, ZERO, KEPT_UNDEFINED,
     "Partial dependence"),
    ("above and below", (0.02, 0.01, 0.03), (-0.02, -0.03, -0.01), ZERO, ZERO, ZERO,
     KEPT_UNDEFINED, "Partial dependence"),
    ("weak", (0.01, 0.005, 0.02), (0.01, 0.002, 0.02), ZERO, ZERO, ZERO,
     _kept(95.0, 92.0, 98.0), "Weak dependence"),
    ("only below", (-0.0004, -0.0007, -0.0001), (0.0001, -0.0002, 0.0003), ZERO, ZERO,
     (-0.002, -0.003, -0.001), KEPT_UNDEFINED, "No dependence"),
    ("none excluding 0", ZERO, ZERO, ZERO, ZERO, ZERO, KEPT_UNDEFINED,
     "No measurable dependence"),
]


@pytest.mark.parametrize("case, r, s, rs, sl, slp, kept, label", VERDICTS,
                         ids=[v[0] for v in VERDICTS])
def test_each_dependence_verdict_follows_its_rule(case: str, r: tuple, s: tuple, rs: tuple,
                                                  sl: tuple, slp: tuple, kept: Retention,
                                                  label: str) -> None:
    from fcaudit.engine.verdicts import dependence
    conditions = {name: _cond(*c) for name, c in (
        ("reassign", r), ("shuffle", s), ("reassign+shuffle", rs), ("static-layer", sl),
        ("static-layer-position", slp), ("static-layer-token", ZERO))}
    sentence = dependence(conditions, {"static-layer": kept})
    assert sentence.startswith(label + " on the coefficient assignment"), sentence
    numbers = (f"reassigning coefficients across inputs costs {r[0]:+.4f} nats [{r[1]:+.4f}, "
               f"{r[2]:+.4f}], shuffling them across tokens {s[0]:+.4f} [{s[1]:+.4f}, "
               f"{s[2]:+.4f}]")
    assert numbers in sentence
    if case == "only below":  # what was seen, said as it is: an intervention that helps
        assert sentence.startswith(
            "No dependence on the coefficient assignment (no penalty's 95% interval lies above "
            "0, and reassigning coefficients across inputs lowers the NLL by 0.0004 nats "
            "[0.0001, 0.0007]; a static per-layer-and-position profile lowers the NLL by "
            "0.0020 nats [0.0010, 0.0030]: the model does not need its coefficients matched to "
            "their input and token)"), sentence
    assert (case in ("only below", "none excluding 0")) == sentence.startswith("No ")


# ---------------------------------------------------------------------- gate axes

class _TimeMajorGate(nn.Module):
    """A gate whose output is [positions, batch, 1] (time-major), not [batch, positions]."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (ids.T.unsqueeze(-1) % 7).float() / 7


class _TimeMajorModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gates = nn.ModuleList([_TimeMajorGate()])
        self.emb = nn.Embedding(toys.V, toys.V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids) * self.gates[0](ids).transpose(0, 1)


@pytest.mark.parametrize("size", [2, 4])
def test_a_time_major_gate_is_refused_even_when_batch_equals_length(size: int,
                                                                    tmp_path: Path) -> None:
    ids = toys.pair_sequences(3 * size, size, 1)
    data = AuditData(ids[:2 * size], ids[2 * size:], {})
    options = AuditOptions(batch_size=size, repeats=1, bootstrap=10, per_layer=False,
                           execution=False, progress=False)
    with pytest.raises(FcauditError) as caught:  # batch == positions: the shapes alone agree
        audit(_TimeMajorModel(), tmp_path / "out", sites=["gates.*"], data=data,
              options=options)
    message = str(caught.value)
    assert "\n" not in message and "site gates.0" in message, message
    assert f"with {size + 1} sequences of {size} tokens; with {size} of {size} the shape " \
        "fitted only because the two counts are equal: are the output's axes [positions, " \
        "batch, ...]?" in message
    assert not (tmp_path / "out").exists()
