"""Crash safety: a full disk (at write, rename or fsync), an interrupt or a SIGKILL
during recording, an interrupted training. Nothing half-written is left under a final
name, and a rerun resumes to the audit.json an uninterrupted run writes.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
from conftest import (
    assert_clean_failure,
    audit_argv,
    canonical,
    run_inprocess,
    run_subprocess,
    temporaries,
)

from fcaudit.io.data import Document, train_tokenizer
from fcaudit.io.fileio import write_json
from fcaudit.io.outdir import MARKER, RUN_FILES, record_files

# ---------------------------------------------------------------- disks and kills

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
    res = run_inprocess(audit_argv(out, tokens), capsys)
    assert_clean_failure(res, tmp_path, out, "eval-00001.safetensors")
    assert "No space left on device" in res.stderr and "free disk space" in res.stderr
    cache = out / "cache"
    assert not (cache / "eval-00001.safetensors").exists()
    assert sorted(p.name for p in cache.glob("eval-*.sha256")) == ["eval-00000.safetensors.sha256"]
    # space freed: the rerun resumes and finishes
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    assert run_inprocess(audit_argv(out, tokens), capsys).returncode == 0


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
    res = run_inprocess(audit_argv(out, tokens), capsys)
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
    res = run_inprocess(audit_argv(out, tokens), capsys)
    monkeypatch.setattr(os, "fsync", real)
    assert_clean_failure(res, tmp_path, out, "No space left on device")
    assert not (out / "cache" / "manifest.json").exists()


def test_interrupt_during_record_then_resume_gives_identical_results(
        tmp_path: Path, tokens: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from fcaudit.engine import cache as cache_mod
    reference = tmp_path / "reference"
    assert run_inprocess(audit_argv(reference, tokens), capsys).returncode == 0

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
    res = run_inprocess(audit_argv(out, tokens), capsys)
    assert res.returncode == 130 and "rerun the same command to resume" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    assert not (out / "audit.json").exists() and not temporaries(tmp_path)
    shards = sorted(p.name.removesuffix(".sha256") for p in (out / "cache").glob("eval-*.sha256"))
    assert shards == ["eval-00000.safetensors", "eval-00001.safetensors"]

    monkeypatch.setattr(cache_mod.CoefficientCache, "write", real)
    stamps = {n: (out / "cache" / n).stat().st_mtime_ns for n in shards}
    assert run_inprocess(audit_argv(out, tokens), capsys).returncode == 0
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
    killed = run_subprocess(audit_argv(out, tokens), tmp_path, prefix=["-c", KILLER])
    assert killed.returncode == -9
    cache = out / "cache"
    assert not (out / "audit.json").exists() and not (cache / "eval-00002.safetensors").exists()
    assert len(temporaries(cache)) == 1  # a SIGKILL runs no cleanup: left under a temp name
    assert run_subprocess(audit_argv(out, tokens), tmp_path).returncode == 0
    assert not temporaries(cache)  # ... and the rerun removes it
    assert run_subprocess(audit_argv(reference, tokens), tmp_path).returncode == 0
    assert canonical(out / "audit.json") == canonical(reference / "audit.json")


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
    from fcaudit.io import runs  # where run folders are written
    monkeypatch.setattr(runs, "write_json", interrupt)  # the last file of the folder
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
    monkeypatch.setattr(runs, "write_json", write_json)
    train_mod.train("dense", "tiny", 0, tmp_path / "keep", steps=1, force=True, progress=False,
                    device="cpu")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"]
    assert sorted(p.name for p in (tmp_path / "keep").iterdir()) == [
        MARKER, "config.json", "model.safetensors", "tokenizer.json", "train_log.jsonl"]
