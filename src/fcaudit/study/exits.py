"""The early-exit study (``fcaudit reproduce --preset exit``): its table and findings.

The early-exit LM (a CALM-style exit controller per layer), the ponder model (PonderNet
halting over a shared block) and the digits classifier (BranchyNet exits), each trained
beside its twin (the same network run to full depth). The question the family's claims
turn on is execution: how deep the model runs, what that saves against the twin, and
whether a learned exit rule does better than a static one. Each row places the learned
controller between fixed exit and the oracle and against fixed exit at the same mean
executed depth (:mod:`fcaudit.engine.exits`). The
cells are written from the audits and the study's aggregates, as the vision and ssm
studies' are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fcaudit.core.conditions import FIXED_EXIT, ORACLE_EXIT, STATIC_LAYER
from fcaudit.engine.result_views import ACCURACY_CORRECT, NLL_CORRECT
from fcaudit.study.seeds import group_mean, penalty, shares, spanned

MISSING = " ({n} of {of} seeds undefined)"

FAMILIES = (("earlyexit", "early-exit LM"), ("ponder", "ponder (PonderNet)"),
            ("branchy", "digits (BranchyNet)"))
#: the table's columns, in the order the table shows them (the README block reads them)
COLUMNS = ("family", "seeds", "score (twin)", "mean executed depth", "vs twin",
           "static-layer retention", FIXED_EXIT, ORACLE_EXIT,
           "share of fixed-to-oracle gap closed", "fixed − learned at matched depth")
TITLE = ("Early exit and adaptive depth against their full-depth twins (mean over seeds; "
         "penalties in the task's loss against the learned rule, [span of the seeds' 95% "
         "intervals])")


def _group(groups: Mapping[str, Mapping[str, Any]], prefix: str) -> Mapping[str, Any] | None:
    return next((g for n, g in groups.items() if n.startswith(f"{prefix}-")), None)








def _score(group: Mapping[str, Any]) -> str:
    acc = group_mean(group, ACCURACY_CORRECT)
    if acc is not None:
        twin = group_mean(group, "twin_accuracy")
        return f"accuracy {acc:.3f} (twin {'n/a' if twin is None else f'{twin:.3f}'})"
    nll, twin = group_mean(group, NLL_CORRECT), group_mean(group, "twin_nll")
    return f"NLL {nll:.3f} (twin {'n/a' if twin is None else f'{twin:.3f}'})"


def _depth(audits: Sequence[Any]) -> str:
    e = [a.exits for a in audits]
    return (f"{float(np.mean([x.evaluation_mean_depth for x in e])):.2f} of {e[0].depth} "
            f"(oracle {float(np.mean([x.oracle_mean_depth for x in e])):.2f})")


def _versus_twin(group: Mapping[str, Any]) -> str:
    flops, speed = group_mean(group, "flops_ratio"), group_mean(group, "speed_ratio")
    if flops is None:
        return "not measured"
    return f"FLOPs {flops:.3f}x, time " + ("not measured" if speed is None else f"{speed:.2f}x")




def _retention(audits: Sequence[Any]) -> str:
    if not all(STATIC_LAYER in a.retention for a in audits):
        return "not run"
    return shares([a.retention[STATIC_LAYER] for a in audits], "undefined (no clear gap)",
                  MISSING)


def _gap_share(audits: Sequence[Any]) -> str:
    """The share of the fixed-to-oracle gap the learned rule closes, over the seeds where
    it is defined."""
    closed = [a.exits.gap_closed for a in audits]
    if any(s is None for s in closed):
        return "not run"
    return shares(closed, "undefined (no clear fixed-to-oracle gap)", MISSING)


def _matched(audits: Sequence[Any]) -> str:
    """Fixed exit at the learned rule's mean depth minus the learned rule."""
    frontiers = [a.exits.frontier for a in audits]
    if any(f is None for f in frontiers):
        return "not run"
    gaps = [f.matched_depth.gap for f in frontiers]
    return spanned([g.value for g in gaps], [g.ci95 for g in gaps], "+.3f")


def table(groups: Mapping[str, Mapping[str, Any]]) -> list[dict[str, str]]:
    """One row per family: the score beside the twin's, depth, execution against the twin,
    static-layer retention, fixed and oracle exit against the learned rule, the share of
    the gap it closes and fixed exit at its own mean depth."""
    rows = []
    for prefix, label in FAMILIES:
        group = _group(groups, prefix)
        if group is None:
            continue
        audits = group["audits"]
        cells = (label, str(len(audits)), _score(group), _depth(audits), _versus_twin(group),
                 _retention(audits), penalty(audits, FIXED_EXIT),
                 penalty(audits, ORACLE_EXIT), _gap_share(audits), _matched(audits))
        rows.append(dict(zip(COLUMNS, cells, strict=True)))
    return rows


def findings(groups: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str]]:
    """Per family: does a static depth do as well as the learned rule at the same mean
    compute, and does the model compute less than its twin; honest either way."""
    out = []
    for prefix, label in FAMILIES:
        group = _group(groups, prefix)
        if group is None:
            continue
        audits = group["audits"]
        if all(a.exits is not None and a.exits.frontier is not None for a in audits):
            gaps = [a.exits.frontier.matched_depth.gap for a in audits]
            wins = sum(g.ci95[0] > 0 for g in gaps)
            out.append((f"{label}: the learned exit rule beats fixed exit at the same mean "
                        "executed depth",
                        f"{'holds' if wins == len(audits) else 'does not hold'}: fixed exit "
                        f"loses by an interval above 0 in {wins} of {len(audits)} seeds; "
                        f"fixed − learned {_matched(audits)}{_degenerate(audits)}"))
        flops = group_mean(group, "flops_ratio")
        if flops is not None:  # a seed whose rule does not adapt saves nothing by exiting
            saves = flops < 0.99 and not _degenerate(audits)
            out.append((f"{label}: early exit computes less than the full-depth twin",
                        f"{'holds' if saves else 'does not hold'}: "
                        f"{_versus_twin(group)} the twin's, at a mean executed depth of "
                        f"{_depth(audits)}{_degenerate(audits)}"))
    return out


def _degenerate(audits: Sequence[Any]) -> str:
    """The seeds whose exit rule does not adapt (every unit stops at one layer: none exits
    early, all after the first, or all after one layer between), said beside the numbers
    they make; empty when every seed's rule adapts."""
    notes = [a.exits.note for a in audits if a.exits is not None and a.exits.note]
    if not notes:
        return ""
    return f" (the rule does not adapt in {len(notes)} of {len(audits)} seeds: {notes[0]})"
