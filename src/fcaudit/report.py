"""Human-facing audit report: ``report.md``, ``report.html`` and figures from audit.json content.

Both documents are rendered from one block model (headings, paragraphs, bullet
lists, tables, figures), so the Markdown and the HTML can never disagree. The
report opens with the three answers (variation, dependence, execution) and the
numbers behind them; the detail tables and a reproducibility section follow.

Every output is deterministic (fixed figure sizes, default matplotlib style,
salted SVG ids, no dates in metadata), so re-rendering the same audit gives
byte-identical files, and every file is written atomically. The HTML is
self-contained: inline CSS, figures as base64 PNG, no scripts, no network.
"""

from __future__ import annotations

import base64
import html
import io
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.style
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from .fileio import write_bytes, write_text

# ---------------------------------------------------------------------------
# Document model: one list of blocks, two renderers (Markdown and HTML).


@dataclass(frozen=True)
class Code:
    """A literal (name, path, command) shown verbatim in a monospace font."""

    text: str


@dataclass(frozen=True)
class Strong:
    text: str


Inline = str | Code | Strong
Line = tuple[Inline, ...]


@dataclass(frozen=True)
class Heading:
    level: int
    text: str


@dataclass(frozen=True)
class Para:
    parts: Line


@dataclass(frozen=True)
class Bullets:
    items: tuple[Line, ...]


@dataclass(frozen=True)
class Table:
    """``align`` holds one letter per column: ``l`` for text, ``r`` for numbers."""

    headers: tuple[str, ...]
    rows: tuple[tuple[Inline, ...], ...]
    align: str


@dataclass(frozen=True)
class CodeBlock:
    text: str


@dataclass(frozen=True)
class Image:
    """A rendered figure: PNG bytes (embedded in HTML) and the file names under figures/."""

    caption: str
    png: bytes
    png_name: str
    svg_name: str


Block = Heading | Para | Bullets | Table | CodeBlock | Image

FIGURE_DIR = "figures"

# Characters that would start emphasis, code, HTML or a table cell; "](" would start a link.
_MD_SPECIAL = str.maketrans({c: "\\" + c for c in "\\`*_<>|"})


def _md_text(text: str) -> str:
    return text.translate(_MD_SPECIAL).replace("](", "]\\(")


def _md_inline(part: Inline) -> str:
    if isinstance(part, Code):
        fence = "``" if "`" in part.text else "`"
        pad = " " if fence == "``" else ""
        return f"{fence}{pad}{part.text}{pad}{fence}"
    if isinstance(part, Strong):
        return f"**{_md_text(part.text)}**"
    return _md_text(part)


def _md_line(parts: Iterable[Inline]) -> str:
    return "".join(_md_inline(p) for p in parts).replace("\n", " ")


def _md_block(block: Block) -> str:
    if isinstance(block, Heading):
        return "#" * block.level + " " + _md_line((block.text,))
    if isinstance(block, Para):
        return _md_line(block.parts)
    if isinstance(block, Bullets):
        return "\n".join("- " + _md_line(item) for item in block.items)
    if isinstance(block, Table):
        rule = {"l": "---", "r": "---:"}
        lines = ["| " + " | ".join(_md_line((h,)) for h in block.headers) + " |",
                 "|" + "|".join(rule[a] for a in block.align) + "|"]
        lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in block.rows]
        return "\n".join(lines)
    if isinstance(block, CodeBlock):
        fence = "`" * max(3, _longest_backtick_run(block.text) + 1)
        return f"{fence}\n{block.text}\n{fence}"
    caption = _md_line((block.caption,))
    return (f"![{caption}]({FIGURE_DIR}/{block.png_name})\n\n"
            f"*{caption}* (vector: [{block.svg_name}]({FIGURE_DIR}/{block.svg_name}))")


def _md_cell(cell: Inline) -> str:
    """A table cell; GFM needs ``|`` escaped even inside code spans."""
    return _md_line((Code(cell.text.replace("|", "\\|")),) if isinstance(cell, Code) else (cell,))


def _longest_backtick_run(text: str) -> int:
    run = best = 0
    for ch in text:
        run = run + 1 if ch == "`" else 0
        best = max(best, run)
    return best


def to_markdown(blocks: Sequence[Block]) -> str:
    return "\n\n".join(_md_block(b) for b in blocks) + "\n"


def _esc(text: str) -> str:
    return html.escape(text, quote=True)


def _html_inline(part: Inline) -> str:
    if isinstance(part, Code):
        return f"<code>{_esc(part.text)}</code>"
    if isinstance(part, Strong):
        return f"<strong>{_esc(part.text)}</strong>"
    return _esc(part)


def _html_line(parts: Iterable[Inline]) -> str:
    return "".join(_html_inline(p) for p in parts)


