"""Every figure fcaudit draws for the audit report and the reproduction study (the trend
study's, in its style, is in :mod:`fcaudit.report.trend_figures`).

One module so the report and ``reproduce`` draw profiles, penalties and variance
shares the same way. Drawing functions take result objects or plain numbers, never
audit.json dicts, and return None when there is nothing to draw; they draw only what
the engine produces (a per-layer profile is mean ± sd, a position map is sampled every
``position_stride`` positions).

Output is deterministic, so re-rendering the same result gives byte-identical files:
fixed sizes and style, salted SVG ids, no dates or software stamps. Each figure is
written as PNG (embedded in HTML reports) and SVG (for print), atomically.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import matplotlib
import matplotlib.style
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fcaudit.engine.result import ETA2_KEYS, Profile
from fcaudit.io.fileio import PLAIN_FILES, FileWriter

FIG_WIDTH = 8.0
MAX_HEATMAP_COLUMNS = 256  # wider position maps are averaged in bins (PNG size, legibility)
STYLE = ["default", {"svg.hashsalt": "fcaudit", "svg.fonttype": "path", "figure.dpi": 100,
                     "savefig.dpi": 100, "font.size": 9, "legend.fontsize": 8, "axes.grid": True,
                     "grid.alpha": 0.3, "axes.axisbelow": True}]
_METADATA = {"png": {"Software": None}, "svg": {"Date": None, "Creator": None}}
SHARE_LABELS = {"eta2_layer": "layer", "eta2_position": "position",
                "eta2_layer_position": "layer × position", "eta2_component": "component",
                "eta2_residual": "residual (input/token content)"}


class Span(NamedTuple):
    """A value with an interval (a 95% CI, or a range over seeds); any part may be None."""

    value: float | None
    lo: float | None = None
    hi: float | None = None

    @classmethod
    def of(cls, value: float | None, interval: Sequence[float] | None) -> Span:
        lo, hi = interval if interval is not None else (None, None)
        return cls(value, lo, hi)


@dataclass(frozen=True)
class RenderedFigure:
    """A written figure: its PNG bytes (for embedding) and the PNG and SVG paths."""

    stem: str
    caption: str
    png: bytes
    png_path: Path
    svg_path: Path


# A figure to draw: file stem, caption, and a function that draws it (None: no data).
FigureSpec = tuple[str, str, Callable[[], Figure | None]]


def write_figures(specs: Sequence[FigureSpec], fig_dir: Path,
                  files: FileWriter = PLAIN_FILES) -> list[RenderedFigure]:
    """Draw each figure under the fixed style (artists read it when created) and write
    PNG and SVG atomically through ``files``; figures without data are skipped."""
    out = []
    with matplotlib.style.context(STYLE):
        for stem, caption, draw in specs:
            fig = draw()
            if fig is None:
                continue
            png, svg = _render(fig)
            png_path, svg_path = fig_dir / f"{stem}.png", fig_dir / f"{stem}.svg"
            files.write_bytes(png_path, png)
            files.write_bytes(svg_path, svg)
            out.append(RenderedFigure(stem, caption, png, png_path, svg_path))
    return out


def _render(fig: Figure) -> tuple[bytes, bytes]:
    """PNG then SVG; the layout solved for the PNG is frozen so both match (and it is faster)."""
    out = []
    for fmt in ("png", "svg"):
        buf = io.BytesIO()
        fig.savefig(buf, format=fmt, metadata=_METADATA[fmt])
        fig.set_layout_engine("none")
        out.append(buf.getvalue())
    return out[0], out[1]


# --------------------------------------------------------------------------- helpers


def floats(values: Sequence[Any]) -> np.ndarray:
    """A float array; None (a value the engine could not compute) becomes NaN."""
    return np.array([np.nan if v is None else v for v in values], dtype=float)


def error_bars(spans: Sequence[Span]) -> np.ndarray:
    """Distances from each value to its interval ends, [2, n]; 0 where any part is missing."""
    v, lo, hi = (floats([getattr(s, k) for s in spans]) for k in ("value", "lo", "hi"))
    err = np.nan_to_num(np.stack([v - lo, hi - v]), nan=0.0, posinf=0.0, neginf=0.0)
    return np.clip(err, 0.0, None)


def _stacked_axes(n: int, height: float) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=(FIG_WIDTH, 0.4 + height * n), layout="constrained")
    return fig, list(fig.subplots(n, 1, squeeze=False)[:, 0])


def _bin_columns(m: np.ndarray, max_columns: int) -> tuple[np.ndarray, int]:
    """Average columns in equal bins so at most ``max_columns`` remain; NaN-aware."""
    width = max(1, math.ceil(m.shape[1] / max_columns))
    if width == 1:
        return m, 1
    bins = math.ceil(m.shape[1] / width)
    padded = np.full((m.shape[0], bins * width), np.nan)
    padded[:, :m.shape[1]] = m
    blocks = padded.reshape(m.shape[0], bins, width)
    finite = np.isfinite(blocks)
    counts = finite.sum(axis=2)
    sums = np.where(finite, blocks, 0.0).sum(axis=2)
    return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan), width


# --------------------------------------------------------------------------- figures


def profile_figure(panels: Mapping[str, Sequence[tuple[str, Profile]]]) -> Figure | None:
    """One panel per title (a family, or a study group); one line per labelled profile:
    the per-layer mean with a ±1 sd band."""
    panels = {t: lines for t, lines in panels.items()
              if any(np.isfinite(floats(p.mean)).any() for _, p in lines)}
    if not panels:
        return None
    fig, axes = _stacked_axes(len(panels), 2.6)
    for ax, (title, lines) in zip(axes, panels.items(), strict=True):
        for i, (label, profile) in enumerate(lines):
            mean, sd = floats(profile.mean), floats(profile.sd)
            x = np.arange(mean.size)
            ax.fill_between(x, mean - sd, mean + sd, color=f"C{i}", alpha=0.2, lw=0)
            ax.plot(x, mean, color=f"C{i}", marker="o", ms=3, label=label)
        ax.set(title=f"{title}: mean coefficient per layer (band: ±1 sd)", xlabel="layer",
               ylabel="coefficient")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if len(lines) > 1:
            ax.legend(loc="best")
    return fig


def heatmap_figure(profiles: Mapping[str, Profile]) -> Figure | None:
    """Mean coefficient by layer and position, one panel per family; the engine stores
    every ``position_stride``-th position, and wide maps are averaged in bins."""
    maps = {fam: (m, p.position_stride) for fam, p in profiles.items()
            if (m := np.array([floats(row) for row in p.position_mean])).ndim == 2
            and np.isfinite(m).any()}
    if not maps:
        return None
    fig, axes = _stacked_axes(len(maps), 2.8)
    for ax, (fam, (m, stride)) in zip(axes, maps.items(), strict=True):
        binned, width = _bin_columns(m, MAX_HEATMAP_COLUMNS)
        right = binned.shape[1] * width * stride - 0.5 * stride
        image = ax.imshow(np.ma.masked_invalid(binned), aspect="auto", interpolation="nearest",
                          cmap="viridis", extent=(-0.5 * stride, right, m.shape[0] - 0.5, -0.5))
        fig.colorbar(image, ax=ax, label="mean coefficient")
        shown = [f"sampled every {stride} positions"] if stride > 1 else []
        shown += [f"averaged in bins of {width}"] if width > 1 else []
        binning = f" ({', '.join(shown)})" if shown else ""
        ax.set(title=f"{fam}: mean coefficient by layer and position{binning}",
               xlabel="position", ylabel="layer")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(False)
    return fig


def expert_load_figure(loads: Mapping[str, Sequence[Sequence[float]]]) -> Figure | None:
    """What routing does, one panel per router family: the share of token-slots each layer
    routes to each expert (from the original routing; uniform is 1/E). A map of mean
    router logits would say nothing about which experts are picked."""
    return _layer_expert_figure(
        loads, lambda m: {"cmap": "viridis", "vmin": 0.0}, "share of token-slots",
        lambda fam, m: f"{fam}: expert load by layer (share of token-slots per expert; "
                       f"uniform = 1/{m.shape[1]})")


def expert_importance_figure(deltas: Mapping[str, Sequence[Sequence[float | None]]], *,
                             loss: str = "NLL") -> Figure | None:
    """Expert importance, one panel per router family: the ``loss`` change when each layer's
    expert is removed from every token's choice (layer x expert), on a diverging scale
    centred on 0; an expert the rule still picked (no removal measured) is grey."""
    def scale(m: np.ndarray) -> dict[str, Any]:
        bound = float(np.nanmax(np.abs(m))) or 1.0
        return {"cmap": IMPORTANCE_CMAP, "vmin": -bound, "vmax": bound}
    return _layer_expert_figure(
        deltas, scale, f"Δ {loss} when removed (nats)",
        lambda fam, m: f"{fam}: expert importance (Δ {loss} with the expert removed; grey: "
                       "still picked, not measured)")


def frontier_figure(curves: Mapping[str, Mapping[str, Sequence[tuple[float, Span]]]]
                    ) -> Figure | None:
    """The savings frontier, one panel per family: NLL penalty against the share of FLOPs
    saved, each rule a curve from the origin with 95% CI bars (dynamic solid, static
    dashed): a static curve on or under the dynamic one means the input-driven rule buys
    nothing."""
    panels = {f: rules for f, rules in curves.items() if any(rules.values())}
    if not panels:
        return None
    fig, axes = _stacked_axes(len(panels), 3.2)
    for ax, (fam, rules) in zip(axes, panels.items(), strict=True):
        _curves(ax, {rule: [(0.0, Span(0.0, 0.0, 0.0)),
                            *((100 * x, span) for x, span in points)]
                     for rule, points in rules.items()}, solid="dynamic")
        ax.set(title=f"{fam}: savings frontier", xlabel="FLOPs saved (%)",
               ylabel="Δ NLL vs correct (nats)")
    return fig


def exit_frontier_figure(curves: Mapping[str, Sequence[tuple[float, Span]]],
                         own: tuple[float, float] | None, *, depth: int, unit: str,
                         loss: str = "NLL") -> Figure | None:
    """The exit frontier in the savings frontier's style: the ``loss`` penalty against the
    mean executed depth, the learned rule's threshold sweep solid and fixed exit dashed,
    95% CI bars, the learned rule at its own threshold (``own``: depth, penalty) starred;
    a fixed-exit curve at or under the learned one means a static depth does as well."""
    curves = {rule: points for rule, points in curves.items() if points}
    if not curves:
        return None
    fig, (ax,) = _stacked_axes(1, 3.2)
    _curves(ax, curves, solid=next(iter(curves)))
    if own is not None:
        ax.plot(*own, "*", ms=11, color="black", zorder=5, label="learned rule, own threshold")
        ax.legend()
    ax.set(title="Exit frontier: loss against mean executed depth",
           xlabel=f"mean executed depth (layers per {unit}, of {depth})",
           ylabel=f"Δ {loss} vs correct (nats)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig


def _curves(ax: Axes, curves: Mapping[str, Sequence[tuple[float, Span]]], solid: str) -> None:
    """Each named curve over x with its interval bars, ``solid`` drawn solid and the
    others dashed, a grey line at 0 and a legend."""
    for name, points in curves.items():
        pts = sorted(points, key=lambda p: p[0])
        spans = [span for _, span in pts]
        ax.errorbar(np.array([x for x, _ in pts]), floats([s.value for s in spans]),
                    yerr=error_bars(spans), marker="o", ms=3, capsize=2, label=name,
                    linestyle="-" if name == solid else "--")
    ax.axhline(0, color="0.5", lw=0.8)
    ax.legend()


IMPORTANCE_CMAP = matplotlib.colormaps["RdBu_r"].with_extremes(bad="0.6")


def _layer_expert_maps(rows_by_family: Mapping[str, Sequence[Sequence[float | None]]]
                       ) -> dict[str, np.ndarray]:
    """Per family, a layer x expert matrix (NaN where a layer has fewer experts or a value
    is None); families with no finite value are left out."""
    maps = {}
    for fam, rows in rows_by_family.items():
        if not rows:
            continue
        m = np.full((len(rows), max(len(r) for r in rows)), np.nan)
        for i, row in enumerate(rows):
            m[i, :len(row)] = floats(row)
        if np.isfinite(m).any():
            maps[fam] = m
    return maps


def _layer_expert_figure(rows_by_family: Mapping[str, Sequence[Sequence[float | None]]],
                         scale: Callable[[np.ndarray], dict[str, Any]], colorbar: str,
                         title: Callable[[str, np.ndarray], str]) -> Figure | None:
    """One layer x expert map per family with integer ticks (NaN cells blank), coloured
    on ``scale(map)``, titled ``title(family, map)``."""
    maps = _layer_expert_maps(rows_by_family)
    if not maps:
        return None
    fig, axes = _stacked_axes(len(maps), 2.8)
    for ax, (fam, m) in zip(axes, maps.items(), strict=True):
        image = ax.imshow(np.ma.masked_invalid(m), aspect="auto", interpolation="nearest",
                          extent=(-0.5, m.shape[1] - 0.5, m.shape[0] - 0.5, -0.5), **scale(m))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        ax.grid(False)
        fig.colorbar(image, ax=ax, label=colorbar)
        ax.set(title=title(fam, m), xlabel="expert", ylabel="layer")
    return fig


def penalty_figure(conditions: Mapping[str, Mapping[str, Span]],
                   per_layer: Mapping[str, Sequence[tuple[int, Span]]] | None = None, *,
                   loss: str = "NLL") -> Figure | None:
    """Penalties vs correct with intervals: per condition (one marker per series: the
    audit, or each study group), and per layer (one line per ``name@layer`` series), in
    ``loss`` (the objective's name for it)."""
    series = _named_spans(conditions)
    layers = _layer_spans(per_layer or {})
    if not series and not layers:
        return None
    fig, axes = _stacked_axes(bool(series) + bool(layers), 3.2)
    if series:
        _condition_panel(axes[0], series, "Penalty per condition (all sites at once)",
                         f"Δ {loss} vs correct (nats) with interval")
    if layers:
        _layer_panel(axes[-1], layers, "Penalty of intervening on one layer (others correct)",
                     f"Δ {loss} (nats), 95% CI", legend=True)
    return fig


def comparison_figure(penalties: Mapping[str, Mapping[str, Span]],
                      retentions: Mapping[str, Mapping[str, Span]], *,
                      loss: str = "NLL") -> Figure | None:
    """Several audits side by side (one colour per model): each condition's penalty (in
    ``loss``) and each static profile's gap retention with their intervals (undefined ones
    left out)."""
    panels = [(spans, title, xlabel, refs) for spans, title, xlabel, refs in (
        (_named_spans(penalties), "Penalty per condition (all sites at once)",
         f"Δ {loss} vs correct (nats), 95% CI", (0.0,)),
        (_named_spans(retentions), "Gap retention of the static profiles",
         "share of the correct-to-global-mean gap kept (%), 95% CI", (0.0, 100.0)))
        if spans]
    if not panels:
        return None
    fig, axes = _stacked_axes(len(panels), 3.2)
    for ax, (spans, title, xlabel, refs) in zip(axes, panels, strict=True):
        _condition_panel(ax, spans, title, xlabel, refs, legend=True)
    return fig


def layer_figure(series: Mapping[str, Sequence[tuple[int, Span]]], title: str,
                 ylabel: str, reference: float | None = None) -> Figure | None:
    """One per-layer quantity, one line per series (a model), with intervals if any."""
    layers = _layer_spans(series)
    if not layers:
        return None
    fig, axes = _stacked_axes(1, 3.2)
    _layer_panel(axes[0], layers, title, ylabel, legend=len(layers) > 1, reference=reference)
    return fig


def _named_spans(series: Mapping[str, Mapping[str, Span]]) -> dict[str, dict[str, Span]]:
    """Each series' spans that have a value; empty when no series has any."""
    kept = {s: {c: span for c, span in spans.items() if span.value is not None}
            for s, spans in series.items()}
    return kept if any(kept.values()) else {}


def _layer_spans(series: Mapping[str, Sequence[tuple[int, Span]]]
                 ) -> dict[str, list[tuple[int, Span]]]:
    kept = {s: [(k, span) for k, span in entries if span.value is not None]
            for s, entries in series.items()}
    return {s: entries for s, entries in kept.items() if entries}


def _condition_panel(ax: Axes, series: Mapping[str, Mapping[str, Span]], title: str,
                     xlabel: str, references: Sequence[float] = (0.0,),
                     legend: bool = False) -> None:
    """One row per name, one marker with its interval per series, dodged vertically."""
    names = list(dict.fromkeys(c for conds in series.values() for c in conds))
    y = np.arange(len(names))[::-1].astype(float)
    offsets = 0.5 * (np.arange(len(series)) - (len(series) - 1) / 2) / max(1, len(series))
    for i, (label, conds) in enumerate(series.items()):
        spans = [conds.get(n, Span(None)) for n in names]
        ax.errorbar(floats([s.value for s in spans]), y + offsets[i],
                    xerr=error_bars(spans), fmt="o", color=f"C{i}", capsize=3, label=label)
    for ref in references:
        ax.axvline(ref, color="grey", lw=0.8)
    ax.set_yticks(y, names)
    ax.set(title=title, xlabel=xlabel)
    if len(series) > 1 or legend:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _layer_panel(ax: Axes, series: Mapping[str, Sequence[tuple[int, Span]]], title: str,
                 ylabel: str, legend: bool, reference: float | None = 0.0) -> None:
    """One line per series over the layers, dodged horizontally, with interval bars."""
    for i, (label, entries) in enumerate(series.items()):
        x = np.array([k for k, _ in entries], dtype=float) + 0.15 * (i - (len(series) - 1) / 2)
        spans = [s for _, s in entries]
        ax.errorbar(x, floats([s.value for s in spans]), yerr=error_bars(spans), fmt="o-",
                    ms=3, lw=1, capsize=2, color=f"C{i}", label=label)
    if reference is not None:
        ax.axhline(reference, color="grey", lw=0.8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(title=title, xlabel="layer", ylabel=ylabel)
    if legend:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))


