"""The study presets of ``fcaudit reproduce``, as data: each one's groups (model family,
size, seeds, twin), its own table's columns and its findings (:mod:`fcaudit.study.declare`
reads them; :mod:`fcaudit.study.reproduce` runs them).

- ``tiny``, ``paper``: the paper's findings beside ours (FeatureGate, MUDD, MoE, SkipGate).
- ``vision``: routing, per-example kernel mixing and token pruning on digits.
- ``ssm``: Mamba (selection: Δ, B and C computed from each token) and its LTI twin S4D,
  on the built-in corpus and on selective copying (the Mamba paper's task a
  time-invariant model fails; :mod:`fcaudit.io.selective_copy`); ``static-layer`` there
  feeds every layer its calibration mean, the twin's form with Mamba's own weights.
- ``exit``: early exit and adaptive depth (a CALM-style exit LM, PonderNet halting,
  BranchyNet exits on digits) beside their full-depth twins: how deep each runs, what
  that saves, and whether the learned rule beats fixed exit at the same mean depth.
- ``fold``: from diagnosis to decision (``fcaudit fold``): FeatureGate, the MoE, Mamba on
  the corpus and on selective copying, and the early-exit LM, each seed's model folded at
  a static profile (or fixed exit), checked, timed against the original and the dense
  twin, and healed with the original fine-tuned alike as the control
  (:mod:`fcaudit.study.folds`).
- ``tasks``: the tiny FeatureGate, MoE and Mamba on benchmark tasks built from the
  evaluation plays (next-word choice, a cloze; :mod:`fcaudit.study.lm_tasks`), scored by
  lm-evaluation-harness under each condition beside the NLL: does the NLL's retention
  predict the task's?
- ``trend``: FeatureGate and MUDD along a ladder of sizes and lengths
  (:mod:`fcaudit.study.trend`).
"""

from __future__ import annotations

import dataclasses

from fcaudit.core.conditions import (
    CORRECT,
    FIXED_EXIT,
    GLOBAL_MEAN,
    ORACLE_EXIT,
    RANDOM_CONDITIONS,
    REASSIGN,
    RETENTION_PROFILES,
    SHUFFLE,
    STATIC_CONDITIONS,
    STATIC_LAYER,
    STATIC_LAYER_POSITION,
    STATIC_LAYER_TOKEN,
)
from fcaudit.core.registry import refusal
from fcaudit.engine import result_views as keys  # metric keys, derived from condition names
from fcaudit.engine.analyses.tasks import metric_key
from fcaudit.engine.objectives import SELECTIVE_COPY
from fcaudit.study import lm_tasks, paper, trend
from fcaudit.study.declare import Finding, Group, Preset
from fcaudit.study.train import TRAIN_PRESETS

TASK = SELECTIVE_COPY
# the corpus runs train half the tiny preset's steps, so that three seeds of both models
# and both tasks fit a 2-core CPU in well under an hour (the numbers are of this length)
CORPUS_SCHEDULE = dataclasses.replace(TRAIN_PRESETS["tiny"], steps=300)
_PAPER_RETENTION = " / ".join(f"{v:.2f}%" for v in paper.RETENTION.values())
_BLOCKS = "{blocks_executed_fraction:.3f} of blocks executed per token"


