"""The generated blocks of README.md and docs/*.md: one renderer per block, from results.

Each renderer reads only the result files it declares, so docs/results/README.md can say
where every number comes from. Numbers are written with fixed digits here and nowhere
else; the paper's numbers come from ``fcaudit.study.trend`` and ``fcaudit.study.reproduce``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from fcaudit.engine.result import token_id_words
from fcaudit.engine.verdicts import WEAK_RETENTION
from fcaudit.io.fileio import read_json
from fcaudit.study import paper, trend
from fcaudit.study import presets as study_presets
from fcaudit.study.presets import PAPER

DEMO = "docs/results/demo.json"
STUDY = "docs/results/study-tiny.json"
VISION = "docs/results/study-vision.json"
SSM = "docs/results/study-ssm.json"
EXIT = "docs/results/study-exit.json"
FOLD_STUDY = "docs/results/study-fold.json"
TASKS_STUDY = "docs/results/study-tasks.json"
PRESETS = "docs/results/presets.json"
TIMINGS = "src/fcaudit/timings.json"
TREND = "docs/trend/results/*.json"
EXTRACT = "python docs/extract_results.py"
TIMINGS_SCRIPT = "python benchmarks/timings.py"


class Results:
    """The result files under one checkout, each read once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.json = cache(self._json)
        self.points = cache(lambda: trend.read_points(root / "docs" / "trend" / "results"))

    def _json(self, rel: str) -> Any:
        return read_json(self.root / rel, "result file")  # fcaudit's guarded reader

    def has(self, rel: str) -> bool:
        return (self.root / rel).is_file()

    def minutes(self, key: str) -> str:
        """A wall time of timings.json as the README and ``--help`` quote it."""
        return f"{self.json(TIMINGS)[key]:.1f}"


@dataclass(frozen=True)
class Block:
    name: str
    what: str
    sources: tuple[str, ...]
    made_by: tuple[str, ...]
    render: Callable[[Results], str]


BLOCKS: dict[str, Block] = {}


def block(name: str, what: str, sources: Sequence[str],
          made_by: Sequence[str]) -> Callable[[Callable[[Results], str]], Callable]:
    """Register a renderer as block ``name``."""
    def register(fn: Callable[[Results], str]) -> Callable[[Results], str]:
        BLOCKS[name] = Block(name, what, tuple(sources), tuple(made_by), fn)
        return fn
    return register


# ------------------------------------------------------------------------- formatting

