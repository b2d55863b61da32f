"""benchmarks/vllm_scale.py (docs/vllm.md, "At scale, on paper"): the storage it committed
is what the audit's cache writes now, and its account of the forward passes adds up, against
a hand count, on a small stand-in audited whole."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import torch

from fcaudit.engine.options import AuditOptions
from fcaudit.io.data import AuditData

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import vllm_scale  # noqa: E402


def test_the_committed_storage_is_what_the_cache_writes_now(tmp_path: Path) -> None:
    committed = json.loads((REPO / "docs" / "results" / "vllm_scale.json").read_text())
    rows = committed["results"]["shapes"]
    assert [r["name"] for r in rows] == [s.name for s in vllm_scale.SHAPES]
    for row, shape in zip(rows, vllm_scale.SHAPES, strict=True):
        assert {f.name: row[f.name] for f in dataclasses.fields(shape)} == \
            dataclasses.asdict(shape)
        for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
            now = vllm_scale.eval_bytes_per_token(shape, dtype, tmp_path)
            assert now == row["eval"][name]
            # every logit in its own dtype, and one float32 loss per token: no more
            assert now["bytes_per_token"] == shape.moe_layers * shape.experts * \
                dtype.itemsize + torch.float32.itemsize
        assert vllm_scale.calib_bytes_per_token(shape, tmp_path) == \
            row["calib_bytes_per_token_at_most"]
        assert vllm_scale.trace_bytes_per_token(shape) == row["trace"]


def test_the_pass_account_adds_up_on_a_small_stand_in() -> None:
    """Two MoE layers of four experts (expert ablation on), one repeat, two evaluation
    batches and one calibration batch: per evaluation batch the correct replay, three
    random conditions once, four static ones and the correct replay again; per MoE layer
    reassign once and static-layer; four ablations per layer; the probe's identity replay."""
    shape = vllm_scale.Shape("small", "a test", layers=3, moe_layers=2, experts=4, top_k=2,
                             why="")
    rng = np.random.default_rng(0)
    data = AuditData(rng.integers(0, 64, (16, 12)), rng.integers(0, 64, (8, 12)),
                     {"source": "random"})
    run = vllm_scale.counted_audit(shape, AuditOptions(repeats=1, bootstrap=10,
                                                       progress=False), data)
    assert run["identity_exact"] and run["sites"] == 2
    timing = 1 + 2 * (2 + 10)  # a record, then 2 warm-up and 10 timed pairs, two sides
    assert vllm_scale.per_batch(shape, run, 2, 1) == {
        "replays_per_eval_batch": 1 + 3 + 4 + 1, "per_layer_runs_per_moe_layer": 2,
        "ablations_per_moe_layer": 4, "record_passes": 3, "probe_replays": 1,
        "controller_timing": timing}
    assert run["counted_passes"] == 2 * (1 + 9 + 2 * (2 + 4)) + 1 + 1 + timing