def variance_figure(shares: Mapping[str, Mapping[str, float | None]]) -> Figure | None:
    """Stacked variance shares (``ETA2_KEYS``) per bar: a family, or a study group."""
    shares = {k: v for k, v in shares.items() if any(v.get(e) is not None for e in ETA2_KEYS)}
    if not shares:
        return None
    fig = Figure(figsize=(FIG_WIDTH, 3.4), layout="constrained")
    ax = fig.subplots()
    x = np.arange(len(shares))
    bottom = np.zeros(len(shares))
    segments = [(SHARE_LABELS[key], f"C{i}", np.nan_to_num(floats([v.get(key)
                                                                    for v in shares.values()])))
                for i, key in enumerate(ETA2_KEYS)]
    remainder = np.clip(1.0 - sum(s for _, _, s in segments), 0.0, None)
    for label, color, values in [*segments, ("unattributed", "lightgrey", remainder)]:
        if not (values > 1e-3).any():
            continue
        bars = ax.bar(x, values, 0.6, bottom=bottom, color=color, label=label)
        ax.bar_label(bars, [f"{s:.0%}" if s >= 0.05 else "" for s in values],
                     label_type="center", fontsize=8)
        bottom += values
    ax.set_xticks(x, list(shares))
    ax.grid(axis="x", visible=False)
    ax.set_ylim(0, max(1.0, float(bottom.max())) * 1.02)
    ax.set(title="Variance shares of the coefficients", ylabel="share of variance")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig


