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

``--offload`` measures instead a model bigger than its memory budget (and writes
``docs/results/offload.json``): a random-initialised Mixtral-shaped MoE of about
``--offload-gb`` GB in float32 is saved as a Hugging Face folder under /tmp, then audited
on a few short sequences, loaded whole and with ``--device-map auto --max-memory
cpu=BUDGET --offload-folder DIR`` (layers beyond the budget read from disk per call). Both
run once with memory free, then again in a memory cgroup whose hard limit (``--limit``,
default the budget plus 1 GiB) counts page cache too (``memlimit.py``): the offloaded audit
must finish there, equal outside ``runtime`` to the whole-model one, while the whole model
does not fit. It prints each run's peak RSS, its anonymous part (what no memory pressure
takes back) and wall time (several minutes; about twice the model's size in memory for the
whole-model run; the capped runs need root).

    python benchmarks/memory.py --offload                 # 6 GB model, cpu=2GiB
    python benchmarks/memory.py --offload --offload-model /tmp/moe-6gb  # reuse a folder
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from memlimit import ChildRun, MemoryCgroup, evict, memory_cgroup, run_measured
from resultfile import RESULTS, ResultFile
from sidebyside import machine

AUDIT_FLAGS = ["--no-per-layer", "--no-execution", "--repeats", "1", "--quiet"]
# the offload case: every main condition once, experts counted, no per-layer or ablation runs
OFFLOAD_FLAGS = ["--repeats", "1", "--bootstrap", "100", "--no-per-layer",
                 "--no-expert-ablation", "--timing-pairs", "0", "--batch-size", "4", "--quiet"]
# --limit's default above the budget: torch, activations and the layer being read in
HEADROOM = 2**30
MOE_SHAPE = {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2048,
             "num_attention_heads": 16, "num_key_value_heads": 8, "num_local_experts": 8,
             "num_experts_per_tok": 2, "max_position_embeddings": 256,
             "tie_word_embeddings": False}


def run_child(args: Sequence[str], group: MemoryCgroup | None = None) -> ChildRun:
    """Run ``python -m fcaudit.cli ARGS`` (in ``group``, if given), measured."""
    return run_measured([sys.executable, "-m", "fcaudit.cli", *args], group)


def ok(run: ChildRun, args: Sequence[str]) -> ChildRun:
    """``run``, or stop the benchmark with the child's error."""
    if run.returncode != 0:
        raise SystemExit(f"fcaudit {' '.join(args)} failed ({run.returncode}):\n{run.stderr}")
    return run


