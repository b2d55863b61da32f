"""A cache written before the engine was reshaped resumes without re-recording (issue 39:
"a cache written by today's main resumes"). tests/fixtures/cache-1688202/mixtral-audit is
the output folder of the golden ``mixtral`` audit (a Hugging Face Mixtral folder with the
savings frontier and expert ablation) as main 1688202 wrote it, before the analyses moved,
the modules merged and the site roles were typed. Resumed by this fcaudit, every record
batch is proven by recomputation and reused, every replay run is reused (a fresh sample
of them replayed again and found equal), and audit.json equals the committed golden.

A model folder is identified by its config and files, so its cache outlives a change of
fcaudit's code; an in-memory model's identity also covers the source of the code its
classes read (fcaudit's own core/contract.py among them), so its cache is refused after
such a change, never reused on trust (tests/test_cache_identity.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from golden_audits import CASES, stripped

FIXTURE = Path(__file__).parent / "fixtures" / "cache-1688202" / "mixtral-audit"
GOLDEN = Path(__file__).parent / "golden" / "mixtral.json"


def test_a_cache_written_by_main_1688202_resumes_without_recording(tmp_path: Path) -> None:
    shutil.copytree(FIXTURE, tmp_path / "mixtral-audit")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the golden's own setting
    try:
        text = CASES["mixtral"](tmp_path).read_text()
    finally:
        torch.set_num_threads(threads)
    reuse = json.loads(text)["runtime"]["reuse"]
    written = json.loads((FIXTURE / "audit.json").read_text())["runtime"]["reuse"]
    assert written["batches_recomputed"] == 1 and written["runs_recomputed"] > 0  # as written
    assert (reuse["batches_reused"], reuse["batches_recomputed"]) == (1, 0)
    assert (reuse["evaluation_batches_recorded"], reuse["calibration_batches_recorded"]) == (0, 0)
    assert (reuse["evaluation_batches_proven"], reuse["calibration_batches_proven"]) == (1, 1)
    assert reuse["runs_recomputed"] == 0
    assert reuse["runs_reused"] == written["runs_recomputed"]
    assert 0 < reuse["replay_runs_verified"] <= reuse["runs_reused"]
    new = stripped(json.loads(text.replace(str(tmp_path), "<tmp>")))
    assert new == json.loads(GOLDEN.read_text())
