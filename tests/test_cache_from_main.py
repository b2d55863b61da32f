"""A cache written before a reshaping of the engine resumes without re-recording (issue 39:
"a cache written by today's main resumes"). tests/fixtures/cache-1688202/moe is the output
folder of the golden ``tiny-moe`` audit (the tiny MoE with its savings frontier) as main
1688202 wrote it, before the analyses moved; resumed by this fcaudit, every record batch is
proven by recomputation and reused, every replay run is reused (a fresh sample of them
replayed again and found equal), and audit.json equals the committed golden."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from golden_audits import CASES, stripped

FIXTURE = Path(__file__).parent / "fixtures" / "cache-1688202" / "moe"
GOLDEN = Path(__file__).parent / "golden" / "tiny-moe.json"


def test_a_cache_written_by_main_1688202_resumes_without_recording(tmp_path: Path) -> None:
    shutil.copytree(FIXTURE, tmp_path / "moe")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the golden's own setting
    try:
        text = CASES["tiny-moe"](tmp_path).read_text()
    finally:
        torch.set_num_threads(threads)
    audit = json.loads(text)
    reuse = audit["runtime"]["reuse"]
    planned = json.loads((FIXTURE / "audit.json").read_text())["runtime"]["reuse"]
    assert planned["batches_recomputed"] == 3 and planned["runs_recomputed"] > 0  # as written
    assert (reuse["batches_reused"], reuse["batches_recomputed"]) == (3, 0)
    assert (reuse["evaluation_batches_recorded"], reuse["calibration_batches_recorded"]) == (0, 0)
    assert (reuse["evaluation_batches_proven"], reuse["calibration_batches_proven"]) == (3, 3)
    assert reuse["runs_recomputed"] == 0
    assert reuse["runs_reused"] == planned["runs_recomputed"]
    assert 0 < reuse["replay_runs_verified"] <= reuse["runs_reused"]
    new = stripped(json.loads(text.replace(str(tmp_path), "<tmp>")))
    assert new == json.loads(GOLDEN.read_text())
