"""The plan before the work: the passes and the cache's size are printed before any pass of
the audit proper, the size matches what the cache takes on disk, and a cache the disk
cannot hold is refused before anything is written (tests/test_audit_plan.py: every pass
counted, the estimate)."""

from __future__ import annotations

import json
import shutil
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
import toys
from conftest import FAST_ARGS, run_inprocess

FAST = [a for a in FAST_ARGS if a != "--quiet"]  # the plan is part of the progress output


def _argv(root: Path, out: Path) -> list[str]:
    np.save(root / "eval.npy", toys.pair_sequences(12, 16, 1))
    np.save(root / "calib.npy", toys.pair_sequences(8, 16, 2))
    return ["audit", "--model", "toys:content_model", "--sites", "gates.*", "--tokens",
            root / "eval.npy", "--calib-tokens", root / "calib.npy", "--out", out, *FAST]


def test_the_plan_is_printed_before_the_work_and_sizes_the_cache(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    res = run_inprocess(_argv(tmp_path, out), capsys)
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    plan = next(i for i, line in enumerate(lines) if line.startswith("fcaudit: plan: about"))
    first_pass = next(i for i, line in enumerate(lines) if "record calibration" in line)
    assert plan < first_pass  # said before the audit's first pass
    # record: evaluation batches 1, 2 (batch 0 is the probe's) and calibration 0, 1; runs:
    # correct, reassign, shuffle, reassign+shuffle, global-mean, static-layer,
    # static-layer-position, static-layer-token (one repeat each; no per-layer runs) and
    # the correct replay again after them, on each of the 3 evaluation batches
    assert "plan: about 31 forward passes" in lines[plan]
    assert "record 4 passes" in lines[plan] and "replay 27 passes" in lines[plan]
    size = next(line for line in lines if line.startswith("fcaudit: plan: cache about"))
    written = json.loads((out / "audit.json").read_text())["runtime"]
    per_sequence = written["plan"]["bytes_per_eval_sequence"]
    assert abs(written["plan"]["cache_bytes"] / 12 - per_sequence) <= 0.5  # over 12 sequences
    assert f"({per_sequence / 1000:.1f} KB per evaluation sequence" in size
    reuse = written["reuse"]
    assert (reuse["evaluation_batches_recorded"], reuse["evaluation_batches_proven"]) == (3, 0)
    assert (reuse["calibration_batches_recorded"], reuse["calibration_batches_proven"]) == (2, 0)


def test_a_cache_the_disk_cannot_hold_is_refused_before_any_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    out = tmp_path / "out"
    res = run_inprocess(_argv(tmp_path, out), capsys)
    assert res.returncode == 2
    assert "the audit's cache needs about" in res.stderr
    assert "has 1.0 KB free: choose --out on a larger disk, or audit fewer sequences " \
           "(--max-eval) or sites" in res.stderr
    assert not out.exists()


def _spy_on_the_plan(monkeypatch: pytest.MonkeyPatch) -> dict:
    """The engine's record plan, kept in ``seen["cost"]`` when the audit computes it."""
    from fcaudit.engine import budget
    seen: dict = {}
    real = budget.record_cost

    def spy(*args, **kw):  # noqa: ANN002, ANN003 - passes through
        seen["cost"] = real(*args, **kw)
        return seen["cost"]
    monkeypatch.setattr("fcaudit.engine.budget.record_cost", spy)
    return seen


def test_a_cache_that_takes_most_of_the_disk_is_warned_about(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    argv = _argv(tmp_path, out)
    seen = _spy_on_the_plan(monkeypatch)
    usage = namedtuple("usage", "total used free")
    # free space for the cache and a little more: more than half of it is taken
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda path: usage(10**12, 0, int(seen["cost"].cache_bytes * 1.5)))
    res = run_inprocess(argv, capsys)
    assert res.returncode == 0, res.stderr
    assert "warning: the cache will take about" in res.stderr


def _on_disk(folder: Path) -> int:
    """What ``folder`` takes on its disk, read from the file system (blocks, not sizes)."""
    return sum(p.stat().st_blocks * 512 for p in [folder, *folder.rglob("*")])


@pytest.mark.parametrize("model, extra", [
    ("toys:content_model", ["--sites", "gates.*", "--no-execution"]),
    ("toys:informative_gated_model", ["--frontier", "--frontier-points", "3",
                                      "--timing-pairs", "0"]),
])
def test_the_planned_cache_covers_what_the_cache_takes_on_disk(
        model: str, extra: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The plan once counted calibration shards as two rows' coefficients (their sums per
    token id hold one row per distinct id: 44 of 64 tokens here), left out the frontier's
    whole calibration coefficients and the blocks every file takes, so a cache of 232 KB on
    disk was planned as 132 KB and a 200 KB disk failed mid-record instead of refusing."""
    seen = _spy_on_the_plan(monkeypatch)
    np.save(tmp_path / "eval.npy", toys.pair_sequences(8, 16, 1))
    np.save(tmp_path / "calib.npy", toys.pair_sequences(8, 16, 2))
    out = tmp_path / "out"
    res = run_inprocess(["audit", "--model", model, "--tokens", tmp_path / "eval.npy",
                         "--calib-tokens", tmp_path / "calib.npy", "--out", out, "--quiet",
                         "--repeats", "1", "--bootstrap", "10", "--no-per-layer",
                         "--batch-size", "4", *extra], capsys)
    assert res.returncode == 0, res.stderr
    taken = _on_disk(out / "cache")
    assert taken <= seen["cost"].cache_bytes <= 1.25 * taken
