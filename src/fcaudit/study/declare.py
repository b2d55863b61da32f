"""A study preset as data: its groups, its table's columns and its findings, and the one
place that turns seeds into what the tables and findings say.

A column or a finding's text is a format string whose fields name *cells*: a bare
metric key is its mean over seeds, ``{penalty reassign}`` the condition's penalty as the
mean over seeds with the span of the seeds' intervals, and so on (:data:`CELLS`). A
finding is the claim, the checks it makes (a metric or cell, a comparison, a threshold)
and the text said after its verdict. Every preset so reads the same numbers the same way
(:mod:`fcaudit.study.presets` declares them; :mod:`fcaudit.study.reproduce` runs them).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fcaudit.api import Span
from fcaudit.core.conditions import STATIC_LAYER_POSITION
from fcaudit.engine.result import AuditResult, token_id_words
from fcaudit.engine.result_parts import Estimate
from fcaudit.engine.result_views import ACCURACY_CORRECT, NLL_CORRECT, RETENTION_LAYER_TOKEN
from fcaudit.study.train import TrainPreset

Seeded = Mapping[str, Any]  # a group studied: its "audits", "per_seed" and "aggregate"


def ci_span(cis: Sequence[Sequence[float]]) -> tuple[float, float]:
    """The span of the seeds' 95% intervals: lowest low to highest high."""
    return min(c[0] for c in cis), max(c[1] for c in cis)


def over_seeds(values: Sequence[float], cis: Sequence[Sequence[float]]) -> Span:
    """The mean over seeds with the span of the seeds' intervals: how every study reports
    an estimate over seeds."""
    return Span(float(np.mean(values)), *ci_span(cis))


def spanned(values: Sequence[float], cis: Sequence[Sequence[float]], spec: str,
            unit: str = "") -> str:
    """``mean<unit> [low, high]``: :func:`over_seeds` as the tables write it."""
    s = over_seeds(values, cis)
    return f"{s.value:{spec}}{unit} [{s.lo:{spec}}, {s.hi:{spec}}]"


class Seeds(dict[str, Any]):
    """One group's seeds as the cells of a format string see them (``str.format_map``):
    a field is a metric key (its mean over seeds) or ``"<cell> <argument>"``."""

    def __init__(self, group: Seeded, label: str = "", missing: str = "not run",
                 other: Seeds | None = None) -> None:
        super().__init__()
        self.group, self.label, self.missing, self.other = group, label, missing, other
        self.audits: Sequence[AuditResult] = group["audits"]
        self.n = len(self.audits)
        self.holds = False  # a finding's verdict, for the text said after it

    def mean(self, key: str) -> float | None:
        return (self.group["aggregate"].get(key) or {}).get("mean")

    def __missing__(self, field: str) -> Any:
        name, _, argument = field.partition(" ")
        if name == "vs":
            assert self.other is not None
            return self.other[argument]
        return CELLS[name](self, argument) if name in CELLS else self.mean(field)


def _penalty(g: Seeds, condition: str) -> str:
    if not all(condition in a.conditions for a in g.audits):
        return g.missing
    found = [a.conditions[condition] for a in g.audits]
    return spanned([c.delta for c in found], [c.ci95 for c in found], "+.3f")


def _shares(estimates: Sequence[Any], undefined: str, seeds_word: bool, spec: str = ".1f",
            unit: str = "%") -> str:
    """Estimates over the seeds where each is defined (shares in percent unless ``spec``
    and ``unit`` say otherwise), with how many are not."""
    defined = [s for s in estimates if s.value is not None]
    if not defined:
        return undefined
    missing = len(estimates) - len(defined)
    said = (f"{missing} seed{'s' * (missing > 1)}" if seeds_word else
            f"{missing} of {len(estimates)} seeds")
    return spanned([s.value for s in defined], [s.ci95 for s in defined], spec, unit) + \
        (f" ({said} undefined)" if missing else "")


def _retention(g: Seeds, profile: str) -> str:
    """Mean static-profile retention over the seeds where defined; on a task scored by
    accuracy, the same share on accuracy beside it (a loss gap can mislead when the
    global-mean baseline is worse than guessing)."""
    if not all(profile in a.conditions for a in g.audits):
        return "not applicable"
    undefined = "undefined (no clear gap)"
    text = _shares([a.retention[profile] for a in g.audits], undefined, True)
    accuracy = [a.retention[profile].accuracy for a in g.audits]
    return text if None in accuracy else \
        f"{text}; on accuracy {_shares(accuracy, undefined, True)}"


