"""torchrun: one audit over two CPU processes (gloo) gives the single-process audit.json;
a process that dies stops the others with one clear line, and the audit resumes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import toys

from fcaudit.engine.result import NONDETERMINISTIC_KEYS

TESTS = Path(__file__).parent


def canonical(path: Path) -> dict:
    result = json.loads(path.read_text())
    for key in NONDETERMINISTIC_KEYS:
        head, _, tail = key.partition(".")
        (result.get(head, {}).pop(tail, None) if tail else result.pop(head, None))
    return result


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("tokens")
    np.save(root / "eval.npy", toys.pair_sequences(20, 16, 1))
    np.save(root / "calib.npy", toys.pair_sequences(12, 16, 2))
    return ["--tokens", str(root / "eval.npy"), "--calib-tokens", str(root / "calib.npy")]


def fcaudit(args: list[str], out: Path, processes: int | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The audit in one plain process (``processes`` None) or under torchrun."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                 str(processes), "--standalone", "-m", "fcaudit"] if processes
                else [sys.executable, "-m", "fcaudit"])
    argv = ["audit", "--model", "toys:content_model", "--sites", "gates.*", "--out", str(out),
            "--batch-size", "4", "--bootstrap", "100", "--repeats", "2", "--no-execution",
            "--quiet", *args]
    return subprocess.run(launcher + argv, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {}),
                               "PYTHONPATH": os.pathsep.join(
                                   [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])})


def test_two_processes_give_the_single_process_audit(tokens: list[str], tmp_path: Path) -> None:
    single = fcaudit(tokens, tmp_path / "single")
    assert single.returncode == 0, single.stderr
    double = fcaudit(tokens, tmp_path / "double", processes=2)
    assert double.returncode == 0, double.stderr
    assert canonical(tmp_path / "double" / "audit.json") == \
        canonical(tmp_path / "single" / "audit.json")
    runtime = json.loads((tmp_path / "double" / "audit.json").read_text())["runtime"]
    assert runtime["schedule"]["processes"] == 2
    assert runtime["schedule"]["process_group"] == "gloo"


def test_one_process_under_torchrun_joins_a_group_and_gives_the_single_process_audit(
        tokens: list[str], tmp_path: Path) -> None:
    """A 1-process torchrun runs every barrier and gather through a real process group
    (how NCCL is checked on one GPU); a plain process has no group."""
    single = fcaudit(tokens, tmp_path / "single")
    assert single.returncode == 0, single.stderr
    one = fcaudit(tokens, tmp_path / "one", processes=1)
    assert one.returncode == 0, one.stderr
    assert canonical(tmp_path / "one" / "audit.json") == \
        canonical(tmp_path / "single" / "audit.json")
    for folder, group in (("one", "gloo"), ("single", None)):
        schedule = json.loads((tmp_path / folder / "audit.json").read_text())["runtime"]["schedule"]
        assert (schedule["processes"], schedule["process_group"]) == (1, group), folder


def test_a_dead_process_stops_the_audit_which_then_resumes(tokens: list[str],
                                                           tmp_path: Path) -> None:
    out = tmp_path / "out"
    dead = fcaudit(tokens, out, processes=2, env={"TOYS_DIE_RANK": "1", "TOYS_DIE_AFTER": "8"})
    assert dead.returncode != 0
    lines = [ln for ln in dead.stderr.splitlines() if ln.startswith("fcaudit: error:")]
    assert len(lines) == 1 and "another process of this 2-process audit stopped" in lines[0]
    assert "rerun the same command" in lines[0] and not (out / "audit.json").exists()
    kept = sorted(p.name for p in (out / "cache").glob("*.sha256"))
    assert kept  # what the processes finished is on disk
    resumed = fcaudit(tokens, out)  # one process now: a resumed audit may change K
    assert resumed.returncode == 0, resumed.stderr
    reference = fcaudit(tokens, tmp_path / "reference")
    assert reference.returncode == 0, reference.stderr
    assert canonical(out / "audit.json") == canonical(tmp_path / "reference" / "audit.json")


def test_a_rank_whose_model_behaves_differently_stops_the_audit(tokens: list[str],
                                                                 tmp_path: Path) -> None:
    """Rank 1 scales its logits by 1.001 (same code, same weights, same fingerprint): the
    ranks' first-batch digests differ, so every rank stops naming rank 1 instead of
    merging its shards."""
    model = ["--model", "toys:rank_skewed_model"]
    alone = fcaudit(tokens + model, tmp_path / "alone", env={"TOYS_SKEW_RANK": "1"})
    assert alone.returncode == 0, alone.stderr  # one process has no rank 1: nothing skewed
    out = tmp_path / "out"
    skewed = fcaudit(tokens + model, out, processes=2, env={"TOYS_SKEW_RANK": "1"})
    assert skewed.returncode != 0
    lines = [ln for ln in skewed.stderr.splitlines() if ln.startswith("fcaudit: error:")]
    assert len(lines) == 2, skewed.stderr  # each of the two processes says it once
    for line in lines:
        assert "rank(s) 1 computed other coefficients or NLL on the first evaluation batch " \
               "than rank 0 (of 2 processes)" in line
    assert not (out / "audit.json").exists()
    assert not list((out / "cache").glob("eval-00001*"))  # stopped before recording
