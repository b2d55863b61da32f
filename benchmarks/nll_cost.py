"""Cost of the per-token NLL: forward + NLL against the forward alone, old vs new formula.

Every record and replay pass of an audit runs a forward and scores its logits, so the
loss is paid on every pass. For each FeatureGate preset (random weights, a batch of
``--batch`` windows of the preset's length) it times, interleaved in one process, the
forward alone, the forward + the old formula (a transposed cross-entropy over a float
copy of all logits), the forward + ``fcaudit.core.nll.token_nll``, and the forward + a bare
``log_softmax`` of the logits into a preallocated buffer: a floor for any loss built
from PyTorch's own kernels, since every logit needs one ``exp``. It prints each one's
time over the forward's in the same round (median [min-max] over rounds).

    python benchmarks/nll_cost.py
    python benchmarks/nll_cost.py --presets tiny --rounds 11
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from resultfile import ResultFile, add_json_option
from sidebyside import (
    add_timing_options,
    apply_timing_options,
    machine,
    ratios,
    reps_for,
    summary,
    time_rounds,
)

from fcaudit.core.nll import token_nll
from fcaudit.models.featuregate import GPT, PRESETS


def old_token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The formula ``token_nll`` replaced (fcaudit <= a677565)."""
    return F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")


@torch.no_grad()
def measure(preset: str, batch: int, rounds: int, seconds: float, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    cfg = PRESETS[preset]
    model = GPT(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size))
    floor_out = torch.empty(batch * cfg.block_size, cfg.vocab_size)
    modes = {"forward": lambda: model(ids),
             "old": lambda: old_token_nll(model(ids), ids),
             "new": lambda: token_nll(model(ids), ids),
             "floor": lambda: torch.log_softmax(model(ids).flatten(0, 1), -1, out=floor_out)}
    times = time_rounds(modes, rounds, reps_for(modes["forward"], seconds))
    per_round = ratios(times, "forward")
    logits = model(ids)
    diff = float((token_nll(logits, ids) - old_token_nll(logits, ids)).abs().max())
    return {"preset": preset, "shape": [batch, cfg.block_size, cfg.vocab_size],
            "forward_ms": 1e3 * min(times["forward"]),
            **{f"{mode}_over_forward": per_round[mode] for mode in ("old", "new", "floor")},
            "max_abs_new_minus_old": diff}


def table_row(row: dict[str, Any]) -> str:
    """One Markdown row: ratios as median [min-max] over rounds."""
    cells = [row["preset"], "x".join(map(str, row["shape"])), f"{row['forward_ms']:.1f}",
             *(summary(row[f"{m}_over_forward"]) for m in ("old", "new", "floor")),
             f"{row['max_abs_new_minus_old']:.1e}"]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"], choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    add_timing_options(parser, seconds=0.3)
    add_json_option(parser, "nll_cost")
    args = parser.parse_args()

    print(apply_timing_options(args) + "\n")
    record = ResultFile("nll_cost.py")
    record.start()
    rows = [measure(p, args.batch, args.rounds, args.seconds, args.seed) for p in args.presets]
    print("| preset | shape | forward ms | old / forward | new / forward | floor / forward | "
          "max abs(new - old) |")
    print("|" + "---|" * 7)
    for row in rows:
        print(table_row(row))
    print(f"\nafter: {machine()}")
    record.write(args.json, {"rounds": args.rounds, "seconds": args.seconds, "rows": rows})


if __name__ == "__main__":
    main()