def _exit_retention(g: Seeds, profile: str) -> str:
    if not all(profile in a.retention for a in g.audits):
        return "not run"
    return _shares([a.retention[profile] for a in g.audits], "undefined (no clear gap)", False)


def _gap_closed(g: Seeds, _: str) -> str:
    """The share of the fixed-to-oracle gap the learned rule closes."""
    shares = [a.exits.gap_closed for a in g.audits]
    if any(s is None for s in shares):
        return "not run"
    return _shares(shares, "undefined (no clear fixed-to-oracle gap)", False)


def _matched(g: Seeds, _: str) -> str:
    """Fixed exit at the learned rule's mean depth minus the learned rule."""
    frontiers = [a.exits.frontier for a in g.audits]
    if any(f is None for f in frontiers):
        return "not run"
    gaps = [f.matched_depth.gap for f in frontiers]
    return spanned([x.value for x in gaps], [x.ci95 for x in gaps], "+.3f")


def _matched_wins(g: Seeds, _: str) -> int | None:
    """Seeds where fixed exit loses by an interval above 0 (None: not run everywhere)."""
    if not all(a.exits is not None and a.exits.frontier is not None for a in g.audits):
        return None
    return sum(a.exits.frontier.matched_depth.gap.ci95[0] > 0 for a in g.audits)


def _degenerate(g: Seeds, _: str) -> str:
    """The seeds whose exit rule does not adapt (every unit stops at one layer), said
    beside the numbers they make; empty when every seed's rule adapts."""
    notes = [a.exits.note for a in g.audits if a.exits is not None and a.exits.note]
    if not notes:
        return ""
    return f" (the rule does not adapt in {len(notes)} of {g.n} seeds: {notes[0]})"


def _score(g: Seeds, _: str) -> str:
    acc, twin = g.mean(ACCURACY_CORRECT), g.mean("twin_accuracy")
    if acc is None:
        acc, twin = g.mean(NLL_CORRECT), g.mean("twin_nll")
    kind = "NLL" if g.mean(ACCURACY_CORRECT) is None else "accuracy"
    return f"{kind} {acc:.3f} (twin {'n/a' if twin is None else f'{twin:.3f}'})"


def _depth(g: Seeds, _: str) -> str:
    e = [a.exits for a in g.audits]
    return (f"{float(np.mean([x.evaluation_mean_depth for x in e])):.2f} of {e[0].depth} "
            f"(oracle {float(np.mean([x.oracle_mean_depth for x in e])):.2f})")


def _versus_twin(g: Seeds, _: str) -> str:
    flops, speed = g.mean("flops_ratio"), g.mean("speed_ratio")
    if flops is None:
        return "not measured"
    return f"FLOPs {flops:.3f}x, time " + ("not measured" if speed is None else f"{speed:.2f}x")


def _execution(g: Seeds, _: str) -> str:
    """How much of the network runs, against the twin (an SSM against its LTI twin)."""
    audit = g.audits[0]
    blocks, flops, speed = (g.mean(k) for k in ("blocks_executed_fraction", "flops_ratio",
                                                "speed_ratio"))
    if flops is None:
        return "not measured"
    every = "every block for every token" if blocks is not None and blocks >= 0.999 \
        else f"{100 * (blocks or 0):.1f}% of the blocks"
    time = "time not measured" if speed is None else f"time {speed:.2f}x"
    return (f"{every}; FLOPs {flops:.3f}x, {time} the twin "
            f"({audit.execution.mode} vs {audit.execution.dense_mode})")


def _executed(g: Seeds, _: str) -> str:
    """A vision family's executed share: experts, else patch tokens, else every block."""
    executed, unit = g.mean("experts_executed_fraction"), "experts"
    if executed is None:
        executed, unit = g.mean("tokens_executed_fraction"), "patch tokens"
    return "every block, one mixed kernel per example" if executed is None \
        else f"{100 * executed:.1f}% of the {unit}"


def _number(g: Seeds, argument: str) -> str:
    """``num KEY DIGITS [SUFFIX]``: the mean with DIGITS decimals, or n/a."""
    key, digits, *suffix = argument.split(" ")
    value = g.mean(key)
    return "n/a" if value is None else f"{value:.{digits}f}{''.join(suffix)}"


def _estimated(g: Seeds, argument: str) -> str:
    """``estimate KEY DIGITS [UNIT]``: the seeds' values of metric KEY (intervals
    ``KEY_lo``, ``KEY_hi``) as the mean with the span of the intervals, over the seeds
    where defined; DIGITS decimals, ``+`` before them for a sign (``+4``)."""
    key, digits, *unit = argument.split(" ")
    spec = f"{'+' if digits.startswith('+') else ''}.{digits.lstrip('+')}f"
    seeds = g.group["per_seed"]
    if any(key not in s for s in seeds):
        return g.missing
    return _shares([Estimate(s.get(key), [s.get(f"{key}_lo"), s.get(f"{key}_hi")])
                    for s in seeds], "undefined", False, spec, "".join(unit))


