"""The selective state-space study (``fcaudit reproduce --preset ssm``): its table and
findings.

Mamba (selection: Δ, B and C computed from each token) and its LTI twin S4D (the same
network with Δ, B and C learned as constants) trained side by side, on the built-in
corpus and on selective copying (the Mamba paper's task where a time-invariant model
fails; :mod:`fcaudit.io.selective_copy`). The audit asks the frozen Mamba whether it
needs its selection matched to each input and token: ``static-layer`` there feeds every
layer its calibration mean, a time-invariant recurrence, the twin's form with Mamba's
own weights. The cells are written here from the study's aggregates, as the vision
study's are (:mod:`fcaudit.study.vision`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from fcaudit.core.conditions import (
    REASSIGN,
    SHUFFLE,
    STATIC_LAYER,
    STATIC_LAYER_POSITION,
    STATIC_LAYER_TOKEN,
)
from fcaudit.engine.objectives import SELECTIVE_COPY
from fcaudit.engine.result import token_id_words
from fcaudit.engine.result_views import (
    ACCURACY_CORRECT,
    NLL_CORRECT,
    RETENTION_LAYER,
    RETENTION_LAYER_TOKEN,
    accuracy_retention_key,
)
from fcaudit.study.seeds import group_mean, penalty, shares
from fcaudit.study.train import TRAIN_PRESETS

TASK = SELECTIVE_COPY
# the corpus runs train half the tiny preset's steps, so that three seeds of both models
# and both tasks fit a 2-core CPU in well under an hour (the numbers are of this length)
CORPUS_SCHEDULE = dataclasses.replace(TRAIN_PRESETS["tiny"], steps=300)
DELTA = "dt"  # Mamba's family of Δ sites
TITLE = ("Mamba and its LTI twin (S4D) on the corpus and on selective copying (mean over "
         "seeds; penalties in the task's loss, [span of the seeds' 95% intervals]; "
         "retentions in % of the Correct-to-GlobalMean gap)")
RETENTIONS = (STATIC_LAYER, STATIC_LAYER_POSITION, STATIC_LAYER_TOKEN)


def _group(groups: Mapping[str, Mapping[str, Any]], task: bool) -> Mapping[str, Any] | None:
    return next((g for n, g in groups.items()
                 if n.startswith("mamba-") and (TASK in n) == task), None)


def _retention(audits: list[Any], profile: str) -> str:
    """Mean retention over the seeds where it is defined, with the span of their
    intervals, and how many seeds had no clear gap; for a task scored by accuracy, the
    same share on accuracy beside it (a loss gap can mislead when the global-mean
    baseline is worse than guessing)."""
    if not all(profile in a.conditions for a in audits):
        return "not applicable"
    text = _share([a.retention[profile] for a in audits])
    accuracy = [a.retention[profile].accuracy for a in audits]
    return text if None in accuracy else f"{text}; on accuracy {_share(accuracy)}"


def _share(retentions: list[Any]) -> str:
    return shares(retentions, "undefined (no clear gap)", " ({n} seed{s} undefined)")


def _score(group: Mapping[str, Any], task: bool) -> str:
    if task:
        return (f"accuracy {group_mean(group, ACCURACY_CORRECT):.3f} (twin "
                f"{group_mean(group, 'twin_accuracy'):.3f})")
    return f"NLL {group_mean(group, NLL_CORRECT):.3f} (twin {group_mean(group, 'twin_nll'):.3f})"


def _token_share(audits: list[Any]) -> str:
    """Δ's token-id share beyond chance, with the share and its chance level beside it
    (means over seeds)."""
    shares = [a.variance[DELTA] for a in audits]
    if any(v.eta2_token_id is None for v in shares):
        return "n/a"
    chance = [v.eta2_token_id_chance for v in shares]
    beyond = [v.epsilon2_token_id for v in shares]
    return token_id_words(float(np.mean([v.eta2_token_id for v in shares])),
                          None if None in chance else float(np.mean(chance)),
                          None if None in beyond else float(np.mean(beyond))
                          ).removeprefix("explains ")


def _execution(group: Mapping[str, Any]) -> str:
    audit = group["audits"][0]
    blocks, flops, speed = (group_mean(group, k) for k in ("blocks_executed_fraction",
                                                      "flops_ratio", "speed_ratio"))
    if flops is None:
        return "not measured"
    every = "every block for every token" if blocks is not None and blocks >= 0.999 \
        else f"{100 * (blocks or 0):.1f}% of the blocks"
    time = "time not measured" if speed is None else f"time {speed:.2f}x"
    return (f"{every}; FLOPs {flops:.3f}x, {time} the twin "
            f"({audit.execution.mode} vs {audit.execution.dense_mode})")


def table(groups: Mapping[str, Mapping[str, Any]]) -> list[dict[str, str]]:
    """One row per task: Mamba's score beside its twin's, the penalties and retentions of
    the selection conditions, Δ's token-id share and execution against the twin."""
    rows = []
    for task, label in ((False, "built-in corpus"), (True, "selective copying")):
        group = _group(groups, task)
        if group is None:
            continue
        audits = group["audits"]
        rows.append({"task": label, "seeds": str(len(audits)), "Mamba (LTI twin)":
                     _score(group, task),
                     REASSIGN: penalty(audits, REASSIGN), SHUFFLE: penalty(audits, SHUFFLE),
                     **{f"{p} retention": _retention(audits, p) for p in RETENTIONS},
                     "token-id share of Δ": _token_share(audits),
                     "execution": _execution(group)})
    return rows


