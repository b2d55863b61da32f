"""MUDDPythia-1.4B scale check on CPU: native forward vs record vs replay.

Builds a model with the official 1.4B shapes and random weights (nothing is
downloaded) on the meta device, then materialises it directly in the target dtype,
so no float32 copy ever exists. For each sequence it times a native forward, a record
pass (``fcaudit.core.sites.record``) and a replay of the recorded coefficients
(``fcaudit.core.sites.replaying``). It prints seconds per token and the peak RSS of each
mode side by side, plus the largest logits difference between replay and native.
That difference must be 0: a replay that feeds back the recorded coefficients is the
same computation.

It then reports the prefix-reuse schedule: on the first sequence it times a replay of
one site's per-layer run with every block that ended before the site stubbed by its
recorded output (the suffix only), at a few sites spread over the depth, checks that
the stubbed correct replay equals the full one bit for bit, and estimates the whole
audit's forward-pass equivalents under both schedules from the audit's own run plan
(interpolating the suffix cost between the timed sites).

Peak RSS per mode is the kernel's high-water mark (VmHWM), reset before each mode
through /proc/self/clear_refs. Where that is unavailable, it falls back to
``getrusage``, whose peak only ever grows.

    python benchmarks/mudd_scale.py                 # 2 x 2048 tokens, bf16 (~10 min, ~5 GB)
    python benchmarks/mudd_scale.py --seqs 1 --seq-len 512
    python benchmarks/mudd_scale.py --preset tiny --seq-len 256 --suffix-sites 6
"""

from __future__ import annotations

import argparse
import re
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from resultfile import ResultFile, add_json_option

from fcaudit.core.adapters import same_bits
from fcaudit.core.recording import record
from fcaudit.core.replaying import replaying
from fcaudit.engine.options import AuditOptions
from fcaudit.engine.passes import replay_batch
from fcaudit.engine.plan import plan_runs
from fcaudit.models.mudd import PRESETS, MuddModel