def _percent(g: Seeds, key: str) -> str:
    value = g.mean(key)
    return "undefined" if value is None else f"{value:.1f}%"


def _token_share(g: Seeds, family: str) -> str:
    """A family's token-id share beyond chance, with the share and its chance level
    beside it (means over seeds)."""
    shares = [a.variance[family] for a in g.audits]
    if any(v.eta2_token_id is None for v in shares):
        return "n/a"
    chance = [v.eta2_token_id_chance for v in shares]
    beyond = [v.epsilon2_token_id for v in shares]
    return token_id_words(float(np.mean([v.eta2_token_id for v in shares])),
                          None if None in chance else float(np.mean(chance)),
                          None if None in beyond else float(np.mean(beyond))
                          ).removeprefix("explains ")


def _token_profile(g: Seeds, _: str) -> str:
    """How much a static profile per (layer, token id) keeps, and how much of the
    within-layer variance the token id explains."""
    ret, share = g.mean(RETENTION_LAYER_TOKEN), g.mean("eta2_token_id")
    words = None if share is None else token_id_words(
        share, g.mean("eta2_token_id_chance"), g.mean("epsilon2_token_id"))
    return (("retention undefined (no clear gap)" if ret is None else
             f"keeps {ret:.2f}% of the gap on average")
            + ("; no variance within layers" if words is None else
               f"; of the within-layer variance, the token id {words} on average"))


def _seeds(g: Seeds, key: str, test: Callable[[float, float], bool]) -> int | None:
    """How many seeds' intervals of metric ``key`` pass ``test`` (None: a seed lacks it)."""
    bounds = [(s.get(f"{key}_lo"), s.get(f"{key}_hi")) for s in g.group["per_seed"]]
    if any(lo is None or hi is None for lo, hi in bounds):
        return None
    return sum(test(lo, hi) for lo, hi in bounds)


def _difference(g: Seeds, argument: str) -> float | None:
    """``diff A|B[|FACTOR]``: field A minus FACTOR x field B (None if either is)."""
    a, b, *factor = argument.split("|")
    x, y = g[a], g[b]
    return None if x is None or y is None else x - float(factor[0] if factor else 1) * y


CELLS: dict[str, Callable[[Seeds, str], Any]] = {
    "label": lambda g, _: g.label, "seeds": lambda g, _: str(g.n),
    "pct": lambda g, key: 100 * (g.mean(key) or 0),
    "min": lambda g, key: g.group["aggregate"][key]["min"],
    "max": lambda g, key: g.group["aggregate"][key]["max"],
    "penalty": _penalty, "retention": _retention, "exit_retention": _exit_retention,
    "gap_closed": _gap_closed, "matched": _matched, "matched_wins": _matched_wins,
    "degenerate": _degenerate,
    "not_adapting": lambda g, _: sum(bool(a.exits and a.exits.note) for a in g.audits),
    "either": lambda g, words: words.split("|")[0 if g.holds else 1],
    "unless": lambda g, key: 1 if g.mean(key) is None else None,  # a finding for the rest
    "score": _score, "depth": _depth, "versus_twin": _versus_twin, "execution": _execution,
    "executed": _executed, "num": _number, "percent": _percent, "estimate": _estimated,
    "position_percent": lambda g, key: "not applicable" if STATIC_LAYER_POSITION not in
    g.audits[0].conditions else _percent(g, key),
    "token_share": _token_share, "token_profile": _token_profile, "diff": _difference,
    # seeds whose penalty interval lies above 0
    "above": lambda g, c: sum(a.conditions[c].ci95[0] > 0 for a in g.audits),
    # seeds whose interval of metric KEY (KEY_lo, KEY_hi per seed) lies below / above 0,
    # or holds 0 (None: a seed lacks it)
    "seeds_below": lambda g, key: _seeds(g, key, lambda lo, hi: hi < 0),
    "seeds_above": lambda g, key: _seeds(g, key, lambda lo, hi: lo > 0),
    "seeds_holding_zero": lambda g, key: _seeds(g, key, lambda lo, hi: lo <= 0 <= hi),
    "accuracy_under": lambda g, c: float(np.mean([a.conditions[c].accuracy
                                                  for a in g.audits])),
}

