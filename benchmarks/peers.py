"""Record and replay with fcaudit against raw forward hooks, nnsight and pyvene.

On one FeatureGate model (random weights) and one batch, each tool records every
gate's output in one forward pass and replays the recorded gates into the model. The
table gives each pass's time over a plain forward timed in the same round (median
[min-max] over interleaved rounds; see ``sidebyside``), plus three checks:

* **gates**: the tool recorded exactly fcaudit's gate tensors (bitwise);
* **logits**: replaying them reproduced the plain forward's logits (bitwise);
* **feeds**: replaying zeros instead changed the logits, so the replay really fed
  the model (a no-op replay would pass the logits check trivially).

fcaudit's replay swaps each controller for a stub, so the gate never runs; hooks,
nnsight and pyvene compute the gate and then overwrite its output. nnsight wraps
every module's ``forward`` for good, and pyvene adds hooks on every call, so each
gets its own copy of the model (same weights) and the plain forward runs on an
untouched one. nnsight and pyvene are optional (``pip install nnsight pyvene``): an
absent one is skipped with a note.

    python benchmarks/peers.py
    python benchmarks/peers.py --presets tiny --rounds 9
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
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
from torch import Tensor

import fcaudit
from fcaudit.models.featuregate import GPT, PRESETS


@dataclass(frozen=True)
class Peer:
    """One tool's way to record the gates (in layer order) and to replay given ones."""

    name: str
    record: Callable[[Tensor], list[Tensor]]
    replay: Callable[[Tensor, list[Tensor]], Tensor]


def fcaudit_peer(model: GPT) -> Peer:
    def record(ids: Tensor) -> list[Tensor]:
        return list(fcaudit.record(model, ids).values())

    names = [site.name for site in model.controller_sites()]

    def replay(ids: Tensor, gates: list[Tensor]) -> Tensor:
        with fcaudit.replay(model, dict(zip(names, gates, strict=True))):
            return model(ids)

    return Peer(f"fcaudit {fcaudit.__version__}", record, replay)


def hooks_peer(model: GPT) -> Peer:
    """Plain ``register_forward_hook``: keep each output, or return a given one."""
    modules = [model.get_submodule(site.path) for site in model.controller_sites()]

    def hooked(hooks: list[Callable[..., Tensor | None]], ids: Tensor) -> Tensor:
        handles = [m.register_forward_hook(h) for m, h in zip(modules, hooks, strict=True)]
        try:
            return model(ids)
        finally:
            for handle in handles:
                handle.remove()

    def record(ids: Tensor) -> list[Tensor]:
        kept: list[Tensor] = []
        hooked([lambda _m, _a, out: kept.append(out.detach())] * len(modules), ids)
        return kept

    def replay(ids: Tensor, gates: list[Tensor]) -> Tensor:
        return hooked([lambda _m, _a, _out, g=g: g for g in gates], ids)

    return Peer("forward hooks", record, replay)


def nnsight_peer(model: GPT) -> Peer:
    import nnsight

    traced = nnsight.NNsight(copy.deepcopy(model))
    layers = [site.layer for site in model.controller_sites()]

    def record(ids: Tensor) -> list[Tensor]:
        with traced.trace(ids):
            kept = nnsight.save([traced.blocks[layer].gate.output for layer in layers])
        return kept

    def replay(ids: Tensor, gates: list[Tensor]) -> Tensor:
        with traced.trace(ids):
            for layer, gate in zip(layers, gates, strict=True):
                traced.blocks[layer].gate.output = gate
            logits = traced.output.save()
        return logits

    return Peer(f"nnsight {importlib.metadata.version('nnsight')}", record, replay)


