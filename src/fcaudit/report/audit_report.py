"""Human-facing audit report: ``report.md``, ``report.html`` and figures from an AuditResult.

The report is written once, as Markdown with GFM tables; ``report.html`` is that
Markdown rendered by markdown-it-py with raw HTML disabled, so the two never disagree
and nothing in a result (a model spec, a path, a site name) can inject markup. Every
string taken from the result is also Markdown-escaped (or put in a code span), so it
cannot break a table, start emphasis or make a link. The HTML is self-contained: inline
CSS, figures as base64 PNG, no scripts, no network (a Content-Security-Policy enforces
it). The three answers (variation, dependence, execution) come first, then the detail
tables and a reproducibility section. Output is deterministic and written atomically.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from fcaudit.core.conditions import (
    CONDITIONS,
    GLOBAL_MEAN,
    REPORTED_CONDITIONS,
    REPORTED_RETENTION,
    SHUFFLE,
    STATIC_LAYER,
    by_role,
)
from fcaudit.core.exits import plural
from fcaudit.engine.result import (
    EXECUTION_LABELS,
    AuditResult,
    ConditionResult,
    Execution,
    Identity,
    NotMeasured,
    Retention,
    condition_rows,
)
from fcaudit.io.data import picked_note, source_words
from fcaudit.io.fileio import PLAIN_FILES, FileWriter
from fcaudit.report.figures import RenderedFigure, write_figures
from fcaudit.report.format import (
    fmt_ci,
    fmt_count,
    fmt_finite,
    fmt_num,
    fmt_pct,
    fmt_seq,
    fmt_with_ci,
)
from fcaudit.report.kinds import kind_facts, twin_facts
from fcaudit.report.markdown import (
    FIGURE_DIR,
    md_code,
    md_figures,
    md_table,
    md_text,
    one_line,
    to_html,
)
from fcaudit.report.report_parts import FIGURE_PLACES, _by_family, _figure_specs, _ordered
from fcaudit.report.reproducibility import reproducibility_section
from fcaudit.report.sections import analysis_sections
from fcaudit.report.sections.exits import exit_unit
from fcaudit.report.selection import (
    dependence_fact,
    execution_note,
    lti_statement,
    profile_note,
    variation_facts,
)
from fcaudit.report.stopping import stopping_section
from fcaudit.report.variation import per_layer_section, variance_section, variation_section

# ---------------------------------------------------------------------------
# The identity replay: a non-exact one is a warning everywhere a verdict is given.

IDENTITY_WARNING = "Warning: the identity replay is not exact."


def _inexact(result: AuditResult) -> Identity | None:
    """The identity check when it failed (an audit only completes so with the user's
    explicit ``--allow-nonexact-identity``)."""
    ident = result.identity
    return ident if ident is not None and not ident.exact else None


def _identity_warning(ident: Identity, loss: str) -> str:
    note = f" {md_text(ident.note)}" if ident.note else ""
    return (f"> **{IDENTITY_WARNING}** Replaying the recorded coefficients (`correct`) does "
            f"not reproduce the original pass bit for bit: max |Δ {loss}| = "
            f"{fmt_num(ident.max_abs_diff)} nats. The audit was run with "
            "`--allow-nonexact-identity`, so every penalty, retention and verdict below is "
            f"measured against an inexact reference.{note}")


def _verdict_warning(ident: Identity, loss: str) -> str:
    return (f"> **{IDENTITY_WARNING}** This verdict rests on an inexact reference "
            f"(max |Δ {loss}| = {fmt_num(ident.max_abs_diff)} nats).")


# ---------------------------------------------------------------------------
# Sections; each returns Markdown blocks.

NOT_MEASURED = EXECUTION_LABELS[2]
CONDITION_MEANING = {name: CONDITIONS[name].meaning for name in REPORTED_CONDITIONS}


def _lead(r: AuditResult) -> str:
    """What was audited on what data, in one paragraph before the answers: the model, the
    evaluation and calibration sets (where they were picked from, how long the window is
    and why), and what every loss and Δ is."""
    m, data = r.model, r.data
    about = ", ".join([md_text(m.class_), f"{fmt_num(m.n_params)} parameters", md_text(m.dtype)])
    text = f"Model {md_code(m.spec)} ({about}), audited on "
    if data.get("eval_sequences") is not None:
        said = [f"{fmt_num(data['eval_tokens'])} tokens"] if data.get("eval_tokens") else []
        if data.get("seq_len"):
            source, _ = source_words(str(data.get("seq_len_source") or "source not recorded"))
            said.append(f"window length: {md_text(source)}")
        window = f" of {fmt_num(data['seq_len'])} tokens" if data.get("seq_len") else ""
        text += (f"{fmt_num(data['eval_sequences'])} evaluation sequences{window}"
                 + (f" ({'; '.join(said)})" if said else "") + " and "
                 f"{fmt_num(data.get('calib_sequences'))} calibration sequences")
    else:  # inputs that are not token ids
        text += (f"{fmt_num(data.get('eval_examples'))} evaluation examples and "
                 f"{fmt_num(data.get('calib_examples'))} calibration examples")
    text += ". "
    if picked := picked_note(data):  # a cap or a shortfall of --max-eval / --max-calib
        text += f"{md_text(picked[:1].upper() + picked[1:])}. "
    if data.get("eval_examples") is not None:
        return text + (f"Loss: {md_code(r.settings.get('objective', ''))} in nats per unit; "
                       "every Δ is against the correct replay (the model fed its own "
                       "recorded coefficients).")
    return text + ("NLL in nats per token; every Δ is against the correct replay (the model "
                   "fed its own recorded coefficients).")


def _variation_facts(r: AuditResult) -> list[str]:
    facts = []
    for fam, var in _by_family(r, r.variance):  # unless the answer says it word for word
        if var.sentence() not in (r.verdict.variation or ""):
            facts.append(f"{md_code(fam)}: {md_text(var.sentence())}.")
    for fam, v in _by_family(r, r.variation):
        facts.append(f"{md_code(fam)}: sd across inputs {fmt_num(v.mean_sd_across_inputs)} and "
                     f"across positions {fmt_num(v.mean_sd_across_positions)}, vs "
                     f"{fmt_num(v.across_layer_sd)} across layers.")
    return facts + variation_facts(r)


def _dependence_facts(r: AuditResult) -> list[str]:
    facts = [f"{md_code(name)}: Δ {r.loss_name()} {fmt_with_ci(c.delta, c.ci95)} nats vs "
             "correct."
             for name in (*by_role("dependence"), STATIC_LAYER, GLOBAL_MEAN)
             if (c := r.conditions.get(name))]
    return kind_facts(r) + facts + [f"{md_code(name)}{_retention_text(ret)}"
                    for name, ret in _ordered(r.retention, REPORTED_RETENTION)] + \
        dependence_fact(r)


def _retention_text(ret: Retention) -> str:
    if ret.value is None:
        return " gap retention: undefined" + (f" ({md_text(ret.reason)})." if ret.reason else ".")
    interval = f" (95% CI {fmt_ci(ret.ci95, 2)})" if ret.ci95 else ""
    return f" keeps {fmt_pct(ret.value)}{interval} of the correct-to-global-mean gap."


def _unit(ex: Execution) -> str:
    """What the execution audit counts per: a token, or an example (other inputs)."""
    return ex.unit or "token"


def _batch(size: int, length: int, unit: str) -> str:
    """A timed batch in its unit: ``8 × 64 tokens``, or ``8 examples`` (one unit each)."""
    return f"{size} × {length} tokens" if unit == "token" else f"{size} {unit}s"


def conditional_meaning(unit: str) -> str:
    """What makes conditional execution "yes", said once for every page that shows it."""
    return (f"fewer blocks or FLOPs per {unit} than dense, or experts skipped per token by "
            "routing")


def _conditional(ex: Execution, more: str = "") -> str:
    """The conditional-execution line: its value, then what would make it yes (or what
    yes means) as a sentence of its own, so the definition never reads as the value's
    reason; a degenerate exit rule says why its fewer blocks or FLOPs are not counted."""
    why = (f"; a degenerate exit rule's fewer blocks or FLOPs are not counted: "
           f"{md_text(ex.degenerate_rule)}" if ex.degenerate_rule else "")
    meaning = conditional_meaning(_unit(ex))
    said = f"Yes means {meaning}" if ex.conditional_execution else \
        f"It would be yes with {meaning}"
    return (f"Conditional execution: **{fmt_num(ex.conditional_execution)}**. "
            f"({said}{why}.){more}")


def _not_measured(ex: Execution) -> str:
    return f"Execution was not measured: {md_text(ex.reason or 'no reason recorded')}."


def _controller_cost(ex: NotMeasured) -> list[str]:
    """Where the model runs, its speed with the controllers computing against their
    outputs supplied."""
    c = ex.controller_cost
    if c is None:
        return []
    return [f"Where the model runs, its controllers computing against their recorded outputs "
            f"supplied (their computation skipped, as a static token-id table would feed "
            f"them): {c.own.tokens_per_s:,.0f} against {c.supplied.tokens_per_s:,.0f} tokens "
            f"per second, latency ratio **{c.ratio.value:.3f}** (95% CI "
            f"{fmt_ci(c.ratio.ci95, 3)}; {md_text(c.ratio_definition)}), {c.pairs} pairs after "
            f"{c.warmup} warm-up runs on one batch of {c.batch_size} x {c.seq_len} tokens on "
            f"{md_code(c.device)} ({md_text(c.device_name)}). On a CPU only the ratio means "
            "anything."]


def _uncounted(operators: Sequence[str]) -> str:
    return (f"**FLOPs verdict refused:** {len(operators)} operator(s) have no FLOP formula, so "
            f"the FLOP counts are incomplete: {', '.join(md_code(op) for op in operators)}.")


def _says_not_measured(r: AuditResult) -> bool:
    """Whether the execution verdict already says it was not measured (and why): its
    label; a result written before labels existed, its sentence."""
    label = r.verdict.label("execution")
    if label is None:
        return (r.execution.reason or "") in r.verdict.execution
    return label == NOT_MEASURED


def _execution_facts(r: AuditResult) -> list[str]:
    ex = r.execution
    if not ex.measured:
        return [] if _says_not_measured(r) else [_not_measured(ex)]
    unit = _unit(ex)
    facts = [f"Blocks executed per {unit}: {fmt_num(ex.blocks_executed, 2)} of "
             f"{fmt_num(ex.blocks_present)} present (dense: "
             f"{fmt_num(ex.dense_blocks_executed, 2)}).",
             f"FLOPs per {unit}: {fmt_count(ex.flops_per_token)} vs dense "
             f"{fmt_count(ex.dense_flops_per_token)} (ratio {fmt_num(ex.flops_ratio)})."]
    if ex.positions_per_block and any(p is not None for p in ex.positions_per_block):
        facts.append("Positions entering each block per example: " + ", ".join(
            "n/a" if p is None else fmt_num(p, 2) for p in ex.positions_per_block) + ".")
    if ex.uncounted_operators:
        facts.append(_uncounted(ex.uncounted_operators))
    if ex.timing is not None:
        ratio = ex.timing.speed_ratio_vs_dense
        facts.append(f"Latency vs dense: {fmt_with_ci(ratio.value, ratio.ci95, sign=False)} "
                     "(model / dense, 95% CI).")
    facts += [*twin_facts(r), _conditional(ex)]
    if ex.experts is not None:
        x = ex.experts
        facts.append(f"Experts run per token per routed layer (mean over layers): "
                     f"{x.experts_per_token_mean_over_layers:.2f} of {x.experts_present_text()}; "
                     "routing changes what is computed (experts skipped per token): "
                     f"**{fmt_num(x.routing_changes_computation)}**.")
    return facts


ANSWERS: tuple[tuple[str, str, Callable[[AuditResult], list[str]]], ...] = (
    ("variation", "Variation: do the coefficients vary?", _variation_facts),
    ("dependence", "Dependence: does the frozen model need them matched?", _dependence_facts),
    ("execution", "Execution: does the mechanism change what is computed?", _execution_facts),
)


def _exit_title(r: AuditResult) -> str:
    units = plural(exit_unit(r))
    return (f"Exits: where do {units} stop, what does stopping cost, and would a static depth "
            "do as well?")


def _answers(r: AuditResult, figures: Mapping[str, RenderedFigure]) -> list[str]:
    """The answers, an exit model's exits first (its depth, the cost of exiting against
    the full model, learned against fixed exit at matched depth), each with the figures
    that illustrate it."""
    exits = (("exits", _exit_title(r), lambda _: []),) if r.verdict.exits else ()
    asked = exits + ANSWERS
    blocks = [f"## The {'four' if len(asked) == 4 else 'three'} answers"]
    inexact = _inexact(r)
    for i, (key, title, facts) in enumerate(asked, start=1):
        blocks.append(f"### {i}. {title}")
        if inexact:
            blocks.append(_verdict_warning(inexact, r.loss_name(per_unit=True)))
        blocks.append(f"**{md_text(getattr(r.verdict, key) or 'No verdict recorded.')}**")
        if items := facts(r):
            blocks.append("\n".join(f"- {item}" for item in items))
        blocks += _figures_at(figures, key)
    return blocks


def _figures_at(figures: Mapping[str, RenderedFigure], place: str) -> list[str]:
    """The figures :data:`FIGURE_PLACES` puts at ``place`` (an answer or a section)."""
    return md_figures([f for stem, f in figures.items() if FIGURE_PLACES.get(stem) == place])


def _repeats_cell(c: ConditionResult) -> str:
    if len(c.repeats) <= 1:
        return str(len(c.repeats))
    return f"{len(c.repeats)}: Δ " + fmt_seq(c.repeat_deltas, partial(fmt_num, sign=True))


Row = dict[str, Any]


def _condition_table(r: AuditResult, rows: Sequence[Row]) -> str:
    """The conditions table from :func:`condition_rows` (repeats with their penalties)."""
    every = {**r.conditions, **(r.custom_conditions or {})}
    cells = [(md_code(row["condition"]), row["meaning"], fmt_num(row["nll"]),
              fmt_num(row["delta"], sign=True),
              fmt_ci((row["ci_low"], row["ci_high"]), sign=True),
              _repeats_cell(every[row["condition"]])) for row in rows]
    header = ("condition", "coefficients fed", f"{r.loss_name()} (nats)", "Δ vs correct", "95% CI",
              "repeats")
    if any(row.get("accuracy") is not None for row in rows):  # classification
        cells = [(*cell, fmt_pct(100 * row["accuracy"]) if row["accuracy"] is not None
                  else "n/a") for cell, row in zip(cells, rows, strict=True)]
        return md_table((*header, "accuracy"), cells, "llrrrlr")
    return md_table(header, cells, "llrrrl")


def _not_applicable(r: AuditResult) -> list[str]:
    """Conditions that cannot act on these sites or inputs, each with its reason."""
    if not r.not_applicable:
        return []
    return ["Not applicable (not run, no number): " + "; ".join(
        f"{md_code(name)}: {md_text(why)}" for name, why in r.not_applicable.items()) + "."]


def identity_words(r: AuditResult, code: Callable[[str], str] = md_code,
                   strong: Callable[[str], str] = lambda t: f"**{t}**") -> str:
    """The identity replay's outcome in words, the same on every page and the console
    (``code`` and ``strong`` mark an option and the outcome for the reader): bitwise exact,
    or how far from it and why the audit went on."""
    ident = r.identity
    diff = r.identity_replay_max_abs_diff if ident is None else ident.max_abs_diff
    measured = (f"max |{r.loss_name(per_unit=True)}(correct) − {r.loss_name()}(original)| = "
                f"{fmt_num(diff)}")
    if ident is not None and not ident.exact:
        return (f"{strong('not exact')} ({measured}), accepted only because the audit was "
                f"run with {code('--allow-nonexact-identity')}")
    if diff == 0:
        return (f"{strong('bitwise exact')}: replaying the recorded coefficients reproduced "
                f"the original pass bit for bit ({measured})")
    return measured


def _identity_check(r: AuditResult) -> str:
    """The identity replay's result, with the engine's note on it (the model's code-identity
    note is the cache's, in the reproducibility section)."""
    note = r.identity.note if r.identity else None
    return f"Identity replay check: {identity_words(r)}." + (f" {md_text(note)}" if note else "")


def _conditions(r: AuditResult) -> list[str]:
    rows = condition_rows(r)
    blocks = ["## Conditions", _condition_table(r, [row for row in rows if not row["custom"]]),
              *_not_applicable(r), _identity_check(r)]
    if r.custom_conditions:
        blocks += ["## Custom conditions",
                   "User-defined interventions, replayed and measured like the conditions "
                   "above (Δ vs correct, paired bootstrap 95% CI).",
                   _condition_table(r, sorted((row for row in rows if row["custom"]),
                                              key=lambda row: row["condition"]))]
    return blocks


def _retention(r: AuditResult) -> list[str]:
    ordered = _ordered(r.retention, REPORTED_RETENTION)
    accuracy = any(ret.accuracy is not None for _, ret in ordered)
    rows = [(md_code(name), *_share_cells(ret),
             *(_share_cells(ret.accuracy) if accuracy else ()),
             "; ".join(n for n in (md_text(ret.reason or "") if ret.value is None else "",
                                   profile_note(r, name)) if n))
            for name, ret in ordered]
    heads = ("retention", "95% CI", "gap (nats) [95% CI]")
    acc_heads = ("accuracy retention", "95% CI", "accuracy gap [95% CI]") if accuracy else ()
    return ["## Gap retention",
            "R(P) = (NLL(global-mean) − NLL(P)) / (NLL(global-mean) − NLL(correct)): the "
            "share of the correct-to-global-mean gap a static profile P keeps. Undefined (the "
            "note says why) when the gap's 95% CI is not above 0, or when the share's own "
            "95% CI is wider than the whole 0–100% scale (a gap too small against its noise "
            "to resolve a share of it)." + (ACCURACY_RETENTION if accuracy else ""),
            md_table(("profile", *heads, *acc_heads, "note"), rows,
                     "l" + "r" * (len(heads) + len(acc_heads)) + "l"), *lti_statement(r)]


ACCURACY_RETENTION = (" Accuracy retention: the same share on accuracy, (acc(P) − "
                      "acc(global-mean)) / (acc(correct) − acc(global-mean)), undefined by the "
                      "same rule on the accuracy gap (a reason is in audit.json).")


def _share_cells(ret: Retention | None) -> tuple[str, str, str]:
    """A retention's value, interval and gap cells (blank where there is none)."""
    if ret is None:
        return ("", "", "")
    return ("undefined" if ret.value is None else fmt_pct(ret.value),
            "n/a" if ret.value is None else fmt_ci(ret.ci95, 2),
            fmt_with_ci(ret.gap, ret.gap_ci95, sign=False))


def _interaction(r: AuditResult) -> list[str]:
    i = r.interaction
    if i is None:
        return ["## Interaction", "Not applicable: "
                + md_text((r.not_applicable or {}).get(SHUFFLE, "shuffle was not run")) + "."]
    return ["## Interaction",
            "I = Δ(reassign+shuffle) − Δ(reassign) − Δ(shuffle) = "
            f"**{fmt_with_ci(i.value, i.ci95)}**"
            " nats (95% CI). Near 0: the two penalties add up; negative: they overlap "
            "(sub-additive); positive: they compound."]


def _expert_rows(ex: Execution) -> list[tuple[str, str, str, str]]:
    x = ex.experts
    if x is None:
        return []
    rows = [("experts run per token per routed layer (mean over layers)",
             f"{x.experts_per_token_mean_over_layers:.2f} of {x.experts_present_text()}", "", ""),
            ("experts run per token, summed over layers",
             f"{x.experts_per_token_summed_over_layers:.2f} of "
             f"{x.experts_present_summed_over_layers}", "", ""),
            ("experts run per token: min / max over layers",
             f"{min(x.experts_per_token_per_layer):.2f} / "
             f"{max(x.experts_per_token_per_layer):.2f}", "", ""),
            ("experts that ran = routers' choices", fmt_num(x.matches_routing), "", "")]
    if x.active_expert_flops_per_token and x.all_expert_flops_per_token:
        rows.append(("expert FLOPs per token: active / if every expert ran",
                     f"{fmt_num(x.active_expert_flops_per_token)} / "
                     f"{fmt_num(x.all_expert_flops_per_token)}", "",
                     f"{x.active_expert_flops_per_token / x.all_expert_flops_per_token:.3f}"))
    return rows


def _execution(r: AuditResult) -> list[str]:
    ex = r.execution
    blocks = ["## Execution"]
    if not ex.measured:
        return blocks + [_not_measured(ex), *_controller_cost(ex)]
    t, unit = ex.timing, _unit(ex)
    fractions = [f for f in ex.blocks_executed_per_layer or () if fmt_finite(f)]
    rows = [
        (f"blocks executed per {unit}", f"{fmt_num(ex.blocks_executed, 2)} of "
         f"{fmt_num(ex.blocks_present)}", f"{fmt_num(ex.dense_blocks_executed, 2)} of "
         f"{fmt_num(ex.dense_blocks_present)}", ""),
        (f"FLOPs per {unit}", fmt_count(ex.flops_per_token), fmt_count(ex.dense_flops_per_token),
         fmt_num(ex.flops_ratio)),
    ]
    if t is None:
        rows.append(("latency per batch", "not measured", "not measured", ""))
    else:
        ratio = t.speed_ratio_vs_dense
        rows += [("latency per batch (ms), median [min, max]",
                  *(f"{1e3 * s.median_s:.3f} [{1e3 * s.min_s:.3f}, {1e3 * s.max_s:.3f}]"
                    for s in (t.model, t.dense)),
                  f"{fmt_with_ci(ratio.value, ratio.ci95, sign=False)} (95% CI)"),
                 (f"throughput ({unit}s/s)", f"{t.model.tokens_per_s:,.0f}",
                  f"{t.dense.tokens_per_s:,.0f}", "")]
    rows += _expert_rows(ex)
    if fractions:
        rows.append((f"blocks executed per layer (fraction of {unit}s): min / mean / max",
                     " / ".join(f"{f:.3f}" for f in (min(fractions),
                                                      sum(fractions) / len(fractions),
                                                      max(fractions))), "", ""))
    blocks += [md_table(("measure", "model", "dense", "model / dense"), rows, "lrrr"),
               _conditional(ex, " Counted, not read from the coefficients.")]
    if ex.uncounted_operators:
        blocks.append(_uncounted(ex.uncounted_operators))
    notes = [f"Dense counterpart: {md_code(ex.dense)}." if ex.dense else "",
             f"Counted on {fmt_num(ex.tokens_counted)} {unit}s; FLOPs: "
             f"{md_text(ex.flops_counted or 'not counted')}."]
    if t is not None:
        notes.append(f"Latency: {t.pairs} interleaved pairs after {t.warmup} warm-up runs on "
                     f"one batch of {_batch(t.batch_size, t.seq_len, unit)}, {t.threads} "
                     f"thread(s) "
                     f"on {md_code(t.device)} ({md_text(t.device_name)}); ratio: "
                     f"{md_text(t.ratio_definition)}; 95% CI from {t.bootstrap_resamples:,} "
                     f"bootstrap resamples (seed {t.seed}).")
    return blocks + [" ".join(n for n in notes if n), *execution_note(r)]


# the detail in the answers' order: the conditions table, then the analyses that lead the
# answers (an exit model's exits, its first answer, from the table's exit rows), then
# dependence, variation, execution; the other analyses after them
TABLE = (_conditions, stopping_section)
DETAILS = (_retention, _interaction, per_layer_section, variance_section, variation_section,
           _execution)


def build_markdown(result: AuditResult, figures: Sequence[RenderedFigure]) -> tuple[str, str]:
    """The whole report as (plain-text title, Markdown): the lead, the answers with the
    figures that illustrate them, then the detail sections, each figure of a section at
    its end, and what reproduces the audit."""
    title = f"Frozen Controller Audit: {one_line(result.model.spec)}"
    blocks = [f"# Frozen Controller Audit: {md_text(result.model.spec)}"]
    if inexact := _inexact(result):
        blocks.append(_identity_warning(inexact, result.loss_name(per_unit=True)))
    shown = {f.stem: f for f in figures}
    blocks += [_lead(result), *_answers(result, shown)]
    for part in [*(section(result) for section in TABLE),
                 *analysis_sections(result, leading=True),
                 *(section(result) for section in DETAILS), *analysis_sections(result),
                 reproducibility_section(result)]:
        if part:
            blocks += part + _figures_at(shown, part[0].removeprefix("## "))
    placed = "\n".join(blocks)
    left = [f for f in figures if f"]({FIGURE_DIR}/{f.png_path.name})" not in placed]
    if left:  # a figure whose answer or section this result lacks (an older audit.json)
        blocks += ["## More figures", *md_figures(left)]
    return title, "\n\n".join(blocks) + "\n"


def write_report(result: AuditResult, out_dir: str | Path,
                 files: FileWriter = PLAIN_FILES) -> list[Path]:
    """Write report.md, report.html and figures/ under ``out_dir`` through ``files`` (the
    folder's results writer); return the paths written."""
    out_dir = Path(out_dir)
    figures = write_figures(_figure_specs(result), out_dir / FIGURE_DIR, files)
    title, markdown = build_markdown(result, figures)
    paths = [p for f in figures for p in (f.png_path, f.svg_path)]
    for name, text in (("report.md", markdown), ("report.html", to_html(title, markdown, figures))):
        paths.append(out_dir / name)
        files.write_text(paths[-1], text)
    return paths