def millions(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n < 1e7 else f"{n / 1e6:.1f}M"


def ci(value: float, interval: Sequence[float], digits: int, sign: str = "",
       unit: str = "") -> str:
    """``value<unit> [low, high]``."""
    lo, hi = interval
    return f"{value:{sign}.{digits}f}{unit} [{lo:.{digits}f}, {hi:.{digits}f}]"


def span(stats: Mapping[str, Any], digits: int, scale: float = 1.0, unit: str = "",
         sign: str = "") -> str:
    """A mean over seeds with the seed range: ``mean (min to max)``."""
    m, lo, hi = (stats[k] * scale for k in ("mean", "min", "max"))
    return f"{m:{sign}.{digits}f}{unit} ({lo:.{digits}f} to {hi:.{digits}f})"


def paper_retention() -> str:
    return " / ".join(f"{v:.2f}%" for v in paper.RETENTION.values())


def paper_eta2() -> str:
    lo, hi = paper.ETA2_LAYER
    return f"{lo:.0f}% to {hi:.0f}%"


def provenance(data: Mapping[str, Any]) -> str:
    dirty = " plus uncommitted changes" if data["src_dirty"] else ""
    return f"fcaudit's code at commit {data['commit']}{dirty}, {data['date']}"


def load_note(host: Mapping[str, Any] | None) -> str:
    threads = host.get("torch_threads") if host else None
    return f"{threads} torch threads" if threads else "torch's default threads"


# ------------------------------------------------------------------------- times

def timed(r: Results, key: str) -> str:
    """A time of timings.json with the machine and load it was measured at."""
    t = r.json(TIMINGS)
    load, host = t["load_average"][key], t.get("host", {}).get(key)
    where = (f"{host['cores']} cores ({host['cpu']}) at {host['threads']} torch "
             f"thread{'s' if host['threads'] != 1 else ''}" if host else
             "2 cores, threads not recorded")
    return (f"{r.minutes(key)} minutes on {where}, load average {load['before'][0]:.2f} "
            f"before and {load['after'][0]:.2f} after")


def _minutes_block(key: str, what: str) -> None:
    @block(f"time-{key}", f"wall time of {what}, with its machine, threads and load",
           [TIMINGS], [TIMINGS_SCRIPT])
    def render(r: Results) -> str:
        return f"about {timed(r, key)}"


_minutes_block("demo", "the demo")
_minutes_block("demo_train", "the demo with --train")
_minutes_block("tests", "the tests")


def featuregate_presets(r: Results) -> list[tuple[str, Mapping[str, Any]]]:
    """FeatureGate's presets, smallest first."""
    fg = r.json(PRESETS)["presets"]["featuregate"]
    return sorted(fg.items(), key=lambda item: item[1]["n_params"])


@block("presets", "parameter counts of the FeatureGate presets", [PRESETS], [f"{EXTRACT} presets"])
def presets_inline(r: Results) -> str:
    first, *rest = featuregate_presets(r)
    return f"`{first[0]}` ({millions(first[1]['n_params'])} parameters), " + \
        ", ".join(f"`{size}` ({millions(p['n_params'])})" for size, p in rest)


@block("presets-shapes", "FeatureGate presets: parameters, layers, width, vocabulary",
       [PRESETS], [f"{EXTRACT} presets"])
def presets_shapes(r: Results) -> str:
    return ", ".join(f"`{size}` ({millions(p['n_params'])}: {p['n_layer']} x {p['n_embd']}, "
                     f"vocab {p['vocab_size']:,})" for size, p in featuregate_presets(r))


# ------------------------------------------------------------------------- demo

def nats(delta: float, interval: Sequence[float]) -> str:
    """A penalty as ``fcaudit demo`` prints it: ``+0.1147 [+0.1038, +0.1259]``."""
    return f"{delta:+.4f} [{interval[0]:+.4f}, {interval[1]:+.4f}]"


def kept(stats: Mapping[str, Any]) -> str:
    """A retention as ``fcaudit demo`` prints it: ``72.24% [68.55, 75.85]``."""
    return f"{stats['value']:.2f}% [{stats['ci95'][0]:.2f}, {stats['ci95'][1]:.2f}]"


def _demo_table(d: Mapping[str, Any]) -> str:
    """The demo's findings, every number at the digits ``fcaudit demo`` prints it with
    (tests/test_readme.py finds each one in the demo's own output)."""
    a, run = d["audit"], d["run"]
    v, eta, ex = a["variation"], a["eta2"], a["execution"]
    r, s = a["conditions"]["reassign"], a["conditions"]["shuffle"]
    exact = "bitwise exact" if a["identity_max_abs_diff"] == 0 else \
        f"NOT exact (max difference {a['identity_max_abs_diff']:g})"
    t = ex["timing"]
    return "\n".join([
        f"| question | answer for tiny FeatureGate ({a['layers']} layers, "
        f"{millions(a['n_params'])} parameters, eval NLL {run['eval_nll']:.4f} vs unigram "
        f"{run['unigram_nll']:.4f}) |", "|---|---|",
        f"| variation | gates vary: sd across inputs {v['mean_sd_across_inputs']:.3g}, across "
        f"positions {v['mean_sd_across_positions']:.3g}, across layers "
        f"{v['across_layer_sd']:.3g}; layer identity explains {100 * eta['layer']:.1f}% of "
        f"their variance, input and token content {100 * eta['residual']:.1f}%; within a layer "
        f"the current token id {_token_words(eta)} |",
        f"| dependence | reassigning gates across inputs costs {nats(r['delta'], r['ci95'])} "
        f"nats, shuffling them across tokens {nats(s['delta'], s['ci95'])}; a static per-layer "
        f"profile keeps {kept(a['retention_static_layer'])} of the Correct-to-GlobalMean gap, "
        f"a static profile per (layer, token id) {kept(a['retention_static_layer_token'])}; "
        f"identity replay is {exact} |",
        f"| execution | {ex['blocks_executed']:.2f} of {ex['blocks_present']} blocks run per "
        f"token, FLOPs {ex['flops_ratio']:.3f}x Dense, latency "
        f"{ci(ex['speed_ratio_vs_dense'], t['ci95'], 2, unit='x Dense')}: "
        f"{'conditional' if ex['conditional_execution'] else 'no conditional'} execution |"])


@block("demo", "the demo's findings and how its one latency was timed",
       [DEMO, TIMINGS], [f"{EXTRACT} demo fcaudit-demo", f"{TIMINGS_SCRIPT} --demo",
                         "python -m fcaudit.study.demo"])
def demo(r: Results) -> str:
    d = r.json(DEMO)
    a, t, run = d["audit"], d["audit"]["execution"]["timing"], d["run"]
    ret = a["retention_static_layer"]["value"]
    uses = "still uses its gates' content" if ret < 90 else \
        "like them, keeps most of the gap with a static profile"
    return "\n".join([
        "", "`fcaudit demo` audits the tiny FeatureGate and its Dense twin shipped inside "
        f"fcaudit (seed 0, {run['steps']} steps, trained by `python -m fcaudit.study.demo` on "
        f"{run['cpu']} at {run['torch_threads']} torch thread"
        f"{'s' if run['torch_threads'] != 1 else ''}; every file's SHA-256 is pinned in "
        "`fcaudit/io/demo_pins.py` and checked before use). Its numbers, from "
        f"`fcaudit-demo/audit/audit.json` ({provenance(d)}, copied to `docs/results/demo.json`):",
        "", _demo_table(d), "",
        "Every number above but the latency is what `fcaudit demo` prints, digit for digit, on "
        "any CPU at any torch thread count (`tests/test_readme.py` reruns the audit and checks "
        f"it; this one ran on {a['host']['cpu']} at {a['host']['torch_threads']} torch "
        f"thread{'s' if a['host']['torch_threads'] != 1 else ''}). The latency ratio is "
        f"machine-dependent: Dense and FeatureGate timed in {t['pairs']} interleaved pairs of a "
        f"batch of {t['batch_size']}; it moves from run to run (the study below gives its range "
        f"over seeds). That demo took {timed(r, 'demo')} (`benchmarks/timings.py`). "
        f"`fcaudit demo --train` trains the pair afresh first ({timed(r, 'demo_train')}): "
        "training rounds as the CPU's kernels do and sums in an order the thread count sets, so "
        "another CPU or thread count trains a slightly different model, whose numbers differ "
        "from these. Unlike the paper's 76M/504M FeatureGates "
        f"({' and '.join(f'{v:.2f}%' for v in paper.RETENTION.values())} kept), the tiny "
        f"model {uses}; {token_sentence(a)}: fcaudit reports what it measures.", ""])


def _token_words(eta: Mapping[str, Any]) -> str:
    """The demo's token-id share as ``fcaudit demo`` prints it: beyond chance first, the
    share and its chance level beside it."""
    return token_id_words(eta["token_id"], eta.get("token_id_chance"),
                          eta.get("token_id_beyond_chance"))


def token_sentence(a: Mapping[str, Any]) -> str:
    """What the per-token-id profile adds to the per-layer one, from the two retentions."""
    layer, tok = a["retention_static_layer"], a["retention_static_layer_token"]
    if tok["ci95"][0] > layer["ci95"][1]:
        return (f"a profile per token id keeps more ({tok['value']:.2f}% against "
                f"{layer['value']:.2f}%), so most of what its gates carry is the current "
                "token's identity, not its context")
    return (f"a profile per token id keeps no more ({tok['value']:.2f}% against "
            f"{layer['value']:.2f}%): its gates carry context beyond the current token")


# ------------------------------------------------------------------------- the tiny study

def finding(findings: Sequence[Sequence[str]], prefix: str) -> str:
    """What the study says about the finding starting with ``prefix``."""
    for claim, here in findings:
        if claim.startswith(prefix):
            return here
    raise KeyError(f"{STUDY} has no finding starting {prefix!r}; rerun the study")


def verdict(findings: Sequence[Sequence[str]], prefix: str) -> str:
    """The study's own word on a finding: holds / does not hold."""
    return finding(findings, prefix).split(":", 1)[0]


def _blocks(g: Mapping[str, Any]) -> str:
    present = g["seed0"]["execution"]["blocks_present"]
    return f"{g['aggregate']['blocks_executed_fraction']['mean'] * present:.2f} of {present} blocks"


def _study_rows(s: Mapping[str, Any]) -> list[str]:
    g, f = s["groups"], s["findings"]
    fg, mudd, moe = (g[f"{a}-tiny"]["aggregate"] for a in ("featuregate", "mudd", "moe"))
    x = g["moe-tiny"]["seed0"]["experts"]
    share = x["active_expert_flops_per_token"] / x["all_expert_flops_per_token"]
    mudd_paper = paper.MUDD
    rows = [
        ("FeatureGate: a static per-layer profile keeps almost all of the gap "
         f"({paper_retention()})", "FeatureGate: a static per-layer",
         span(fg["retention_static_layer"], 1, unit="%")),
        (f"FeatureGate: layer identity explains {paper_eta2()} of coefficient variance",
         "FeatureGate: layer identity", span(fg["eta2_layer"], 1, 100, "%")),
        ("FeatureGate runs every block", "FeatureGate runs every block",
         _blocks(g["featuregate-tiny"])),
        (f"FeatureGate is slower than Dense ({paper_slowdown()})", "FeatureGate is slower",
         f"latency {span(fg['speed_ratio'], 3, unit='x')}"),
        ("MUDD: reassignment and shuffling raise NLL strongly (+"
         f"{mudd_paper['delta_reassign']:.2f} / +{mudd_paper['delta_shuffle']:.2f} nats at 1.4B)",
         "MUDD: reassignment", f"{mean3(mudd, 'delta_reassign')} and "
         f"{mean3(mudd, 'delta_shuffle')} nats"),
        ("MUDD depends on the assignment more than FeatureGate", "The contrast",
         f"{mean3(mudd, 'delta_reassign')} vs {mean3(fg, 'delta_reassign')} nats, seed "
         "ranges " + ("apart" if "ranges apart" in finding(f, "The contrast") else "overlap")),
        ("MUDD runs every block", "MUDD runs every block",
         f"{_blocks(g['mudd-tiny'])}, FLOPs {mudd['flops_ratio']['mean']:.2f}x, latency "
         f"{mudd['speed_ratio']['mean']:.2f}x"),
        ("(routing, named by the paper but not measured there) MoE routing changes what is "
         "computed", "MoE (hard routing)",
         f"{moe['experts_executed_fraction']['mean'] * x['num_experts_per_layer'][0]:.2f} of "
         f"{x['num_experts_per_layer'][0]} experts run per token and layer, "
         f"{100 * share:.0f}% of the expert FLOPs"),
        ("the frozen MoE depends on its routing staying matched to the input", "MoE: the frozen",
         f"reassigning router logits re-routes {100 * moe['rerouted_reassign']['mean']:.1f}% of "
         "the (token, layer) expert sets and costs "
         f"{span(moe['delta_reassign'], 2, sign='+')} nats; a static per-layer profile keeps "
         f"{span(moe['retention_static_layer'], 1, unit='%')} of the gap"),
    ]
    return [f"| {claim} | {verdict(f, prefix)}: {here} |" for claim, prefix, here in rows] + \
        [_token_row(label, g[f"{arch}-tiny"]["aggregate"]) for arch, label in
         (("featuregate", "FeatureGate"), ("mudd", "MUDD"), ("moe", "MoE"))
         if f"{arch}-tiny" in g] + \
        [_frontier_row(label, g[f"{arch}-tiny"]["aggregate"]) for arch, label in
         (("featuregate", "FeatureGate"), ("moe", "MoE"))
         if f"{arch}-tiny" in g
         and (g[f"{arch}-tiny"]["aggregate"].get("frontier_gap_25") or {}).get("n")] + \
        ([_skip_check_row(g["skipgate-tiny"]["aggregate"])]
         if "frontier_on_curve" in g.get("skipgate-tiny", {}).get("aggregate", {}) else [])


def _skip_check_row(agg: Mapping[str, Any]) -> str:
    """The frontier's check on the model that really skips: the dynamic rule at SkipGate's
    own thresholds must reproduce its pass at the FLOPs it measurably saves."""
    on = agg["frontier_on_curve"]["min"] == 1
    return (f"| (not in the paper) SkipGate: does the frontier's accounting match a model "
            f"that really skips? | {'holds' if on else 'does NOT hold'}: the dynamic rule at "
            f"its own thresholds costs {span(agg['frontier_own_delta'], 4, sign='+')} nats at "
            f"{100 * agg['frontier_own_flops_saved']['mean']:.1f}% of the FLOPs saved by the "
            f"frontier's count, {100 * agg['frontier_measured_flops_saved']['mean']:.1f}% "
            "measured against Dense |")


def _frontier_row(label: str, agg: Mapping[str, Any]) -> str:
    """Beyond the paper: would an input-independent rule save as much compute? The gap is
    the best static rule's NLL penalty minus the dynamic rule's at 25% of FLOPs saved."""
    gap = agg["frontier_gap_25"]
    word = ("the dynamic rule is cheaper in NLL in every seed" if gap["min"] > 0 else
            "a static rule does at least as well in every seed" if gap["max"] <= 0 else
            "the seeds disagree")
    return (f"| (not in the paper) {label}: would a static rule skip 25% of the FLOPs as "
            f"cheaply as the controller? | {word}: best static minus dynamic penalty "
            f"{span(gap, 4, sign='+')} nats (`--frontier`) |")


def _token_row(label: str, agg: Mapping[str, Any]) -> str:
    """Beyond the paper: is the controller's output a function of the current token id?
    (Hash Layers, Mixtral's routing analysis.) The word follows the seed range."""
    tok, layer, share, chance, beyond = (agg.get(k) for k in (
        "retention_static_layer_token", "retention_static_layer", "eta2_token_id",
        "eta2_token_id_chance", "epsilon2_token_id"))
    if tok is None or share is None:
        return f"| (not in the paper) {label}: a static profile per (layer, token id) | undefined |"
    weak = WEAK_RETENTION  # the verdicts' "keeps most of the gap" line
    word = (f"mostly the token id: a profile per token id keeps at least {weak:g}% in every "
            "seed" if tok["min"] >= weak else "context beyond the token id: a profile per "
            f"token id keeps less than {weak:g}% in some seed")
    explains = (f"{span(beyond, 1, 100, '%')} of the within-layer variance beyond chance "
                f"({span(share, 1, 100, '%')} against a chance level of "
                f"{span(chance, 1, 100, '%')})" if beyond and beyond.get("mean") is not None
                else f"{span(share, 1, 100, '%')} of the within-layer variance (eta squared; "
                "these results predate its chance level)")
    return (f"| (not in the paper) {label}: is it the token or the context? | {word}; "
            f"static-layer-token keeps {span(tok, 1, unit='%')} (static-layer "
            f"{span(layer, 1, unit='%')}), the token id explains {explains} |")


def mean3(stats: Mapping[str, Any], key: str) -> str:
    """A penalty's mean over seeds, signed, three digits."""
    return f"{stats[key]['mean']:+.3f}"


def paper_slowdown() -> str:
    """The paper's FeatureGate slowdown against Dense, in percent (from its time ratio)."""
    ratio = float(PAPER["featuregate"]["speed_ratio"].split()[0])
    return f"{100 * (ratio - 1):.1f}%"


@block("study-tiny", "the tiny study's findings (mean and seed range)",
       [STUDY, DEMO, TIMINGS], [f"{EXTRACT} study study-tiny",
                                "fcaudit reproduce --preset tiny --seeds 3 --out study-tiny"])
def study_tiny(r: Results) -> str:
    s = r.json(STUDY)
    g = s["groups"]
    seeds, sg = g["featuregate-tiny"]["seeds"], g["skipgate-tiny"]
    x = g["moe-tiny"]["seed0"]["experts"]
    sga, moe = sg["aggregate"], g["moe-tiny"]["aggregate"]
    threads, cpu = s["host"]["torch_threads"], s["host"]["cpu"]
    demo_run = r.json(DEMO)["run"]  # where the shipped demo model was trained
    same_as_demo = "its seed 0 is the demo's model above" if \
        (demo_run["cpu"], demo_run["torch_threads"]) == (cpu, threads) else \
        "its seed 0 against the demo above, trained on another CPU or thread count"
    return "\n".join([
        "", f"`OMP_NUM_THREADS={threads} fcaudit reproduce --preset tiny --seeds {seeds}` "
        f"({seeds} seeds each of tiny "
        f"FeatureGate with its Dense twin, tiny MUDD and a tiny top-{x['top_k_per_layer'][0]}-of-"
        f"{x['num_experts_per_layer'][0]} MoE, {sg['seeds']} seed of SkipGate; "
        f"{r.minutes('reproduce_tiny')} minutes on 2 cores as `benchmarks/timings.py` timed it) "
        "writes `reproduction.md` with our numbers beside the paper's. From its findings table "
        f"(one run, {provenance(s)}, copied to `docs/results/study-tiny.json`; latencies are "
        "medians of interleaved pairs on a 2-core CPU shared with other jobs). It ran on "
        f"{cpu} at {threads} torch thread{'s' if threads != 1 else ''}; on another CPU model "
        "or at another thread count each seed trains to a slightly different model, so the "
        f"numbers differ ({same_as_demo}).", "",
        f"| paper finding | here (mean over {seeds} seeds, seed range in parentheses) |",
        "|---|---|", *_study_rows(s), "",
        f"SkipGate, the reference with real savings (seed 0), runs {_blocks(sg)} per token at "
        f"{sga['flops_ratio']['mean']:.2f}x Dense FLOPs and {sga['speed_ratio']['mean']:.2f}x "
        "Dense latency: the execution audit does detect savings when they exist. The MoE's "
        f"blocks cost what Dense's do (FLOPs {moe['flops_ratio']['mean']:.3f}x, its expert "
        f"width chosen so), and it runs {moe['speed_ratio']['mean']:.2f}x Dense's time on a "
        f"CPU ({x['num_experts_per_layer'][0]} small expert matmuls per layer): routing saves "
        "only against running every expert.", "",
        f"These are tiny models trained for {s['steps']} steps: the paper's 76M/504M FeatureGate "
        "findings need `--preset paper` on a GPU, with a corpus larger than Shakespeare's "
        f"{millions(r.points()[0]['corpus_tokens'])} training tokens (`fcaudit reproduce "
        "--preset paper --train-data my_corpus/`).", ""])


# ------------------------------------------------------------------------- the trend

TREND_KEYS = (("retention_static_layer", "static-layer retention (%)"),
              ("eta2_layer", "eta2 layer (%)"),
              ("delta_reassign", "reassign (nats)"), ("delta_shuffle", "shuffle (nats)"))


def _trend_row(p: Mapping[str, Any]) -> str:
    m = p["models"]["featuregate"]["mean"]
    cells = []
    for key, _ in TREND_KEYS:
        metric = trend.METRICS[key]
        cells.append(f"{metric.number(m[key]['mean'])} [{metric.number(m[key]['min'])}, "
                     f"{metric.number(m[key]['max'])}]")
    return (f"| {p['point']} | {millions(p['n_params'])} | {millions(p['training_tokens'])} | "
            + " | ".join(cells) + " |")


def _mudd_sentence(points: Sequence[Mapping[str, Any]]) -> str:
    at = [(p["steps"], p["models"]["mudd"]["mean"]["delta_reassign"]["mean"])
          for p in points if "mudd" in p["models"]]
    pays = " and ".join(f"{v:.3f} nats ({steps} steps)" for steps, v in at)
    return f"MUDD, the contrast, pays {pays} for reassignment."


@block("trend", "the trend study: its points, table and what it shows",
       [TREND, TIMINGS], ["fcaudit reproduce --preset trend --out study-trend "
                          "(copy study-trend/points/*.json to docs/trend/results/)"])
def trend_block(r: Results) -> str:
    points = r.points()
    sizes = list(dict.fromkeys((p["size"], p["n_params"]) for p in points))
    steps = {size: [p["steps"] for p in points if p["size"] == size] for size, _ in sizes}
    ladder = ", ".join(f"{size} ({millions(n)}) for "
                       f"{' and '.join(map(str, steps[size]))} steps" for size, n in sizes)
    seeds = {len(p["models"]["featuregate"]["seeds"]) for p in points}
    walls = ", ".join(f"{p['point']} {p['wall_s'] / 60:.0f}" for p in points)
    head = "| point | parameters | training tokens | " + \
        " | ".join(label for _, label in TREND_KEYS) + " |"
    paper = f"| paper | 76M / 504M | | {paper_retention()} | {paper_eta2()} | | |"
    return "\n".join([
        "", "`fcaudit reproduce --preset trend --out study-trend` asks whether the gap to the "
        "paper is about model size, training length or the method. It trains FeatureGate with "
        f"its Dense twin at {ladder}, {'/'.join(map(str, sorted(seeds)))} seeds each, all with "
        f"tiny's batch shape ({points[0]['batch_size'] * points[0]['seq_len']:,} tokens a step), "
        "with MUDD as the contrast at the tiny points, and audits every FeatureGate and MUDD "
        f"model (about {r.minutes('reproduce_trend')} minutes on 2 cores; an interrupted study "
        "resumes). Each finished point leaves a small summary, "
        "`study-trend/points/<point>.json`; the copies committed under `docs/trend/results/` "
        "give [docs/trend/trend.md](docs/trend/trend.md) (every point in a table, the figure, "
        "and what the trend shows and cannot show) with `python docs/trend/make_trend.py`.", "",
        f"Minutes of training and auditing per point, on 2 cores: {walls}. FeatureGate, mean "
        "over seeds [seed range]:", "", head, "|---|---:|---:|---:|---:|---:|---:|",
        *(_trend_row(p) for p in points), paper, "",
        trend.shows(points)[0], "", _mudd_sentence(points) + " What the trend cannot show "
        "(seeds, scale, one corpus, learning rate and vocabulary changing with size) is in "
        "[docs/trend/trend.md](docs/trend/trend.md).", ""])


# ------------------------------------------------------------------------- benchmarks

def bench(name: str) -> str:
    return f"docs/results/{name}.json"


def measured(data: Mapping[str, Any]) -> str:
    """How a benchmark's numbers were taken, from its result file."""
    m = data["machine"]
    command = " ".join([f"python {data['script']}", *data["argv"]]).strip()
    if data.get("carried_over"):
        return (f"Carried over, not re-measured here: {data['carried_over']}. Taken then by "
                f"`{command}` on {m['cpu']}, {m['cores']} cores, {m['threads']} torch threads, "
                f"torch {m['torch']}.")
    loads = [", ".join(f"{x:.2f}" for x in v)
             for v in (m["load_average"], data["load_average_after"])]
    dirty = " plus uncommitted changes" if data["dirty"] else ""
    return (f"Measured by `{command}` at commit {data['commit']}{dirty} on {data['date']}: "
            f"{m['cpu']}, {m['cores']} cores, {m['threads']} torch threads, torch {m['torch']}; "
            f"load average {loads[0]} before and {loads[1]} after.")


def median_range(values: Sequence[float] | Mapping[str, float], digits: int = 3) -> str:
    """Per-round ratios as ``median [min-max]`` (a carried-over file holds the three)."""
    if isinstance(values, Mapping):
        mid, lo, hi = values["median"], values["min"], values["max"]
    else:
        mid, lo, hi = statistics.median(values), min(values), max(values)
    return f"{mid:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


def low_high(values: Sequence[float], digits: int = 3) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.{digits}f}" if f"{lo:.{digits}f}" == f"{hi:.{digits}f}" else \
        f"{lo:.{digits}f}-{hi:.{digits}f}"