PAPER_FINDINGS = (
    Finding("featuregate", "FeatureGate: a static per-layer profile keeps almost all (>= 90%) "
            f"of the Correct-to-GlobalMean gap (paper: {_PAPER_RETENTION})",
            ((keys.RETENTION_LAYER, ">=", 90),), "{retention_static_layer:.2f}% on average",
            undefined="undefined (no clear gap)"),
    Finding("featuregate", "FeatureGate: layer identity explains most of the coefficient "
            f"variance (paper: {paper.eta2_text()})", (("eta2_layer", ">=", 0.8),),
            "{pct eta2_layer:.1f}% on average", undefined="does not hold: 0.0% on average"),
    Finding("featuregate", "FeatureGate runs every block",
            (("blocks_executed_fraction", ">=", 0.999),), _BLOCKS),
    Finding("featuregate", "FeatureGate is slower than Dense (paper: "
            f"{100 * (paper.SPEED_RATIO - 1):.1f}% slower)", (("speed_ratio", ">", 1),),
            "time ratio {speed_ratio:.3f} on average"),
    Finding("mudd", "MUDD: reassignment and token shuffling raise NLL strongly (paper: +1.91 "
            "and +2.96 nats on MUDDPythia-1.4B)",
            ((keys.DELTA_REASSIGN, ">", 0.1), (keys.DELTA_SHUFFLE, ">", 0.1)),
            "reassign {delta_reassign:+.3f}, shuffle {delta_shuffle:+.3f} nats on average"),
    # every MUDD seed above every FeatureGate seed: the seed ranges do not overlap
    Finding("mudd", "The contrast: MUDD depends on the assignment more than FeatureGate",
            ((f"min {keys.DELTA_REASSIGN}", ">", f"vs max {keys.DELTA_REASSIGN}"),),
            "reassign penalty {delta_reassign:+.3f} (MUDD) vs {vs delta_reassign:+.3f} "
            "(FeatureGate), seed ranges {either apart|overlap}", versus="featuregate"),
    Finding("mudd", "MUDD runs every block", (("blocks_executed_fraction", ">=", 0.999),),
            _BLOCKS),
    # hard routing (our MoE), the third kind of controller the paper separates
    Finding("moe", "MoE (hard routing): routing changes what is computed",
            (("experts_executed_fraction", "<", 0.99),),
            "each token runs {pct experts_executed_fraction:.1f}% of the experts (2 of 8 per "
            "layer when it holds)"),
    Finding("moe", "MoE: the frozen model depends on its routing staying matched to the input",
            ((keys.DELTA_REASSIGN, ">", 0.1), (keys.rerouted_key(REASSIGN), "any", 0)),
            f"reassigning router logits re-routes {{pct {keys.rerouted_key(REASSIGN)}:.1f}}% of "
            "the (token, layer) expert sets and costs {delta_reassign:+.3f} nats on average"),
    # beyond the paper: how much a static profile per (layer, token id) keeps, and how much
    # of the within-layer variance the token id explains, per controller kind
    *(Finding(prefix, f"{label}: a static profile per (layer, token id) (not in the paper)",
              (), "{token_profile}", words=None)
      for prefix, label in (("featuregate", "FeatureGate"), ("mudd", "MUDD"), ("moe", "MoE"))),
)

_VISION = (("vit-moe", "ViT-MoE"), ("tokenprune", "TokenPrune"), ("condconv", "CondConv"))
_NEEDS = "the reassign penalty's interval lies above 0 in {above reassign} of {seeds} seeds; "
# per family: does the frozen model need its coefficients matched to the image, and does
# the mechanism compute less (routing: against running every expert)
VISION_FINDINGS = tuple(f for prefix, label in _VISION for f in (
    Finding(prefix, f"{label}: the frozen model needs its coefficients matched to the "
            "image", (("above reassign", "==", "all"),),
            _NEEDS + "reassigning costs {penalty reassign} nats"),
    Finding(prefix, f"{label}: routing changes which experts run",
            (("flops_ratio", "any", 0), ("experts_executed_fraction", "<", 0.99)),
            "each patch token runs {pct experts_executed_fraction:.1f}% of the experts; "
            "FLOPs {flops_ratio:.3f}x the dense twin, whose MLP has the active experts' "
            "width"),
    Finding(prefix, f"{label}: the mechanism computes less than its dense twin",
            (("flops_ratio", "<", 0.99), ("unless experts_executed_fraction", "any", 0)),
            "FLOPs {flops_ratio:.3f}x the twin{either |; every example runs the full "
            "network}")))

