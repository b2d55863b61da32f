"""The GPU check: what fcaudit promises on a CPU, checked on CUDA in one short run.

Prints one table (and writes ``docs/results/gpu_check.json``):

* identity: a replay of the recorded coefficients equals the unperturbed pass bit for bit,
  in float32 and bfloat16, for FeatureGate, MUDD and the tiny MoE (random weights);
* cost: record and replay per pass against a plain forward, timed side by side in
  interleaved rounds in this process (median and range of the ratio);
* ``token_nll``: the per-token NLL's time at several chunk budgets on a 50k vocabulary,
  against ``F.cross_entropy`` on the same logits, and its largest difference from it;
* torchrun: a 1-process ``torchrun`` audit (a real process group: NCCL on CUDA, gloo on a
  CPU) gives the single-process ``audit.json`` outside ``runtime``;
* 1.4B: the 1.4B-shaped MUDDPythia (random weights, bf16): forward, record and replay
  seconds per token and the replay's bitwise equality.

On a machine without CUDA it runs on the CPU at small sizes and says which rows it
skipped (the 1.4B row needs ``--include-1.4b``: about 10 minutes and 5 GB on a CPU, see
``benchmarks/mudd_scale.py``). Under 8 minutes on one GPU.

    python benchmarks/gpu_check.py                 # cuda when available, else cpu
    python benchmarks/gpu_check.py --device cpu --json /tmp/gpu_check.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from resultfile import ResultFile, add_json_option

from fcaudit import find_sites, record, replay
from fcaudit.core import nll
from fcaudit.core.adapters import same_bits
from fcaudit.engine.result import NONDETERMINISTIC_KEYS

HERE = Path(__file__).resolve().parent
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FAMILIES = ("featuregate", "mudd", "moe")
VOCAB_50K = 50304  # GPT-2's vocabulary padded to a multiple of 64, as MUDDPythia's


def tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    """The family's tiny preset with random weights whose controllers vary with the input
    (a zero-initialised MUDD generator would emit constants)."""
    torch.manual_seed(seed)
    if family == "mudd":
        from mudd_scale import build
        return build("tiny", torch.float32)
    from fcaudit.io.loading import get_arch
    arch = get_arch(family)
    module = __import__(arch.module, fromlist=[arch.model_class])
    return getattr(module, arch.model_class)(arch.config("tiny")).eval()


def featuregate_factory() -> torch.nn.Module:
    """``--model gpu_check:featuregate_factory`` for the torchrun row: the same weights in
    every process."""
    return tiny_model("featuregate")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(fn: Callable[[], Any], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def span(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


@torch.no_grad()
def identity_and_cost(family: str, dtype: torch.dtype, device: torch.device, batch: int,
                      seq_len: int, rounds: int) -> dict[str, Any]:
    """Bitwise identity of the replay, and record / replay time over a plain forward."""
    model = tiny_model(family).to(device=device, dtype=dtype)
    ids = torch.randint(0, 2048, (batch, seq_len), device=device)
    sites = find_sites(model)
    original = model(ids)
    recording = record(model, ids, sites)
    with replay(model, recording):
        replayed = model(ids)
    exact = same_bits(replayed, original) and same_bits(recording.output, original)
    ratios: dict[str, list[float]] = {"record": [], "replay": []}
    for _ in range(rounds + 1):  # interleaved, so drifts in clock or load hit all three
        forward = seconds(lambda: model(ids), device)
        ratios["record"].append(seconds(lambda: record(model, ids, sites), device) / forward)

        def replayed_pass() -> None:
            with replay(model, recording):
                model(ids)
        ratios["replay"].append(seconds(replayed_pass, device) / forward)
    ratios = {k: v[1:] for k, v in ratios.items()}  # the first round warms caches up
    return {"family": family, "dtype": str(dtype).removeprefix("torch."), "bitwise": exact,
            "sites": len(sites), "record_over_forward": ratios["record"],
            "replay_over_forward": ratios["replay"]}


@torch.no_grad()
def nll_chunks(device: torch.device, batch: int, seq_len: int, rounds: int) -> list[dict]:
    """``token_nll`` at chunk budgets around the device's default, against cross-entropy."""
    logits = torch.randn(batch, seq_len, VOCAB_50K, device=device)
    ids = torch.randint(0, VOCAB_50K, (batch, seq_len), device=device)
    reference = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    name = "CHUNK_ELEMENTS_CPU" if device.type == "cpu" else "CHUNK_ELEMENTS_ACCELERATOR"
    default = getattr(nll, name)
    rows = []
    for budget in sorted({default >> 4, default >> 2, default, default << 2}):
        setattr(nll, name, budget)
        try:
            diff = (nll.token_nll(logits, ids) - reference).abs().max().item()  # also warms up
            ratio = [seconds(lambda: nll.token_nll(logits, ids), device) / seconds(
                lambda: F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:],
                                        reduction="none"), device) for _ in range(rounds + 1)]
            ratio = ratio[1:]  # the first round warms caches up
        finally:
            setattr(nll, name, default)
        rows.append({"chunk_elements": budget, "default": budget == default,
                     "over_cross_entropy": ratio, "max_abs_diff": diff})
    return rows


