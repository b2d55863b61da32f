"""The report's section for exit models (early exit, adaptive depth): where the units
that exit (tokens, patches or examples, in the exit sites' words) stop, and where the
learned exit controller sits between fixed exit and the oracle. An audit without an exit
condition reads exactly as before (no section)."""

from __future__ import annotations

from fcaudit.core.conditions import CORRECT, FIXED_EXIT, FIXED_EXIT_POSITION, ORACLE_EXIT
from fcaudit.core.exits import MASKED, plural
from fcaudit.engine.frontier_parts import ExitFrontier
from fcaudit.engine.result import EXITS, AuditResult
from fcaudit.io.hf_exit import HEADS_NOTE
from fcaudit.io.hf_exit import KIND as HF_EARLY_EXIT
from fcaudit.report.format import fmt_num, fmt_pct_with_ci, fmt_share, fmt_with_ci
from fcaudit.report.markdown import md_code, md_table, md_text
from fcaudit.report.sections.base import Renderer


def _row(r: AuditResult, name: str, what: str, depth: str) -> tuple[str, str, str, str]:
    c = r.conditions.get(name)
    if name in (r.not_applicable or {}):  # e.g. no positions to fix an exit per
        return md_code(name), what, "", "not applicable"
    if c is None:
        return md_code(name), what, depth, "not run"
    return md_code(name), what, depth, fmt_with_ci(c.delta, c.ci95, sign=True)


def exit_unit(r: AuditResult) -> str:
    """What exits, as the audit recorded it (a token, a patch, an example); a result
    written before it was recorded: an example where the sites have no position axis
    (no depth per position), else a token."""
    e = r.exits
    if e is not None and e.unit is not None:
        return e.unit
    return "example" if e is not None and not e.fixed_exit_depth_per_position else "token"


def exits_section(r: AuditResult) -> list[str]:
    """Depths, the references' penalties, the share of the gap closed, the exit frontier."""
    e = r.exits
    if e is None:
        return []
    unit, per = exit_unit(r), e.fixed_exit_depth_per_position
    depth_ci = e.evaluation_mean_depth_ci95  # None in results written before it
    rows = [_row(r, FIXED_EXIT, f"one layer for every {unit}", f"{e.fixed_exit_depth}"),
            _row(r, FIXED_EXIT_POSITION, f"one layer per {unit} position" if per
                 else "one layer per position",
                 f"{min(per)}-{max(per)}" if per else ""),
            _row(r, CORRECT, "the learned controller (its own scores)",
                 fmt_num(e.evaluation_mean_depth, 3)),
            _row(r, ORACLE_EXIT, "earliest layer predicting the full-depth answer",
                 fmt_num(e.oracle_mean_depth, 3))]
    blocks = ["## Exits",
              f"Layers executed per {unit} (of {e.depth}), counted by hooks on the model's "
              f"exit rules: {fmt_with_ci(e.evaluation_mean_depth, depth_ci, 3, False)} on the "
              f"evaluation set, {fmt_num(e.calibration_mean_depth, 3)} on calibration; "
              f"{fmt_share(e.share_exiting_first_layer)} of the evaluation {plural(unit)} "
              f"stop after the first layer, {fmt_share(e.share_full_depth)} run every layer.",
              md_table(("exit rule", f"each {unit} exits at", "depth",
                        "Δ vs correct [95% CI]"), rows, "llrr")]
    if e.note:
        blocks.append(f"**Degenerate exit rule:** {md_text(e.note)}.")
    if r.model.kind == HF_EARLY_EXIT:
        blocks.append(f"**Not trained for early exit:** {md_text(HEADS_NOTE)}. **Masked, not "
                      f"skipped:** {md_text(MASKED)} (the execution audit counts every layer "
                      f"on every {unit}; the depths above are what a skipping implementation "
                      "would execute).")
    g = e.gap_closed
    if g is not None:
        share = "undefined" if g.value is None else fmt_pct_with_ci(g.value, g.ci95)
        why = f" ({md_text(g.reason)})" if g.value is None and g.reason else ""
        blocks.append(f"Share of the fixed-to-oracle gap the learned controller closes, "
                      f"(L(fixed) − L(learned)) / (L(fixed) − L(oracle)): {share}{why}.")
    return blocks + frontier_blocks(e.frontier)


def frontier_blocks(f: ExitFrontier | None) -> list[str]:
    """The threshold sweep against fixed exit at the same mean executed depth: one row per
    learned point, fixed exit beside it at its depth (interpolated between whole depths),
    so a deep model's table has the sweep's rows only; fixed exit at each whole depth is
    the figure's (and audit.json's)."""
    if f is None:
        return []
    fixed = sorted(int(p.mean_depth) for p in f.points if p.rule == "fixed")
    rows = [("own learned" if p.threshold is None else "learned",
             "" if p.threshold is None else fmt_num(p.threshold, 4), fmt_num(p.mean_depth, 3),
             fmt_with_ci(p.delta.value, p.delta.ci95, sign=True),
             "" if p.fixed is None else fmt_with_ci(p.fixed.value, p.fixed.ci95, sign=True),
             "" if p.gap is None else fmt_with_ci(p.gap.value, p.gap.ci95, sign=True))
            for p in f.points if p.rule == "learned"]
    sweep = "" if f.own_threshold is not None else (
        " The exit rules carry no one `threshold` to move, so the learned rule has its own "
        "point only.")
    drawn = (f" Fixed exit at each whole depth it was run at ({_spans(fixed)}) is drawn in "
             "the exit frontier's figure and kept in audit.json (`exits.frontier.points`)."
             if fixed else "")
    return ["### Exit frontier: would a static depth do as well?",
            "The learned rule at other thresholds (its own rule, exits read in real passes) "
            "beside fixed exit at the same mean executed depth (interpolated between the "
            "whole depths around it); the last column is fixed minus learned (positive: the "
            f"static depth loses at the same mean compute).{sweep}{drawn}",
            md_table(("rule", "threshold", "mean depth", "Δ learned vs correct [95% CI]",
                      "Δ fixed exit at that depth [95% CI]",
                      "fixed − learned [95% CI]"), rows, "lrrrrr"),
            f"**Matched depth:** {md_text(f.sentence)}"]


def _spans(depths: list[int]) -> str:
    """Whole depths as runs: ``1-3, 8``."""
    runs: list[list[int]] = []
    for d in depths:
        if runs and d == runs[-1][-1] + 1:
            runs[-1].append(d)
        else:
            runs.append([d])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


RENDERER = Renderer(EXITS, lambda r, _section: exits_section(r), leads=True)
