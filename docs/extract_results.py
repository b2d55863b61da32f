"""Copy the numbers the docs quote out of fcaudit's own outputs into docs/results/*.json.

The docs never quote an output folder directly: a demo or a study folder is hundreds of
megabytes and is not committed. This script reads the few numbers the README quotes from
such a folder into a small committed JSON file, with where and on what code they were
made; ``docs/make_docs.py`` renders the docs from those files.

    python docs/extract_results.py demo fcaudit-demo       # -> docs/results/demo.json
                                     # (fcaudit-demo: made by benchmarks/timings.py --demo
                                     # --keep-demo fcaudit-demo)
    python docs/extract_results.py study study-tiny        # -> docs/results/study-tiny.json
    python docs/extract_results.py vision study-vision     # -> docs/results/study-vision.json
    python docs/extract_results.py ssm study-ssm           # -> docs/results/study-ssm.json
    python docs/extract_results.py exit study-exit         # -> docs/results/study-exit.json
    python docs/extract_results.py fold study-fold         # -> docs/results/study-fold.json
    python docs/extract_results.py tasks study-tasks       # -> docs/results/study-tasks.json
    python docs/extract_results.py presets                 # -> docs/results/presets.json

Keys read (a missing one is an error naming it, never a silently dropped number):
``audit.json``: conditions.{reassign,shuffle}.{delta,ci95},
retention.{static-layer,static-layer-token}.{value,ci95},
variance[family].eta2_{layer,residual,token_id} (and, null in an audit.json from before
issue 37, variance[family].{eta2_token_id_chance,epsilon2_token_id}),
variation[family].{mean_sd_across_inputs,
mean_sd_across_positions,across_layer_sd}, identity_replay_max_abs_diff, model.n_params,
sites, execution.{blocks_executed,blocks_present,flops_ratio,speed_ratio_vs_dense,
conditional_execution},
execution.timing.{speed_ratio_vs_dense.ci95,pairs,threads,batch_size},
execution.experts.{num_experts_per_layer,top_k_per_layer,active_expert_flops_per_token,
all_expert_flops_per_token}, runtime.host; a run's ``config.json``: results.{eval_nll,
unigram_nll,cpu,torch_threads}, train.steps; a study's ``reproduction.json``:
groups[*].{seeds,aggregate}, findings, command; its ``timings.json``: the seconds of every
run and audit.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fcaudit.core.errors import FcauditError
from fcaudit.io.fileio import read_json

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
TIMINGS = "src/fcaudit/timings.json"  # written by benchmarks/timings.py, not code
PRESET_ARCHES = ("featuregate", "dense", "mudd", "moe")
PRESET_SIZES = ("tiny", "mid", "small", "76m", "504m")


class MissingKey(SystemExit):
    """An output lacks a key the docs quote: say which, in which file."""


def get(data: Mapping[str, Any], path: str, source: Path) -> Any:
    """``data[a][b]...`` for ``path`` "a.b...", or exit naming the missing key and file."""
    value: Any = data
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise MissingKey(f"{source}: no key {path!r} (audit.json changed? adjust "
                             f"docs/extract_results.py)")
        value = value[part]
    return value


def read(path: Path) -> dict[str, Any]:
    """A result file of an output folder, through fcaudit's guarded reader (a FIFO, a
    device, a file nested too deeply or holding a number beyond a float: one line)."""
    if not path.exists():
        raise SystemExit(f"{path} does not exist: is this a finished fcaudit output folder?")
    try:
        return read_json(path, "result file")
    except FcauditError as exc:
        raise SystemExit(str(exc)) from exc


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def provenance(folder: Path, command: str, commit: str | None = None) -> dict[str, Any]:
    """Which code made the folder: the last commit that changed src/ before the folder was
    last written (so a commit made after the run is not credited with it; run this on the
    checkout that ran the command), and whether src/ has uncommitted changes now."""
    stamp = folder.stat().st_mtime
    made = time.strftime("%Y-%m-%d", time.gmtime(stamp))
    if commit is not None and not _git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"):
        raise SystemExit(f"--commit {commit} is not a commit of this repository")
    return {"command": command,
            "commit": _git("rev-parse", "--short", commit) if commit else
            _git("log", "-1", "--format=%h", f"--before=@{int(stamp)}", "--", "src",
                 f":!{TIMINGS}"),
            "src_dirty": bool(_git("status", "--porcelain", "--", "src", f":!{TIMINGS}")),
            "date": made}


def audit_numbers(path: Path) -> dict[str, Any]:
    """The numbers of one audit.json that the docs quote."""
    a = read(path)
    family = get(a, "sites", path)[0]["family"]  # the main family comes first
    ex = get(a, "execution", path)
    out = {
        "n_params": get(a, "model.n_params", path),
        "layers": sum(1 for s in a["sites"] if s["family"] == family),
        "identity_max_abs_diff": get(a, "identity_replay_max_abs_diff", path),
        "conditions": {c: {"delta": get(a, f"conditions.{c}.delta", path),
                           "ci95": get(a, f"conditions.{c}.ci95", path)}
                       for c in ("reassign", "shuffle")},
        "retention_static_layer": {k: get(a, f"retention.static-layer.{k}", path)
                                   for k in ("value", "ci95")},
        "retention_static_layer_token": {k: get(a, f"retention.static-layer-token.{k}", path)
                                         for k in ("value", "ci95")},
        "eta2": {**{k: get(a, f"variance.{family}.eta2_{k}", path)
                    for k in ("layer", "residual", "token_id")},
                 # the token-id share's chance level and the share beyond it (issue 37)
                 **{k: a["variance"][family].get(key) for k, key in (
                     ("token_id_chance", "eta2_token_id_chance"),
                     ("token_id_beyond_chance", "epsilon2_token_id"))}},
        "variation": {k: get(a, f"variation.{family}.{k}", path) for k in
                      ("mean_sd_across_inputs", "mean_sd_across_positions", "across_layer_sd")},
        "execution": {k: get(ex, k, path) for k in (
            "blocks_executed", "blocks_present", "flops_ratio", "speed_ratio_vs_dense",
            "conditional_execution")},
        "host": get(a, "runtime.host", path),
    }
    if ex.get("timing"):
        out["execution"]["timing"] = {
            "ci95": get(ex, "timing.speed_ratio_vs_dense.ci95", path),
            **{k: get(ex, f"timing.{k}", path) for k in ("pairs", "threads", "batch_size")}}
    if ex.get("experts"):
        out["experts"] = {k: get(ex, f"experts.{k}", path) for k in (
            "num_experts_per_layer", "top_k_per_layer", "active_expert_flops_per_token",
            "all_expert_flops_per_token")}
    return out


def demo(folder: Path) -> dict[str, Any]:
    """``fcaudit demo``'s audit and its FeatureGate run (the shipped model: where it was
    trained, and at how many threads, is in its config.json)."""
    run = read(folder / "featuregate" / "config.json")
    src = folder / "featuregate" / "config.json"
    return {**provenance(folder, "fcaudit demo"),
            "audit": audit_numbers(folder / "audit" / "audit.json"),
            "run": {k.split(".")[-1]: get(run, k, src) for k in (
                "results.eval_nll", "results.unigram_nll", "train.steps", "results.cpu",
                "results.torch_threads")}}


def study(folder: Path) -> dict[str, Any]:
    """``fcaudit reproduce --preset tiny``: every group's aggregate over seeds, the findings,
    and each group's seed-0 audit (layers, blocks, experts). Its wall time is not read: a
    study may have been paused or resumed (benchmarks/timings.py times one)."""
    source = folder / "reproduction.json"
    rep = read(source)
    groups = {}
    for name, g in get(rep, "groups", source).items():
        first = audit_numbers(folder / "audits" / f"{name}-s0" / "audit.json")
        groups[name] = {"seeds": get(g, "seeds", source), "aggregate": get(g, "aggregate", source),
                        "seed0": {k: first[k] for k in ("n_params", "layers", "execution",
                                                        "experts") if k in first}}
    run = read(folder / "runs" / "featuregate-tiny-s0" / "config.json")
    return {**provenance(folder, get(rep, "command", source)), "groups": groups,
            "findings": get(rep, "findings", source), "steps": run["train"]["steps"],
            "host": first["host"]}


def own_table(folder: Path, commit: str | None, preset: str) -> dict[str, Any]:
    """``fcaudit reproduce --preset vision``, ``ssm``, ``exit`` or ``fold``: the study's own table
    rows (written by the study from its aggregates), its findings, each group's aggregate
    over seeds, and the wall time its timings.json recorded (runs and audits this folder made)."""
    source = folder / "reproduction.json"
    rep = read(source)
    timings = read(folder / "timings.json")
    first = sorted((folder / "audits").glob("*-s0"))[0] / "audit.json"
    return {**provenance(folder, get(rep, "command", source), commit),
            "host": get(read(first), "runtime.host", first),
            "table": get(rep, preset, source), "findings": get(rep, "findings", source),
            "groups": {name: {"seeds": g["seeds"], "aggregate": g["aggregate"]}
                       for name, g in get(rep, "groups", source).items()},
            "timed_s": round(sum(timings.values()), 1), "timed_items": len(timings)}


def presets() -> dict[str, Any]:
    """Parameter counts and shapes of every preset, counted on the meta device."""
    import torch

    from fcaudit.io.loading import get_arch
    out: dict[str, Any] = {}
    for arch in PRESET_ARCHES:
        spec = get_arch(arch)
        for size in PRESET_SIZES:
            try:
                cfg = spec.config(size)
            except Exception:  # noqa: BLE001 (a size this arch does not have)
                continue
            with torch.device("meta"):
                n = sum(p.numel() for p in spec.build(cfg).parameters())
            out.setdefault(arch, {})[size] = {
                "n_params": n, "n_layer": cfg.n_layer, "vocab_size": cfg.vocab_size,
                "n_embd": getattr(cfg, "n_embd", None) or getattr(cfg, "dim", None)}
    return {"command": "python docs/extract_results.py presets", "presets": out}


def write(name: str, content: Mapping[str, Any]) -> None:
    path = RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {path.relative_to(ROOT)}")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("demo", "study", "vision", "ssm", "exit", "fold", "tasks",
                                    "presets"))
    p.add_argument("folder", type=Path, nargs="?", help="the demo or study output folder")
    p.add_argument("--commit", help="the commit whose code made the folder, when it is not "
                   "the last one before the folder was written (a study run from a worktree)")
    args = p.parse_args(argv)
    if args.what == "presets":
        write("presets", presets())
    elif args.folder is None:
        p.error(f"{args.what} needs the output folder")
    elif args.what in ("vision", "ssm", "exit", "fold", "tasks"):
        write(f"study-{args.what}", own_table(args.folder, args.commit, args.what))
    else:
        write("demo" if args.what == "demo" else "study-tiny",
              demo(args.folder) if args.what == "demo" else study(args.folder))


if __name__ == "__main__":
    main()