def retention_figure(groups: Mapping[str, Sequence[Span]]) -> Figure | None:
    """Static-layer gap retention per seed and group; an undefined one is an ``x`` at 0."""
    if not any(groups.values()):
        return None
    fig = Figure(figsize=(FIG_WIDTH, 3.2), layout="constrained")
    ax = fig.subplots()
    for i, spans in enumerate(groups.values()):
        x = i + 0.05 * np.arange(len(spans))
        defined = np.array([s.value is not None for s in spans], dtype=bool)
        ax.plot(x[~defined], np.zeros((~defined).sum()), "x", color="grey")
        kept = [s for s in spans if s.value is not None]
        if kept:
            ax.errorbar(x[defined], floats([s.value for s in kept]), yerr=error_bars(kept),
                        fmt="o", capsize=3, color=f"C{i}")
    ax.set_xticks(range(len(groups)), list(groups))
    ax.axhline(100, color="black", lw=0.8, ls="--")
    ax.set(title="Gap retention of the static per-layer profile, per seed (x: undefined)",
           ylabel="static-layer retention (%)")
    return fig


def ratio_figure(groups: Mapping[str, Mapping[str, Span]]) -> Figure | None:
    """Model / dense ratios (bars) per group, one bar per measure, with their ranges."""
    groups = {g: m for g, m in groups.items() if any(s.value is not None for s in m.values())}
    if not groups:
        return None
    measures = list(dict.fromkeys(k for m in groups.values() for k, s in m.items()
                                  if s.value is not None))
    fig = Figure(figsize=(FIG_WIDTH, 3.2), layout="constrained")
    ax = fig.subplots()
    x = np.arange(len(groups))
    width = 0.8 / len(measures)
    for j, measure in enumerate(measures):
        spans = [m.get(measure, Span(None)) for m in groups.values()]
        ax.bar(x + width * j, floats([s.value for s in spans]), width,
               yerr=error_bars(spans), capsize=3, label=measure)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(x + width * (len(measures) - 1) / 2, list(groups))
    ax.set(title="Execution against the dense counterpart (bars: seed range)",
           ylabel="model / dense")
    ax.legend()
    return fig
