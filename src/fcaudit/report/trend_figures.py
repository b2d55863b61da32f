"""The trend study's figure (:mod:`fcaudit.study.trend`): each metric against parameters
and against training tokens, seeds as dots, published figures as anchors; drawn in the
style of :mod:`fcaudit.report.figures`, which writes it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter

from fcaudit.report.figures import FIG_WIDTH, Span, error_bars, floats


class TrendPoint(NamedTuple):
    """One series' value at one ladder point: where the point sits on both axes, the mean
    over seeds with its interval, each seed's value, and the point's name."""

    params: float
    tokens: float
    value: Span
    seeds: tuple[float, ...] = ()
    name: str = ""


class Anchor(NamedTuple):
    """A published figure to mark beside a series: a value (``lo == hi``) or a band, at
    ``params`` on the parameter axis, or (None, or on the token axis, where the
    published training lengths are not known) as a line across."""

    label: str
    series: str  # drawn in this series' colour
    lo: float
    hi: float
    params: float | None = None


@dataclass(frozen=True)
class TrendPanel:
    """One metric of the trend figure, drawn against parameters and against tokens."""

    ylabel: str
    series: Mapping[str, Sequence[TrendPoint]]
    anchors: Sequence[Anchor] = ()
    reference: float | None = None  # a grey line (0 nats, 100%)


TREND_AXES = (("params", "parameters"), ("tokens", "training tokens"))


def _count_label(n: float) -> str:
    """1.23M, 10M, 1B: counts of parameters and tokens on log axes."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.3g}"


def trend_figure(panels: Sequence[TrendPanel]) -> Figure | None:
    """One row per metric: against parameters (left) and training tokens (right), log
    scales shared down each column. Points sharing the other axis' value are joined (a
    size trained for several lengths, a length at several sizes); small dots are the
    seeds; the first row names the first series' points."""
    panels = [p for p in panels
              if any(t.value.value is not None for ts in p.series.values() for t in ts)]
    if not panels:
        return None
    fig = Figure(figsize=(FIG_WIDTH, 0.8 + 2.2 * len(panels)), layout="constrained")
    grid = fig.subplots(len(panels), len(TREND_AXES), squeeze=False, sharex="col")
    for i, (row, panel) in enumerate(zip(grid, panels, strict=True)):
        for ax, (axis, _) in zip(row, TREND_AXES, strict=True):
            _trend_axes(ax, panel, axis, names=i == 0)
            ax.set_ylabel(panel.ylabel)
    tokens = sorted({t.tokens for p in panels for ts in p.series.values() for t in ts})
    for (axis, label), top, bottom in zip(TREND_AXES, grid[0], grid[-1], strict=True):
        top.set_title(f"against {label}")
        bottom.set_xlabel(label)
        bottom.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _count_label(v)))
        bottom.xaxis.set_minor_formatter(NullFormatter())
        if axis == "tokens":  # a margin even for one length (else the dodge looks wide)
            bottom.set_xticks(tokens)
            bottom.set_xlim(tokens[0] / 1.3, tokens[-1] * 1.3)
    handles: dict[str, Any] = {}
    for ax in grid.flat:
        for handle, name in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(name, handle)
    fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncols=3)
    return fig


TREND_DODGE = 0.012  # decades between series sharing a point, so their bars stay apart


def _trend_axes(ax: Axes, panel: TrendPanel, axis: str, names: bool) -> None:
    other = "tokens" if axis == "params" else "params"
    for i, (name, points) in enumerate(panel.series.items()):
        kept = [t for t in points if t.value.value is not None]
        if not kept:
            continue
        colour, dodge = f"C{i}", 10 ** (TREND_DODGE * (i - (len(panel.series) - 1) / 2))

        def x(t: TrendPoint, dodge: float = dodge) -> float:
            return getattr(t, axis) * dodge

        for shared in sorted({getattr(t, other) for t in kept}):
            line = sorted((t for t in kept if getattr(t, other) == shared), key=x)
            if len(line) > 1:
                ax.plot([x(t) for t in line], [t.value.value for t in line], color=colour,
                        lw=0.8, alpha=0.6)
        ax.errorbar(floats([x(t) for t in kept]), floats([t.value.value for t in kept]),
                    yerr=error_bars([t.value for t in kept]), fmt="o", ms=4, capsize=3,
                    color=colour, label=name)
        ax.plot([x(t) for t in kept for _ in t.seeds], [v for t in kept for v in t.seeds], ".",
                ms=3, alpha=0.5, color=colour)
        for t in kept if names and i == 0 else ():
            ax.annotate(t.name, (x(t), t.value.value), xytext=(4, 3),
                        textcoords="offset points", fontsize=6, color=colour)
    colours = {name: f"C{i}" for i, name in enumerate(panel.series)}
    for anchor in panel.anchors:
        colour = colours.get(anchor.series, "black")
        if axis == "params" and anchor.params is not None:
            half = (anchor.hi - anchor.lo) / 2
            ax.errorbar([anchor.params], [anchor.lo + half], yerr=[[half], [half]], fmt="*",
                        ms=9, capsize=3, color=colour, mec="black", mew=0.5,
                        label=f"paper: {anchor.label}")
        elif anchor.lo == anchor.hi:
            # on the token axis a line across: the paper does not state its training length
            note = " (tokens unknown)" if anchor.params is not None else ""
            ax.axhline(anchor.lo, color=colour, lw=0.9, ls=":",
                       label=f"paper: {anchor.label}{note}")
        else:
            ax.axhspan(anchor.lo, anchor.hi, color=colour, alpha=0.12, lw=0,
                       label=f"paper: {anchor.label}")
    if panel.reference is not None:
        ax.axhline(panel.reference, color="grey", lw=0.8)
    ax.set_xscale("log")