T = TypeVar("T")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark; False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_gb() -> float:
    try:
        status = Path("/proc/self/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 2**20
    except (OSError, AttributeError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux


def measure(fn: Callable[[], T]) -> tuple[T, float, float]:
    """fn's result, its wall-clock seconds and the peak RSS (GB) while it ran."""
    reset_peak_rss()
    start = time.perf_counter()
    with torch.no_grad():
        out = fn()
    return out, time.perf_counter() - start, peak_rss_gb()


def build(preset: str, dtype: torch.dtype) -> MuddModel:
    """Random weights with live controllers: generators on, static weights off one-hot."""
    with torch.device("meta"):
        model = MuddModel(PRESETS[preset])
    model = model.to(dtype).to_empty(device="cpu")
    model.init_weights()
    with torch.no_grad():
        # the training init zeroes the generators (constant coefficients); wake them up
        for bs, generator in zip(model.dense_bs, model.dynamic_dense, strict=True):
            bs.add_(0.1 * torch.randn_like(bs))
            torch.nn.init.normal_(generator.w2.weight, std=0.02)
    return model.eval()


def prefix_schedule(model: MuddModel, ids: torch.Tensor, coefficients: dict[str, torch.Tensor],
                    samples: int) -> dict[str, Any]:
    """Time suffix-only per-layer replays; print and return both schedules' forward
    equivalents."""
    sites = model.controller_sites()
    fed = {site: coefficients[site.name] for site in sites}
    blocks = list(model.execution_blocks())
    full, full_s, _ = measure(lambda: replay_batch(model, ids, fed, trace=blocks))
    trace = full.trace
    prefix_len = [len(trace.prefix(s.path)) for s in sites]
    picked = sorted({round(i) for i in np.linspace(0, len(sites) - 1, samples)})
    suffix_cost, timed = [], []
    for i in picked:
        known = {p: trace.outputs[p] for p in trace.prefix(sites[i].path)}
        out, s, _ = measure(lambda known=known: replay_batch(model, ids, fed, known=known))
        exact = same_bits(out.logits, full.logits)
        suffix_cost.append(s / full_s)
        timed.append({"site": sites[i].name, "layer": i, "blocks_stubbed": prefix_len[i],
                      "suffix_over_full": s / full_s, "equal": exact})
        print(f"  site {sites[i].name}: {prefix_len[i]} blocks stubbed, replay "
              f"{s:.2f}s = {s / full_s:.3f}x a full replay, equal to it: {exact}")
    costs = np.interp(prefix_len, [prefix_len[i] for i in picked], suffix_cost)
    by_site = dict(zip((s.name for s in sites), costs, strict=True))
    runs = plan_runs(sites, AuditOptions())
    # both schedules: the record pass, the replays, and the correct replay repeated in full
    # at the end of the batch; prefix reuse adds each site's proof, one more suffix pass
    naive = 2 + len(runs)
    proofs = sum(by_site.values())
    one_site = [r.target.only_site for r in runs]  # per-layer and ablation runs: their site
    prefix = 2 + proofs + sum(1.0 if s is None else by_site[s.name] for s in one_site)
    print(f"audit plan: {len(runs)} replays ({sum(s is not None for s in one_site)} per-layer) "
          f"and the end-of-batch repeat; forward-pass equivalents: naive {naive}, prefix "
          f"reuse {prefix:.1f} (incl. {len(sites)} proofs, {proofs:.1f}) = "
          f"{prefix / naive:.3f}x the naive schedule")
    return {"sites": timed, "replays": len(runs),
            "per_layer_runs": sum(s is not None for s in one_site), "naive_passes": naive,
            "prefix_passes": prefix, "proofs": len(sites), "proofs_cost": proofs}


def time_modes(model: MuddModel, args: argparse.Namespace) -> tuple[
        dict[str, list[float]], dict[str, float], float, dict[str, Any] | None]:
    """Seconds and peak RSS of native, record and replay per sequence, the largest logits
    difference between replay and native, and the prefix schedule (first sequence)."""
    sites = model.controller_sites()
    vocab = model.config.vocab_size
    schedule = None
    seconds: dict[str, list[float]] = {"native": [], "record": [], "replay": []}
    peaks: dict[str, float] = dict.fromkeys(seconds, 0.0)
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        native_file = Path(tmp) / "native.pt"
        for n in range(args.seqs):
            ids = torch.randint(0, vocab, (args.batch, args.seq_len))
            native, s, gb = measure(lambda ids=ids: model(ids))
            seconds["native"].append(s)
            peaks["native"] = max(peaks["native"], gb)
            torch.save(native, native_file)  # off the heap, so it inflates no later peak
            del native

            coefficients, s, gb = measure(lambda ids=ids: record(model, ids, sites))
            seconds["record"].append(s)
            peaks["record"] = max(peaks["record"], gb)

            def replay(ids: torch.Tensor = ids, coefficients: dict = coefficients) -> torch.Tensor:
                with replaying(model, {site: coefficients[site.name] for site in sites}):
                    return model(ids)

            replayed, s, gb = measure(replay)
            seconds["replay"].append(s)
            peaks["replay"] = max(peaks["replay"], gb)
            if n == 0 and args.suffix_sites > 0:
                print("prefix reuse (first sequence):")
                schedule = prefix_schedule(model, ids, coefficients, args.suffix_sites)
            native = torch.load(native_file, mmap=True)
            worst = max(worst, (replayed.float() - native.float()).abs().max().item())
            del native, replayed, coefficients
            print(f"sequence {n + 1}/{args.seqs}: " + ", ".join(
                f"{mode} {times[-1]:.1f}s" for mode, times in seconds.items()))
    return seconds, peaks, worst, schedule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="1.4b", choices=sorted(PRESETS))
    parser.add_argument("--seqs", type=int, default=2, help="sequences (batches) to time")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--suffix-sites", type=int, default=4,
                        help="sites at which to time a suffix-only replay (0: skip)")
    add_json_option(parser, "mudd_scale")
    args = parser.parse_args()
    result = ResultFile("mudd_scale.py")
    result.start()

    torch.manual_seed(args.seed)
    exact_peaks = reset_peak_rss()
    model, build_s, build_gb = measure(lambda: build(args.preset, DTYPES[args.dtype]))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{args.preset}: {n_params / 1e9:.3f}B params in {args.dtype}, built in {build_s:.0f}s "
          f"(peak RSS {build_gb:.2f} GB); torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    with torch.no_grad():  # warm-up: kernel selection and allocator, not timed
        model(torch.randint(0, model.config.vocab_size, (1, 64)))
    seconds, peaks, worst, schedule = time_modes(model, args)

    tokens = args.batch * args.seq_len
    print(f"\n{args.seqs} x [{args.batch}, {args.seq_len}] tokens, mean over sequences; "
          + ("peak RSS per mode (VmHWM reset before each)" if exact_peaks
             else "peak RSS since start (getrusage; could not reset per mode)"))
    print(f"{'mode':8} {'s/token':>10} {'ms/token':>9} {'peak RSS GB':>12}")
    for mode, times in seconds.items():
        per_token = statistics.mean(times) / tokens
        print(f"{mode:8} {per_token:10.5f} {1e3 * per_token:9.2f} {peaks[mode]:12.2f}")
    print(f"max |logits replay - native| = {worst:g}")
    print(f"process peak RSS (getrusage) = "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GB")
    result.write(args.json, {
        "preset": args.preset, "dtype": args.dtype, "n_params": n_params, "seqs": args.seqs,
        "batch": args.batch, "seq_len": args.seq_len, "exact_peaks": exact_peaks,
        "ms_per_token": {m: [1e3 * t / tokens for t in times] for m, times in seconds.items()},
        "peak_rss_gb": peaks, "max_abs_diff": worst, "schedule": schedule})


if __name__ == "__main__":
    main()