_COPY, _CORPUS = f"mamba-{TASK}", "mamba-tiny"
_TOKEN_GAIN = f"diff {keys.RETENTION_LAYER_TOKEN}|{keys.RETENTION_LAYER}"
SSM_FINDINGS = (
    Finding(_COPY, "Selective copying: the LTI twin fails the task that selection solves (the "
            "Mamba paper's Table 1: a time-invariant S4 layer fails, the selective S6 layer "
            "solves it)", ((keys.ACCURACY_CORRECT, ">=", 0.9), ("twin_accuracy", "<=", 0.5)),
            "Mamba's accuracy {accuracy_correct:.3f}, its LTI twin's {twin_accuracy:.3f} "
            "(every answer of an example right)"),
    Finding(_COPY, "Selective copying: fed an LTI profile (static-layer), the frozen Mamba "
            "loses the task (the planted truth)",
            ((keys.ACCURACY_CORRECT, ">=", 0.5),
             (f"diff accuracy_under {STATIC_LAYER}|{keys.ACCURACY_CORRECT}|0.2", "<=", 0)),
            f"accuracy {{accuracy_under {STATIC_LAYER}:.3f}} under static-layer (correct: "
            "{accuracy_correct:.3f}); retention on accuracy {percent "
            f"{keys.accuracy_retention_key(STATIC_LAYER)}}}, on the loss "
            "{percent retention_static_layer}"),
    Finding(_COPY, "Selective copying: the frozen Mamba needs its selection matched to the "
            "input", (("above reassign", "==", "all"),),
            _NEEDS + "reassigning costs {penalty reassign}"),
    Finding(_CORPUS, "Built-in corpus: how much of the Correct-to-GlobalMean gap a trained "
            "Mamba keeps with an LTI profile (static-layer)",
            ((keys.RETENTION_LAYER, "any", 0),), "at this scale, a trained Mamba on Shakespeare "
            "keeps {retention_static_layer:.1f}% with an LTI profile",
            undefined="undefined (no clear gap)", words=None),
    Finding(_CORPUS, "Built-in corpus: is selection a lookup of the current token? "
            "(static-layer-token against static-layer)", ((_TOKEN_GAIN, ">=", 20),),
            "a profile per (layer, token id) keeps {retention_static_layer_token:.1f}%, "
            f"{{{_TOKEN_GAIN}:+.1f}} points over the per-layer profile",
            words=("the token id carries much of what selection does",
                   "selection is more than a lookup of the current token"), last=True),
    Finding((_CORPUS, _COPY), "Selection changes no execution (every token runs every block)",
            (("blocks_executed_fraction", ">=", 0.999),), "{execution}"),
)

_EXITS = (("earlyexit", "early-exit LM"), ("ponder", "ponder (PonderNet)"),
          ("branchy", "digits (BranchyNet)"))
EXIT_FINDINGS = tuple(f for prefix, label in _EXITS for f in (
    Finding(prefix, f"{label}: the learned exit rule beats fixed exit at the same mean "
            "executed depth", (("matched_wins", "==", "all"),),
            "fixed exit loses by an interval above 0 in {matched_wins} of {seeds} seeds; "
            "fixed − learned {matched}{degenerate}"),
    # a seed whose rule does not adapt saves nothing by exiting
    Finding(prefix, f"{label}: early exit computes less than the full-depth twin",
            (("flops_ratio", "<", 0.99), ("not_adapting", "==", 0)),
            "{versus_twin} the twin's, at a mean executed depth of {depth}{degenerate}")))

HEAL_STEPS = 100  # each seed's fold healed this long (and the original alike, the control)
_FOLDED = (("featuregate", STATIC_LAYER), ("moe", STATIC_LAYER_TOKEN), ("mamba", STATIC_LAYER),
           ("earlyexit", FIXED_EXIT))