def canonical(path: Path) -> dict[str, Any]:
    result = json.loads(path.read_text())
    for key in NONDETERMINISTIC_KEYS:
        head, _, tail = key.partition(".")
        (result.get(head, {}).pop(tail, None) if tail else result.pop(head, None))
    return result


def torchrun_audit(device: torch.device) -> dict[str, Any]:
    """One process under torchrun (a real process group) against a plain process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rng = np.random.default_rng(0)
        np.save(root / "eval.npy", rng.integers(0, 2048, (16, 64)).astype(np.int64))
        np.save(root / "calib.npy", rng.integers(0, 2048, (8, 64)).astype(np.int64))
        argv = ["audit", "--model", "gpu_check:featuregate_factory", "--tokens",
                str(root / "eval.npy"), "--calib-tokens", str(root / "calib.npy"),
                "--device", device.type, "--batch-size", "4", "--bootstrap", "100",
                "--repeats", "2", "--no-execution", "--quiet"]
        launchers = {"single": [sys.executable, "-m", "fcaudit"],
                     "torchrun": [sys.executable, "-m", "torch.distributed.run",
                                  "--nproc-per-node", "1", "--standalone", "-m", "fcaudit"]}
        walls = {}
        for name, launcher in launchers.items():
            start = time.perf_counter()
            proc = subprocess.run([*launcher, *argv, "--out", str(root / name)], env=env,
                                  capture_output=True, text=True, timeout=600)
            walls[name] = time.perf_counter() - start
            if proc.returncode:
                return {"equal": False, "error": f"{name}: {proc.stderr.strip()[-400:]}"}
        group = json.loads((root / "torchrun" / "audit.json").read_text()
                           )["runtime"]["schedule"].get("process_group")
        return {"equal": canonical(root / "torchrun" / "audit.json")
                == canonical(root / "single" / "audit.json"),
                "process_group": group, "wall_s": walls}


@torch.no_grad()
def mudd_1_4b(device: torch.device, seq_len: int) -> dict[str, Any]:
    from mudd_scale import build
    model = build("1.4b", torch.bfloat16).to(device)
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len), device=device)
    model(ids[:, :64])  # warm-up: kernel choice and allocator
    times: dict[str, float] = {}
    times["forward"] = seconds(lambda: model(ids), device)
    original = model(ids)
    sites = find_sites(model)
    start = time.perf_counter()
    recording = record(model, ids, sites)
    sync(device)
    times["record"] = time.perf_counter() - start

    def replayed_pass() -> torch.Tensor:
        with replay(model, recording):
            return model(ids)
    times["replay"] = seconds(replayed_pass, device)
    exact = same_bits(replayed_pass(), original)
    return {"tokens": seq_len, "bitwise": exact,
            "ms_per_token": {k: 1e3 * v / seq_len for k, v in times.items()}}


def table(results: dict[str, Any]) -> str:
    rows = []
    for r in results["identity"]:
        rows.append((f"identity {r['family']} {r['dtype']}", f"{r['sites']} sites",
                     "bitwise" if r["bitwise"] else "DIFFERS",
                     f"record {span(r['record_over_forward'])}x, replay "
                     f"{span(r['replay_over_forward'])}x a forward"))
    for r in results["token_nll"]:
        rows.append(("token_nll 50k vocab", f"chunk 2^{r['chunk_elements'].bit_length() - 1}"
                     + (" (default)" if r["default"] else ""),
                     f"max diff {r['max_abs_diff']:.1e}",
                     f"{span(r['over_cross_entropy'])}x cross_entropy"))
    run = results["torchrun"]
    rows.append(("torchrun 1 process", str(run.get("process_group")),
                 "equal" if run["equal"] else "DIFFERS", run.get("error", "audit.json outside "
                                                                 "runtime vs a plain process")))
    big = results["mudd_1.4b"]
    if "skipped" in big:
        rows.append(("MUDD 1.4B bf16", "-", "skipped", big["skipped"]))
    else:
        ms = big["ms_per_token"]
        rows.append(("MUDD 1.4B bf16", f"{big['tokens']} tokens",
                     "bitwise" if big["bitwise"] else "DIFFERS",
                     ", ".join(f"{k} {v:.2f} ms/token" for k, v in ms.items())))
    head = "| check | setting | result | detail |\n|---|---|---|---|\n"
    return head + "\n".join("| " + " | ".join(row) + " |" for row in rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=("cuda", "cpu"))
    p.add_argument("--rounds", type=int, default=None,
                   help="timing rounds per row (default: 20 on CUDA, 3 on a CPU)")
    p.add_argument("--include-1.4b", dest="big", action="store_true",
                   help="also run the 1.4B-shaped MUDD on a CPU (always on CUDA)")
    p.add_argument("--skip-torchrun", action="store_true",
                   help="leave out the torchrun row (two subprocess audits)")
    add_json_option(p, "gpu_check")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    rounds = args.rounds or (20 if cuda else 3)
    batch, seq_len = (32, 128) if cuda else (2, 64)  # the tiny presets' context is 128
    out = ResultFile("gpu_check.py")
    out.start()
    torch.manual_seed(0)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if cuda else "cpu",
                               "rounds": rounds, "batch": batch, "seq_len": seq_len}
    results["identity"] = [identity_and_cost(f, d, device, batch, seq_len, rounds)
                           for f in FAMILIES for d in DTYPES.values()]
    results["token_nll"] = nll_chunks(device, *((8, 512) if cuda else (4, 128)), rounds)
    results["torchrun"] = ({"equal": True, "skipped": "--skip-torchrun"} if args.skip_torchrun
                           else torchrun_audit(device))
    results["mudd_1.4b"] = (mudd_1_4b(device, 2048 if cuda else 256) if cuda or args.big else
                            {"skipped": "on a CPU only with --include-1.4b (about 10 minutes, "
                                        "5 GB; benchmarks/mudd_scale.py)"})
    results["skipped"] = [k for k in ("torchrun", "mudd_1.4b") if "skipped" in results[k]]
    print(f"device {results['device']}, torch {torch.__version__}, batch {batch} x {seq_len} "
          f"tokens, {rounds} rounds")
    results["table"] = table(results)  # as printed, so the docs show what the run printed
    print(results["table"])
    if results["skipped"]:
        print("skipped rows: " + ", ".join(results["skipped"]))
    out.write(args.json, results)
    failed = [r for r in results["identity"] if not r["bitwise"]]
    if failed or not results["torchrun"]["equal"] or not results["mudd_1.4b"].get("bitwise", True):
        sys.exit(1)


if __name__ == "__main__":
    main()