def findings(groups: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str]]:
    """What the study shows, from the numbers, honest either way."""
    out = []
    copy, corpus = _group(groups, True), _group(groups, False)
    if copy is not None:
        out += _copy_findings(copy)
    if corpus is not None:
        ret = group_mean(corpus, RETENTION_LAYER)
        out.append(("Built-in corpus: how much of the Correct-to-GlobalMean gap a trained "
                    "Mamba keeps with an LTI profile (static-layer)",
                    "undefined (no clear gap)" if ret is None else
                    f"at this scale, a trained Mamba on Shakespeare keeps {ret:.1f}% with an "
                    "LTI profile"))
        token, layer = (group_mean(corpus, k) for k in (RETENTION_LAYER_TOKEN,
                                                   RETENTION_LAYER))
        if token is not None and layer is not None:
            out.append(("Built-in corpus: is selection a lookup of the current token? "
                        "(static-layer-token against static-layer)",
                        f"a profile per (layer, token id) keeps {token:.1f}%, "
                        f"{token - layer:+.1f} points over the per-layer profile: "
                        + ("the token id carries much of what selection does"
                           if token - layer >= 20 else "selection is more than a lookup of "
                           "the current token")))
    for group in (g for g in (corpus, copy) if g is not None):
        blocks = group_mean(group, "blocks_executed_fraction")
        if blocks is not None:
            out.append(("Selection changes no execution (every token runs every block)",
                        f"{'holds' if blocks >= 0.999 else 'does not hold'}: "
                        f"{_execution(group)}"))
            break
    return out


def _pct(value: float | None) -> str:
    return "undefined" if value is None else f"{value:.1f}%"


def _copy_findings(group: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Selective copying: the LTI twin fails where selection succeeds, and the frozen
    selective model fed an LTI profile loses the task (the planted truth)."""
    acc, twin = group_mean(group, ACCURACY_CORRECT), group_mean(group, "twin_accuracy")
    audits = group["audits"]
    static = float(np.mean([a.conditions[STATIC_LAYER].accuracy for a in audits]))
    ret = group_mean(group, accuracy_retention_key(STATIC_LAYER))
    above = sum(a.conditions[REASSIGN].ci95[0] > 0 for a in audits)
    return [
        ("Selective copying: the LTI twin fails the task that selection solves (the Mamba "
         "paper's Table 1: a time-invariant S4 layer fails, the selective S6 layer solves it)",
         f"{'holds' if acc >= 0.9 and twin <= 0.5 else 'does not hold'}: Mamba's accuracy "
         f"{acc:.3f}, its LTI twin's {twin:.3f} (every answer of an example right)"),
        ("Selective copying: fed an LTI profile (static-layer), the frozen Mamba loses the "
         "task (the planted truth)",
         f"{'holds' if acc >= 0.5 and static <= 0.2 * acc else 'does not hold'}: accuracy "
         f"{static:.3f} under static-layer (correct: {acc:.3f}); retention on accuracy "
         f"{_pct(ret)}, on the loss {_pct(group_mean(group, RETENTION_LAYER))}"),
        ("Selective copying: the frozen Mamba needs its selection matched to the input",
         f"{'holds' if above == len(audits) else 'does not hold'}: the reassign penalty's "
         f"interval lies above 0 in {above} of {len(audits)} seeds; reassigning costs "
         f"{penalty(audits, REASSIGN)}")]
