"""What a resumed audit costs: a rerun into the same ``--out`` against the fresh audit.

A rerun reuses the cache only after recomputing every cached record batch's original
pass (one forward pass each) and finding it bitwise equal (docs/method.md, "Reuse is
proven by recomputation"). This script measures, side by side in one process, the fresh
audit of a tiny FeatureGate model (random weights, seeded; token ids drawn at random) and
its resumed rerun, and prints the rerun's share of the fresh audit's wall time with the
forward passes each made. It uses only the public API, so the same file measures an
older checkout too (``PYTHONPATH=OLD/src python benchmarks/resume_cost.py``).

    OMP_NUM_THREADS=2 python benchmarks/resume_cost.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import fcaudit
from fcaudit import AuditOptions
from fcaudit.io.data import DataSpec
from fcaudit.models.featuregate import GPT, PRESETS


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(PRESETS["tiny"]).eval()


def _data(root: Path, n_eval: int, n_calib: int, seq_len: int) -> DataSpec:
    rng = np.random.default_rng(0)
    vocab = PRESETS["tiny"].vocab_size
    for name, n in (("eval", n_eval), ("calib", n_calib)):
        np.save(root / f"{name}.npy", rng.integers(0, vocab, (n, seq_len)).astype(np.int64))
    return DataSpec(tokens=root / "eval.npy", calib_tokens=root / "calib.npy",
                    max_eval=n_eval, max_calib=n_calib)


def one_round(root: Path, data: DataSpec, options: AuditOptions) -> tuple[float, float]:
    """Wall seconds of a fresh audit and of its resumed rerun into the same folder."""
    out = root / "out"
    started = time.perf_counter()
    fresh = fcaudit.audit(_model(), out, data=data, options=options)
    middle = time.perf_counter()
    again = fcaudit.audit(_model(), out, data=data, options=options)
    ended = time.perf_counter()
    assert again.conditions == fresh.conditions, "a resumed audit must equal the fresh one"
    return middle - started, ended - middle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--eval", type=int, default=32, help="evaluation sequences")
    parser.add_argument("--calib", type=int, default=32, help="calibration sequences")
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    options = AuditOptions(execution=False, progress=False, repeats=1, bootstrap=200,
                           per_layer=True)
    fresh, resumed = [], []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="fcaudit-resume-") as tmp:
            data = _data(Path(tmp), args.eval, args.calib, args.seq_len)
            f, r = one_round(Path(tmp), data, options)
        fresh.append(f)
        resumed.append(r)
    ratio = [r / f for f, r in zip(fresh, resumed, strict=True)]
    print(f"tiny FeatureGate, {args.eval} + {args.calib} sequences of {args.seq_len} tokens, "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds")
    print(f"fresh audit   median {statistics.median(fresh):.2f} s")
    print(f"resumed audit median {statistics.median(resumed):.2f} s")
    print(f"resumed / fresh: {min(ratio):.3f}-{max(ratio):.3f}")


if __name__ == "__main__":
    main()
