"""What a resumed audit costs: a rerun into the same ``--out`` against the fresh audit.

A rerun reuses the cache only after recomputing every cached record batch's original
pass (one forward pass each) and finding it bitwise equal, and after replaying again a
fresh sample of the cached replay runs (every run of the plan on one cached batch) and
finding it bitwise equal (docs/method.md, "Reuse is proven by recomputation"). This
script measures, side by side in one process, the fresh audit of a tiny FeatureGate
model (random weights, seeded; token ids drawn at random), its resumed rerun with the
default sample and, where the checkout has it, with ``verify_reuse="all"``, and prints
each rerun's share of the fresh audit's wall time and the share of the cached replay
runs it replayed again. It uses only the public API, so the same file measures an older
checkout too (``PYTHONPATH=OLD/src python benchmarks/resume_cost.py``).

    OMP_NUM_THREADS=2 python benchmarks/resume_cost.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import fields, replace
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


def one_round(root: Path, data: DataSpec, options: AuditOptions,
              proofs: list[str]) -> tuple[float, dict[str, tuple[float, float | None]]]:
    """Wall seconds of a fresh audit, and per proof mode of its resumed rerun into the same
    folder with the share of cached replay runs that rerun replayed again."""
    out = root / "out"
    started = time.perf_counter()
    fresh = fcaudit.audit(_model(), out, data=data, options=options)
    wall = time.perf_counter() - started
    resumed = {}
    for mode in proofs:
        again_options = options if mode == "" else replace(options, verify_reuse=mode)
        started = time.perf_counter()
        again = fcaudit.audit(_model(), out, data=data, options=again_options)
        resumed[mode] = (time.perf_counter() - started,
                         (again.runtime.reuse or {}).get("replay_share_verified"))
        assert again.conditions == fresh.conditions, "a resumed audit must equal the fresh one"
    return wall, resumed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--eval", type=int, default=32, help="evaluation sequences")
    parser.add_argument("--calib", type=int, default=32, help="calibration sequences")
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    options = AuditOptions(execution=False, progress=False, repeats=1, bootstrap=200,
                           per_layer=True)
    # "": the checkout's default; "all" where the checkout can prove every reused run
    proofs = ["", "all"] if "verify_reuse" in {f.name for f in fields(options)} else [""]
    fresh, resumed = [], {mode: [] for mode in proofs}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="fcaudit-resume-") as tmp:
            data = _data(Path(tmp), args.eval, args.calib, args.seq_len)
            f, r = one_round(Path(tmp), data, options, proofs)
        fresh.append(f)
        for mode, timed in r.items():
            resumed[mode].append(timed)
    print(f"tiny FeatureGate, {args.eval} + {args.calib} sequences of {args.seq_len} tokens, "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds")
    print(f"fresh audit   median {statistics.median(fresh):.2f} s")
    for mode, timed in resumed.items():
        ratio = [r / f for f, (r, _) in zip(fresh, timed, strict=True)]
        share = timed[0][1]
        proven = "no replay proven" if share is None else \
            f"{100 * share:.1f}% of the cached replay runs replayed again"
        print(f"resumed audit ({mode or 'default'}) median "
              f"{statistics.median(r for r, _ in timed):.2f} s; resumed / fresh "
              f"{min(ratio):.3f}-{max(ratio):.3f}; {proven}")


if __name__ == "__main__":
    main()