def cache_bytes(cache: Path) -> tuple[int, int]:
    """(all files of the cache, those that grow with the evaluation set)."""
    files = [p for p in cache.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    fixed = sum(p.stat().st_size for p in files
                if p.name.startswith("calib-") or p.name == "manifest.json")
    return total, total - fixed


def build_moe(folder: Path, gigabytes: float) -> dict:
    """A random Mixtral-shaped MoE of about ``gigabytes`` (1e9 bytes) in float32, saved with
    ``save_pretrained``; as many layers as that size holds. Its facts, for the result file."""
    import torch
    import transformers
    probe = transformers.MixtralConfig(**MOE_SHAPE, num_hidden_layers=1)
    with torch.device("meta"):
        one = sum(p.numel() for p in transformers.MixtralForCausalLM(probe).parameters())
        two = sum(p.numel() for p in transformers.MixtralForCausalLM(
            transformers.MixtralConfig(**MOE_SHAPE, num_hidden_layers=2)).parameters())
    layers = max(1, round((gigabytes * 1e9 / 4 - (2 * one - two)) / (two - one)))
    config = transformers.MixtralConfig(**MOE_SHAPE, num_hidden_layers=layers)
    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        model = transformers.MixtralForCausalLM(config).eval()
        with torch.no_grad():  # routers with a trained router's spread, not near zero
            for name, param in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    param.normal_(0, 0.05)
        model.save_pretrained(folder)
        del model
    disk = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    return {"family": "mixtral", "dtype": "float32", "layers": layers,
            "experts": MOE_SHAPE["num_local_experts"], "shape": MOE_SHAPE,
            "params": (two - one) * (layers - 1) + one, "weights_bytes_on_disk": disk}


def canonical(audit_json: Path) -> dict:
    """audit.json without the keys it lists as differing between identical audits."""
    result = json.loads(audit_json.read_text())
    for dotted in result["nondeterministic_keys"]:
        *parents, leaf = dotted.split(".")
        node = result
        for key in parents:
            node = node.get(key, {})
        node.pop(leaf, None)
    return result


def offload_runs(folder: Path, tmp: Path, budget: str, limit: int
                 ) -> tuple[dict[str, dict], str | None]:
    """The four audits, each its own child process: whole and offloaded with memory free,
    then both again in a memory cgroup capped at ``limit`` bytes (the offloaded one must
    finish there; the whole model should not fit). Rows by case, and why the capped runs
    were not made, if they were not."""
    data = ["--tokens", f"{tmp}/eval.npy", "--calib-tokens", f"{tmp}/calib.npy"]
    placed = ["--device-map", "auto", "--max-memory", f"cpu={budget}",
              "--offload-folder", f"{tmp}/offload"]
    cases = [("in_memory", [], False), ("offloaded", placed, False),
             ("offloaded_capped", placed, True), ("in_memory_capped", [], True)]
    rows: dict[str, dict] = {}
    with memory_cgroup(limit) as group:
        why = group if isinstance(group, str) else None
        for case, extra, capped in cases:
            if capped and why:
                continue
            out = tmp / case
            args = ["audit", "--model", str(folder), "--out", str(out), *data,
                    *OFFLOAD_FLAGS, *extra]
            if capped:  # the model's pages are charged to the capped child, not to a cache
                evict(sorted(folder.glob("*.safetensors")))
            run = run_child(args, group if capped else None)
            row = {"wall_s": run.wall_s, "peak_rss_bytes": run.peak_rss_bytes,
                   "peak_anon_bytes": run.peak_anon_bytes,
                   "peak_file_bytes": run.peak_file_bytes, "returncode": run.returncode,
                   "limit_bytes": run.limit_bytes, "cgroup_peak_bytes": run.cgroup_peak_bytes,
                   "oom_killed": run.oom_killed, "finished": run.returncode == 0}
            if run.returncode == 0:
                audit = json.loads((out / "audit.json").read_text())
                row.update(identity_max_abs_diff=audit["identity_replay_max_abs_diff"],
                           identity_exact="identity" not in audit,
                           placement=audit["runtime"].get("placement"),
                           canonical=canonical(out / "audit.json"))
            elif not (capped and case == "in_memory_capped"):  # only that one may fail
                ok(run, args)
            rows[case] = row
            state = "finished" if run.returncode == 0 else \
                f"ended {run.returncode}{' (OOM kill)' if run.oom_killed else ''}"
            print(f"{case}: {state}, {run.wall_s:.0f}s, peak RSS "
                  f"{run.peak_rss_bytes / 2**30:.2f} GiB (anonymous "
                  f"{run.peak_anon_bytes / 2**30:.2f}), load {os.getloadavg()[0]:.2f}",
                  flush=True)
    return rows, why


def offload_case(args: argparse.Namespace) -> None:
    """The whole-model audit against the offloaded one, with memory free and capped."""
    import numpy as np

    from fcaudit.io.placement import parse_size
    budget = parse_size(args.budget, "--budget")
    limit = parse_size(args.limit, "--limit") if args.limit else budget + HEADROOM
    print(f"{machine()}\n")
    record = ResultFile("memory.py")
    record.start()
    with tempfile.TemporaryDirectory(prefix="fcaudit-offload-", dir="/tmp") as tmp:
        folder = Path(args.offload_model or Path(tmp) / "moe")
        started = time.perf_counter()
        model = build_moe(folder, args.offload_gb)
        build_s = time.perf_counter() - started
        print(f"model {folder}: {model['params'] / 1e9:.2f}B parameters, "
              f"{model['weights_bytes_on_disk'] / 1e9:.2f} GB, {build_s:.0f}s", flush=True)
        rng = np.random.default_rng(0)
        for name in ("eval", "calib"):
            ids = rng.integers(0, MOE_SHAPE["vocab_size"], (args.offload_seqs, 32))
            np.save(Path(tmp) / f"{name}.npy", ids.astype(np.int64))
        rows, why = offload_runs(folder, Path(tmp), args.budget, limit)
        audits = [row.pop("canonical") for row in rows.values() if "canonical" in row]
        same = all(a == audits[0] for a in audits[1:])
        left = (Path(tmp) / "offload").exists()
    print(f"\n{len(audits)} finished audit.json equal outside runtime: {same}; offload "
          f"folder left behind: {left}" + (f"; capped runs not made: {why}" if why else ""))
    print(f"after: {machine()}")
    record.write(args.json or RESULTS / "offload.json", {
        "command": " ".join(["fcaudit audit", *OFFLOAD_FLAGS]), "budget": args.budget,
        "limit_bytes": limit, "capped_not_made": why,
        "eval_sequences": args.offload_seqs, "seq_len": 32, "model": model,
        "build_s": build_s, "equal_outside_runtime": same, "offload_folder_left": left,
        "rows": rows})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=64, help="N: the first evaluation set size")
    parser.add_argument("--factors", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-calib", type=int, default=64)
    parser.add_argument("--run", metavar="FOLDER", help="a trained run folder (default: "
                        "train a tiny FeatureGate for 30 steps into a temporary folder)")
    parser.add_argument("--offload", action="store_true", help="the model-bigger-than-memory "
                        "case instead (writes docs/results/offload.json)")
    parser.add_argument("--offload-gb", type=float, default=6.0, help="its size in GB")
    parser.add_argument("--offload-model", metavar="FOLDER",
                        help="build the model here, or reuse the one already there")
    parser.add_argument("--offload-seqs", type=int, default=4,
                        help="evaluation and calibration sequences of 32 tokens")
    parser.add_argument("--budget", default="2GiB", help="--max-memory cpu=BUDGET")
    parser.add_argument("--limit", default=None, metavar="SIZE",
                        help="the memory cgroup's hard limit for the capped runs (default: "
                             "the budget plus 1GiB, for torch, activations and the layer "
                             "read in)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="result file (default: docs/results/memory.json, with --offload "
                             "docs/results/offload.json)")
    args = parser.parse_args()
    if args.offload:
        offload_case(args)
        return
    args.json = args.json or RESULTS / "memory.json"

    print(f"{machine()}\n")
    record = ResultFile("memory.py")
    record.start()
    train_s = None
    with tempfile.TemporaryDirectory(prefix="fcaudit-memory-") as tmp:
        run = args.run or str(Path(tmp) / "fg")
        if not args.run:
            train = ["train", "--arch", "featuregate", "--preset", "tiny", "--steps", "30",
                     "--out", run, "--quiet"]
            train_s = ok(run_child(train), train).wall_s
            print(f"trained {run} in {train_s:.0f}s")
        rows = []
        for i, factor in enumerate(args.factors):
            out = Path(tmp) / f"audit-{i}"  # a fresh folder each: no cache is reused
            audit = ["audit", "--model", run, "--out", str(out), "--max-eval",
                     str(factor * args.n), "--max-calib", str(args.max_calib), *AUDIT_FLAGS]
            done = ok(run_child(audit), audit)
            seconds, rss = done.wall_s, done.peak_rss_bytes
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
