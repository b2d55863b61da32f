"""``fcaudit fold`` on the demo's FeatureGate: each foldable profile folded, checked, timed
and healed, side by side in one run (docs/fold.md).

The shipped demo FeatureGate (``fcaudit demo``'s; its SHA-256s pinned) is audited on the
built-in data with the default options (execution off: the fold times itself), then each
of ``static-layer``, ``static-layer-position`` and ``static-layer-token`` is folded: the
fold's exactness against the replayed condition and the audit's number, its latency and
FLOPs against the original and the dense twin (interleaved pairs of one batch), and a
short healing with the original fine-tuned alike as the control. Writes
docs/results/fold_demo.json (``--json`` elsewhere); docs/fold.md's block is rendered from it.

    python benchmarks/fold_demo.py [--pairs N] [--heal-steps N]
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import torch
from resultfile import ResultFile, add_json_option

import fcaudit
from fcaudit.engine.actions.fold import fold
from fcaudit.engine.options import AuditOptions
from fcaudit.io.demo_models import shipped_folder
from fcaudit.study.heal import heal

PROFILES = ("static-layer", "static-layer-position", "static-layer-token")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=20, help="timing pairs (default 20)")
    parser.add_argument("--heal-steps", type=int, default=100,
                        help="healing steps, each model (default 100)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    add_json_option(parser, "fold_demo")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    record = ResultFile("fold_demo.py")
    record.start()
    run = shipped_folder("featuregate")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        audit_dir = Path(tmp) / "audit"
        result = fcaudit.audit(str(run), audit_dir, options=AuditOptions(
            execution=False, progress=False))
        assert result is not None
        for profile in PROFILES:
            start = time.perf_counter()
            done = fold(audit_dir, profile, Path(tmp) / profile, timing_pairs=args.pairs)
            fold_s = time.perf_counter() - start
            start = time.perf_counter()
            healed = heal(Path(tmp) / profile, run, args.heal_steps, done.eval_ids,
                          progress=False)
            heal_s = time.perf_counter() - start
            retention = result.retention.get(profile)
            rows.append({"profile": profile, "fold": done.to_json(), "heal": healed.to_json(),
                         "audit_retention": None if retention is None else
                         dataclasses.asdict(retention),
                         "fold_s": round(fold_s, 1), "heal_s": round(heal_s, 1)})
            print(f"{profile}: max diff {done.exactness.max_abs_diff:.3g}, latency vs "
                  f"original {done.vs_original.latency_ratio.value:.3f}, vs dense "
                  f"{done.vs_dense.latency_ratio.value:.3f}; penalty "
                  f"{healed.penalty_before.value:+.4f} -> {healed.penalty_after.value:+.4f} "
                  f"({fold_s:.1f} s + {heal_s:.1f} s)", flush=True)
    record.write(args.json, {"model": "the shipped demo FeatureGate (fcaudit demo)",
                             "pairs": args.pairs, "heal_steps": args.heal_steps,
                             "threads": args.threads, "profiles": rows})


if __name__ == "__main__":
    main()