_FOLD_ROWS = (("featuregate-tiny", f"FeatureGate, {STATIC_LAYER}"),
              ("moe-tiny", f"MoE, {STATIC_LAYER_TOKEN} (a hash-routed MoE)"),
              ("mamba-tiny", f"Mamba, {STATIC_LAYER} (its LTI twin by FFT), corpus"),
              ("earlyexit-tiny", f"early-exit LM, {FIXED_EXIT} (cut at that depth)"),
              ("mamba-selective-copy", f"Mamba, {STATIC_LAYER}, selective copying"))
FOLD_FINDINGS = (
    Finding("featuregate", "FeatureGate folded at its static per-layer profile runs at the "
            "Dense twin's speed (latency within 5% of the twin's)",
            (("fold_latency_twin", "<=", 1.05),),
            "{estimate fold_latency_twin 3 x} the twin's latency, "
            "{estimate fold_latency_source 3 x} the original's"),
    Finding("featuregate", "Healing recovers most (>= 50%) of FeatureGate's fold penalty "
            "beyond what the control gains", (("heal_recovered", ">=", 50.0),),
            "{estimate heal_recovered 1 %} recovered after {num heal_steps 0} steps",
            undefined="no clear penalty to recover"),
    Finding("mamba-tiny", "Mamba's time-invariant fold runs faster than its selective scan",
            (("fold_latency_source", "<", 1.0),),
            "{estimate fold_latency_source 3 x} the original's latency"),
    Finding("mamba-selective-copy", "On selective copying (the planted truth) the "
            "time-invariant fold is worse than the model in every seed",
            ((f"above {STATIC_LAYER}", "==", "all"),),
            f"penalty {{penalty {STATIC_LAYER}}}"),
    Finding("mamba-selective-copy", "Healing does not make the time-invariant fold pass "
            "selective copying: its task accuracy after healing stays below half that of the "
            "original fine-tuned alike (means over seeds)",
            (("diff heal_accuracy_after|heal_control_accuracy|0.5", "<", 0),),
            "the fold's accuracy {num heal_accuracy_before 3} before healing, "
            "{num heal_accuracy_after 3} after {num heal_steps 0} steps; the original's "
            "{num heal_control_accuracy 3}"),
    Finding("earlyexit", "The early-exit LM cut at its fixed-exit depth runs faster than the "
            "model with its learned exits", (("fold_latency_source", "<", 1.0),),
            "{estimate fold_latency_source 3 x} the original's latency, "
            f"penalty {{penalty {FIXED_EXIT}}}"),
)

_NEXT, _CLOZE = (lm_tasks.NEXT_WORD, "acc"), (lm_tasks.CLOZE, "perplexity")
_NLL_KEPT = keys.RETENTION_LAYER


def _estimate(task: tuple[str, str], condition: str, digits: str, part: str = "") -> str:
    return f"{{estimate {metric_key(*task, condition, part)} {digits}}}"


def _task_findings(prefix: str, label: str) -> tuple[Finding, ...]:
    """Does the task need the controllers (the global-mean floor moves it in every seed),
    and does the NLL's retention predict the task's?"""
    out = []
    for task, what, side, word in ((_NEXT, "next-word accuracy", "below", "lowers"),
                                   (_CLOZE, "cloze perplexity", "above", "raises")):
        floor = metric_key(*task, GLOBAL_MEAN, "penalty")
        kept = metric_key(*task, STATIC_LAYER, "retention")
        out += [
            Finding(prefix, f"{label}: {what} needs the controllers: the {GLOBAL_MEAN} floor "
                    f"{word} it in every seed (interval {side} 0)",
                    ((f"seeds_{side} {floor}", "==", "all"),),
                    f"{{num {metric_key(*task, CORRECT)} 3}} with its own coefficients, "
                    f"{{num {metric_key(*task, GLOBAL_MEAN)} 3}} under {GLOBAL_MEAN} (means "
                    f"over seeds; {side} 0 in {{seeds_{side} {floor}}} of {{seeds}} seeds)"),
            Finding(prefix, f"{label}: its NLL retention predicts its {what} retention under "
                    "a static per-layer profile (within 25 points, means over seeds)",
                    ((f"diff {_NLL_KEPT}|{kept}", "<=", 25),
                     (f"diff {kept}|{_NLL_KEPT}", "<=", 25)),
                    f"NLL {{{_NLL_KEPT}:.1f}}%, {what} {{{kept}:.1f}}%",
                    undefined="undefined: no clear Correct-to-GlobalMean gap on the task "
                              "or the NLL in some seed, so no retention to compare")]
    return tuple(out)


