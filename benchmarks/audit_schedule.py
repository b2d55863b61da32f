"""Whole-audit wall time against the plain forward passes its schedule needs, and the
cost account that says what the ratio depends on.

For each model: the time of one plain forward pass over the evaluation set (measured
side by side with the audits), and the wall time of the whole in-memory audit (record,
calibration, every replay, bootstrap; execution off) under the naive schedule (every
replay a full pass) and under prefix reuse (a per-layer run recomputes only the blocks
after its site). Ratios are to ``(1 + replays)`` plain forward passes, the naive
schedule's forward-pass equivalents, over rounds in alternating order (naive, prefix,
prefix, naive, ...), min and max over rounds. The two schedules' results are checked
equal (audit.json without its runtime section).

The cost account, machine-independent: every audit is run with hooks counting the
sequences each forward pass and each block evaluates (a block stubbed by prefix reuse
is not called, so it is not counted). Beside it, the share of a pass that is not in the
blocks (embedding, final norm, output head, MUDD's mixing, and the audit's per-token
NLL) is timed: a pass with every block replaced by its recorded output, side by side
with a full one. The ideal ratio is then ``(passes x fixed + block evaluations / L x
(full - fixed)) / (1 + replays)`` full passes: what the audit's forward passes cost
on this machine, without its other work (feeds, digests, bootstrap).

    python benchmarks/audit_schedule.py                  # tiny, small FeatureGate; deep MUDD
    python benchmarks/audit_schedule.py --rounds 3 --models mudd-24
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from resultfile import ResultFile, add_json_option
from torch import nn

from fcaudit.api import audit
from fcaudit.core.nll import token_nll
from fcaudit.core.replaying import OutputStub, swapped, tracing
from fcaudit.core.sites import find_sites
from fcaudit.engine import stages
from fcaudit.engine.plan import plan_runs
from fcaudit.engine.run import AuditOptions
from fcaudit.io.data import AuditData
from fcaudit.models.featuregate import GPT
from fcaudit.models.featuregate import PRESETS as GPT_PRESETS
from fcaudit.models.mudd import PRESETS as MUDD_PRESETS
from fcaudit.models.mudd import MuddModel


def models() -> dict[str, tuple[nn.Module, int]]:
    """name -> (model with random weights, sequence length)."""
    torch.manual_seed(0)
    return {
        "featuregate-tiny": (GPT(GPT_PRESETS["tiny"]), 128),
        "featuregate-small": (GPT(dataclasses.replace(GPT_PRESETS["small"], block_size=128)), 128),
        "mudd-24": (MuddModel(dataclasses.replace(MUDD_PRESETS["tiny"], n_layer=24)), 128),
    }


@torch.no_grad()
def forward_pass_seconds(model: nn.Module, ids: np.ndarray, batch: int) -> float:
    """One plain forward pass over every evaluation sequence, batch by batch."""
    start = time.perf_counter()
    for i in range(0, len(ids), batch):
        model(torch.from_numpy(ids[i:i + batch]))
    return time.perf_counter() - start


CHECKS = ("proof", "repeat")  # the schedule's check passes, counted apart


@dataclasses.dataclass
class Counts:
    """What the forward passes of one audit evaluated, in sequences: passes (model calls,
    each weighted by its batch's rows) and block evaluations, in all and in the schedule's
    checks: a site's prefix proof (the correct feed on that site's suffix) and the correct
    replay repeated in full at the end of each batch."""

    blocks: Sequence[str]
    passes: dict[str, int] = dataclasses.field(default_factory=dict)  # kind -> sequences
    evaluated: dict[str, int] = dataclasses.field(default_factory=dict)  # kind -> block rows
    rows: int = 0  # rows of the pass running now
    kind: str = "run"  # what the pass running now is: "run" or one of CHECKS

    def in_passes(self, n_eval: int) -> dict[str, float]:
        """Evaluation-set passes and block evaluations in evaluation-set passes of all the
        blocks (every block on every evaluation sequence once is 1), in all and per check."""
        scale = n_eval * len(self.blocks)
        out = {"passes": sum(self.passes.values()) / n_eval,
               "block_passes": sum(self.evaluated.values()) / scale}
        for kind in CHECKS:
            out[f"{kind}_passes"] = self.passes.get(kind, 0) / n_eval
            out[f"{kind}_block_passes"] = self.evaluated.get(kind, 0) / scale
        return out


@contextlib.contextmanager
def counting(model: nn.Module, blocks: Sequence[str]) -> Iterator[Counts]:
    """Count every forward pass of ``model`` and every call of its ``blocks`` (a block
    swapped out for a stub is not called, so prefix reuse shows as fewer evaluations);
    passes made by the replay stage's checks are also counted apart."""
    counts = Counts(blocks)

    def on_pass(_m: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = args[0] if args else next(iter(kwargs.values()))
        counts.rows = int(ids.shape[0])
        counts.passes[counts.kind] = counts.passes.get(counts.kind, 0) + counts.rows

    def on_block(_m: nn.Module, _a: Any) -> None:
        counts.evaluated[counts.kind] = counts.evaluated.get(counts.kind, 0) + counts.rows

    checked = stages._Passes.correct_with

    def correct_with(self: Any, known: Any = None) -> Any:
        counts.kind = "proof" if known else "repeat"
        try:
            return checked(self, known)
        finally:
            counts.kind = "run"
    handles = [model.register_forward_pre_hook(on_pass, with_kwargs=True)]
    handles += [model.get_submodule(p).register_forward_pre_hook(on_block) for p in blocks]
    stages._Passes.correct_with = correct_with
    try:
        yield counts
    finally:
        stages._Passes.correct_with = checked
        for handle in handles:
            handle.remove()


@torch.no_grad()
def pass_shares(model: nn.Module, ids: np.ndarray, batch: int, blocks: Sequence[str],
                repeats: int = 3) -> dict[str, float]:
    """Seconds over the evaluation set, min over ``repeats`` interleaved: a full pass, the
    same pass with every block replaced by its recorded output (what no schedule can
    skip), and the per-token NLL an audit adds to each pass."""
    chunks = [torch.from_numpy(ids[i:i + batch]) for i in range(0, len(ids), batch)]
    stubs, logits = [], []
    for x in chunks:
        with tracing(model, blocks, []) as trace:
            logits.append(model(x))
        stubs.append({p: OutputStub(model.get_submodule(p), trace.outputs[p]) for p in blocks})

    def stubbed() -> None:
        for x, known in zip(chunks, stubs, strict=True):
            with swapped(model, known):
                model(x)
    timed = {"full": lambda: [model(x) for x in chunks], "fixed": stubbed,
             "nll": lambda: [token_nll(y, x) for y, x in zip(logits, chunks, strict=True)]}
    best = dict.fromkeys(timed, float("inf"))
    for _ in range(repeats):
        for key, fn in timed.items():
            start = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - start)
    return best