def _html_block(block: Block) -> str:
    if isinstance(block, Heading):
        return f"<h{block.level}>{_esc(block.text)}</h{block.level}>"
    if isinstance(block, Para):
        return f"<p>{_html_line(block.parts)}</p>"
    if isinstance(block, Bullets):
        items = "".join(f"<li>{_html_line(item)}</li>" for item in block.items)
        return f"<ul>{items}</ul>"
    if isinstance(block, Table):
        head = "".join(f"<th>{_esc(h)}</th>" for h in block.headers)
        body = "\n".join(
            "<tr>" + "".join(f'<td class="{a}">{_html_inline(c)}</td>'
                             for a, c in zip(block.align, row, strict=True)) + "</tr>"
            for row in block.rows)
        return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}\n</tbody>\n</table>"
    if isinstance(block, CodeBlock):
        return f"<pre><code>{_esc(block.text)}</code></pre>"
    data = base64.b64encode(block.png).decode("ascii")
    return (f'<figure><img src="data:image/png;base64,{data}" alt="{_esc(block.caption)}">'
            f"<figcaption>{_esc(block.caption)}</figcaption></figure>")


_CSS = """
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1b1f24;
       background: #fff; margin: 0; }
main { max-width: 64rem; margin: 0 auto; padding: 1.5rem; }
h1 { font-size: 1.6rem; margin-bottom: .2rem; }
h2 { font-size: 1.25rem; border-bottom: 1px solid #d0d7de; padding-bottom: .2rem;
     margin-top: 2rem; }
h3 { font-size: 1.05rem; margin-bottom: .3rem; }
table { border-collapse: collapse; margin: .6rem 0; font-size: 13px; }
th, td { border: 1px solid #d0d7de; padding: .25rem .5rem; vertical-align: top; }
th { background: #f6f8fa; text-align: left; }
td.r { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
code, pre { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace;
            font-size: 12.5px; background: #f6f8fa; }
code { padding: 0 .2rem; border-radius: 3px; }
pre { padding: .6rem; overflow-x: auto; white-space: pre-wrap; word-break: break-all; }
figure { margin: 1rem 0; }
figure img { max-width: 100%; height: auto; border: 1px solid #eaeef2; }
figcaption { font-size: 13px; color: #57606a; }
"""

# The browser enforces self-containment: nothing may load except inline styles and data: images.
_CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"


def to_html(title: str, blocks: Sequence[Block]) -> str:
    body = "\n".join(_html_block(b) for b in blocks)
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">\n'
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{_esc(title)}</title>\n<style>{_CSS}</style>\n</head>\n"
            f"<body>\n<main>\n{body}\n</main>\n</body>\n</html>\n")


# ---------------------------------------------------------------------------
# Reading and formatting audit values (any key may be missing or null).


def _get(obj: Any, *keys: str) -> Any:
    """``obj[k1][k2]...`` or None when any level is missing, null or not a mapping."""
    for key in keys:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def _dict(obj: Any, *keys: str) -> Mapping[str, Any]:
    value = _get(obj, *keys)
    return value if isinstance(value, Mapping) else {}


def _list(obj: Any, *keys: str) -> list[Any]:
    value = _get(obj, *keys)
    return list(value) if isinstance(value, (list, tuple)) else []


