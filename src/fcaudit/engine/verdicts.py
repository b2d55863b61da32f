"""Verdicts: one sentence per question, backed by the numbers, with thresholds defined once
(the execution audit's too: ``TOLERANCE`` for savings, ``SPEED_TOLERANCE`` for latency).

Every dependence label rests on 95% intervals that support it. A change of the loss
counts only above ``NEGLIGIBLE`` (1% of perplexity). Static-layer retention makes a label
only when it is measurable (defined: its gap's interval above 0 and its own interval no
wider than the 0-100% scale) on a gap whose interval lies above ``NEGLIGIBLE``. Dependence
is *strong* when the reassign or shuffle penalty's interval lies above ``STRONG_PENALTY``
or that retention's interval lies below ``STRONG_RETENTION``; *weak* when the retention's
interval lies at or above ``WEAK_RETENTION`` and both penalties' intervals below
``WEAK_PENALTY``; *none* when no retention makes a label, no penalty's interval lies above
``NEGLIGIBLE`` and some lies below 0 (an intervention that lowers the NLL is no
dependence: the sentence says which, by how much); *unresolved* (no measurable
dependence) when no retention makes a label and no penalty's interval lies above
``NEGLIGIBLE`` or below 0; *partial* otherwise (some interval above ``NEGLIGIBLE``, or a
retention that makes a label between the strong and weak bounds).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from fcaudit.core.conditions import (
    CONDITIONS,
    CORRECT,
    GLOBAL_MEAN,
    REASSIGN,
    SHUFFLE,
    STATIC_LAYER,
    by_role,
)
from fcaudit.core.exits import MASKED, plural
from fcaudit.core.kinds import KINDS
from fcaudit.engine.frontier_parts import ExitSummary
from fcaudit.engine.result import (
    ConditionResult,
    Estimate,
    Execution,
    ExecutionSection,
    ExpertExecution,
    Identity,
    Retention,
    VarianceShares,
    Variation,
    Verdict,
    VerdictPart,
)
from fcaudit.engine.result_parts import (
    EXECUTION_LABELS,
    EXIT_LABELS,
    EXITS,
    QUESTIONS,
    VARIATION_LABELS,
)
from fcaudit.engine.result_views import delta_key, retention_key, with_interval

STRONG_PENALTY = 0.1  # nats, lower CI bound of reassign or shuffle
STRONG_RETENTION = 50.0  # percent, upper CI bound of static-layer retention
WEAK_RETENTION = 90.0  # percent, lower CI bound of static-layer retention
WEAK_PENALTY = 0.05  # nats, upper CI bound of reassign and shuffle
VARIES_SD = 1e-6  # spread below which coefficients "do not vary"
TOLERANCE = 0.01  # relative saving in blocks or FLOPs below which nothing is "saved"
SPEED_TOLERANCE = 0.02  # latency ratios within 2% of 1 are no clear difference
# The smallest change of the loss that counts: 1% of perplexity (the exponential of the
# loss; the same 1% below which fewer blocks or FLOPs are no saving). An interval clear of
# 0 but not of this proves a real change too small to matter: it makes no label, nor does
# a retention's share of a Correct-to-GlobalMean gap that small (a random model's gap of
# 1e-4 nats can be clear of 0, and a share of it says nothing about dependence).
NEGLIGIBLE = math.log1p(TOLERANCE)  # nats (0.00995)
NEGLIGIBLE_WORDS = f"{100 * TOLERANCE:g}% of perplexity"  # as sentences say it


def variation_part(variance: Mapping[str, VarianceShares],
                   spread: Mapping[str, Variation]) -> VerdictPart:
    """Whether the coefficients vary, family by family, with the spreads it rests on."""
    parts, varies, numbers = [], [], {}
    for family, v in spread.items():
        eta = variance[family]
        vary = v.mean_sd_across_inputs > VARIES_SD or v.mean_sd_across_positions > VARIES_SD
        varies.append(vary)
        numbers |= {f"{family}.sd_across_inputs": v.mean_sd_across_inputs,
                    f"{family}.sd_across_positions": v.mean_sd_across_positions,
                    f"{family}.sd_across_layers": v.across_layer_sd}
        parts.append(
            f"{family}: coefficients {'vary' if vary else 'do not vary'} (sd across inputs "
            f"{v.mean_sd_across_inputs:.3g}, across positions {v.mean_sd_across_positions:.3g}, "
            f"across layers {v.across_layer_sd:.3g}); {eta.sentence()}")
    label = VARIATION_LABELS[0 if all(varies) else 1 if any(varies) else 2]
    return VerdictPart(label, numbers, "; ".join(parts) + ".")


# the phrase each penalty is said with, from the registry
PENALTIES = {name: CONDITIONS[name].penalty or name for name in by_role("penalty")}


def _retention_labels(sl: Retention) -> bool:
    """Whether static-layer retention may make a dependence label: measurable (a value
    and its interval) on a Correct-to-GlobalMean gap whose interval lies above
    ``NEGLIGIBLE``."""
    return sl.value is not None and sl.ci95 is not None and sl.gap_ci95[0] > NEGLIGIBLE


def _judge(conditions: Mapping[str, ConditionResult], sl: Retention) -> tuple[str, str]:
    """The verdict's label and the head of its sentence; each label rests on intervals
    that support it (the module's rules)."""
    # conditions not applicable to the sites (no position axis, no token ids) are absent
    main = [conditions[n] for n in by_role("dependence") if n in conditions]
    above = [n for n in PENALTIES if n in conditions and conditions[n].ci95[0] > NEGLIGIBLE]
    below = [n for n in PENALTIES if n in conditions and conditions[n].ci95[1] < 0]
    kept = sl.ci95 if _retention_labels(sl) else None
    if max(c.ci95[0] for c in main) > STRONG_PENALTY or (kept is not None
                                                         and kept[1] < STRONG_RETENTION):
        return "strong", "Strong dependence on the coefficient assignment"
    if kept is not None and kept[0] >= WEAK_RETENTION and \
            max(c.ci95[1] for c in main) < WEAK_PENALTY:
        return "weak", "Weak dependence on the coefficient assignment"
    if kept is None and not above and below:
        helps = "; ".join(f"{PENALTIES[n]} lowers the NLL by {-conditions[n].delta:.4f} nats "
                          f"[{-conditions[n].ci95[1]:.4f}, {-conditions[n].ci95[0]:.4f}]"
                          for n in below)
        return "none", (f"No dependence on the coefficient assignment (no penalty's 95% "
                        f"interval lies above {NEGLIGIBLE_WORDS}, and {helps}: the model does "
                        "not need its coefficients matched to their input and token)")
    if kept is None and not above:
        return "unresolved", ("No measurable dependence on the coefficient assignment (no "
                              f"penalty's 95% interval lies above {NEGLIGIBLE_WORDS} or below "
                              "0, and no retention of a measurable gap: none found, or too "
                              "few sequences to resolve one)")
    return "partial", "Partial dependence on the coefficient assignment"


def _kept_text(sl: Retention) -> str:
    """What static-layer retention says, and why it makes no label when it makes none."""
    if sl.value is None or sl.ci95 is None:
        why = sl.reason if sl.gap_ci95[0] > 0 and sl.reason else \
            "no clear Correct-to-GlobalMean gap"
        return f"static-profile retention is undefined ({why})"
    text = (f"a static per-layer profile keeps {sl.value:.2f}% [{sl.ci95[0]:.2f}, "
            f"{sl.ci95[1]:.2f}] of the Correct-to-GlobalMean gap")
    if _retention_labels(sl):
        return text
    return (f"{text}, but that gap, {sl.gap:.3g} nats [{sl.gap_ci95[0]:.3g}, "
            f"{sl.gap_ci95[1]:.3g}], does not lie above {NEGLIGIBLE_WORDS} ({NEGLIGIBLE:.3g} "
            "nats): too small for its share to make a label")  # 3 digits: the gap is tiny


def _dependence_numbers(conditions: Mapping[str, ConditionResult],
                        sl: Retention) -> dict[str, float | None]:
    """The penalties the dependence verdict reads, the per-layer profile's retention and
    the gap that retention is a share of (global-mean's penalty)."""
    out: dict[str, float | None] = {}
    for name in by_role("dependence"):
        if (c := conditions.get(name)) is not None:
            out |= with_interval(delta_key(name), c.delta, c.ci95)
    return out | with_interval(retention_key(STATIC_LAYER), sl.value, sl.ci95) | \
        with_interval(delta_key(GLOBAL_MEAN), sl.gap, sl.gap_ci95)  # the gap it is a share of


def dependence_part(conditions: Mapping[str, ConditionResult],
                    retention: Mapping[str, Retention], across: str = "tokens") -> VerdictPart:
    """The dependence verdict; ``across``: what shuffle permutes, in the sites' own axis
    names (tokens, patches, rows and columns)."""
    r, s = conditions[REASSIGN], conditions.get(SHUFFLE)
    sl = retention[STATIC_LAYER]
    shuffled = f"shuffling them across {across} {s.delta:+.4f} [{s.ci95[0]:+.4f}, " \
        f"{s.ci95[1]:+.4f}]" if s is not None else \
        "shuffling is not applicable (the coefficients have no position axis)"
    label, head = _judge(conditions, sl)
    return VerdictPart(label, _dependence_numbers(conditions, sl),
                       f"{head}: reassigning coefficients across inputs costs "
                       f"{r.delta:+.4f} nats [{r.ci95[0]:+.4f}, {r.ci95[1]:+.4f}], {shuffled}; "
                       f"{_kept_text(sl)}.")


def execution_part(e: ExecutionSection, exits: ExitSummary | None = None) -> VerdictPart:
    """The execution verdict, also when it was not measured (then with the reason); exits
    that are counted, not realised, read as the depth a model that skipped would run."""
    if not e.measured:
        return VerdictPart(EXECUTION_LABELS[2], {}, f"Execution not measured: {e.reason}.")
    numbers = {"blocks_executed": e.blocks_executed, "flops_ratio": e.flops_ratio,
               "blocks_present": None if e.blocks_present is None else float(e.blocks_present)}
    if e.mode == MASKED and exits is not None:
        return VerdictPart(EXECUTION_LABELS[3], numbers, _masked_sentence(e, exits))
    label = 4 if e.conditional_execution is None else 0 if e.conditional_execution else 1
    return VerdictPart(EXECUTION_LABELS[label], numbers, verdict_execution(e))


def _masked_sentence(e: Execution, exits: ExitSummary) -> str:
    """Exits counted, not realised: every layer (and every exit head) ran, so this pass's
    FLOPs and time are no deployment's; the exits' depth says what skipping exited layers
    would run. A degenerate rule's depth is one fixed depth's, said as such."""
    unit, depth = e.unit or "token", exits.evaluation_mean_depth
    blocks = f"{depth:.2f} of {exits.depth} layers per {unit}"
    share = f" ({100 * depth / exits.depth:.0f}% of the layers)"
    heads = (f"; this pass cost {e.flops_ratio:.2f}x the model's own FLOPs, the price of "
             "reading an exit head at every layer") if e.flops_ratio is not None else ""
    fixed = f" The exit rule is degenerate: {e.degenerate_rule}." if e.degenerate_rule else ""
    return (f"Exits counted, not realised: every layer ran on every {unit} and an exited "
            f"{unit}'s updates were discarded, so no FLOPs or time were saved here; a model "
            f"that skipped the exited layers would run {blocks}{share}{heads}.{fixed}")


def exits_part(ex: ExitSummary | None, correct: ConditionResult,
               loss: str) -> VerdictPart | None:
    """Where an exit model's units stop, what stopping costs against the model run to full
    depth, and whether a fixed exit at the same mean depth does as well (None: no exits
    measured). The label rests on the matched-depth interval: a learned rule is only
    "adaptive" where a static depth of the same mean compute loses, clear of 0."""
    if ex is None:
        return None
    unit = plural(ex.unit or "token")
    lo, hi = ex.evaluation_mean_depth_ci95 or [ex.evaluation_mean_depth] * 2
    parts = [f"{unit} stop after {ex.evaluation_mean_depth:.2f} of {ex.depth} layers on "
             f"average [{lo:.2f}, {hi:.2f}] (the oracle's depth {ex.oracle_mean_depth:.2f}, "
             f"fixed exit's {ex.fixed_exit_depth})"]
    numbers: dict[str, float | None] = {"exits.mean_depth": ex.evaluation_mean_depth}
    f = ex.frontier
    full = next((p for p in (f.points if f else []) if p.rule == "fixed"
                 and p.mean_depth == ex.depth), None)
    if full is not None:  # loss(full depth) - loss(correct): minus the cost of exiting
        cost, (c_lo, c_hi) = -full.delta.value, (-full.delta.ci95[1], -full.delta.ci95[0])
        parts.append(f"exiting costs {cost:+.4f} nats [{c_lo:+.4f}, {c_hi:+.4f}] of {loss} "
                     f"against the full model ({correct.nll:.4f} with exits, "
                     f"{correct.nll - cost:.4f} at full depth)")
        numbers |= with_interval("exits.exiting_cost", cost, [c_lo, c_hi])
    label = EXIT_LABELS[3] if ex.note else None
    if f is not None:
        gap = f.matched_depth.gap
        numbers |= with_interval("exits.matched_depth_gap", gap.value, gap.ci95)
        text = f"{gap.value:+.4f} [{gap.ci95[0]:+.4f}, {gap.ci95[1]:+.4f}]"
        if gap.ci95[0] > 0:
            label, said = label or EXIT_LABELS[0], (f"a fixed exit at the same mean depth "
                                                    f"does worse by {text}: the learned rule "
                                                    "beats a static depth")
        elif gap.ci95[1] < 0:
            label, said = label or EXIT_LABELS[2], (
                f"a fixed exit at the same mean depth does better by {-gap.value:.4f} nats "
                f"[{-gap.ci95[1]:.4f}, {-gap.ci95[0]:.4f}]: a static depth beats the learned "
                "rule")
        else:
            label, said = label or EXIT_LABELS[1], (f"a fixed exit at the same mean depth "
                                                    f"does as well ({text}, interval "
                                                    "includes 0): a static depth is as good")
        parts.append(said)
    text = "; ".join(parts)
    head = f"Degenerate exit rule: {ex.note}; " if ex.note else ""
    return VerdictPart(label, numbers, head + (text if head else text[0].upper() + text[1:])
                       + ".")


def kind_caveat(kinds: Mapping[str, str]) -> str:
    """For families (``family -> kind name``) whose kind makes a dependence mean something
    other than a controller's (an activation, hidden states): what it means, said after
    the dependence answer."""
    said = []
    for name in dict.fromkeys(kinds.values()):
        kind = KINDS.get(name)
        if kind is not None and kind.dependence:
            families = ", ".join(f for f, k in kinds.items() if k == name)
            said.append(f" The coefficients of {families} are {kind.dependence}.")
    return "".join(said)


def judge(variance: Mapping[str, VarianceShares], spread: Mapping[str, Variation],
          conditions: Mapping[str, ConditionResult], retention: Mapping[str, Retention],
          across: str, execution: ExecutionSection, identity: Identity | None,
          exits: ExitSummary | None = None, loss: str = "NLL",
          kinds: Mapping[str, str] | None = None
          ) -> tuple[Verdict, dict[str, dict[str, float | None]]]:
    """The audit's :class:`Verdict` (sentences qualified by the identity check, labels)
    and the numbers each answer rests on, by question (exit models: ``exits`` too);
    ``kinds``: each family's kind, which may say what its dependence means."""
    dependence = dependence_part(conditions, retention, across)
    dependence = VerdictPart(dependence.label, dependence.numbers,
                             dependence.sentence + kind_caveat(kinds or {}))
    parts = dict(zip(QUESTIONS, (variation_part(variance, spread), dependence,
                                 execution_part(execution, exits)), strict=True))
    exited = exits_part(exits, conditions[CORRECT], loss)
    verdict = Verdict(*(qualified(p.sentence, identity) for p in parts.values()),
                      *(p.label for p in parts.values()),
                      **({EXITS: qualified(exited.sentence, identity),
                          f"{EXITS}_label": exited.label} if exited else {}))
    numbers = {q: p.numbers for q, p in parts.items()}
    return verdict, numbers | ({EXITS: exited.numbers} if exited else {})


def qualified(sentence: str, identity: Identity | None) -> str:
    """A verdict prefixed with the identity warning when replay was not exact."""
    if identity is None or identity.exact:
        return sentence
    return (f"[NOT EXACT: identity replay differs from the original pass by up to "
            f"{identity.max_abs_diff:.3g} nats per token; read with care] {sentence}")


def _speed_word(ratio: Estimate) -> str:
    (lo, hi), value = ratio.ci95, ratio.value
    if lo > 1 and value > 1 + SPEED_TOLERANCE:
        return "slower"
    if hi < 1 and value < 1 - SPEED_TOLERANCE:
        return "faster"
    return "no clear difference"


def verdict_execution(e: Execution) -> str:
    """One sentence answering "does the mechanism change what is computed?", with numbers;
    for a routed model the experts come first, then blocks and FLOPs against Dense. The
    head word is ``conditional_execution``; the routed-model parts agree with
    ``experts.routing_changes_computation`` and ``saves_against_dense``."""
    if e.dense_blocks_executed is None and e.experts is None and not e.degenerate_rule:
        return _alone_sentence(e)
    head = "Conditional execution" if e.conditional_execution else "No conditional execution"
    if e.experts is not None:
        saved = ("no dense counterpart to compare with" if e.saves_against_dense is None
                 else "savings against Dense" if e.saves_against_dense
                 else "no savings against Dense")
        head = f"{head}: {_experts_sentence(e.experts)} Blocks and FLOPs: {saved}"
    if e.degenerate_rule:  # said first: every number after it is a fixed depth's
        head = (f"{head}{'; ' if e.experts is not None else ': '}the exit rule is "
                f"degenerate, {e.degenerate_rule}. Blocks and FLOPs")
    if e.uncounted_operators:
        flops = (f"FLOPs not compared: the counter cannot count "
                 f"{', '.join(e.uncounted_operators)}")
    elif e.flops_ratio is not None:
        flops = f"FLOPs {e.flops_ratio:.3f}x Dense"
    else:
        flops = "no FLOPs compared" if e.dense_flops_per_token is None else "no FLOPs counted"
    dense = f" (Dense {e.dense_blocks_executed:.2f})" if e.dense_blocks_executed is not None \
        else ""
    text = (f"{head}: {e.blocks_executed:.2f} of {e.blocks_present} blocks run per "
            f"{e.unit or 'token'}"
            f"{dense}, {flops}")
    if e.timing is not None:
        ratio = e.timing.speed_ratio_vs_dense
        lo, hi = ratio.ci95
        text += f"; latency {ratio.value:.2f}x Dense [{lo:.2f}, {hi:.2f}]" + \
            ("" if e.degenerate_rule else f", {_speed_word(ratio)}")
    elif e.dense is not None:
        text += "; latency not measured"
    if e.degenerate_rule:
        text += (f"; these are the costs of one fixed depth for every {e.unit or 'token'}, "
                 "none of it a saving of conditional execution")
    return text + "."


def flops_text(flops: float) -> str:
    """A FLOP count in the unit that keeps it readable (GFLOPs, MFLOPs, kFLOPs)."""
    for unit, scale in (("GFLOPs", 1e9), ("MFLOPs", 1e6), ("kFLOPs", 1e3)):
        if flops >= scale:
            return f"{flops / scale:.3g} {unit}"
    return f"{flops:.3g} FLOPs"


def _alone_sentence(e: Execution) -> str:
    """The execution answer counted on the model alone (no dense counterpart, no experts):
    every block on every unit is no conditional execution; blocks skipped are said, but
    with nothing to compare, no saving is claimed. Then what a twin would be."""
    unit = e.unit or "token"
    present = e.blocks_present or 0
    if e.uncounted_operators:
        flops = f"FLOPs not counted in full ({', '.join(e.uncounted_operators)})"
    else:
        flops = f"{flops_text(e.flops_per_token or 0.0)} per {unit}"
    if e.conditional_execution is None:
        head = (f"Execution not compared: {e.blocks_executed:.2f} of {present} blocks run per "
                f"{unit}, {flops}, counted on the model alone; without a dense counterpart no "
                "saving is shown")
    else:
        ran = (f"every block runs on every {unit} ({present} of {present})"
               if e.blocks_executed == present else
               f"{e.blocks_executed:.2f} of {present} blocks run per {unit} (within "
               f"{100 * TOLERANCE:g}% of all)")
        head = f"No conditional execution: {ran}, {flops}, counted on the model alone"
    return f"{head}; {e.twin_note or 'no dense counterpart given'}."


def _experts_sentence(x: ExpertExecution) -> str:
    share = (f" ({100 * x.active_expert_flops_per_token / x.all_expert_flops_per_token:.1f}% "
             "of the expert FLOPs every expert would cost)"
             if x.active_expert_flops_per_token and x.all_expert_flops_per_token else "")
    checked = "" if x.matches_routing else \
        " WARNING: the experts that ran differ from the routers' choices."
    runs = (f"each token runs {x.experts_per_token_mean_over_layers:.2f} of "
            f"{x.experts_present_text()} experts per routed layer")
    if x.routing_changes_computation:
        return (f"routing changes what is computed (experts skipped per token): {runs}, the "
                f"ones its router picks{share}.{checked}")
    return (f"routing does not change what is computed: {runs} (every expert); the router "
            f"only weights them.{checked}")
