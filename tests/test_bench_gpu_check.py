"""benchmarks/gpu_check.py runs on a CPU too: every row is checked there, the rows a CPU
cannot run say so, and its result file holds what the table shows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FAMILIES = {"featuregate", "mudd", "moe"}
DTYPES = {"float32", "bfloat16"}


def run_check(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"),
                           "--device", "cpu", "--rounds", "1", "--json", str(out), *extra],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())["results"]


def check_common(proc: subprocess.CompletedProcess, results: dict) -> None:
    identity = results["identity"]
    assert {(r["family"], r["dtype"]) for r in identity} == \
        {(f, d) for f in FAMILIES for d in DTYPES}
    assert len(identity) == len(FAMILIES) * len(DTYPES)
    for row in identity:
        assert row["bitwise"] is True, row
        assert row["sites"] > 0 and all(x > 0 for x in row["record_over_forward"]
                                        + row["replay_over_forward"]), row
        assert f"| identity {row['family']} {row['dtype']} | {row['sites']} sites | bitwise |" \
            in proc.stdout
    chunks = results["token_nll"]
    assert [r["default"] for r in chunks].count(True) == 1
    for row in chunks:  # every budget scores the same numbers as cross_entropy
        assert row["max_abs_diff"] < 1e-4, row
        assert f"chunk 2^{row['chunk_elements'].bit_length() - 1}" in proc.stdout
    assert results["mudd_1.4b"]["skipped"].startswith("on a CPU only with --include-1.4b")
    assert "| MUDD 1.4B bf16 | - | skipped |" in proc.stdout


def test_the_gpu_check_runs_on_a_cpu_and_names_what_it_skipped(tmp_path: Path) -> None:
    proc, results = run_check(tmp_path, "--skip-torchrun")
    check_common(proc, results)
    assert results["skipped"] == ["torchrun", "mudd_1.4b"]
    assert "skipped rows: torchrun, mudd_1.4b" in proc.stdout


@pytest.mark.slow
def test_the_gpu_checks_torchrun_row_joins_a_gloo_group_on_a_cpu(tmp_path: Path) -> None:
    proc, results = run_check(tmp_path)
    check_common(proc, results)
    run = results["torchrun"]
    assert (run["equal"], run["process_group"]) == (True, "gloo"), run
    assert "| torchrun 1 process | gloo | equal |" in proc.stdout
    assert results["skipped"] == ["mudd_1.4b"]