OPS: dict[str, Callable[[Any, Any], bool]] = {
    ">=": operator.ge, ">": operator.gt, "<": operator.lt, "<=": operator.le,
    "==": operator.eq, "any": lambda v, t: True}

Check = tuple[str, str, float | str]  # a field, a comparison, a threshold: a number, "all"
# (the group's seed count) or a field ("vs <field>": of the compared group)


@dataclass(frozen=True)
class Finding:
    """A claim, the checks that decide it, and what is said after the verdict.

    ``group``: the group prefix it reads (the first of several with every field defined);
    ``versus``: a second group whose fields a threshold may name (``vs <field>``);
    ``undefined``: said when a field is undefined (None: the finding is left out);
    ``words``: the verdict's two words (None: no verdict, the text alone); ``last``: the
    verdict after the text."""

    group: str | tuple[str, ...]
    claim: str
    checks: tuple[Check, ...]
    said: str
    undefined: str | None = None
    versus: str | None = None
    words: tuple[str, str] | None = ("holds", "does not hold")
    last: bool = False

    def judge(self, g: Seeds) -> tuple[str, str] | None:
        values = [g[field] for field, _, _ in self.checks]
        if any(v is None for v in values):
            return None if self.undefined is None else (self.claim, self.undefined)
        g.holds = all(OPS[op](v, g.n if t == "all" else g[t] if isinstance(t, str) else t)
                      for v, (_, op, t) in zip(values, self.checks, strict=True))
        text = self.said.format_map(g)
        if self.words is None:
            return self.claim, text
        word = self.words[0] if g.holds else self.words[1]
        return self.claim, f"{text}: {word}" if self.last else f"{word}: {text}"


@dataclass(frozen=True)
class Group:
    """One model family at one size, trained and audited over several seeds."""

    arch: str
    preset: str
    seeds: int = 0  # 0: the study's seed count (``--seeds``, else the preset's)
    dense: str | None = "own"  # "own": the trained Dense twin of the same seed; or the
    # twin's arch (the vision families' dense-vit, dense-cnn), trained at the same preset
    schedule: TrainPreset | None = None  # None: the preset's own training settings
    point: str = ""  # a trend point (size and length, "tiny-600"); names the run folders
    task: str | None = None  # a synthetic task (fcaudit train --task); None: the corpus
    control: bool = False  # a single-seed control: ``--seeds`` leaves its count alone
    fold: str | None = None  # a condition folded into each seed's model after its audit
    heal: int = 0  # steps healing the fold (with the control), 0: none
    benchmarks: bool = False  # its audits score the study's lm-eval tasks (study/lm_tasks.py)

    @property
    def stem(self) -> str:
        return "-".join(filter(None, (self.task, self.point or self.preset)))

    @property
    def name(self) -> str:
        return f"{self.arch}-{self.stem}"

    @property
    def dense_arch(self) -> str | None:
        return "dense" if self.dense == "own" else self.dense


def pick(groups: Mapping[str, Seeded], prefix: str) -> Seeded | None:
    """The first group named ``prefix`` or ``prefix-...``."""
    return next((g for n, g in groups.items() if n == prefix or n.startswith(f"{prefix}-")),
                None)


@dataclass(frozen=True)
class Preset:
    """A study: its groups and seed count, its own table (title, rows: group prefix and
    label, columns: header and cell format) and its findings; ``missing``: a penalty
    cell's text where a condition was not run."""

    groups: tuple[Group, ...]
    seeds: int = 3
    title: str = ""
    rows: tuple[tuple[str, str], ...] = ()
    columns: tuple[tuple[str, str], ...] = ()
    findings: tuple[Finding, ...] = ()
    missing: str = "not run"

    def table(self, groups: Mapping[str, Seeded]) -> list[dict[str, str]]:
        """One row per group present: each column's format over the group's seeds."""
        seeds = [Seeds(g, label, self.missing) for prefix, label in self.rows
                 if (g := pick(groups, prefix)) is not None]
        return [{head: text.format_map(g) for head, text in self.columns} for g in seeds]

    def judge(self, groups: Mapping[str, Seeded]) -> list[tuple[str, str]]:
        """Every finding whose group is present and whose fields are defined."""
        out = []
        for f in self.findings:
            other = pick(groups, f.versus) if f.versus else None
            if f.versus and other is None:
                continue
            versus = None if other is None else Seeds(other, "", self.missing)
            for prefix in (f.group,) if isinstance(f.group, str) else f.group:
                group = pick(groups, prefix)
                said = None if group is None else \
                    f.judge(Seeds(group, "", self.missing, versus))
                if said is not None:
                    out.append(said)
                    break
        return out
