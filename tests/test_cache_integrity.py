"""The coefficient cache refuses what it cannot trust: a corrupted shard (checksum), a
garbled manifest, a cache recorded with another model, setup or data; the empty
cache of a failed start is not in the way.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import toys
from conftest import (
    assert_clean_failure,
    audit_argv,
    run_inprocess,
)

from fcaudit.core.errors import FcauditError

# ------------------------------------------------------------------ the cache itself

@pytest.fixture
def recorded(tmp_path: Path, tokens: dict[str, Path],
             capsys: pytest.CaptureFixture[str]) -> Path:
    out = tmp_path / "out"
    assert run_inprocess(audit_argv(out, tokens), capsys).returncode == 0
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
    res = run_inprocess(audit_argv(recorded, tokens), capsys)
    assert_clean_failure(res, tmp_path, recorded, f"{name} fails its checksum")
    assert "delete" in res.stderr


def test_garbled_manifest_is_reported(recorded: Path, tmp_path: Path, tokens: dict[str, Path],
                                      capsys: pytest.CaptureFixture[str]) -> None:
    (recorded / "cache" / "manifest.json").write_text('{"schema": "fcaudit.ca')
    res = run_inprocess(audit_argv(recorded, tokens), capsys)
    assert_clean_failure(res, tmp_path, recorded, "manifest.json is not valid JSON")
    assert f"delete {recorded / 'cache'}" in res.stderr


@pytest.mark.parametrize("change, needle", [
    ({"model": "toys:constant_model"}, "different model"),
    ({"extra": ("--batch-size", "8")}, "different --batch-size (4 -> 8)"),
], ids=["other_model", "other_batch_size"])
def test_cache_from_another_model_or_setup_is_refused(change: dict, needle: str,
                                                      recorded: Path, tmp_path: Path,
                                                      tokens: dict[str, Path],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    res = run_inprocess(audit_argv(recorded, tokens, **change), capsys)
    assert_clean_failure(res, tmp_path, recorded, needle)


def test_cache_from_other_data_is_refused(recorded: Path, tmp_path: Path,
                                          tokens: dict[str, Path],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    other = dict(tokens, eval=tmp_path / "other.npy")
    np.save(other["eval"], toys.pair_sequences(16, 16, 9))
    res = run_inprocess(audit_argv(recorded, other), capsys)
    assert_clean_failure(res, tmp_path, recorded, "different evaluation data")


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
    assert run_inprocess(audit_argv(out, tokens), capsys).returncode == 2
    assert (out / "cache" / "manifest.json").exists()
    monkeypatch.undo()
    assert run_inprocess(audit_argv(out, tokens, model="toys:constant_model"),
                         capsys).returncode == 0
    res = run_inprocess(audit_argv(out, tokens), capsys)
    assert res.returncode == 2 and "different model" in res.stderr
