"""``fcaudit fold`` on a Mamba: the time-invariant fold against the selective scan by
sequence length, side by side in one run (docs/fold.md).

A tiny-preset Mamba run folder (random weights: what is timed does not depend on their
values; the built-in corpus's tokenizer) is audited on the built-in data (execution off)
and its ``static-layer`` profile folded with ``fcaudit.fold`` (exactness checked against
the replayed condition). Then the folded model (the S4D network at the layers' mean Δ,
B, C, run by FFT) and the original (the chunked selective scan) are timed in interleaved
pairs on one batch of random token ids at each length, the execution audit's method. The
question: is the time-invariant fold faster, and from what sequence length? Writes
docs/results/fold_lengths.json (``--json`` elsewhere); docs/fold.md's block is rendered
from it.

    python benchmarks/fold_lengths.py [--pairs N] [--lengths 64,128,...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import torch
from resultfile import ResultFile, add_json_option

import fcaudit
from fcaudit.engine.actions.fold import fold
from fcaudit.engine.execution import time_interleaved
from fcaudit.engine.options import AuditOptions
from fcaudit.io.data import DataSpec
from fcaudit.io.loading import load_run, save_run_model
from fcaudit.models.mamba import PRESETS, Mamba
from fcaudit.study.train import builtin_tokenizer

BATCH = 4


def _run(folder: Path) -> Path:
    torch.manual_seed(0)
    cfg = PRESETS["tiny"]
    folder.mkdir(parents=True)
    save_run_model(folder, Mamba(cfg))
    (folder / "tokenizer.json").write_text(builtin_tokenizer(cfg.vocab_size).to_str(),
                                           encoding="utf-8")
    (folder / "config.json").write_text(json.dumps({
        "fcaudit_run": 1, "arch": "mamba", "preset": "tiny", "seed": 0,
        "model_config": dataclasses.asdict(cfg)}), encoding="utf-8")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=20, help="timing pairs (default 20)")
    parser.add_argument("--lengths", default="64,128,256,512,1024,2048",
                        help="sequence lengths timed, comma-separated")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    add_json_option(parser, "fold_lengths")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    record = ResultFile("fold_lengths.py")
    record.start()
    lengths = [int(x) for x in args.lengths.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        run = _run(Path(tmp) / "run")
        data = DataSpec(max_eval=32, max_calib=32)
        start = time.perf_counter()
        fcaudit.audit(str(run), Path(tmp) / "audit", data=data,
                      options=AuditOptions(execution=False, progress=False))
        audit_s = time.perf_counter() - start
        start = time.perf_counter()
        done = fold(Path(tmp) / "audit", "static-layer", Path(tmp) / "folded", data=data,
                    timing_pairs=args.pairs)
        fold_s = time.perf_counter() - start
        original, folded = load_run(run).model, load_run(Path(tmp) / "folded").model
        vocab = original.config.vocab_size
        rows = []
        for length in lengths:
            ids = torch.randint(0, vocab, (BATCH, length), generator=torch.Generator().manual_seed(
                length))
            timed = time_interleaved(folded, original, ids, pairs=args.pairs)
            rows.append({"length": length, "latency_ratio": dataclasses.asdict(
                timed.speed_ratio_vs_dense), "folded_tokens_per_s": timed.model.tokens_per_s,
                "original_tokens_per_s": timed.dense.tokens_per_s})
            print(f"T={length}: latency folded / original "
                  f"{timed.speed_ratio_vs_dense.value:.3f}, {timed.model.tokens_per_s:,.0f} "
                  f"against {timed.dense.tokens_per_s:,.0f} tokens/s", flush=True)
    record.write(args.json, {
        "model": "a tiny-preset Mamba, random weights", "batch_size": BATCH,
        "pairs": args.pairs, "threads": args.threads, "fold": done.to_json(),
        "audit_s": round(audit_s, 1), "fold_s": round(fold_s, 1), "lengths": rows})


if __name__ == "__main__":
    main()
