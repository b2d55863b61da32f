"""Whole-audit wall time against the plain forward passes its schedule needs.

For each model: the time of one plain forward pass over the evaluation set (measured
side by side with the audits), and the wall time of the whole in-memory audit (record,
calibration, every replay, bootstrap; execution off) under the naive schedule (every
replay a full pass) and under prefix reuse (a per-layer run recomputes only the blocks
after its site). Ratios are to ``(1 + replays)`` plain forward passes, the naive
schedule's forward-pass equivalents, over rounds in alternating order (naive, prefix,
prefix, naive, ...), min and max over rounds. The two schedules' results are checked
equal (audit.json without its runtime section).

    python benchmarks/audit_schedule.py                  # tiny, small FeatureGate; deep MUDD
    python benchmarks/audit_schedule.py --rounds 3 --models mudd-24
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
import torch
from resultfile import ResultFile, add_json_option
from torch import nn

from fcaudit.api import audit
from fcaudit.core.sites import find_sites
from fcaudit.engine.plan import plan_runs
from fcaudit.engine.run import AuditOptions
from fcaudit.io.data import AuditData
from fcaudit.models.featuregate import GPT
from fcaudit.models.featuregate import PRESETS as GPT_PRESETS
from fcaudit.models.mudd import PRESETS as MUDD_PRESETS
from fcaudit.models.mudd import MuddModel


def models() -> dict[str, tuple[nn.Module, int]]:
    """name -> (model with random weights, sequence length)."""
    torch.manual_seed(0)
    return {
        "featuregate-tiny": (GPT(GPT_PRESETS["tiny"]), 128),
        "featuregate-small": (GPT(dataclasses.replace(GPT_PRESETS["small"], block_size=128)), 128),
        "mudd-24": (MuddModel(dataclasses.replace(MUDD_PRESETS["tiny"], n_layer=24)), 128),
    }


@torch.no_grad()
def forward_pass_seconds(model: nn.Module, ids: np.ndarray, batch: int) -> float:
    """One plain forward pass over every evaluation sequence, batch by batch."""
    start = time.perf_counter()
    for i in range(0, len(ids), batch):
        model(torch.from_numpy(ids[i:i + batch]))
    return time.perf_counter() - start


def audit_seconds(model: nn.Module, data: AuditData, options: AuditOptions) -> tuple[float, dict]:
    start = time.perf_counter()
    result = audit(model, data=data, options=options)
    content = result.to_json()
    content.pop("runtime"), content.pop("command")
    return time.perf_counter() - start, content


def bench(name: str, model: nn.Module, seq_len: int, args: argparse.Namespace) -> dict:
    model.eval()
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    data = AuditData(rng.integers(0, vocab, (args.eval, seq_len)),
                     rng.integers(0, vocab, (args.calib, seq_len)), {"source": "random"})
    options = AuditOptions(execution=False, progress=False, batch_size=args.batch)
    runs = plan_runs(find_sites(model), options)
    replays = len(runs)
    forward_pass_seconds(model, data.eval_ids, args.batch)  # warm-up
    ratios: dict[str, list[float]] = {"naive": [], "prefix": []}
    results = {}
    for r in range(args.rounds):
        order = ("naive", "prefix") if r % 2 == 0 else ("prefix", "naive")
        for schedule in order:
            forward = forward_pass_seconds(model, data.eval_ids, args.batch)
            seconds, results[schedule] = audit_seconds(
                model, data, dataclasses.replace(options, schedule=schedule))
            ratios[schedule].append(seconds / ((1 + replays) * forward))
    same = results["naive"] == results["prefix"]
    return {"model": name, "seq_len": seq_len, "replays": replays,
            "per_layer_runs": sum(r.site is not None for r in runs), "naive": ratios["naive"],
            "prefix": ratios["prefix"], "equal": same}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="*", default=None, help="default: all")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--eval", type=int, default=32, help="evaluation sequences")
    p.add_argument("--calib", type=int, default=16, help="calibration sequences")
    p.add_argument("--batch", type=int, default=8)
    add_json_option(p, "audit_schedule")
    args = p.parse_args()
    record = ResultFile("audit_schedule.py")
    record.start()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.eval} eval / "
          f"{args.calib} calib sequences, batch {args.batch}, {args.rounds} rounds")
    print(f"{'model':20} {'replays':>7}  {'naive audit / (1+replays) fwd':>30}  "
          f"{'prefix audit / (1+replays) fwd':>31}  {'prefix / naive':>14}  equal")
    rows = []
    for name, (model, seq_len) in models().items():
        if args.models and name not in args.models:
            continue
        row = bench(name, model, seq_len, args)
        rel = [p / n for p, n in zip(row["prefix"], row["naive"], strict=True)]
        rows.append({**row, "prefix_over_naive": rel})
        span = lambda v: f"{min(v):.3f}-{max(v):.3f}"  # noqa: E731
        print(f"{name:20} {row['replays']:>7}  {span(row['naive']):>30}  "
              f"{span(row['prefix']):>31}  {span(rel):>14}  {row['equal']}", flush=True)
    record.write(args.json, {"rounds": args.rounds, "eval": args.eval, "calib": args.calib,
                             "batch": args.batch, "models": rows})


if __name__ == "__main__":
    main()