_BENCHMARKED = (("featuregate-tiny", "FeatureGate"), ("moe-tiny", "MoE"),
                ("mamba-tiny", "Mamba"))
TASK_FINDINGS = tuple(f for prefix, label in _BENCHMARKED
                      for f in _task_findings(prefix.split("-")[0], label))

_SPANNED = "[span of the seeds' 95% intervals]"
PRESETS: dict[str, Preset] = {
    # soft gating, dynamic cross-layer mixing and hard routing (the three kinds the paper
    # separates), plus SkipGate: the positive control for real conditional execution
    "tiny": Preset((Group("featuregate", "tiny"), Group("mudd", "tiny", dense=None),
                    Group("moe", "tiny"), Group("skipgate", "tiny", 1, control=True)),
                   findings=PAPER_FINDINGS),
    "paper": Preset((Group("featuregate", "76m", 7), Group("featuregate", "504m", 3)),
                    findings=PAPER_FINDINGS),
    "trend": Preset((), seeds=trend.SEEDS),  # the groups: trend.LADDER's points
    "vision": Preset(
        tuple(Group(arch, "tiny", dense=twin) for arch, twin in (
            ("vit-moe", "dense-vit"), ("tokenprune", "dense-vit"), ("condconv", "dense-cnn"))),
        title="Vision families on digits (mean over seeds; penalties in nats of "
              f"cross-entropy, {_SPANNED})",
        rows=_VISION,
        columns=(("family", "{label}"), ("seeds", "{seeds}"),
                 ("accuracy (twin)", "{num accuracy_correct 3} ({num twin_accuracy 3})"),
                 (REASSIGN, "{penalty reassign}"), (SHUFFLE, "{penalty shuffle}"),
                 ("static-layer retention", "{percent retention_static_layer}"),
                 ("static-layer-position retention",
                  "{position_percent retention_static_layer_position}"),
                 ("executed", "{executed}"), ("FLOPs vs twin", "{num flops_ratio 3 x}"),
                 ("latency vs twin", "{num speed_ratio 2 x}")),
        findings=VISION_FINDINGS, missing="not applicable (no position axis)"),
    "ssm": Preset(
        (Group("mamba", "tiny", dense="s4d", schedule=CORPUS_SCHEDULE),
         Group("mamba", "tiny", dense="s4d", task=TASK)),
        title="Mamba and its LTI twin (S4D) on the corpus and on selective copying (mean over "
              f"seeds; penalties in the task's loss, {_SPANNED}; retentions in % of the "
              "Correct-to-GlobalMean gap)",
        rows=((_CORPUS, "built-in corpus"), (_COPY, "selective copying")),
        columns=(("task", "{label}"), ("seeds", "{seeds}"), ("Mamba (LTI twin)", "{score}"),
                 (REASSIGN, "{penalty reassign}"), (SHUFFLE, "{penalty shuffle}"),
                 *((f"{p} retention", f"{{retention {p}}}")
                   for p in (STATIC_LAYER, STATIC_LAYER_POSITION, STATIC_LAYER_TOKEN)),
                 ("token-id share of Δ", "{token_share dt}"), ("execution", "{execution}")),
        findings=SSM_FINDINGS),
    "exit": Preset(
        (Group("earlyexit", "tiny"), Group("ponder", "tiny", dense="dense-ponder"),
         Group("branchy", "tiny", dense="dense-cnn")),
        title="Early exit and adaptive depth against their full-depth twins (mean over seeds; "
              f"penalties in the task's loss against the learned rule, {_SPANNED})",
        rows=_EXITS,
        columns=(("family", "{label}"), ("seeds", "{seeds}"), ("score (twin)", "{score}"),
                 ("mean executed depth", "{depth}"), ("vs twin", "{versus_twin}"),
                 ("static-layer retention", f"{{exit_retention {STATIC_LAYER}}}"),
                 (FIXED_EXIT, f"{{penalty {FIXED_EXIT}}}"),
                 (ORACLE_EXIT, f"{{penalty {ORACLE_EXIT}}}"),
                 ("share of fixed-to-oracle gap closed", "{gap_closed}"),
                 ("fixed − learned at matched depth", "{matched}")),
        findings=EXIT_FINDINGS),
    "fold": Preset(
        (*(Group(arch, "tiny", dense=None, schedule=CORPUS_SCHEDULE, fold=condition,
                 heal=HEAL_STEPS) for arch, condition in _FOLDED),
         Group("mamba", "tiny", dense=None, task=TASK, fold=STATIC_LAYER, heal=HEAL_STEPS)),
        title="Each family folded at one condition: exactness, speed against the original "
              "and the dense twin (untrained: only its speed is read), and healing against "
              f"the original fine-tuned alike (mean over seeds, {_SPANNED})",
        rows=_FOLD_ROWS,
        columns=(("family, condition folded", "{label}"), ("seeds", "{seeds}"),
                 ("penalty in the audit", "{estimate fold_penalty +3}"),
                 ("largest loss difference", "{max fold_max_diff:.2g}"),
                 ("latency / original", "{estimate fold_latency_source 3}"),
                 ("FLOPs / original", "{num fold_flops_source 3}"),
                 ("latency / dense twin", "{estimate fold_latency_twin 3}"),
                 ("penalty before healing", "{estimate heal_before +4}"),
                 ("after healing", "{estimate heal_after +4}"),
                 ("recovered", "{estimate heal_recovered 1 %}")),
        findings=FOLD_FINDINGS),
    "tasks": Preset(
        tuple(Group(arch, "tiny", dense=None, schedule=CORPUS_SCHEDULE, benchmarks=True)
              for arch in ("featuregate", "moe", "mamba")),
        title="Benchmark tasks beside the NLL: next-word choice among four words and a cloze "
              "built from the evaluation plays (mean over seeds, accuracy and perplexity "
              f"{_SPANNED}; retentions in % of the Correct-to-GlobalMean gap)",
        rows=_BENCHMARKED,
        columns=(("family", "{label}"), ("seeds", "{seeds}"),
                 (f"NLL retention, {STATIC_LAYER}", f"{{retention {STATIC_LAYER}}}"),
                 ("next word: accuracy", _estimate(_NEXT, CORRECT, "3")),
                 (f"under {STATIC_LAYER}", _estimate(_NEXT, STATIC_LAYER, "3")),
                 ("retention", _estimate(_NEXT, STATIC_LAYER, "1 %", "retention")),
                 ("cloze: perplexity", _estimate(_CLOZE, CORRECT, "1")),
                 (f"cloze under {STATIC_LAYER}", _estimate(_CLOZE, STATIC_LAYER, "1")),
                 ("cloze retention", _estimate(_CLOZE, STATIC_LAYER, "1 %", "retention"))),
        findings=TASK_FINDINGS),
}
STUDY_PRESETS = tuple(PRESETS)