def _real(x: Any) -> float | None:
    """A finite float, or None for anything else (missing, null, text, inf)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return None
    value = float(x)
    return value if math.isfinite(value) else None


def _num(x: Any, digits: int = 4, sign: bool = False) -> str:
    """Fixed decimals for ordinary values, scientific notation for tiny or huge ones."""
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, numbers.Integral):
        return f"{int(x):+,}" if sign else f"{int(x):,}"
    value = _real(x)
    if value is None:
        return "n/a" if x is None or isinstance(x, numbers.Real) else str(x)
    plus = "+" if sign else ""
    if value != 0 and not 10.0 ** -digits <= abs(value) < 1e6:
        return f"{value:{plus}.3e}"
    return f"{value:{plus}.{digits}f}"


def _ci(ci: Any, digits: int = 4, sign: bool = False) -> str:
    if isinstance(ci, (list, tuple)) and len(ci) == 2 and all(_real(v) is not None for v in ci):
        return f"[{_num(ci[0], digits, sign)}, {_num(ci[1], digits, sign)}]"
    return "n/a"


def _with_ci(x: Any, ci: Any, digits: int = 4, sign: bool = True) -> str:
    return f"{_num(x, digits, sign)} {_ci(ci, digits, sign)}" if ci else _num(x, digits, sign)


def _share(x: Any) -> str:
    """An eta-squared fraction as a percentage."""
    value = _real(x)
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _pct(x: Any) -> str:
    value = _real(x)
    return "n/a" if value is None else _num(value, 2) + "%"


def _seq(values: Sequence[Any], fmt: Callable[[Any], str] = _num, limit: int = 8) -> str:
    """A comma-separated list, cut after ``limit`` items so a table cell stays short."""
    shown = ", ".join(fmt(v) for v in values[:limit])
    return shown + (f", … ({len(values)} in all)" if len(values) > limit else "")


def _general(x: Any) -> str:
    """A raw value of any magnitude in at most six significant digits."""
    value = _real(x)
    if value is None or isinstance(x, numbers.Integral):
        return _num(x)
    return f"{value:,.6g}"


def _value_cell(value: Any) -> Inline:
    """One raw value: strings verbatim as code, numbers in general format, lists joined."""
    if isinstance(value, str):
        return Code(value)
    if isinstance(value, (list, tuple)):
        if any(isinstance(v, (str, Mapping, list, tuple)) for v in value):
            return Code(", ".join(str(v) for v in value))
        return _seq(value, _general, limit=12)
    return _general(value)


def _flatten(mapping: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out += _flatten(value, name + ".")
        else:
            out.append((name, value))
    return out


def _kv_table(mapping: Mapping[str, Any]) -> Table:
    rows = tuple((Code(key), _value_cell(value)) for key, value in _flatten(mapping))
    return Table(("item", "value"), rows, "ll")


def _families(audit: Mapping[str, Any]) -> list[str]:
    """Families in site order, then any only named by the per-family sections."""
    names = [s.get("family") for s in _list(audit, "sites") if isinstance(s, Mapping)]
    for section in ("variance", "variation", "profiles"):
        names += list(_dict(audit, section))
    return [n for n in dict.fromkeys(names) if isinstance(n, str)]


# ---------------------------------------------------------------------------
# Sections.

CONDITION_ORDER = ("original", "correct", "reassign", "shuffle", "reassign+shuffle",
                   "static-layer", "static-layer-position", "global-mean")
CONDITION_MEANING = {
    "original": "controller live (record pass)",
    "correct": "own coefficients replayed (reference)",
    "reassign": "coefficients of another sequence",
    "shuffle": "own coefficients, positions permuted",
    "reassign+shuffle": "both at once",
    "static-layer": "per-site calibration mean",
    "static-layer-position": "per-site, per-position calibration mean",
    "global-mean": "one mean for the whole family",
}
PER_LAYER_CONDITIONS = ("reassign", "static-layer")
RETENTION_PROFILES = ("static-layer", "static-layer-position")
SHARES = (("eta2_layer", "layer"), ("eta2_position", "position"),
          ("eta2_layer_position", "layer × position"), ("eta2_component", "component"),
          ("eta2_residual", "residual (input/token content)"))


def _condition_names(conditions: Mapping[str, Any]) -> list[str]:
    return ([n for n in CONDITION_ORDER if n in conditions]
            + sorted(n for n in conditions if n not in CONDITION_ORDER))


def _variation_facts(audit: Mapping[str, Any]) -> list[Line]:
    facts: list[Line] = []
    for fam in _families(audit):
        var, spread = _dict(audit, "variance", fam), _dict(audit, "variation", fam)
        if var:
            facts.append((Code(fam), f": layer identity explains {_share(var.get('eta2_layer'))} "
                          f"of coefficient variance (position {_share(var.get('eta2_position'))}, "
                          f"layer × position {_share(var.get('eta2_layer_position'))}, "
                          f"input/token content {_share(var.get('eta2_residual'))})."))
        if spread:
            facts.append((Code(fam), ": sd across inputs "
                          f"{_num(spread.get('mean_sd_across_inputs'))} and across positions "
                          f"{_num(spread.get('mean_sd_across_positions'))}, vs "
                          f"{_num(spread.get('across_layer_sd'))} across layers."))
    return facts


def _dependence_facts(audit: Mapping[str, Any]) -> list[Line]:
    conditions = _dict(audit, "conditions")
    facts: list[Line] = [
        (Code(name), f": Δ NLL {_with_ci(c.get('delta'), c.get('ci95'))} nats vs correct.")
        for name in ("reassign", "shuffle", "static-layer", "global-mean")
        if (c := _dict(conditions, name))]
    for name in RETENTION_PROFILES:
        if r := _dict(audit, "retention", name):
            facts.append((Code(name), _retention_text(r)))
    return facts


def _retention_text(r: Mapping[str, Any]) -> str:
    if r.get("value") is None:
        return " gap retention: undefined" + (f" ({r['reason']})." if r.get("reason") else ".")
    return (f" keeps {_pct(r.get('value'))}"
            + (f" (95% CI {_ci(r['ci95'], 2)})" if r.get("ci95") else "")
            + " of the correct-to-global-mean gap.")


def _not_measured_reason(ex: Mapping[str, Any]) -> str:
    return str(ex.get("reason") or "no execution measurement in this audit")


def _not_measured(ex: Mapping[str, Any]) -> str:
    return f"Execution was not measured: {_not_measured_reason(ex)}."


def _execution_facts(audit: Mapping[str, Any]) -> list[Line]:
    ex = _dict(audit, "execution")
    if not ex.get("measured"):
        said = _not_measured_reason(ex) in str(_get(audit, "verdict", "execution") or "")
        return [] if said else [(_not_measured(ex),)]
    facts: list[Line] = [
        (f"Blocks executed per token: {_num(ex.get('blocks_executed'), 2)} of "
         f"{_num(ex.get('blocks_present'))} present (dense: "
         f"{_num(ex.get('dense_blocks_executed'), 2)}).",),
        (f"FLOPs per token: {_num(ex.get('flops_per_token'))} vs dense "
         f"{_num(ex.get('dense_flops_per_token'))} (ratio {_num(ex.get('flops_ratio'))}).",)]
    speed = _dict(ex, "timing", "speed_ratio_vs_dense")
    if speed or "speed_ratio_vs_dense" in ex:
        value = speed.get("value", ex.get("speed_ratio_vs_dense"))
        model, dense = _dict(ex, "timing", "model"), _dict(ex, "timing", "dense")
        facts.append((f"Speed ratio vs dense: {_with_ci(value, speed.get('ci95'), sign=False)}; "
                      f"throughput {_general(model.get('tokens_per_s'))} vs dense "
                      f"{_general(dense.get('tokens_per_s'))} tokens/s.",))
    if "conditional_execution" in ex:
        facts.append(("Conditional execution: ", Strong(_num(ex["conditional_execution"])), "."))
    return facts


def _answers(audit: Mapping[str, Any]) -> list[Block]:
    blocks: list[Block] = [Heading(2, "The three answers")]
    for i, (key, title, facts) in enumerate((
            ("variation", "Variation: do the coefficients vary?", _variation_facts),
            ("dependence", "Dependence: does the frozen model need them matched?",
             _dependence_facts),
            ("execution", "Execution: does the mechanism change what is computed?",
             _execution_facts)), start=1):
        blocks += [Heading(3, f"{i}. {title}"),
                   Para((Strong(str(_get(audit, "verdict", key) or "No verdict recorded.")),))]
        if items := facts(audit):
            blocks.append(Bullets(tuple(items)))
    return blocks


def _repeats_cell(c: Mapping[str, Any], correct_nll: Any) -> str:
    repeats = _list(c, "repeats")
    if len(repeats) <= 1:
        return str(len(repeats))
    deltas = _list(c, "repeat_deltas")
    if not deltas and _real(correct_nll) is not None:
        deltas = [r - correct_nll if _real(r) is not None else None for r in repeats]
    return f"{len(repeats)}: Δ " + _seq(deltas, lambda v: _num(v, sign=True)) if deltas else \
        f"{len(repeats)}: NLL " + _seq(repeats)


def _conditions(audit: Mapping[str, Any]) -> list[Block]:
    conditions = _dict(audit, "conditions")
    blocks: list[Block] = [Heading(2, "Conditions")]
    if not conditions:
        return blocks + [Para(("No conditions in this audit.",))]
    correct_nll = _get(conditions, "correct", "nll")
    rows = tuple((Code(n), CONDITION_MEANING.get(n, ""), _num(c.get("nll")),
                  _num(c.get("delta"), sign=True), _ci(c.get("ci95"), sign=True),
                  _repeats_cell(c, correct_nll))
                 for n in _condition_names(conditions) if isinstance(c := conditions[n], Mapping))
    blocks.append(Table(("condition", "coefficients fed", "NLL (nats)", "Δ vs correct",
                         "95% CI", "repeats"), rows, "llrrrl"))
    diff = _get(audit, "identity_replay_max_abs_diff")
    if diff is not None:
        note = " (bitwise identical)" if _real(diff) == 0 else ""
        blocks.append(Para(("Identity replay check: max |per-token NLL(correct) − NLL(original)| = "
                            f"{_num(diff)}{note}.",)))
    return blocks


def _retention(audit: Mapping[str, Any]) -> list[Block]:
    blocks: list[Block] = [Heading(2, "Gap retention"), Para((
        "R(P) = (NLL(global-mean) − NLL(P)) / (NLL(global-mean) − NLL(correct)): the share of "
        "the correct-to-global-mean gap a static profile P keeps. Undefined when the gap's "
        "95% CI includes 0.",))]
    rows = []
    for name in RETENTION_PROFILES:
        if not (r := _dict(audit, "retention", name)):
            continue
        undefined = r.get("value") is None
        rows.append((Code(name), "undefined" if undefined else _pct(r.get("value")),
                     "n/a" if undefined else _ci(r.get("ci95"), 2),
                     _with_ci(r.get("gap"), r.get("gap_ci95"), sign=False),
                     str(r.get("reason") or "") if undefined else ""))
    if not rows:
        return blocks + [Para(("No retention figures in this audit.",))]
    return blocks + [Table(("profile", "retention", "95% CI", "gap (nats) [95% CI]", "note"),
                           tuple(rows), "lrrrl")]


def _interaction(audit: Mapping[str, Any]) -> list[Block]:
    inter = _dict(audit, "interaction")
    if not inter:
        return []
    return [Heading(2, "Interaction"), Para((
        "I = Δ(reassign+shuffle) − Δ(reassign) − Δ(shuffle) = ",
        Strong(_with_ci(inter.get("value"), inter.get("ci95"))),
        " nats (95% CI). Near 0: the two penalties add up; negative: they overlap "
        "(sub-additive); positive: they compound.",))]


def _per_layer(audit: Mapping[str, Any]) -> list[Block]:
    """One table per family joining per-layer spread and per-layer intervention penalties."""
    blocks: list[Block] = [Heading(2, "Per layer")]
    for fam in _families(audit):
        spread = {e.get("layer"): e for e in _list(audit, "variation", fam, "per_layer")
                  if isinstance(e, Mapping)}
        penalties = {name: {e.get("layer"): e for e in _list(audit, "per_layer", name)
                            if isinstance(e, Mapping) and e.get("family", fam) == fam}
                     for name in PER_LAYER_CONDITIONS}
        if table := _per_layer_table(spread, {n: e for n, e in penalties.items() if e}):
            blocks += [Heading(3, f"Family {fam}"), table]
    if len(blocks) == 1:
        blocks.append(Para(("No per-layer results in this audit.",)))
    elif not _dict(audit, "per_layer"):
        blocks.insert(1, Para(("Per-layer interventions were not run; coefficient spread only.",)))
    return blocks


def _per_layer_table(spread: Mapping[Any, Mapping[str, Any]],
                     penalties: Mapping[str, Mapping[Any, Mapping[str, Any]]]) -> Table | None:
    layers = sorted(k for k in {*spread, *(k for e in penalties.values() for k in e)}
                    if isinstance(k, int))
    if not layers:
        return None
    columns: list[tuple[str, str, Callable[[int], Inline]]] = [
        ("layer", "r", str),
        ("site", "l", lambda k: Code(_site_of(k, spread, *penalties.values()))),
    ]
    if spread:
        columns += [(header, "r", lambda k, key=key: _num(_get(spread.get(k), key)))
                    for header, key in (("mean", "mean"), ("sd inputs", "sd_across_inputs"),
                                        ("sd positions", "sd_across_positions"))]
    columns += [(f"Δ {name}@layer [95% CI]", "r",
                 lambda k, e=entries: _with_ci(_get(e.get(k), "delta"), _get(e.get(k), "ci95")))
                for name, entries in penalties.items()]
    return Table(tuple(h for h, _, _ in columns),
                 tuple(tuple(cell(k) for _, _, cell in columns) for k in layers),
                 "".join(a for _, a, _ in columns))


def _site_of(layer: Any, *tables: Mapping[Any, Any]) -> str:
    for table in tables:
        if isinstance(entry := table.get(layer), Mapping) and entry.get("site"):
            return str(entry["site"])
    return ""


def _variance(audit: Mapping[str, Any]) -> list[Block]:
    blocks: list[Block] = [Heading(2, "Variance decomposition"), Para((
        "Share of the coefficients' variance (evaluation set) explained by layer identity, "
        "position and their interaction; the residual is what varies with input and token "
        "content.",))]
    families = _dict(audit, "variance")
    for fam in _families(audit):
        if not (var := _dict(families, fam)):
            continue
        comps = [c for c in _list(var, "components") if isinstance(c, Mapping)]
        keys = [(k, label) for k, label in SHARES
                if any(k in row for row in (var, *comps))]
        rows = [("pooled", _num(var.get("n_values")), *(_share(var.get(k)) for k, _ in keys))]
        rows += [(f"component {_list(c, 'index')}", "",
                  *(_share(c.get(k)) for k, _ in keys)) for c in comps]
        blocks += [Heading(3, f"Family {fam}"),
                   Table(("scope", "values", *(label for _, label in keys)), tuple(rows),
                         "lr" + "r" * len(keys))]
        if var.get("components_note"):
            blocks.append(Para((str(var["components_note"]),)))
    if len(blocks) == 2:
        blocks.append(Para(("No variance decomposition in this audit.",)))
    return blocks


def _variation(audit: Mapping[str, Any]) -> list[Block]:
    rows = tuple((Code(fam), _num(v.get("across_layer_sd")), _num(v.get("mean_sd_across_inputs")),
                  _num(v.get("mean_sd_across_positions")), _num(v.get("ratio_inputs_to_layers")),
                  _num(v.get("ratio_positions_to_layers")))
                 for fam in _families(audit) if (v := _dict(audit, "variation", fam)))
    if not rows:
        return []
    return [Heading(2, "Variation summary"), Para((
        "Standard deviation of coefficients across inputs and across positions within a layer "
        "(mean over layers), relative to the spread of layer means.",)),
        Table(("family", "sd across layers", "sd across inputs", "sd across positions",
               "inputs / layers", "positions / layers"), rows, "lrrrrr")]


def _execution(audit: Mapping[str, Any]) -> list[Block]:
    ex = _dict(audit, "execution")
    blocks: list[Block] = [Heading(2, "Execution")]
    if not ex.get("measured"):
        return blocks + [Para((_not_measured(ex),))]
    details = {k: v for k, v in ex.items() if k not in ("measured", "blocks_executed_per_layer")}
    fractions = _floats(_get(ex, "blocks_executed_per_layer"))
    if np.isfinite(fractions).any():
        details["blocks_executed_per_layer (min, mean, max)"] = [
            float(f(fractions)) for f in (np.nanmin, np.nanmean, np.nanmax)]
    return blocks + [_kv_table(details)]


def _reproducibility(audit: Mapping[str, Any]) -> list[Block]:
    blocks: list[Block] = [Heading(2, "Reproducibility")]
    command = _get(audit, "command")
    blocks += [CodeBlock(str(command))] if command else [Para(("Command not recorded.",))]
    blocks.append(Para(("Schema ", Code(str(_get(audit, "schema") or "unknown")),
                        ", fcaudit ", Code(str(_get(audit, "fcaudit_version") or "unknown")),
                        ".")))
    for title, key in (("Model", "model"), ("Data", "data")):
        if section := _dict(audit, key):
            blocks += [Heading(3, title), _kv_table(section)]
    if sites := _sites_table(audit):
        blocks += [Heading(3, "Sites"), sites]
    for title, keys in (("Seeds", ("seeds",)), ("Settings", ("settings",)),
                        ("Versions", ("versions",)), ("Host", ("runtime", "host"))):
        if section := _dict(audit, *keys):
            blocks += [Heading(3, title), _kv_table(section)]
    return blocks


def _sites_table(audit: Mapping[str, Any]) -> Table | None:
    by_family: dict[str, list[Mapping[str, Any]]] = {}
    for site in _list(audit, "sites"):
        if isinstance(site, Mapping):
            by_family.setdefault(str(site.get("family")), []).append(site)
    rows = []
    for fam, sites in by_family.items():
        shapes = list(dict.fromkeys(str(list(s.get("trailing_shape") or [])) for s in sites))
        shown = ", ".join(shapes) if len(shapes) <= 3 else \
            f"{shapes[0]} … {shapes[-1]} ({len(shapes)} distinct)"
        rows.append((Code(fam), str(len(sites)), Code(str(sites[0].get("name", ""))),
                     Code(str(sites[-1].get("name", ""))), shown))
    return Table(("family", "sites", "first", "last", "trailing shapes"), tuple(rows),
                 "lrlll") if rows else None


# ---------------------------------------------------------------------------
# Figures.

FIG_WIDTH = 8.0
MAX_HEATMAP_COLUMNS = 256
_STYLE = ["default", {"svg.hashsalt": "fcaudit", "svg.fonttype": "path", "figure.dpi": 100,
                      "savefig.dpi": 100, "font.size": 9, "legend.fontsize": 8, "axes.grid": True,
                      "grid.alpha": 0.3, "axes.axisbelow": True}]
_METADATA = {"png": {"Software": None}, "svg": {"Date": None, "Creator": None}}


def _floats(values: Any) -> np.ndarray:
    """A 1-D float array; null and non-numeric entries become NaN."""
    if not isinstance(values, (list, tuple)):
        return np.zeros(0)
    return np.array([np.nan if (v := _real(x)) is None else v for x in values], dtype=float)


def _matrix(rows: Any) -> np.ndarray:
    """A layer x position array from possibly ragged lists, padded with NaN."""
    arrays = [_floats(r) for r in rows] if isinstance(rows, (list, tuple)) else []
    width = max((a.size for a in arrays), default=0)
    out = np.full((len(arrays), width), np.nan)
    for i, a in enumerate(arrays):
        out[i, :a.size] = a
    return out


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


def _error_bars(values: np.ndarray, cis: Sequence[Any]) -> np.ndarray:
    """Distances from each value to its CI ends (0 where the CI is missing)."""
    lo_hi = np.array([_floats(ci) if isinstance(ci, (list, tuple)) and len(ci) == 2
                      else np.full(2, np.nan) for ci in cis]).reshape(-1, 2)
    err = np.stack([values - lo_hi[:, 0], lo_hi[:, 1] - values])
    return np.clip(np.nan_to_num(err, nan=0.0, posinf=0.0, neginf=0.0), 0.0, None)


def _stacked_axes(n: int, height: float) -> tuple[Figure, list[Any]]:
    fig = Figure(figsize=(FIG_WIDTH, 0.4 + height * n), layout="constrained")
    return fig, list(fig.subplots(n, 1, squeeze=False)[:, 0])


def _profile_figure(audit: Mapping[str, Any]) -> Figure | None:
    profiles = {f: p for f, p in _dict(audit, "profiles").items()
                if isinstance(p, Mapping) and np.isfinite(_floats(p.get("mean"))).any()}
    if not profiles:
        return None
    fig, axes = _stacked_axes(len(profiles), 2.4)
    for ax, (fam, p) in zip(axes, profiles.items(), strict=True):
        mean = _floats(p["mean"])
        x = np.arange(mean.size)
        q10, q90, sd = (_floats(p.get(k)) for k in ("q10", "q90", "sd"))
        if q10.size == q90.size == mean.size:
            ax.fill_between(x, q10, q90, color="C0", alpha=0.15, lw=0, label="q10–q90")
        if sd.size == mean.size:
            ax.fill_between(x, mean - sd, mean + sd, color="C0", alpha=0.35, lw=0,
                            label="mean ± sd")
        ax.plot(x, mean, color="C0", marker="o", ms=3, label="mean")
        ax.set(title=f"{fam}: coefficient per layer", xlabel="layer", ylabel="coefficient")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(loc="best")
    return fig


def _heatmap_figure(audit: Mapping[str, Any]) -> Figure | None:
    maps = {f: m for f, p in _dict(audit, "profiles").items()
            if isinstance(p, Mapping) and np.isfinite(m := _matrix(p.get("position_mean"))).any()}
    if not maps:
        return None
    seq_len = _real(_get(audit, "data", "seq_len"))
    fig, axes = _stacked_axes(len(maps), 2.8)
    for ax, (fam, m) in zip(axes, maps.items(), strict=True):
        # The engine may store every k-th position of long sequences; recover k from seq_len.
        stride = max(1, math.ceil(seq_len / m.shape[1])) if seq_len else 1
        binned, width = _bin_columns(m, MAX_HEATMAP_COLUMNS)
        image = ax.imshow(np.ma.masked_invalid(binned), aspect="auto", interpolation="nearest",
                          cmap="viridis", extent=(-0.5 * stride, binned.shape[1] * width * stride
                                                  - 0.5 * stride, m.shape[0] - 0.5, -0.5))
        fig.colorbar(image, ax=ax, label="mean coefficient")
        shown = [f"sampled every {stride} positions"] if stride > 1 else []
        shown += [f"averaged in bins of {width}"] if width > 1 else []
        binning = f" ({', '.join(shown)})" if shown else ""
        ax.set(title=f"{fam}: mean coefficient by layer and position{binning}",
               xlabel="position", ylabel="layer")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(False)
    return fig


def _penalty_figure(audit: Mapping[str, Any]) -> Figure | None:
    conditions = _dict(audit, "conditions")
    names = [n for n in _condition_names(conditions)
             if n != "correct" and _real(_get(conditions, n, "delta")) is not None]
    series = []
    for name in PER_LAYER_CONDITIONS:
        entries = [e for e in _list(audit, "per_layer", name) if isinstance(e, Mapping)
                   and _real(e.get("delta")) is not None and _real(e.get("layer")) is not None]
        for fam in dict.fromkeys(e.get("family") for e in entries):
            series.append((name, fam, [e for e in entries if e.get("family") == fam]))
    if not names and not series:
        return None
    fig, axes = _stacked_axes(bool(names) + bool(series), 3.2)
    if names:
        ax = axes[0]
        deltas = np.array([_real(conditions[n]["delta"]) for n in names])
        y = np.arange(len(names))[::-1]
        ax.errorbar(deltas, y, xerr=_error_bars(deltas, [conditions[n].get("ci95") for n in names]),
                    fmt="o", color="C3", capsize=3)
        ax.axvline(0, color="grey", lw=0.8)
        ax.set_yticks(y, names)
        ax.set(title="Penalty per condition (all sites at once)",
               xlabel="Δ NLL vs correct (nats), 95% CI")
    if series:
        ax = axes[-1]
        families = {fam for _, fam, _ in series}
        for i, (name, fam, entries) in enumerate(series):
            x = np.array([_real(e["layer"]) for e in entries]) + 0.15 * (i - (len(series) - 1) / 2)
            d = np.array([_real(e["delta"]) for e in entries])
            label = f"{name}@layer" + (f" ({fam})" if len(families) > 1 else "")
            ax.errorbar(x, d, yerr=_error_bars(d, [e.get("ci95") for e in entries]), fmt="o-",
                        ms=3, lw=1, capsize=2, color=f"C{i}", label=label)
        ax.axhline(0, color="grey", lw=0.8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(title="Penalty of intervening on one layer (others correct)", xlabel="layer",
               ylabel="Δ NLL (nats), 95% CI")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def _variance_figure(audit: Mapping[str, Any]) -> Figure | None:
    families = {f: v for f, v in _dict(audit, "variance").items()
                if isinstance(v, Mapping) and any(_real(v.get(k)) is not None for k, _ in SHARES)}
    if not families:
        return None
    fig = Figure(figsize=(FIG_WIDTH, 3.4), layout="constrained")
    ax = fig.subplots()
    x = np.arange(len(families))
    bottom = np.zeros(len(families))
    segments = [(label, f"C{i}", np.array([_real(v.get(key)) or 0.0 for v in families.values()]))
                for i, (key, label) in enumerate(SHARES)]
    remainder = np.clip(1.0 - sum(s for _, _, s in segments), 0.0, None)
    for label, color, shares in [*segments, ("unattributed", "lightgrey", remainder)]:
        if not (shares > 1e-3).any():
            continue
        bars = ax.bar(x, shares, 0.6, bottom=bottom, color=color, label=label)
        ax.bar_label(bars, [f"{s:.0%}" if s >= 0.05 else "" for s in shares],
                     label_type="center", fontsize=8)
        bottom += shares
    ax.set_xticks(x, list(families))
    ax.grid(axis="x", visible=False)
    ax.set_ylim(0, max(1.0, float(bottom.max())) * 1.02)
    ax.set(title="Variance shares of the coefficients per family", ylabel="share of variance")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig


FIGURES: tuple[tuple[str, str, Callable[[Mapping[str, Any]], Figure | None]], ...] = (
    ("profile", "Coefficient per layer: mean with ±1 sd (and q10–q90 where recorded).",
     _profile_figure),
    ("heatmap", "Mean coefficient by layer and position.", _heatmap_figure),
    ("penalties", "NLL penalties vs correct replay with 95% bootstrap CIs.", _penalty_figure),
    ("variance", "Variance shares of the coefficients.", _variance_figure),
)


def _render(fig: Figure) -> dict[str, bytes]:
    """PNG then SVG; the layout solved for the PNG is frozen so both match (and it is faster)."""
    out = {}
    for fmt in ("png", "svg"):
        buf = io.BytesIO()
        fig.savefig(buf, format=fmt, metadata=_METADATA[fmt])
        fig.set_layout_engine("none")
        out[fmt] = buf.getvalue()
    return out


def write_figures(data: Any, fig_dir: Path,
                  figures: Sequence[tuple[str, str, Callable[[Any], Figure | None]]] = FIGURES,
                  ) -> tuple[list[Image], list[Path]]:
    """Draw every figure ``data`` has data for; write PNG and SVG atomically."""
    images: list[Image] = []
    paths: list[Path] = []
    with matplotlib.style.context(_STYLE):
        for stem, caption, draw in figures:
            fig = draw(data)
            if fig is None:
                continue
            rendered = _render(fig)
            for fmt, blob in rendered.items():
                paths.append(fig_dir / f"{stem}.{fmt}")
                write_bytes(paths[-1], blob)
            images.append(Image(caption, rendered["png"], f"{stem}.png", f"{stem}.svg"))
    return images, paths


def _figures(images: Sequence[Image]) -> list[Block]:
    if not images:
        return [Heading(2, "Figures"), Para(("No figure data in this audit.",))]
    return [Heading(2, "Figures"), *images]


# ---------------------------------------------------------------------------


def _lead(audit: Mapping[str, Any]) -> Line:
    """One line saying what was audited on what data, from whatever fields are present."""
    model, data = _dict(audit, "model"), _dict(audit, "data")
    about = [str(model[k]) if k != "n_params" else f"{_num(model[k])} parameters"
             for k in ("class", "n_params", "dtype") if model.get(k) is not None]
    parts: list[Inline] = []
    if model.get("spec"):
        parts += ["Model ", Code(str(model["spec"])), f" ({', '.join(about)}). " if about else ". "]
    if data.get("eval_sequences") is not None:
        parts.append(f"Evaluation: {_num(data['eval_sequences'])} sequences"
                     + (f" of {_num(data['seq_len'])} tokens" if data.get("seq_len") else "")
                     + (f" ({_num(data['eval_tokens'])} tokens)"
                        if data.get("eval_tokens") else "") + "; ")
    if data.get("calib_sequences") is not None:
        parts.append(f"calibration: {_num(data['calib_sequences'])} sequences. ")
    return (*parts, "NLL in nats per token; Δ is relative to correct replay.")


def build_blocks(audit: Mapping[str, Any], images: Sequence[Image]) -> tuple[str, list[Block]]:
    """The whole report as (title, blocks); the three answers come first."""
    model = _dict(audit, "model")
    title = f"Frozen Controller Audit: {model.get('spec') or model.get('class') or 'model'}"
    blocks: list[Block] = [Heading(1, title), Para(_lead(audit))]
    for section in (_answers, _conditions, _retention, _interaction, _per_layer, _variance,
                    _variation, _execution, _reproducibility):
        blocks += section(audit)
    return title, blocks + _figures(images)


def write_report(audit: dict, out_dir: Path) -> list[Path]:
    """Write report.md, report.html and figures/ under ``out_dir``; return the paths written."""
    out_dir = Path(out_dir)
    images, paths = write_figures(audit, out_dir / FIGURE_DIR)
    title, blocks = build_blocks(audit, images)
    for name, text in (("report.md", to_markdown(blocks)), ("report.html", to_html(title, blocks))):
        paths.append(out_dir / name)
        write_text(paths[-1], text)
    return paths
