"""Peak memory of an audit against the number of evaluation sequences.

The audit streams: coefficients go to on-disk shards batch by batch, replay reads
them back lazily, and the bootstrap draws its resamples in bounded chunks. So peak
RSS must stay flat as the evaluation set grows while the cache grows linearly. This
runs ``fcaudit audit`` on one tiny FeatureGate model at N, 4N and 16N evaluation
sequences, each as its own child process, and prints the child's peak RSS (its
``ru_maxrss``, read with ``os.wait4`` for that child alone) and the cache size on
disk, with their ratios to the first row. The cache's bytes per evaluation sequence
(calibration shards and manifest left out) must be the same in every row.

Without ``--run`` it first trains a tiny FeatureGate for 30 steps into a temporary
folder (about half a minute).

    python benchmarks/memory.py                   # N = 64: 64, 256, 1024 sequences
    python benchmarks/memory.py --n 32 --run runs/fg
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from resultfile import ResultFile, add_json_option
from sidebyside import machine

AUDIT_FLAGS = ["--no-per-layer", "--no-execution", "--repeats", "1", "--quiet"]


def run_child(args: Sequence[str]) -> tuple[float, int]:
    """Run ``python -m fcaudit.cli ARGS``; its wall seconds and peak RSS in bytes."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "fcaudit.cli", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr = proc.stderr.read() if proc.stderr else ""
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage, not all children's
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"fcaudit {' '.join(args)} failed ({proc.returncode}):\n{stderr}")
    return time.perf_counter() - start, usage.ru_maxrss * 1024  # kB on Linux


def cache_bytes(cache: Path) -> tuple[int, int]:
    """(all files of the cache, those that grow with the evaluation set)."""
    files = [p for p in cache.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    fixed = sum(p.stat().st_size for p in files
                if p.name.startswith("calib-") or p.name == "manifest.json")
    return total, total - fixed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=64, help="N: the first evaluation set size")
    parser.add_argument("--factors", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-calib", type=int, default=64)
    parser.add_argument("--run", metavar="FOLDER", help="a trained run folder (default: "
                        "train a tiny FeatureGate for 30 steps into a temporary folder)")
    add_json_option(parser, "memory")
    args = parser.parse_args()

    print(f"{machine()}\n")
    record = ResultFile("memory.py")
    record.start()
    train_s = None
    with tempfile.TemporaryDirectory(prefix="fcaudit-memory-") as tmp:
        run = args.run or str(Path(tmp) / "fg")
        if not args.run:
            train_s, _ = run_child(["train", "--arch", "featuregate", "--preset", "tiny",
                                    "--steps", "30", "--out", run, "--quiet"])
            print(f"trained {run} in {train_s:.0f}s")
        rows = []
        for i, factor in enumerate(args.factors):
            out = Path(tmp) / f"audit-{i}"  # a fresh folder each: no cache is reused
            seconds, rss = run_child(["audit", "--model", run, "--out", str(out),
                                      "--max-eval", str(factor * args.n),
                                      "--max-calib", str(args.max_calib), *AUDIT_FLAGS])
            n_eval = json.loads((out / "audit.json").read_text())["data"]["eval_sequences"]
            total, growing = cache_bytes(out / "cache")
            rows.append((factor, n_eval, rss, total, growing, seconds))
            print(f"{factor}N: {n_eval} sequences, {seconds:.0f}s, load "
                  f"{os.getloadavg()[0]:.2f}", flush=True)

    _, n0, rss0, total0, _, _ = rows[0]
    print(f"\nfcaudit audit --max-eval k*{args.n} --max-calib {args.max_calib} "
          f"{' '.join(AUDIT_FLAGS)}\n")
    print("| eval sequences | peak RSS MB | RSS / first | cache MB | cache / first | "
          "sequences / first | cache bytes per sequence | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for _, n_eval, rss, total, growing, seconds in rows:
        print(f"| {n_eval} | {rss / 2**20:.1f} | {rss / rss0:.3f} | {total / 2**20:.2f} | "
              f"{total / total0:.2f} | {n_eval / n0:.2f} | {growing / n_eval:.0f} | "
              f"{seconds:.0f} |")
    (_, n_first, rss_first, *_), (_, n_last, rss_last, *_) = rows[0], rows[-1]
    if n_last != n_first:
        slope = (rss_last - rss_first) / (n_last - n_first)
        print(f"\npeak RSS slope {slope:+.0f} bytes per evaluation sequence (first to last row)")
    print(f"after: {machine()}")
    record.write(args.json, {
        "command": f"fcaudit audit --max-eval k*{args.n} --max-calib {args.max_calib} "
                   + " ".join(AUDIT_FLAGS), "train_s": train_s,
        "rows": [{"factor": f, "eval_sequences": n, "peak_rss_bytes": rss, "cache_bytes": total,
                  "growing_cache_bytes": growing, "wall_s": sec}
                 for f, n, rss, total, growing, sec in rows]})


if __name__ == "__main__":
    main()