def study(preset: str, seeds: int | None) -> list[Group]:
    """The groups of a study preset (``--seeds`` overrides every group's seed count but a
    fixed one's); the groups of one trend point are consecutive."""
    if preset not in PRESETS:
        raise refusal(f"unknown study preset {preset!r}", preset, list(STUDY_PRESETS))
    n = seeds or PRESETS[preset].seeds
    if preset == "trend":
        return [Group(arch, p.size, n, dense="own" if arch == "featuregate" else None,
                      schedule=p.schedule, point=p.name)
                for p in trend.LADDER for arch in p.arches]
    return [dataclasses.replace(g, seeds=g.seeds if g.control else seeds or g.seeds or n)
            for g in PRESETS[preset].groups]


# What the paper reported (fcaudit.study.paper), shown beside our aggregates.
PAPER = {
    "featuregate": {keys.RETENTION_LAYER: paper.retention_text(),
                    "eta2_layer": paper.eta2_text(), "blocks": "every block runs",
                    "speed_ratio": f"{paper.SPEED_RATIO} "
                                   f"({100 * (paper.SPEED_RATIO - 1):.1f}% slower than Dense)"},
    "mudd": {REASSIGN: f"+{paper.MUDD[keys.DELTA_REASSIGN]} nats (MUDDPythia-1.4B)",
             SHUFFLE: f"+{paper.MUDD[keys.DELTA_SHUFFLE]} nats",
             "static": "static replacement also hurts strongly", "blocks": "every block runs"},
    "moe": {"routing": "the paper names sparse experts and token routing as dynamic "
                       "mechanisms; it reports no MoE measurement"},
}

