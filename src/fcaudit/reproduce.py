"""``fcaudit reproduce``: the paper's study end to end, multi-seed, resumable.

Trains every (architecture, preset, seed) of the study, audits each trained
model (dependence and execution), aggregates across seeds and writes
``reproduction.json``, ``reproduction.md``, ``report.html`` and figures. Every
finished training run and audit is reused on rerun, so an interrupted study
resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import platform
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure

from . import __version__
from .audit_run import AuditOptions, run_audit
from .errors import FcauditError
from .fileio import read_json, write_json, write_text
from .loading import is_run_folder
from .report import (
    Bullets,
    Code,
    CodeBlock,
    Heading,
    Para,
    Table,
    to_html,
    to_markdown,
    write_figures,
)
from .train import train

SCHEMA = "fcaudit.reproduction/1"


@dataclass(frozen=True)
class Group:
    """One model family at one size, trained and audited over several seeds."""

    arch: str
    preset: str
    seeds: int
    dense: str | None = "own"  # "own": the trained Dense twin of the same seed

    @property
    def name(self) -> str:
        return f"{self.arch}-{self.preset}"


def study(preset: str, seeds: int | None) -> list[Group]:
    """The groups of a study preset (``--seeds`` overrides every group's seed count)."""
    if preset == "tiny":
        n = seeds or 3
        return [Group("featuregate", "tiny", n), Group("mudd", "tiny", n, dense=None),
                Group("skipgate", "tiny", 1)]
    if preset == "paper":
        return [Group("featuregate", "76m", seeds or 7), Group("featuregate", "504m", seeds or 3)]
    raise FcauditError(f"unknown study preset {preset!r}; choose tiny or paper")


# What the paper reported (SPEC section 8), shown beside our aggregates.
PAPER = {
    "featuregate": {"retention_static_layer": "98.70% (76M, 7 seeds); 99.43% (504M, 3 seeds)",
                    "eta2_layer": "87% to 96%", "blocks": "every block runs",
                    "speed_ratio": "1.308 (30.8% slower than Dense)"},
    "mudd": {"reassign": "+1.9067 nats (MUDDPythia-1.4B)", "shuffle": "+2.9637 nats",
             "static": "static replacement also hurts strongly", "blocks": "every block runs"},
}


def metrics_of(audit: Mapping[str, Any]) -> dict[str, float | None]:
    """The numbers aggregated across seeds, flat, from one audit.json."""
    c, r = audit["conditions"], audit["retention"]
    out: dict[str, float | None] = {"nll_correct": c["correct"]["nll"]}
    for name in ("reassign", "shuffle", "reassign+shuffle", "static-layer",
                 "static-layer-position", "global-mean"):
        out[f"delta_{name}"] = c[name]["delta"]
    out["interaction"] = audit["interaction"]["value"]
    out["retention_static_layer"] = r["static-layer"]["value"]
    out["retention_static_layer_position"] = r["static-layer-position"]["value"]
    family = next(iter(audit["variance"]))  # the first family: the main one
    for key in ("eta2_layer", "eta2_position", "eta2_layer_position", "eta2_component",
                "eta2_residual"):
        out[key] = audit["variance"][family][key]
    ex = audit["execution"]
    if ex.get("measured"):
        out["blocks_executed_fraction"] = ex["blocks_executed"] / ex["blocks_present"]
        out["flops_ratio"] = ex["flops_ratio"]
        out["speed_ratio"] = ex.get("speed_ratio_vs_dense")
    return out


def aggregate(per_seed: Sequence[Mapping[str, float | None]]) -> dict[str, dict[str, Any]]:
    """Mean, sd (n-1), min and max of each metric over seeds; null values are left out."""
    keys = list(dict.fromkeys(k for m in per_seed for k in m))
    out = {}
    for key in keys:
        values = np.array([m[key] for m in per_seed if m.get(key) is not None], dtype=float)
        out[key] = {"n": int(len(values)),
                    "mean": float(values.mean()) if len(values) else None,
                    "sd": float(values.std(ddof=1)) if len(values) > 1 else None,
                    "min": float(values.min()) if len(values) else None,
                    "max": float(values.max()) if len(values) else None}
    return out


@dataclass(frozen=True)
class StudySettings:
    """What every training run and audit of the study shares."""

    options: AuditOptions
    steps: int | None = None  # override the presets' step counts (smoke tests)
    max_eval: int | None = 64
    max_calib: int | None = 64
    train_data: str | None = None  # train on this text instead of the built-in corpus


def _ensure_run(arch: str, preset: str, seed: int, folder: Path, st: StudySettings) -> Path:
    if is_run_folder(folder):
        return folder
    return train(arch, preset, seed, folder, force=True, steps=st.steps,
                 progress=st.options.progress, data=st.train_data)


def run_group(group: Group, out: Path, st: StudySettings) -> list[dict[str, Any]]:
    """Train and audit every seed of ``group`` (reusing what exists); return the audits."""
    audits = []
    for seed in range(group.seeds):
        run = _ensure_run(group.arch, group.preset, seed, out / "runs" / f"{group.name}-s{seed}",
                          st)
        dense = None
        if group.dense == "own":
            dense = str(_ensure_run("dense", group.preset, seed,
                                    out / "runs" / f"dense-{group.preset}-s{seed}", st))
        audit_dir = out / "audits" / f"{group.name}-s{seed}"
        if (audit_dir / "audit.json").is_file():
            audits.append(read_json(audit_dir / "audit.json", "audit"))
            continue
        audits.append(run_audit(str(run), audit_dir, dense=dense, max_eval=st.max_eval,
                                max_calib=st.max_calib,
                                options=dataclasses.replace(st.options, seed=seed)))
    return audits


def _fmt(stats: Mapping[str, Any] | None, digits: int = 4, pct: bool = False) -> str:
    if not stats or stats.get("mean") is None:
        return "undefined"
    unit = "%" if pct else ""
    sd = f" ± {stats['sd']:.{digits}f}" if stats.get("sd") is not None else ""
    return (f"{stats['mean']:.{digits}f}{unit}{sd} (range {stats['min']:.{digits}f} to "
            f"{stats['max']:.{digits}f}, n={stats['n']})")


ROWS: tuple[tuple[str, str, int, bool], ...] = (
    ("nll_correct", "NLL (correct replay)", 4, False),
    ("delta_reassign", "penalty: reassign", 4, False),
    ("delta_shuffle", "penalty: shuffle", 4, False),
    ("delta_reassign+shuffle", "penalty: reassign+shuffle", 4, False),
    ("interaction", "factorial interaction", 4, False),
    ("delta_static-layer", "penalty: static-layer", 4, False),
    ("delta_static-layer-position", "penalty: static-layer-position", 4, False),
    ("delta_global-mean", "penalty: global-mean", 4, False),
    ("retention_static_layer", "retention: static-layer", 2, True),
    ("retention_static_layer_position", "retention: static-layer-position", 2, True),
    ("eta2_layer", "eta2 layer", 3, False),
    ("eta2_position", "eta2 position", 3, False),
    ("eta2_layer_position", "eta2 layer x position", 3, False),
    ("eta2_component", "eta2 component", 3, False),
    ("eta2_residual", "eta2 residual (content)", 3, False),
    ("blocks_executed_fraction", "blocks executed / present", 3, False),
    ("flops_ratio", "FLOPs ratio vs dense", 3, False),
    ("speed_ratio", "time ratio vs dense", 3, False),
)


def findings(groups: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str]]:
    """Each of the paper's findings, and whether it holds at this scale (from the numbers)."""
    out = []
    fg = next((g for n, g in groups.items() if n.startswith("featuregate")), None)
    mudd = next((g for n, g in groups.items() if n.startswith("mudd")), None)

    def mean(g: Mapping[str, Any] | None, key: str) -> float | None:
        return None if g is None else (g["aggregate"].get(key) or {}).get("mean")

    ret = mean(fg, "retention_static_layer")
    if fg is not None:
        out.append(("FeatureGate: a static per-layer profile keeps almost all (>= 90%) of the "
                    "Correct-to-GlobalMean gap (paper: 98.70% / 99.43%)",
                    "undefined (no clear gap)" if ret is None else
                    f"{'holds' if ret >= 90 else 'does not hold'}: {ret:.2f}% on average"))
        eta = mean(fg, "eta2_layer")
        out.append(("FeatureGate: layer identity explains most of the coefficient variance "
                    "(paper: 87% to 96%)",
                    f"{'holds' if eta is not None and eta >= 0.8 else 'does not hold'}: "
                    f"{100 * (eta or 0):.1f}% on average"))
        frac = mean(fg, "blocks_executed_fraction")
        if frac is not None:
            out.append(("FeatureGate runs every block",
                        f"{'holds' if frac >= 0.999 else 'does not hold'}: {frac:.3f} of "
                        "blocks executed per token"))
        speed = mean(fg, "speed_ratio")
        if speed is not None:
            out.append(("FeatureGate is slower than Dense (paper: 30.8% slower)",
                        f"{'holds' if speed > 1 else 'does not hold'}: time ratio "
                        f"{speed:.3f} on average"))
    if mudd is not None:
        r, s = mean(mudd, "delta_reassign"), mean(mudd, "delta_shuffle")
        out.append(("MUDD: reassignment and token shuffling raise NLL strongly (paper: +1.91 "
                    "and +2.96 nats on MUDDPythia-1.4B)",
                    f"{'holds' if min(r, s) > 0.1 else 'does not hold'}: reassign {r:+.3f}, "
                    f"shuffle {s:+.3f} nats on average"))
        if fg is not None:
            fr = mean(fg, "delta_reassign")
            # every MUDD seed above every FeatureGate seed: the seed ranges do not overlap
            apart = mudd["aggregate"]["delta_reassign"]["min"] > \
                fg["aggregate"]["delta_reassign"]["max"]
            out.append(("The contrast: MUDD depends on the assignment more than FeatureGate",
                        f"{'holds' if apart else 'does not hold'}: reassign penalty {r:+.3f} "
                        f"(MUDD) vs {fr:+.3f} (FeatureGate), seed ranges "
                        f"{'apart' if apart else 'overlap'}"))
        frac = mean(mudd, "blocks_executed_fraction")
        if frac is not None:
            out.append(("MUDD runs every block", f"{'holds' if frac >= 0.999 else 'does not hold'}"
                                                 f": {frac:.3f} of blocks executed per token"))
    return out