def pyvene_peer(model: GPT) -> Peer:
    import pyvene as pv

    layers = [site.layer for site in model.controller_sites()]

    def wrapped(intervention: type) -> pv.IntervenableModel:
        config = pv.IntervenableConfig(representations=[
            pv.RepresentationConfig(component=f"blocks[{layer}].gate.output",
                                    intervention=intervention()) for layer in layers])
        return pv.IntervenableModel(config, copy.deepcopy(model))

    collector, setter = wrapped(pv.CollectIntervention), wrapped(pv.VanillaIntervention)

    def record(ids: Tensor) -> list[Tensor]:
        (_, kept), _ = collector(base={"input_ids": ids})
        return kept

    def replay(ids: Tensor, gates: list[Tensor]) -> Tensor:
        _, logits = setter(base={"input_ids": ids}, source_representations=gates)
        return logits

    return Peer(f"pyvene {importlib.metadata.version('pyvene')}", record, replay)


def peers(model: GPT) -> tuple[list[Peer], list[str]]:
    """Every tool that is installed and runs here, and a note for each one skipped."""
    found, skipped = [fcaudit_peer(model), hooks_peer(model)], []
    for name, make in (("nnsight", nnsight_peer), ("pyvene", pyvene_peer)):
        try:
            found.append(make(model))
        except ImportError as exc:
            skipped.append(f"{name} skipped: not installed ({exc}); pip install {name}")
    return found, skipped


@torch.no_grad()
def measure(preset: str, batch: int, seq_len: int, rounds: int, seconds: float,
            seed: int) -> tuple[list[dict[str, str]], list[str]]:
    torch.manual_seed(seed)
    model = GPT(PRESETS[preset]).eval()
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len))
    logits = model(ids)
    truth = list(fcaudit.record(model, ids).values())
    zeros = [torch.zeros_like(g) for g in truth]
    found, skipped = peers(model)
    modes: dict[str, Callable[[], object]] = {"forward": lambda: model(ids),
                                              "forward (A/A)": lambda: model(ids)}
    for peer in found:
        modes[f"{peer.name} record"] = lambda p=peer: p.record(ids)
        modes[f"{peer.name} replay"] = lambda p=peer: p.replay(ids, truth)
    per_round = ratios(time_rounds(modes, rounds, reps_for(modes["forward"], seconds)),
                       "forward")
    rows = [{"tool": "plain forward (A/A)", "record / forward": summary(per_round["forward (A/A)"]),
             "replay / forward": "", "gates": "", "logits": "", "feeds": ""}]
    for peer in found:
        gates = peer.record(ids)
        same = len(gates) == len(truth) and all(
            g.dtype == t.dtype and torch.equal(g, t) for g, t in zip(gates, truth, strict=True))
        rows.append({"tool": peer.name,
                     "record / forward": summary(per_round[f"{peer.name} record"]),
                     "replay / forward": summary(per_round[f"{peer.name} replay"]),
                     "gates": "same" if same else "DIFFERENT",
                     "logits": "same" if torch.equal(peer.replay(ids, gates), logits)
                     else "DIFFERENT",
                     "feeds": "yes" if not torch.equal(peer.replay(ids, zeros), logits)
                     else "NO"})
    return rows, skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"], choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    add_timing_options(parser, seconds=0.2)
    add_json_option(parser, "peers")
    args = parser.parse_args()

    print(apply_timing_options(args))
    record = ResultFile("peers.py")
    record.start()
    tables = []
    for preset in args.presets:
        rows, skipped = measure(preset, args.batch, args.seq_len, args.rounds, args.seconds,
                                args.seed)
        print(f"\n{preset}: batch {args.batch} x {args.seq_len} tokens; load "
              f"{machine().rsplit('load average ', 1)[1]}")
        for note in skipped:
            print(note)
        print("| " + " | ".join(rows[0]) + " |")
        print("|" + "---|" * len(rows[0]))
        for row in rows:
            print("| " + " | ".join(row.values()) + " |")
        tables.append({"preset": preset, "load_average": [round(x, 2) for x in os.getloadavg()],
                       "skipped": skipped, "rows": rows})
    record.write(args.json, {"rounds": args.rounds, "seconds": args.seconds,
                             "batch": args.batch, "seq_len": args.seq_len, "presets": tables})


if __name__ == "__main__":
    main()
