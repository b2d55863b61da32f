"""Execution audit side by side: FeatureGate, SkipGate and Dense against Dense.

Trains nothing. By default it builds the models of one preset with random weights
(SkipGate's threshold starts at the median of its initial gates, so about half the
tokens skip each block); pass run folders to measure trained models instead. Every
model is measured against the same Dense model on the built-in evaluation windows:
blocks executed, FLOPs per token, and latency timed interleaved with Dense. The
Dense-vs-Dense row is an A/A check of the timing method: its interval should
contain 1.

    python benchmarks/execution_featuregate_vs_dense.py
    python benchmarks/execution_featuregate_vs_dense.py --featuregate runs/fg \\
        --dense runs/dense --skipgate runs/sg --pairs 30
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from resultfile import ResultFile, add_json_option
from torch import nn

from fcaudit.engine.execution import measure_execution
from fcaudit.engine.result import Execution
from fcaudit.engine.verdicts import verdict_execution
from fcaudit.io.data import builtin_documents, cut_windows, encode_documents, spread_pick
from fcaudit.io.loading import get_arch, load_model
from fcaudit.study.train import builtin_tokenizer


def model_for(arch: str, folder: str | None, preset: str, seed: int) -> nn.Module:
    """A trained run folder when given, else a fresh model of ``preset``."""
    if folder:
        return load_model(folder)
    torch.manual_seed(seed)
    spec = get_arch(arch)
    return spec.build(spec.config(preset)).eval()


def eval_windows(vocab_size: int, seq_len: int, sequences: int) -> torch.Tensor:
    tok = builtin_tokenizer(vocab_size)
    windows = cut_windows(encode_documents(tok, builtin_documents("eval")), seq_len)
    return torch.from_numpy(windows[spread_pick(len(windows), sequences)])


def format_table(results: dict[str, Execution]) -> str:
    """Side-by-side text table of several measurements (name -> measure_execution result)."""
    rows = [("model", "blocks run/present", "FLOPs/token", "FLOPs vs dense", "ms/batch",
             "tokens/s", "latency vs dense [95% CI]")]
    for name, e in results.items():
        t = e.timing
        if t is not None:
            ratio = t.speed_ratio_vs_dense
            speed = (f"{1e3 * t.model.median_s:.2f}", f"{t.model.tokens_per_s:,.0f}",
                     f"{ratio.value:.3f} [{ratio.ci95[0]:.3f}, {ratio.ci95[1]:.3f}]")
        else:
            speed = ("-", "-", "-")
        ratio_text = f"{e.flops_ratio:.3f}x" if e.flops_ratio is not None else "n/a"
        rows.append((name, f"{e.blocks_executed:.2f}/{e.blocks_present}",
                     f"{(e.flops_per_token or 0) / 1e6:.3f}M", ratio_text, *speed))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)
    return "\n".join(line.rstrip() for line in lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for arch in ("featuregate", "dense", "skipgate"):
        parser.add_argument(f"--{arch}", metavar="RUN", help=f"trained {arch} run folder")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--sequences", type=int, default=64, help="windows counted for FLOPs")
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    add_json_option(parser, "execution_featuregate_vs_dense")
    args = parser.parse_args()
    record = ResultFile("execution_featuregate_vs_dense.py")
    record.start()

    models = {arch: model_for(arch, getattr(args, arch), args.preset, args.seed)
              for arch in ("featuregate", "skipgate", "dense")}
    dense = models["dense"]
    input_ids = eval_windows(dense.config.vocab_size, args.seq_len, args.sequences)
    results = {name: measure_execution(model, dense, input_ids, batch_size=args.batch_size,
                                       pairs=args.pairs, warmup=args.warmup, seed=args.seed,
                                       threads=args.threads)
               for name, model in models.items()}
    timing = results["dense"].timing
    print(f"{args.preset}: {len(input_ids)} windows x {args.seq_len} tokens, timing batch "
          f"{timing.batch_size}, {timing.pairs} pairs after {timing.warmup} warm-up, "
          f"{timing.threads} threads on {timing.device} ({timing.device_name})\n")
    print(format_table(results))
    print()
    for name, result in results.items():
        print(f"{name}: {verdict_execution(result)}")
    record.write(args.json, {"preset": args.preset, "windows": len(input_ids),
                             "seq_len": args.seq_len,
                             "trained": {arch: getattr(args, arch) for arch in models},
                             "measurements": {name: dataclasses.asdict(result)
                                              for name, result in results.items()}})


if __name__ == "__main__":
    main()
