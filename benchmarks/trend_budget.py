"""Seconds per training step of every model of the trend ladder, and what the ladder costs.

Run before ``fcaudit reproduce --preset trend`` to check that it fits the machine: it
times FeatureGate, Dense and MUDD training steps (the study's batch shape, AdamW, after
warm-up steps) at every size of ``fcaudit.study.trend.LADDER``, in wall and CPU seconds, and
projects the ladder's training time (points x seeds x steps). With ``--audits`` it also
times, per size, one FeatureGate audit (with execution against Dense) and one MUDD
audit at the study's settings, on models trained for one step (an audit costs the same
whatever the weights). On a machine shared with other work, wall time is inflated;
CPU seconds with ``--threads 1`` are the steadier measure of one core's cost.

    python benchmarks/trend_budget.py [--steps 10] [--threads N] [--audits]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from fcaudit.api import audit
from fcaudit.engine.run import AuditOptions
from fcaudit.io.data import DataSpec
from fcaudit.io.loading import get_arch
from fcaudit.study import trend
from fcaudit.study.train import train

ARCHES = ("featuregate", "dense", "mudd")


def step_seconds(arch: str, size: str, steps: int, warmup: int = 2) -> tuple[float, float]:
    """Wall and CPU seconds of one training step (random tokens: speed does not depend
    on the text), averaged over ``steps`` steps after ``warmup``."""
    a = get_arch(arch)
    cfg = a.config(size)
    torch.manual_seed(0)
    model = a.build(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    shape = (trend.BATCH.batch_size, trend.BATCH.seq_len + 1)
    batch = torch.randint(0, cfg.vocab_size, shape)
    for i in range(warmup + steps):
        if i == warmup:
            wall, cpu = time.perf_counter(), time.process_time()
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def audit_seconds(point: trend.Point, folder: Path) -> dict[str, float]:
    """Wall seconds of one FeatureGate audit (with Dense) and one MUDD audit as the study
    runs them: the point's 128-token windows, 64 evaluation and 64 calibration
    sequences, no per-layer variants."""
    runs = {arch: train(arch, point.size, 0, folder / arch, steps=1, progress=False,
                        schedule=point.schedule) for arch in ARCHES}
    out = {}
    for arch, dense in (("featuregate", runs["dense"]), ("mudd", None)):
        started = time.perf_counter()
        audit(runs[arch], folder / f"audit-{arch}", dense=dense,
              options=AuditOptions(per_layer=False, progress=False),
              data=DataSpec(max_eval=64, max_calib=64))
        out[arch] = time.perf_counter() - started
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per model")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--audits", action="store_true", help="also time one audit per size")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    sizes = list(dict.fromkeys(p.size for p in trend.LADDER))
    per_step = {}
    for size in sizes:
        for arch in ARCHES:
            wall, cpu = step_seconds(arch, size, args.steps)
            per_step[size, arch] = wall
            print(f"{size:>6} {arch:>12}: {wall:6.3f} s/step wall, {cpu:6.3f} s/step CPU")
    total = 0.0
    for p in trend.LADDER:
        seconds = trend.SEEDS * p.steps * sum(per_step[p.size, a] for a in ARCHES)
        total += seconds
        print(f"{p.name:>11} ({p.tokens:,} tokens): training {seconds / 60:6.1f} min "
              f"({trend.SEEDS} seeds x {p.steps} steps x featuregate + dense + mudd)")
    print(f"ladder training: {total / 60:.1f} min (wall per step as measured here)")
    if args.audits:
        with tempfile.TemporaryDirectory() as tmp:
            for size in sizes:
                point = next(p for p in trend.LADDER if p.size == size)
                times = audit_seconds(point, Path(tmp) / size)
                print(f"{size:>6} audits: " + ", ".join(f"{a} {s:.0f} s"
                                                       for a, s in times.items()))


if __name__ == "__main__":
    main()