# ------------------------------------------------------------------------------- figures

def _profiles_figure(groups: Mapping[str, Mapping[str, Any]]) -> Figure | None:
    names = [n for n, g in groups.items() if g["profiles"]]
    if not names:
        return None
    fig = Figure(figsize=(8.0, 2.8 * len(names)), layout="constrained")
    for ax, name in zip(fig.subplots(len(names), 1, squeeze=False)[:, 0], names, strict=True):
        for seed, prof in enumerate(groups[name]["profiles"]):
            mean, sd = np.array(prof["mean"]), np.array(prof["sd"])
            x = np.arange(len(mean))
            ax.plot(x, mean, marker="o", label=f"seed {seed}")
            ax.fill_between(x, mean - sd, mean + sd, alpha=0.15)
        ax.set_title(f"{name}: mean coefficient per layer (band: ± sd)")
        ax.set_xlabel("layer")
        ax.legend(loc="best")
    return fig


def _penalties_figure(groups: Mapping[str, Mapping[str, Any]]) -> Figure | None:
    conds = ("reassign", "shuffle", "reassign+shuffle", "static-layer", "static-layer-position",
             "global-mean")
    fig = Figure(figsize=(8.0, 3.6), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / max(1, len(groups))
    for i, (name, g) in enumerate(groups.items()):
        means, lo, hi = [], [], []
        for c in conds:
            vals = [a["conditions"][c] for a in g["audits"]]
            means.append(np.mean([v["delta"] for v in vals]))
            lo.append(min(v["ci95"][0] for v in vals))
            hi.append(max(v["ci95"][1] for v in vals))
        x = np.arange(len(conds)) + i * width
        err = np.array([np.array(means) - lo, np.array(hi) - means]).clip(min=0)
        ax.bar(x, means, width, yerr=err, capsize=3, label=name)
    ax.set_xticks(np.arange(len(conds)) + width * (len(groups) - 1) / 2, conds, rotation=20)
    ax.set_ylabel("penalty vs correct (nats)")
    ax.set_title("Penalties per condition: mean over seeds; bars span the seeds' 95% intervals")
    ax.legend()
    return fig


def _retention_figure(groups: Mapping[str, Mapping[str, Any]]) -> Figure | None:
    fig = Figure(figsize=(8.0, 3.2), layout="constrained")
    ax = fig.subplots()
    for i, g in enumerate(groups.values()):
        for seed, a in enumerate(g["audits"]):
            r = a["retention"]["static-layer"]
            if r["value"] is None:
                ax.plot(i, 0, marker="x", color="grey")
                continue
            ax.errorbar(i + 0.05 * seed, r["value"], yerr=[[r["value"] - r["ci95"][0]],
                                                           [r["ci95"][1] - r["value"]]],
                        marker="o", capsize=3, color=f"C{i}")
    ax.set_xticks(range(len(groups)), list(groups))
    ax.axhline(100, color="black", lw=0.8, ls="--")
    ax.set_ylabel("static-layer retention (%)")
    ax.set_title("Gap retention of the static per-layer profile, per seed (x: undefined)")
    return fig


def _variance_figure(groups: Mapping[str, Mapping[str, Any]]) -> Figure | None:
    keys = ("eta2_layer", "eta2_position", "eta2_layer_position", "eta2_component",
            "eta2_residual")
    fig = Figure(figsize=(8.0, 3.2), layout="constrained")
    ax = fig.subplots()
    bottom = np.zeros(len(groups))
    for key in keys:
        vals = np.array([g["aggregate"][key]["mean"] or 0.0 for g in groups.values()])
        ax.bar(list(groups), vals, bottom=bottom, label=key.removeprefix("eta2_"))
        bottom += vals
    ax.set_ylabel("share of coefficient variance")
    ax.set_title("Variance decomposition (mean over seeds)")
    ax.legend(loc="center left", bbox_to_anchor=(1, 0.5))
    return fig


def _execution_figure(groups: Mapping[str, Mapping[str, Any]]) -> Figure | None:
    names = [n for n, g in groups.items() if g["aggregate"].get("flops_ratio")]
    if not names:
        return None
    fig = Figure(figsize=(8.0, 3.2), layout="constrained")
    ax = fig.subplots()
    x = np.arange(len(names))
    for j, (key, label) in enumerate((("flops_ratio", "FLOPs"), ("speed_ratio", "time"),
                                      ("blocks_executed_fraction", "blocks executed"))):
        stats = [groups[n]["aggregate"].get(key) or {} for n in names]
        mean = np.array([s.get("mean") or np.nan for s in stats])
        lo = np.array([s.get("min") or np.nan for s in stats])
        hi = np.array([s.get("max") or np.nan for s in stats])
        ax.bar(x + 0.27 * j, mean, 0.27, yerr=np.nan_to_num([mean - lo, hi - mean]), capsize=3,
               label=label)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(x + 0.27, names)
    ax.set_ylabel("model / dense")
    ax.set_title("Execution against the dense counterpart (bars: seed range)")
    ax.legend()
    return fig


FIGURES: tuple[tuple[str, str, Callable[[Any], Figure | None]], ...] = (
    ("study_profiles", "Per-layer coefficient profiles across seeds", _profiles_figure),
    ("study_penalties", "Penalties per condition per family", _penalties_figure),
    ("study_retention", "Static-layer retention per seed", _retention_figure),
    ("study_variance", "Variance shares", _variance_figure),
    ("study_execution", "FLOPs, time and blocks against dense", _execution_figure),
)


# -------------------------------------------------------------------------------- report

def _blocks(result: Mapping[str, Any], images: Sequence[Any]) -> list[Any]:
    groups = result["groups"]
    listing = ", ".join(f"{n} ({len(g['audits'])})" for n, g in groups.items())
    blocks: list[Any] = [Heading(1, "fcaudit reproduction: Dynamic Parameterization Is Not "
                                    "Dynamic Inference"),
                         Para((f"Study preset {result['preset']}; groups (seeds): {listing}.",))]
    blocks += [Heading(2, "Findings at this scale"),
               Table(("paper finding", "here"), tuple((f, v) for f, v in result["findings"]),
                     "ll")]
    for name, g in groups.items():
        paper = PAPER.get(name.split("-")[0], {})
        blocks.append(Heading(2, f"{name}: mean ± sd over seeds"))
        rows = tuple((label, _fmt(g["aggregate"].get(key), digits, pct))
                     for key, label, digits, pct in ROWS if key in g["aggregate"])
        blocks.append(Table(("metric", "ours"), rows, "lr"))
        if paper:
            blocks.append(Bullets(tuple((f"paper, {k}: {v}",) for k, v in paper.items())))
    blocks.append(Heading(2, "Figures"))
    blocks += list(images)
    blocks += [Heading(2, "Rerun"),
               Para(("Every number above comes from these commands; each audit's own report is "
                     "under ", Code("audits/"), ".")),
               CodeBlock(result["command"] or ""),
               Table(("package", "version"), tuple(result["versions"].items()), "ll")]
    return blocks


def reproduce(preset: str, out: str | Path, *, seeds: int | None = None,
              mudd_checkpoint: str | None = None, settings: StudySettings | None = None,
              command: str | None = None) -> dict[str, Any]:
    """Run (or resume) the study and write the aggregated reproduction report."""
    out = Path(out)
    st = settings or StudySettings(AuditOptions())
    groups: dict[str, dict[str, Any]] = {}
    for group in study(preset, seeds):
        audits = run_group(group, out, st)
        groups[group.name] = {"audits": audits,
                              "aggregate": aggregate([metrics_of(a) for a in audits]),
                              "profiles": [next(iter(a["profiles"].values())) for a in audits]}
    if mudd_checkpoint:
        audit_dir = out / "audits" / "muddpythia-checkpoint"
        audit = (read_json(audit_dir / "audit.json", "audit")
                 if (audit_dir / "audit.json").is_file()
                 else run_audit(mudd_checkpoint, audit_dir, max_eval=st.max_eval,
                                max_calib=st.max_calib, options=st.options))
        groups["mudd-checkpoint"] = {"audits": [audit],
                                     "aggregate": aggregate([metrics_of(audit)]),
                                     "profiles": [next(iter(audit["profiles"].values()))]}
    versions = {"fcaudit": __version__, "torch": torch.__version__, "numpy": np.__version__,
                "python": platform.python_version()}
    result = {"schema": SCHEMA, "preset": preset,
              "command": command or shlex.join(["fcaudit", "reproduce", "--preset", preset,
                                                "--out", str(out)]),
              "groups": groups, "findings": findings(groups), "versions": versions}
    images, _ = write_figures(groups, out / "figures", FIGURES)
    blocks = _blocks(result, images)
    summary = {**result, "groups": {n: {"aggregate": g["aggregate"], "seeds": len(g["audits"]),
                                        "per_seed": [metrics_of(a) for a in g["audits"]]}
                                    for n, g in groups.items()}}
    write_json(out / "reproduction.json", summary)
    write_text(out / "reproduction.md", to_markdown(blocks))
    write_text(out / "report.html", to_html("fcaudit reproduction", blocks))
    return summary