def ideal_ratio(account: dict[str, float], shares: dict[str, float], passes: int) -> float:
    """What the counted passes and block evaluations cost, in ``passes`` full forwards:
    each pass pays the fixed part and the NLL, each block evaluation its share of the rest
    (blocks taken as equally costly)."""
    blocks = shares["full"] - shares["fixed"]
    cost = account["passes"] * (shares["fixed"] + shares["nll"]) + \
        account["block_passes"] * blocks
    return cost / (passes * shares["full"])


def audit_seconds(model: nn.Module, data: AuditData, options: AuditOptions
                  ) -> tuple[float, dict, Counts]:
    blocks = model.execution_blocks()
    with counting(model, blocks) as counts:
        start = time.perf_counter()
        result = audit(model, data=data, options=options)
        seconds = time.perf_counter() - start
    content = result.to_json()
    content.pop("runtime"), content.pop("command")
    return seconds, content, counts


def bench(name: str, model: nn.Module, seq_len: int, args: argparse.Namespace) -> dict:
    model.eval()
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    data = AuditData(rng.integers(0, vocab, (args.eval, seq_len)),
                     rng.integers(0, vocab, (args.calib, seq_len)), {"source": "random"})
    options = AuditOptions(execution=False, progress=False, batch_size=args.batch)
    runs = plan_runs(find_sites(model), options)
    replays = len(runs)
    forward_pass_seconds(model, data.eval_ids, args.batch)  # warm-up
    ratios: dict[str, list[float]] = {"naive": [], "prefix": []}
    results, account = {}, {}
    for r in range(args.rounds):
        order = ("naive", "prefix") if r % 2 == 0 else ("prefix", "naive")
        for schedule in order:
            forward = forward_pass_seconds(model, data.eval_ids, args.batch)
            seconds, results[schedule], counts = audit_seconds(
                model, data, dataclasses.replace(options, schedule=schedule))
            ratios[schedule].append(seconds / ((1 + replays) * forward))
            account[schedule] = counts.in_passes(args.eval)
    shares = pass_shares(model, data.eval_ids, args.batch, model.execution_blocks())
    ideal = {s: ideal_ratio(account[s], shares, 1 + replays) for s in account}
    return {"model": name, "seq_len": seq_len, "replays": replays,
            "per_layer_runs": sum(run.target.only_site is not None for run in runs),
            "naive": ratios["naive"],
            "prefix": ratios["prefix"], "equal": results["naive"] == results["prefix"],
            "layers": len(model.execution_blocks()), "account": account,
            "pass_seconds": shares,
            "fixed_share": (shares["fixed"] + shares["nll"]) / (shares["full"] + shares["nll"]),
            "ideal": {**ideal, "prefix_over_naive": ideal["prefix"] / ideal["naive"]}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="*", default=None, help="default: all")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--eval", type=int, default=32, help="evaluation sequences")
    p.add_argument("--calib", type=int, default=16, help="calibration sequences")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add_json_option(p, "audit_schedule")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    record = ResultFile("audit_schedule.py")
    record.start()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}; {args.eval} eval / "
          f"{args.calib} calib sequences, batch {args.batch}, {args.rounds} rounds")
    print(f"{'model':18} {'replays':>7} {'naive/fwd':>12} {'prefix/fwd':>12} {'prefix/naive':>13}"
          f" {'ideal p/n':>9} {'ideal p/fwd':>11} {'fixed':>6} {'passes n/p':>12}"
          f" {'blocks n/p':>13} equal")
    rows = [row for name, (model, seq_len) in models().items()
            if not args.models or name in args.models
            for row in [report(bench(name, model, seq_len, args))]]
    record.write(args.json, {"rounds": args.rounds, "eval": args.eval, "calib": args.calib,
                             "batch": args.batch, "threads": torch.get_num_threads(),
                             "models": rows})


def report(row: dict) -> dict:
    """Print one model's line; the row with its measured prefix / naive ratios."""
    rel = [p / n for p, n in zip(row["prefix"], row["naive"], strict=True)]
    span = lambda v: f"{min(v):.3f}-{max(v):.3f}"  # noqa: E731
    acc, ideal = row["account"], row["ideal"]
    print(f"{row['model']:18} {row['replays']:>7} {span(row['naive']):>12} "
          f"{span(row['prefix']):>12} {span(rel):>13} {ideal['prefix_over_naive']:>9.3f} "
          f"{ideal['prefix']:>11.3f} {row['fixed_share']:>6.3f} "
          f"{acc['naive']['passes']:>5.1f}/{acc['prefix']['passes']:<6.1f} "
          f"{acc['naive']['block_passes']:>6.1f}/{acc['prefix']['block_passes']:<6.1f} "
          f"{row['equal']}", flush=True)
    return {**row, "prefix_over_naive": rel}


if __name__ == "__main__":
    main()