def md_table(head: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> str:
    sep = "|" + "|".join("---:" if a == "r" else "---" for a in align.ljust(len(head), "l"))
    return "\n".join(["| " + " | ".join(head) + " |", sep + "|",
                      *("| " + " | ".join(r) + " |" for r in rows)])


def seed_counts(v: Mapping[str, Any]) -> str:
    """The seed counts of a study's groups, e.g. "3" or "1/3"."""
    return "/".join(map(str, sorted({g["seeds"] for g in v["groups"].values()})))


def study_command(v: Mapping[str, Any], per: str) -> str:
    """The opening of a study's prose: its command, commit, date and seeds."""
    return (f"`{v['command'].split(' --out')[0]}` (fcaudit's code at commit {v['commit']}, "
            f"{v['date']}; {seed_counts(v)} seeds per {per}")


def own_table(v: Mapping[str, Any], columns: Sequence[str], align: str, prose: str) -> str:
    """A study that writes its own table cells (vision, ssm): its prose, the table copied
    as it is (``align`` for every column after the first two) and its findings."""
    return "\n".join([
        "", prose, "",
        md_table(columns, [[row[c] for c in columns] for row in v["table"]],
                 "lr" + align * (len(columns) - 2)), "",
        md_table(("finding", "here"), [(f, h) for f, h in v["findings"]]), ""])


VISION_COLUMNS = ("family", "seeds", "accuracy (twin)", "reassign", "shuffle",
                  "static-layer retention", "static-layer-position retention", "executed",
                  "FLOPs vs twin", "latency vs twin")


@block("study-vision", "the vision study's table and findings (sklearn digits)",
       [VISION], [f"{EXTRACT} vision study-vision",
                  "fcaudit reproduce --preset vision --seeds 3 --out study-vision"])
def study_vision(r: Results) -> str:
    """The study writes its own table cells from its aggregates; they are copied as they are."""
    v = r.json(VISION)
    return own_table(v, VISION_COLUMNS, "r", (
        study_command(v, "family") + ", each with its dense twin; "
        "penalties in nats of cross-entropy with the span of the seeds' 95% "
        "intervals; latencies are medians of interleaved pairs on a 2-core CPU shared with "
        f"other jobs; run on {v['host']['cpu']} at {v['host']['torch_threads']} torch "
        "threads, and, as for the tiny study, another CPU model or thread count trains "
        "slightly different models; copied to `docs/results/study-vision.json`):"))


SSM_STUDY_COLUMNS = ("task", "seeds", "Mamba (LTI twin)", "reassign", "shuffle",
                     "static-layer retention", "static-layer-position retention",
                     "static-layer-token retention", "token-id share of Δ", "execution")


@block("study-ssm", "the selective state-space study's table and findings (Mamba vs S4D)",
       [SSM], [f"{EXTRACT} ssm study-ssm",
               "fcaudit reproduce --preset ssm --seeds 3 --out study-ssm"])
def study_ssm(r: Results) -> str:
    """The study writes its own table cells from its aggregates; they are copied as they are."""
    v = r.json(SSM)
    return own_table(v, SSM_STUDY_COLUMNS, "l", (
        study_command(v, "task") + ", each with its LTI twin trained alongside; "
        "penalties in the task's loss (nats per token on the corpus, "
        "per answer token on selective copying) with the span of the seeds' 95% intervals; "
        f"latencies are medians of interleaved pairs on a 2-core CPU shared with other jobs; "
        f"run on {v['host']['cpu']} at {v['host']['torch_threads']} torch thread(s); "
        f"{v['timed_s'] / 60:.1f} minutes of training and auditing as its timings.json "
        f"recorded; copied to `docs/results/study-ssm.json`{_raw_token_note(v)}):"))


def _raw_token_note(v: Mapping[str, Any]) -> str:
    """For a study table whose token-id cells predate their chance level: say so."""
    cells = [row["token-id share of Δ"] for row in v["table"]]
    return "" if all("chance" in c or c == "n/a" for c in cells) else (
        "; its token-id shares are eta squared, not corrected for chance: the study "
        "predates the chance level")


@block("study-exit", "the early-exit study's table and findings (exit LM, ponder, digits)",
       [EXIT], [f"{EXTRACT} exit study-exit",
                "fcaudit reproduce --preset exit --seeds 3 --out study-exit"])
def study_exit(r: Results) -> str:
    """The study writes its own table cells from its aggregates; they are copied as they are."""
    v = r.json(EXIT)
    return _study_table(v, "exit", study_command(v, "family") + ", each with its full-depth "
                        "twin trained alongside; penalties in the task's loss (nats per token "
                        "for the LMs, per image for the digits) against the learned exit rule, "
                        "with the span of the seeds' 95% intervals", EXIT)


def _study_table(v: Mapping[str, Any], preset: str, opening: str, file: str,
                 untimed: str = "") -> str:
    """A study preset's own table (its declared columns) after its prose: the opening,
    then how its latencies and wall time were taken and where the numbers were copied."""
    return own_table(v, [head for head, _ in study_presets.PRESETS[preset].columns], "l", (
        opening + "; latencies are medians of interleaved pairs on a 2-core CPU; "
        f"run on {v['host']['cpu']} at {v['host']['torch_threads']} torch thread(s); "
        f"{v['timed_s'] / 60:.1f} minutes of training and auditing as its timings.json "
        f"recorded{untimed}; copied to `{file}`):"))


@block("study-fold", "the fold study's table and findings (fcaudit fold on each family)",
       [FOLD_STUDY], [f"{EXTRACT} fold study-fold",
                      "fcaudit reproduce --preset fold --seeds 3 --out study-fold"])
def study_fold(r: Results) -> str:
    """The study writes its own table cells from its aggregates; they are copied as they are."""
    v = r.json(FOLD_STUDY)
    return _study_table(v, "fold", study_command(v, "family") + "; penalties in the task's "
                        "loss (nats per token on the corpus, per answer token on selective "
                        "copying), with the span of the seeds' 95% intervals", FOLD_STUDY,
                        " (folding and healing not included)")


@block("study-tasks", "the benchmark-task study's table and findings (NLL retention against "
       "task retention)", [TASKS_STUDY], [f"{EXTRACT} tasks study-tasks",
                                          "fcaudit reproduce --preset tasks --seeds 3 --out "
                                          "study-tasks"])
def study_tasks(r: Results) -> str:
    """The study writes its own table cells from its aggregates; they are copied as they are."""
    v = r.json(TASKS_STUDY)
    return own_table(v, [head for head, _ in study_presets.PRESETS["tasks"].columns], "l", (
        study_command(v, "family") + "; the tasks are passages of the evaluation plays "
        "(`fcaudit.study.lm_tasks`), scored by lm-evaluation-harness under each condition; "
        f"run on {v['host']['cpu']} at {v['host']['torch_threads']} torch thread(s); "
        f"{v['timed_s'] / 60:.1f} minutes of training and auditing (the tasks included) as "
        f"its timings.json recorded; copied to `{TASKS_STUDY}`):"))


NLL_TARGET = 1.03  # issue 13's goal for new / forward on tiny


@block("nll-cost", "per-token NLL cost over a plain forward", [bench("nll_cost"), PRESETS],
       ["python benchmarks/nll_cost.py --rounds 21 --seconds 0.2"])
def nll_cost(r: Results) -> str:
    d = r.json(bench("nll_cost"))
    res = d["results"]
    rows = [(row["preset"], "x".join(map(str, row["shape"])), f"{row['forward_ms']:.1f}",
             *(median_range(row[f"{m}_over_forward"]) for m in ("old", "new", "floor")),
             f"{row['max_abs_new_minus_old']:.1e}") for row in res["rows"]]
    table = md_table(("preset", "shape", "forward ms", "old / forward", "new / forward",
                      "floor / forward", "max abs(new - old)"), rows)
    tiny = next(row for row in res["rows"] if row["preset"] == "tiny")
    shape = r.json(PRESETS)["presets"]["featuregate"]["tiny"]
    target_met = statistics.median(tiny["new_over_forward"]) <= NLL_TARGET
    return "\n".join([
        "", f"{measured(d)} {res['rounds']} rounds of about {res['seconds']} s per mode:", "",
        table, "",
        *(f"* **{row['preset']}**: new {median_range(row['new_over_forward'])} over a plain "
          f"forward (old {median_range(row['old_over_forward'])}), floor "
          f"{median_range(row['floor_over_forward'])}." for row in res["rows"]),
        f"* The issue's target of {NLL_TARGET} on tiny is "
        f"{'met' if target_met else 'not met'} in this run. Tiny's vocabulary is "
        f"{shape['vocab_size'] // shape['n_embd']} times its width, so scoring the logits is "
        "a large share of its forward, and a log-softmax costs one `exp` per logit with "
        "PyTorch's kernels (the floor). Going below the floor would take a fused one-pass "
        "log-sum-exp kernel (e.g. compiled), which a preset this small does not justify.", ""])


MEMORY_GOAL = 5.0  # percent: issue 13's bound on the peak's growth from N to 16N


@block("memory", "an audit's peak RSS and cache size against the evaluation set size",
       [bench("memory")], ["python benchmarks/memory.py"])
def memory(r: Results) -> str:
    d = r.json(bench("memory"))
    res = d["results"]
    rows, first = res["rows"], res["rows"][0]
    table = md_table(
        ("eval sequences", "peak RSS MB", "RSS / first", "cache MB", "cache / first",
         "sequences / first", "cache bytes per sequence", "wall s"),
        [(str(x["eval_sequences"]), f"{x['peak_rss_bytes'] / 2**20:.1f}",
          f"{x['peak_rss_bytes'] / first['peak_rss_bytes']:.3f}",
          f"{x['cache_bytes'] / 2**20:.2f}", f"{x['cache_bytes'] / first['cache_bytes']:.2f}",
          f"{x['eval_sequences'] / first['eval_sequences']:.2f}",
          f"{x['growing_cache_bytes'] / x['eval_sequences']:.0f}", f"{x['wall_s']:.0f}")
         for x in rows])
    last = rows[-1]
    growth = 100 * (last["peak_rss_bytes"] / first["peak_rss_bytes"] - 1)
    per_seq = sorted({round(x["growing_cache_bytes"] / x["eval_sequences"]) for x in rows})
    trained = f", training included ({res['train_s']:.0f} s)" if res["train_s"] else ""
    return "\n".join([
        "", f"{measured(d)} Each row is `{res['command']}`{trained}:", "", table, "",
        f"Peak RSS moves by {growth:+.1f}% from {first['eval_sequences']} to "
        f"{last['eval_sequences']} sequences (goal: within {MEMORY_GOAL:.0f}%), and the cache "
        "grows linearly: "
        + (f"{per_seq[0]} bytes per evaluation sequence in every row" if len(per_seq) == 1
           else f"{per_seq[0]} to {per_seq[-1]} bytes per evaluation sequence")
        + f". The cache's ratio at {last['eval_sequences'] / first['eval_sequences']:.0f}N is "
        f"{last['cache_bytes'] / first['cache_bytes']:.1f} rather than "
        f"{last['eval_sequences'] / first['eval_sequences']:.0f} because the calibration shards "
        "do not grow with N.", ""])


PEER_COLUMNS = ("record / forward", "replay / forward", "gates", "logits", "feeds")


@block("peers", "record and replay against forward hooks, nnsight and pyvene",
       [bench("peers"), bench("peers-1thread")],
       ["python benchmarks/peers.py --rounds 9",
        "python benchmarks/peers.py --threads 1 --rounds 9 --json docs/results/peers-1thread.json"])
def peers(r: Results) -> str:
    parts = [""]
    checks = []
    for name in ("peers", "peers-1thread"):
        d = r.json(bench(name))
        res = d["results"]
        parts += [f"{measured(d)} Batch {res['batch']} x {res['seq_len']} tokens, "
                  f"{res['rounds']} rounds:", ""]
        for t in res["presets"]:
            load = ", ".join(f"{x:.2f}" for x in t["load_average"])
            parts += [md_table((f"{t['preset']} (load {load})", *PEER_COLUMNS),
                               [(row["tool"], *(row[c] for c in PEER_COLUMNS))
                                for row in t["rows"]]), ""]
            parts += [f"* {note}" for note in t["skipped"]]
            checks += [row for row in t["rows"] if row["gates"]]
    same = all(row["gates"] == row["logits"] == "same" and row["feeds"] == "yes"
               for row in checks)
    parts += [("Every tool recorded the same gate tensors bit for bit, every replay "
               "reproduced the logits bit for bit, and every replay of zeros changed them."
               if same else "NOT every tool passed every check: see the tables."), ""]
    return "\n".join(parts)


SCHEDULE_TARGET = 0.6  # issue 13's goal: a 24-layer model's audit / its forward passes


@block("audit-schedule", "a whole audit against its forward passes, naive and prefix reuse",
       [bench("audit_schedule")], ["python benchmarks/audit_schedule.py"])
def audit_schedule(r: Results) -> str:
    d = r.json(bench("audit_schedule"))
    res = d["results"]
    rows = [(m["model"], str(m["replays"]), low_high(m["naive"]), low_high(m["prefix"]),
             low_high(m["prefix_over_naive"]), *_schedule_account(m),
             "yes" if m["equal"] else "NO") for m in res["models"]]
    deep = max(res["models"], key=lambda m: m["per_layer_runs"])
    passes, per_layer = 1 + deep["replays"], deep["per_layer_runs"]
    met = max(deep["prefix"]) <= SCHEDULE_TARGET
    return "\n".join([
        "", f"{measured(d)} {res['eval']} evaluation and {res['calib']} calibration sequences, "
        f"batch {res['batch']}, {res['rounds']} rounds, min-max over rounds:", "",
        md_table(("model", "replays", "naive audit / (1 + replays) forwards",
                  "prefix audit / (1 + replays) forwards", "prefix / naive",
                  "ideal prefix / naive", "ideal prefix / (1 + replays) forwards",
                  "fixed share of a pass", "passes naive / prefix",
                  "block passes naive / prefix", "audit.json equal"),
                 rows, "lrrrrrrrrrl"), "",
        f"**The target of {SCHEDULE_TARGET}x for the deepest model ({deep['model']}) is "
        f"{'met' if met else 'not met'}: {low_high(deep['prefix'])}x.** Prefix reuse itself "
        f"takes its audit to {low_high(deep['prefix_over_naive'])} of the naive one: of the "
        f"{passes} passes, {passes - per_layer} stay full (the record pass, the correct replay "
        f"and the main-condition replays), and the {per_layer} per-layer runs cost their suffix; "
        "on top, both schedules repeat the correct replay in full at the end of each batch, and "
        "the prefix schedule proves each site's prefix on each batch with one more suffix pass. "
        f"The naive audit already costs {low_high(deep['naive'])}x its forward passes (NLL, "
        "stubs, calibration, bootstrap), and the prefix schedule keeps that per-pass overhead.",
        "", _schedule_bound(deep), ""])


NOT_MEASURED = "not measured at this commit"


def _schedule_account(m: Mapping[str, Any]) -> tuple[str, ...]:
    """The cost-account columns of one model's row (result files before the account: said)."""
    if "account" not in m:
        return ("not measured",) * 5
    acc, ideal = m["account"], m["ideal"]
    return (f"{ideal['prefix_over_naive']:.3f}", f"{ideal['prefix']:.3f}",
            f"{m['fixed_share']:.3f}",
            f"{acc['naive']['passes']:.1f} / {acc['prefix']['passes']:.1f}",
            f"{acc['naive']['block_passes']:.1f} / {acc['prefix']['block_passes']:.1f}")


def _schedule_bound(m: Mapping[str, Any]) -> str:
    """What the deepest model's prefix audit can cost at best, from its counted passes."""
    if "account" not in m:
        return (f"The cost account (passes and block evaluations counted per schedule, the "
                f"fixed share of a pass, the ideal ratio) is {NOT_MEASURED}: rerun "
                "`python benchmarks/audit_schedule.py`.")
    acc, ideal, sec = m["account"]["prefix"], m["ideal"], m["pass_seconds"]
    passes = 1 + m["replays"]
    proofs = (f" Of these, the per-site proofs are {acc['proof_passes']:.1f} passes and "
              f"{acc['proof_block_passes']:.1f} passes' worth of blocks: with free non-block "
              f"work the blocks alone would cost {acc['block_passes'] / passes:.3f}x the "
              f"(1 + replays) forwards, and "
              f"{(acc['block_passes'] - acc['proof_block_passes']) / passes:.3f}x without "
              "the proofs." if "proof_passes" in acc else "")
    return (f"Counted for {m['model']} ({m['layers']} blocks): the prefix schedule makes "
            f"{acc['passes']:.1f} evaluation-set passes but evaluates only "
            f"{acc['block_passes']:.1f} passes' worth of blocks.{proofs} A pass with every "
            f"block stubbed ({sec['fixed']:.3f} s) plus the NLL ({sec['nll']:.3f} s) is "
            f"{m['fixed_share']:.3f} of a full pass ({sec['full']:.3f} s) here, and every "
            "pass pays it. So at best the prefix audit costs "
            f"{ideal['prefix']:.3f}x its (1 + replays) forwards, {ideal['prefix_over_naive']:.3f} "
            f"of the naive audit's {ideal['naive']:.3f}x: the rest of the measured ratio is "
            "the audit's work outside its forward passes (feeds, digests, bootstrap).")


@block("target-ci", "--target-ci against fixed audits: sequences used and wall time",
       [bench("target_ci")], ["python benchmarks/target_ci.py --runs RUNS"])
def target_ci(r: Results) -> str:
    d = r.json(bench("target_ci"))
    res = d["results"]
    rows = [(m["model"], f"{row['target']:g}", str(m["pool"]), str(row["sequences_used"]),
             " > ".join(map(str, row["round_sizes"])),
             f"yes ({row['widest']} {row['widest_half_width']:.4f})" if row["reached"] else
             f"no, pool used up ({row['widest']} {row['widest_half_width']:.4f})",
             f"{row['replay_passes_total']} / {row['replay_passes_fixed']}",
             str(row["runs_reused"]), f"{row['target_ci_s']:.1f}", f"{row['fixed_n_s']:.1f}",
             f"{m['full_pool_s']:.1f}", "yes" if row["equal_to_fixed_n"] else "NO")
            for m in res["models"] for row in m["rows"]]
    o = res["options"]
    return "\n".join([
        "", f"{measured(d)} Floor {o['min_sequences']}, batch {o['batch_size']}, "
        f"{o['repeats']} repeats, {o['bootstrap']} resamples, {o['calib']} calibration "
        f"sequences, {'with' if o['expert_ablation'] else 'no'} expert ablation, no execution "
        "audit; one run each, in one process:", "",
        md_table(("model", "target (nats)", "pool", "sequences used", "round sizes",
                  "target met (widest, half-width)", "replay passes: rounds / fixed-N",
                  "replay runs kept", "target-ci s", "fixed-N s", "full pool s",
                  "equal to fixed-N"), rows, "lrrrllrrrrrl"), "",
        "*Fixed-N*: the fixed audit of the sequences the target-ci audit used (its audit.json "
        "must be equal outside `runtime` and `stopping`); *full pool*: the fixed audit of "
        "every pool sequence, what an audit without a target costs. The replay passes of the "
        "rounds add up to more than the fixed-N audit's (each round replays the random "
        "conditions of every earlier batch again; *replay runs kept* are the runs taken from "
        "the previous round by digest); the saving is against the full pool, when the target "
        "is met early. The pass counts are exact; the wall times are single runs on a shared "
        "machine (see the load average above) and move with its load.", ""])


OFFLOAD_CMD = "python benchmarks/memory.py --offload"


@block("offload", "a model bigger than its memory: disk offload against the whole model, "
       "with memory free and under a hard limit", [bench("offload")], [OFFLOAD_CMD])
def offload(r: Results) -> str:
    if not r.has(bench("offload")):  # minutes and the model's size in memory: said, not faked
        return (f"\nNot measured at this commit: `{OFFLOAD_CMD}` writes "
                "`docs/results/offload.json`, then `python docs/make_docs.py` renders it here.\n")
    d = r.json(bench("offload"))
    res = d["results"]
    m, rows, limit = res["model"], res["rows"], res["limit_bytes"]
    from fcaudit.io.placement import parse_size
    budget = parse_size(res["budget"], "budget")
    gib = lambda n: f"{n / 2**30:.2f}"
    placed = rows["offloaded"]["placement"]
    spread = ", ".join(f"{n} on {dev}" for dev, n in placed["modules_per_device"].items())

    def state(x: Mapping[str, Any]) -> str:
        if not x["finished"]:
            return (f"no: killed by the OOM killer after {x['wall_s']:.0f} s" if x["oom_killed"]
                    else f"no: exit {x['returncode']} after {x['wall_s']:.0f} s")
        exact = x["identity_exact"] and x["identity_max_abs_diff"] == 0
        return f"yes, identity replay {'exact' if exact else 'NOT exact'}"

    table = md_table(
        ("loaded", "memory", "finished", "peak RSS GiB", "anonymous GiB", "cgroup peak GiB",
         "wall s"),
        [("whole model" if case.startswith("in_memory") else "offloaded",
          f"capped at {gib(x['limit_bytes'])} GiB" if x["limit_bytes"] else "free", state(x),
          gib(x["peak_rss_bytes"]), gib(x["peak_anon_bytes"]),
          gib(x["cgroup_peak_bytes"]) if x["cgroup_peak_bytes"] else "-",
          f"{x['wall_s']:.0f}" if x["finished"] else "-") for case, x in rows.items()],
        "lllrrrr")
    finished = sum(x["finished"] for x in rows.values())
    same = "equal" if res["equal_outside_runtime"] else "NOT equal"
    free = rows["offloaded"]
    anon = free["peak_anon_bytes"]
    lines = [f"The {finished} audit.json that finished are **{same}** outside `runtime`; the "
             f"offload folder was {'left behind' if res['offload_folder_left'] else 'removed'}"
             f" afterwards. With memory free, the offloaded audit's peak RSS is "
             f"{gib(free['peak_rss_bytes'])} GiB ({free['peak_rss_bytes'] / budget:.1f}x the "
             f"budget), but only {gib(anon)} GiB ({anon / budget:.2f}x the budget) is anonymous "
             "memory; the rest are pages of the memory-mapped checkpoint and offload files, "
             "which the kernel keeps mapped while memory is free and takes back under "
             "pressure."]
    capped, whole = rows.get("offloaded_capped"), rows.get("in_memory_capped")
    if res["capped_not_made"] or capped is None or whole is None:
        lines.append(f"The capped runs were not made: {res['capped_not_made']}.")
    else:
        size = m["weights_bytes_on_disk"]
        lines.append(
            f"Under a hard limit of {gib(limit)} GiB (a memory cgroup that charges page cache "
            f"too; the model's files evicted from the cache first), "
            + (f"the offloaded audit **finished**, so a model of {size / 2**30:.2f} GiB of "
               f"weights was audited in {limit / size:.2f}x its size in memory"
               if capped["finished"] else "the offloaded audit **did not finish**")
            + "; the whole-model audit "
            + ("was killed there, as a model bigger than the memory it is given must be."
               if not whole["finished"] else
               "**finished there too**: the limit is not below what the whole model needs."))
    return "\n".join([
        "", f"{measured(d)} The model: a random-initialised {m['family']}-shaped MoE, "
        f"{m['params'] / 1e9:.2f}B parameters in {m['dtype']} ({m['layers']} layers of "
        f"{m['experts']} experts, {m['weights_bytes_on_disk'] / 1e9:.2f} GB of safetensors), "
        f"built in {res['build_s']:.0f} s. Each audit is `{res['command']}` on "
        f"{res['eval_sequences']} evaluation and calibration sequences of {res['seq_len']} "
        f"tokens, in a child process of its own; the offloaded one adds `--device-map auto "
        f"--max-memory cpu={res['budget']} --offload-folder DIR`, which placed the model's "
        f"modules as {spread}. *Peak RSS*: the child's `ru_maxrss`; *anonymous*: its "
        "`RssAnon`, sampled every 20 ms; *cgroup peak*: the capped cgroup's own high-water "
        "mark, page cache included:", "", table, "", " ".join(lines), ""])


@block("mudd-scale", "a 1.4B-shaped MUDDPythia: native, record, replay and suffix replays",
       [bench("mudd_scale")],
       ["python benchmarks/mudd_scale.py --seqs 1 --seq-len 512 --suffix-sites 5"])
def mudd_scale(r: Results) -> str:
    if not r.has(bench("mudd_scale")):  # ~10 minutes and 5 GB on 2 cores: said, not faked
        return ("\nNot measured at this commit: `python benchmarks/mudd_scale.py --seqs 1 "
                "--seq-len 512 --suffix-sites 5` writes `docs/results/mudd_scale.json` "
                "(several minutes and about 5 GB of memory on 2 cores), then "
                "`python docs/make_docs.py` renders it here.\n")
    d = r.json(bench("mudd_scale"))
    res = d["results"]
    sch = res["schedule"]
    costs = ", ".join(f"{s['suffix_over_full']:.2f}x" for s in sch["sites"])
    layers = ", ".join(str(s["layer"]) for s in sch["sites"])
    equal = "each bitwise equal to" if all(s["equal"] for s in sch["sites"]) else \
        "NOT all equal to"
    ms = ", ".join(f"{mode} {low_high(v, 1)}" for mode, v in res["ms_per_token"].items())
    peak = max(res["peak_rss_gb"].values())
    return "\n".join([
        "", f"{measured(d)} The model has {res['n_params'] / 1e9:.2f}B parameters in "
        f"{res['dtype']} (random weights), {res['seqs']} x {res['batch']} x {res['seq_len']} "
        "tokens, compute only. Suffix replays cost "
        f"{costs} a full replay at sites {layers}, {equal} the full replay, and the plan's "
        f"forward-pass equivalents fall from {sch['naive_passes']} to "
        f"{sch['prefix_passes']:.1f} ({sch['prefix_passes'] / sch['naive_passes']:.3f}x; "
        f"interpolated between the timed sites; with the correct replay repeated at the end of "
        f"the batch in both, and prefix reuse's {sch['proofs']} per-site proofs, "
        f"{sch['proofs_cost']:.1f} passes' worth, at their suffixes' cost): the "
        "large-vocabulary output head is paid by every per-layer run. Milliseconds per token: "
        f"{ms}; peak RSS {peak:.1f} GB; replay logits against native: max difference "
        f"{res['max_abs_diff']:g}.", ""])


@block("hf-moe-sweep", "every MoE family of the installed transformers, checked",
       [bench("hf_moe_sweep")], ["python benchmarks/hf_moe_sweep.py"])
def hf_moe_sweep(r: Results) -> str:
    d = r.json(bench("hf_moe_sweep"))
    res = d["results"]
    return (f"{measured(d)} transformers {res['transformers']}, batch {res['batch']} x "
            f"{res['seq_len']} tokens, {res['wall_s']:.0f} s: {len(res['passed'])} MoE families "
            f"pass all checks, {len(res['failed'])} fail, {len(res['skipped'])} skipped, "
            f"{len(res['dense'])} dense. Passing: {', '.join(res['passed'])}."
            + (f" Failing: {', '.join(_failing(res))}." if res["failed"] else ""))


def _failing(res: dict) -> list[str]:
    """Each failing family with the first check it failed (a site count is no failure)."""
    out = []
    for family in res["failed"]:
        row = res["rows"][family]
        failed = [f"{k}: {row[k]}" for k in ("sites", "identity", "donor", "experts", "audit")
                  if row.get(k) not in ("yes", "dense") and not str(row.get(k)).isdigit()]
        out.append(f"{family} ({failed[0]})" if failed else family)
    return out


README_MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")


@block("hf-moe-count", "how many MoE families the sweep checked, beyond those the README names",
       [bench("hf_moe_sweep")], ["python benchmarks/hf_moe_sweep.py"])
def hf_moe_count(r: Results) -> str:
    passed = r.json(bench("hf_moe_sweep"))["results"]["passed"]
    missing = [f for f in README_MOE if f not in passed]
    if missing:
        raise ValueError(f"the README names {', '.join(missing)}, which the sweep did not pass")
    return f"{len(passed) - len(README_MOE)} more families"


SSM_COLUMNS = ("family", "selection sites", "sites found (family: count)", "identity exact",
               "donor changes output", "default audit", "seconds")


def _audit_cell(row: dict) -> str:
    """The default audit's cell: yes with how the prefix schedule went (and where its
    model was, when transformers could not save it), or its error."""
    where = "" if row.get("folder", "saved") == "saved" else f", {row['folder']}"
    return f"{row['audit']}, prefix {row['prefix']}{where}" if row.get("prefix") else \
        row["audit"]


@block("hf-ssm-sweep", "every state-space family of tests/ssm_families.py, checked",
       [bench("hf_ssm_sweep")], ["python benchmarks/hf_ssm_sweep.py"])
def hf_ssm_sweep(r: Results) -> str:
    d = r.json(bench("hf_ssm_sweep"))
    res = d["results"]
    rows = [(family, str(row["selection_sites"]),
             ", ".join(f"{k}: {v}" for k, v in row["families"].items()), row["identity"],
             row["donor"], _audit_cell(row), f"{row['seconds']:.2f}")
            for family, row in res["rows"].items()]
    return "\n".join([
        "", f"{measured(d)} transformers {res['transformers']}, batch {res['batch']} x "
        f"{res['seq_len']} tokens, {res['wall_s']:.0f} s in all: {len(res['passed'])} families "
        f"pass every check, {len(res['failed'])} fail"
        + (f" ({', '.join(res['failed'])})." if res["failed"] else "."), "",
        md_table(SSM_COLUMNS, rows, "lrllllr"), ""])


@block("gpu-check", "the GPU check's table, on the device it last ran on",
       [bench("gpu_check")], ["python benchmarks/gpu_check.py"])
def gpu_check(r: Results) -> str:
    d = r.json(bench("gpu_check"))
    res = d["results"]
    where = ("on a CPU (no GPU was lent when this was run: the CUDA rows are to be run "
             "where one is)" if res["device"] == "cpu" else f"on {res['device']}")
    skipped = (f" Rows skipped: {', '.join(res['skipped'])}." if res["skipped"] else "")
    return "\n".join(["", f"Last run {where}, batch {res['batch']} x {res['seq_len']} tokens, "
                      f"{res['rounds']} timing rounds (ratios: median [min-max]).{skipped} "
                      + measured(d), "", res["table"], ""])


# ------------------------------------------------------------------------- vLLM at scale

VLLM_SCALE = "python benchmarks/vllm_scale.py"


def computed(data: Mapping[str, Any]) -> str:
    """How a computed (not timed) result was made: its command, commit and date."""
    command = " ".join([f"python {data['script']}", *data["argv"]]).strip()
    dirty = " plus uncommitted changes" if data["dirty"] else ""
    return f"Computed by `{command}` at commit {data['commit']}{dirty} on {data['date']}"


SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def _gb(bytes_per_token: float, tokens: float) -> str:
    """Bytes per token over ``tokens`` tokens, in GB (10^9 bytes), three digits."""
    return f"{bytes_per_token * tokens / 1e9:.3g}"


@block("vllm-scale-storage", "what an audit in vLLM records per token against a routing "
       "trace, per million tokens, for three published MoE shapes",
       [bench("vllm_scale")], [VLLM_SCALE])
def vllm_scale_storage(r: Results) -> str:
    d = r.json(bench("vllm_scale"))
    res = d["results"]
    million = res["million"]
    rows = []
    for s in res["shapes"]:
        bf16, f32, trace = s["eval"]["bfloat16"], s["eval"]["float32"], s["trace"]
        if bf16["stored"]["logits"] != ["BF16"] or f32["stored"]["logits"] != ["F32"]:
            raise ValueError(f"{s['name']}: the shards hold logits as "
                             f"{bf16['stored']['logits']} and {f32['stored']['logits']}")
        rows.append((s["name"], f"{s['moe_layers']} of {s['layers']}",
                     f"{s['experts']}, top-{s['top_k']}",
                     _gb(bf16["bytes_per_token"], million), _gb(f32["bytes_per_token"], million),
                     f"{_gb(trace['vllm_ids'], million)} ({trace['vllm_id_dtype']})",
                     _gb(trace["ids_and_weights"], million),
                     f"{bf16['bytes_per_token'] / trace['vllm_ids']:.0f}x"))
    first = res["shapes"][0]
    bf16, passes = first["eval"]["bfloat16"], first["passes"]
    element = bf16["logits_bytes_per_token"] // (first["moe_layers"] * first["experts"])
    calib = first["calib_bytes_per_token_at_most"]
    tokens = passes["eval_sequences"] * passes["default_window"]
    return "\n".join([
        "", f"{computed(d)}; no model of these sizes was loaded: each evaluation shard is "
        "written at the model's shape by the audit's own cache code (`EvaluationShard`, "
        "`CoefficientCache.write`) and measured, a trace sized from the dtypes its writer "
        f"uses. GB (10^9 bytes) per {million:,} tokens:", "",
        md_table(("model (published config)", "MoE layers", "experts, top-k",
                  "fcaudit: router logits, bfloat16", "router logits, float32",
                  "vLLM trace: expert ids", "ids and weights (int32, float32)",
                  "fcaudit (bfloat16) / vLLM trace"), rows, "lrrrrrrr"), "",
        f"Per {first['name']} token the record is {first['moe_layers']} MoE layers x "
        f"{first['experts']} logits x {element} bytes = {bf16['logits_bytes_per_token']:,} "
        f"bytes, and {bf16['nll_bytes_per_token']:.0f} bytes of the token's loss "
        f"({', '.join(SAFETENSORS_DTYPES[t] for t in bf16['stored']['nll'])}): "
        f"{bf16['bytes_per_token']:,.0f} bytes, where "
        f"vLLM's trace keeps {first['trace']['vllm_ids']} (its {first['top_k']} expert ids "
        f"at each of the {first['layers']} layers, the dense ones included, one byte each "
        f"up to {res['vllm_uint8_experts']} experts). The default audit's "
        f"{passes['eval_sequences']} evaluation windows of {passes['default_window']} tokens "
        f"({tokens:,} tokens) record {_gb(bf16['bytes_per_token'], tokens)} GB. Calibration "
        "windows are kept as float64 sums, per position and per token id present in each "
        f"batch, not per token: at most {_gb(calib, million)} GB per million calibration "
        f"tokens for {first['name']} ({calib / bf16['bytes_per_token']:.1f}x the evaluation "
        "record), reached when every token of a batch has an id of its own; tokens of one "
        "id share a row.", ""])


@block("vllm-scale-passes", "an audit's forward passes, per batch and MoE layer, counted on "
       "stand-ins with three published MoE shapes", [bench("vllm_scale")], [VLLM_SCALE])
def vllm_scale_passes(r: Results) -> str:
    d = r.json(bench("vllm_scale"))
    res = d["results"]
    rows = []
    for s in res["shapes"]:
        p, default, main = s["passes"], s["passes"]["default"], s["passes"]["main_only"]
        if not (default["identity_exact"] and main["identity_exact"]):
            raise ValueError(f"{s['name']}: the stand-in's identity replay was not exact")
        per_eval = 1 + default["replays_per_eval_batch"] + s["moe_layers"] * (
            default["per_layer_runs_per_moe_layer"] + default["ablations_per_moe_layer"])
        rows.append((s["name"], str(s["moe_layers"]),
                     f"{default['ablations_per_moe_layer'] * s['moe_layers']}"
                     if default["ablations_per_moe_layer"] else "off",
                     f"{per_eval:,}", f"{default['counted_passes']:,}",
                     f"{default['plan_passes']:,} + "
                     f"{default['counted_passes'] - default['plan_passes']}",
                     f"{main['counted_passes']:,}",
                     millions(default["counted_passes"] * p["batch_size"] * p["default_window"])))
    first = res["shapes"][0]
    p, default = first["passes"], first["passes"]["default"]
    extra = default["counted_passes"] - default["plan_passes"]
    return "\n".join([
        "", f"{computed(d)}: each audit is the default one (`fcaudit.audit` with default "
        f"options: {p['repeats']} repeats, batches of {p['batch_size']}) of the command line's "
        f"default data sizes ({p['eval_sequences']} evaluation and {p['calib_sequences']} "
        "calibration windows), run on a stand-in that has the model's router sites (one per "
        "MoE layer, with the adapter vLLM's routers get) and, as a served model, no execution "
        "blocks; its forward passes are counted. The counts do not depend on the window's "
        f"length (the stand-in's is {p['seq_len']} tokens); the tokens column is the engine's "
        f"work at the default window of {p['default_window']} tokens.", "",
        md_table(("model", "MoE layers", "expert ablations per batch",
                  "passes per evaluation batch", "passes, default audit",
                  "plan + probe", "main conditions alone", "tokens through the engine"),
                 rows, "lrrrrrrr"), "",
        f"Per evaluation batch: one record pass, {default['replays_per_eval_batch']} replays "
        "of the main conditions (the correct replay, each random condition once per repeat, "
        "each static condition, the correct replay once more), "
        f"{default['per_layer_runs_per_moe_layer']} per-layer runs per MoE layer and, where "
        f"no router has more than {res['ablation_max_experts']} experts, one ablation per "
        "expert and MoE layer; per calibration batch one record pass; and the probe's "
        "identity replay of the first batch. So an audit of `L` MoE layers over `B_e` "
        "evaluation and `B_c` calibration batches makes "
        f"`B_e x (1 + {default['replays_per_eval_batch']} + "
        f"{default['per_layer_runs_per_moe_layer']} L) + B_c + {default['probe_replays']} + "
        f"{default['controller_timing']}` forward passes (`+ B_e x E L` with expert ablation "
        f"over `E` experts), the last {default['controller_timing']} the served model's "
        "execution answer (one record pass, then its routers computing against their logits "
        "supplied in warm-up and timed pairs on one batch; `--timing-pairs 0` drops them). *Plan + "
        "probe*: the passes the audit's plan line names before the work (`runtime.plan`) and "
        f"the probe's {extra} (the first batch's record and identity replay), equal to the "
        "count in every row. *Main conditions alone*: `--no-per-layer --no-expert-ablation`. "
        f"On the engine each pass is one scheduled step of a batch's {p['batch_size']} "
        "windows.", ""])


# ------------------------------------------------------------------------- registries
# What fcaudit knows, read from its registries (never typed by hand): the families the
# model registry builds, the analyses and their report sections, the conditions, the
# objectives and the discovery rules.

REGISTRY_SOURCES = ("src/fcaudit/io/arches.py", "src/fcaudit/engine/analyses/__init__.py",
                    "src/fcaudit/report/sections/__init__.py", "src/fcaudit/core/conditions.py",
                    "src/fcaudit/engine/objectives.py", "src/fcaudit/core/discovery.py")


@block("registries", "the families, analyses, conditions, objectives and discovery rules, "
       "from their registries", REGISTRY_SOURCES, ["the registries themselves, at import"])
def registries(r: Results) -> str:
    from fcaudit.core.conditions import CONDITIONS
    from fcaudit.core.discovery import BLOCK_RULES, EXPERT_RULES, SITE_RULES
    from fcaudit.engine.analyses import ANALYSES
    from fcaudit.engine.objectives import OBJECTIVES
    from fcaudit.io.arches import ARCHES
    from fcaudit.report.sections import RENDERERS
    families = [(f"`{a.name}`", f"`models/{a.module.rsplit('.', 1)[1]}.py`", a.model_class,
                 "digits" if a.task == "vision" else "tokens",
                 ", ".join(f"{k}={v}" for k, v in a.fixed) or "")
                for a in ARCHES.values()]
    analyses = [(f"`{a.name}`", f"`engine/analyses/{a.plan.__module__.rsplit('.', 1)[1]}.py`",
                 "yes" if a.name in RENDERERS else "JSON fallback")
                for a in ANALYSES.values()]
    conditions = [(f"`{c.name}`", c.kind, "default" if c.default else "opt-in", c.meaning)
                  for c in CONDITIONS.values()]
    objectives = [(f"`{o.name}`", o.unit, o.help) for o in OBJECTIVES.values()]
    rules = [(kind, ", ".join(f"`{name}`" for name in registry))
             for kind, registry in (("sites", SITE_RULES), ("blocks", BLOCK_RULES),
                                    ("experts", EXPERT_RULES))]
    return "\n".join([
        "", f"Model families (`fcaudit train --arch`, {len(families)}):", "",
        md_table(("arch", "file", "model class", "inputs", "fixed config"), families, "lllll"),
        "", f"Analyses (`engine.analyses.ANALYSES`, {len(analyses)}):", "",
        md_table(("analysis", "module", "own report section"), analyses, "lll"),
        "", f"Conditions (`core.conditions.CONDITIONS`, {len(conditions)}):", "",
        md_table(("condition", "kind", "run", "meaning"), conditions, "llll"),
        "", f"Objectives (`engine.objectives.OBJECTIVES`, {len(objectives)}):", "",
        md_table(("objective", "unit", "help"), objectives, "lll"),
        "", "Discovery rules (`core.discovery`), tried in order:", "",
        md_table(("finds", "rules"), rules, "ll"), ""])


FOLD_DEMO = "python benchmarks/fold_demo.py"


def _estimate(e: Mapping[str, Any] | None, digits: int, sign: str = "", scale: float = 1.0,
              unit: str = "") -> str:
    """An ``Estimate`` (value and ci95) of a result file, or "not defined"."""
    if e is None:
        return "not defined"
    lo, hi = (x * scale for x in e["ci95"])
    return f"{e['value'] * scale:{sign}.{digits}f}{unit} [{lo:{sign}.{digits}f}, " \
        f"{hi:{sign}.{digits}f}]"


@block("fold-demo", "the demo FeatureGate's profiles folded: exactness, speed and healing",
       [bench("fold_demo")], [FOLD_DEMO])
def fold_demo(r: Results) -> str:
    d = r.json(bench("fold_demo"))
    res = d["results"]
    rows = []
    for p in res["profiles"]:
        f, h = p["fold"], p["heal"]
        rows.append((f"`{p['profile']}`", _estimate(p["audit_retention"], 1, unit="%"),
                     f"{f['exactness']['max_abs_diff']:.3g}",
                     _estimate(f["vs_original"]["latency_ratio"], 3),
                     f"{f['vs_original']['flops_ratio']:.4f}",
                     _estimate(f["vs_dense"]["latency_ratio"], 3),
                     _estimate(h["penalty_before"], 4, "+"),
                     _estimate(h["penalty_after"], 4, "+"),
                     _estimate(h["recovered"], 1, scale=100, unit="%"),
                     f"{p['fold_s']:.0f} + {p['heal_s']:.0f}"))
    return "\n".join([
        "", f"{measured(d)} The model: {res['model']}, audited on the built-in data; each "
        f"fold timed in "
        f"{res['pairs']} interleaved pairs of one batch, each healing {res['heal_steps']} "
        "steps of each model. Latency and FLOPs are the folded model's over the other's "
        "(< 1: the folded model is faster); the penalty is the folded model's NLL minus the "
        "original's per sequence (nats), before healing and after (against the original "
        "fine-tuned alike), with 95% intervals:", "",
        md_table(("profile", "the audit's retention", "largest loss difference",
                  "latency / original", "FLOPs / original", "latency / dense twin",
                  "penalty before", "penalty after healing", "recovered", "seconds (fold + "
                  "heal)"), rows, "lrrrrrrrrr"), ""])


@block("fold-lengths", "a Mamba's time-invariant fold against its selective scan by length",
       [bench("fold_lengths")], ["python benchmarks/fold_lengths.py"])
def fold_lengths(r: Results) -> str:
    d = r.json(bench("fold_lengths"))
    res = d["results"]
    e, speed = res["fold"]["exactness"], res["fold"]["vs_original"]
    rows = [(str(x["length"]), _estimate(x["latency_ratio"], 3),
             f"{x['folded_tokens_per_s']:,.0f}", f"{x['original_tokens_per_s']:,.0f}")
            for x in res["lengths"]]
    return "\n".join([
        "", f"{measured(d)} The model: {res['model']}, audited on the built-in data "
        f"({res['audit_s']:.0f} s) and its `static-layer` profile folded ({res['fold_s']:.0f} s, "
        f"timing included): largest per-token loss difference {e['max_abs_diff']:.2g} against "
        f"the replayed condition (mean {e['mean_abs_diff']:.2g}, {e['tokens']:,} tokens), "
        f"latency against the original at the audit's length "
        f"{_estimate(speed['latency_ratio'], 3)}, FLOPs (matrix products only) "
        f"{speed['flops_ratio']:.3f}. Then one batch of {res['batch_size']} random sequences "
        f"per length, {res['pairs']} interleaved pairs each (< 1: the fold is faster), with "
        "95% intervals:", "",
        md_table(("length", "latency folded / original", "folded tokens/s",
                  "original tokens/s"), rows, "rrrr"), ""])


@block("tasks-overhead", "fcaudit tasks' requests per second against a plain lm-eval run",
       [bench("tasks_overhead")], ["python benchmarks/tasks_overhead.py"])
def tasks_overhead(r: Results) -> str:
    d = r.json(bench("tasks_overhead"))
    res = d["results"]
    names = {"plain_lm_eval": "lm-evaluation-harness's own model (HFLM, batch size 1)",
             "plain_lm_eval_32": "lm-evaluation-harness's own model (HFLM, batch size 32)",
             "original": "fcaudit, `original` (a record pass per batch of one token length)",
             "correct": "fcaudit, `correct` (a record and an identity replay per batch)"}
    rows = [(names[k], f"{v['requests_per_s']:,.1f}", f"{v['accuracy']:.3f}",
             f"{v['time_over_plain']:.2f}" if "time_over_plain" in v else "1")
            for k, v in res["runs"].items()]
    return "\n".join([
        "", f"{measured(d)} The model: {res['model']}; a local multiple-choice task of "
        f"{res['docs']} questions ({res['requests']:,} requests), scored on the same loaded "
        "task each way:", "",
        md_table(("run", "requests/s", "accuracy", "time over the plain run's"), rows, "lrrr"),
        ""])