# The rows of each group's table in reproduction.md: metric key, label, digits, percent.
ROWS: tuple[tuple[str, str, int, bool], ...] = (
    (keys.NLL_CORRECT, "NLL (correct replay; classification: cross-entropy)", 4, False),
    (keys.ACCURACY_CORRECT, "accuracy (correct replay)", 4, False),
    ("twin_accuracy", "dense twin's accuracy", 4, False),
    *((keys.delta_key(n), f"penalty: {n}", 4, False) for n in RANDOM_CONDITIONS),
    ("interaction", "factorial interaction", 4, False),
    *((keys.delta_key(n), f"penalty: {n}", 4, False) for n in STATIC_CONDITIONS),
    *((keys.retention_key(p), f"retention: {p}", 2, True) for p in RETENTION_PROFILES),
    ("eta2_layer", "eta2 layer", 3, False),
    ("eta2_position", "eta2 position", 3, False),
    ("eta2_layer_position", "eta2 layer x position", 3, False),
    ("eta2_component", "eta2 component (which entry of a coefficient vector)", 3, False),
    ("eta2_residual", "eta2 residual (content)", 3, False),
    ("eta2_token_id", "token-id share of within-layer variance", 3, False),
    ("eta2_token_id_chance", "its chance level, (ids - 1) / (tokens - 1)", 3, False),
    ("epsilon2_token_id", "token-id share beyond chance (epsilon squared)", 3, False),
    ("blocks_executed_fraction", "blocks executed / present", 3, False),
    ("flops_ratio", "FLOPs ratio vs dense", 3, False),
    ("experts_executed_fraction", "experts executed / present", 3, False),
    ("tokens_executed_fraction", "patch tokens entering blocks / dense twin's", 3, False),
    *((keys.rerouted_key(n), f"expert sets re-routed: {n}", 3, False) for n in keys.REROUTED),
    ("speed_ratio", "time ratio vs dense", 3, False),
    ("frontier_gap_25", "frontier gap at 25% FLOPs saved (best static - dynamic, nats)", 4,
     False),
    ("frontier_own_delta", "own-threshold frontier point: penalty (nats)", 4, False),
    ("frontier_own_flops_saved", "own-threshold frontier point: FLOPs saved, counted", 3,
     False),
    ("frontier_measured_flops_saved", "FLOPs saved measured against dense", 3, False),
    ("frontier_on_curve", "on its own dynamic curve (1 = yes)", 0, False),
)
