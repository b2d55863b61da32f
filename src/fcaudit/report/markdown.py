"""Markdown and self-contained HTML for every page fcaudit writes (the audit report, the
study's reproduction report, the trend page): text from a result is escaped so it cannot
break a table or inject markup, and the HTML is rendered from the same Markdown, so the
two never disagree."""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from markdown_it import MarkdownIt

from fcaudit.report.figures import RenderedFigure
from fcaudit.report.format import fmt_finite, fmt_num, fmt_seq

if TYPE_CHECKING:
    from markdown_it.renderer import RendererHTML
    from markdown_it.token import Token
    from markdown_it.utils import EnvType, OptionsDict

FIGURE_DIR = "figures"  # beside the page: figures/NAME.png and .svg

# Backslash-escaped so text from a result cannot start emphasis, code, raw HTML or an
# autolink, an entity or strikethrough, or close a heading; "](" is broken so it cannot
# make a link or image, and "|" is escaped by md_table, where it matters. Such text is
# only ever placed mid-line, so line-start syntax (lists, quotes) cannot occur.
_MD_ESCAPE = str.maketrans({c: "\\" + c for c in "\\`*_<&~#"})


def one_line(value: object) -> str:
    """A line break inside a table cell or a heading would end it."""
    return " ".join(str(value).splitlines())


def md_text(value: object) -> str:
    """Any value as literal Markdown text on one line."""
    return one_line(value).strip().translate(_MD_ESCAPE).replace("](", "]\\(")


def md_code(value: object) -> str:
    """Any value as a literal code span (names, paths), fenced past its own backticks."""
    text = one_line(value)
    if not text:
        return ""
    fence = "`" * (max(map(len, re.findall("`+", text)), default=0) + 1)
    pad = " " if text[0] in "` " or text[-1] in "` " else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def md_fenced(text: str) -> str:
    """A literal code block (a command line), fenced past its own backticks."""
    fence = "`" * max(3, max(map(len, re.findall("`+", text)), default=0) + 1)
    return f"{fence}\n{text}\n{fence}"


def md_table(headers: Sequence[str], rows: Iterable[Sequence[str]], align: str) -> str:
    """A GFM table of Markdown cells; ``align`` has ``l`` (text) or ``r`` (numbers) per column.

    Every ``|`` in a cell is escaped: GFM unescapes it before parsing the cell, code
    spans included, so a pipe in a name shows as itself and never splits the row.
    """
    def line(cells: Sequence[str]) -> str:
        if len(cells) != len(align):
            raise ValueError(f"table row has {len(cells)} cells, expected {len(align)}")
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    rule = "|" + "|".join({"l": "---", "r": "---:"}[a] for a in align) + "|"
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def md_kv_table(mapping: Mapping[str, Any]) -> str:
    """Nested settings as ``item | value`` rows (dotted keys)."""
    return md_table(("item", "value"), ((md_code(k), fmt_value_cell(v))
                                        for k, v in flatten(mapping)), "ll")


def md_figures(figures: Sequence[RenderedFigure]) -> list[str]:
    """Each figure as its PNG with a caption and a link to the SVG."""
    blocks = []
    for f in figures:
        caption, png, svg = md_text(f.caption), f.png_path.name, f.svg_path.name
        blocks += [f"![{caption}]({FIGURE_DIR}/{png})",
                   f"*{caption}* (vector: [{svg}]({FIGURE_DIR}/{svg}))"]
    return blocks


def _embedded_image(self: RendererHTML, tokens: Sequence[Token], idx: int,
                    options: OptionsDict, env: EnvType) -> str:
    """Images are our figures: the PNG is embedded so the page needs no other file."""
    token = tokens[idx]
    png = env["figures"][token.attrGet("src")]
    token.attrSet("src", "data:image/png;base64," + base64.b64encode(png).decode("ascii"))
    return self.image(tokens, idx, options, env)


_MARKDOWN = MarkdownIt("commonmark", {"html": False}).enable("table")
_MARKDOWN.add_render_rule("image", _embedded_image)

_CSS = """
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1b1f24;
       background: #fff; margin: 0; }
main { max-width: 64rem; margin: 0 auto; padding: 1.5rem; }
h1 { font-size: 1.6rem; margin-bottom: .2rem; }
h2 { font-size: 1.25rem; border-bottom: 1px solid #d0d7de; padding-bottom: .2rem;
     margin-top: 2rem; }
h3 { font-size: 1.05rem; margin-bottom: .3rem; }
table { border-collapse: collapse; margin: .6rem 0; font-size: 13px; display: block;
        max-width: 100%; overflow-x: auto; }
th, td { border: 1px solid #d0d7de; padding: .25rem .5rem; vertical-align: top; }
th { background: #f6f8fa; text-align: left; }
td { font-variant-numeric: tabular-nums; }
td[style*="right"] { white-space: nowrap; }
code, pre { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace;
            font-size: 12.5px; background: #f6f8fa; }
code { padding: 0 .2rem; border-radius: 3px; }
td code { word-break: break-all; }
pre { padding: .6rem; overflow-x: auto; white-space: pre-wrap; word-break: break-all; }
blockquote { margin: .8rem 0; padding: .2rem .9rem; border-left: 4px solid #cf222e;
             background: #fff1f0; }
img { max-width: 100%; height: auto; border: 1px solid #eaeef2; }
em { color: #57606a; }
"""

# The browser enforces self-containment: nothing may load except inline styles and data: images.
_CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"


def to_html(title: str, markdown: str, figures: Sequence[RenderedFigure]) -> str:
    """The Markdown as a self-contained page; ``figures`` are the images it links."""
    body = _MARKDOWN.render(markdown, {"figures": {f"{FIGURE_DIR}/{f.png_path.name}": f.png
                                                   for f in figures}})
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">\n'
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{html.escape(title)}</title>\n<style>{_CSS}</style>\n</head>\n"
            f"<body>\n<main>\n{body}</main>\n</body>\n</html>\n")


# ---------------------------------------------------------------------------
# Formatting numbers (a value the engine could not compute is None).


def fmt_general(x: Any) -> str:
    """A raw setting of any magnitude in at most six significant digits."""
    if isinstance(x, float) and fmt_finite(x):
        return f"{x:,.6g}"
    return fmt_num(x) if x is None or isinstance(x, (bool, int, float)) else md_text(x)


def fmt_value_cell(value: Any) -> str:
    """One raw value: strings verbatim as code, numbers in general format, lists joined."""
    if isinstance(value, str):
        return md_code(value)
    if isinstance(value, (list, tuple)):
        if any(isinstance(v, (str, Mapping, list, tuple)) for v in value):
            return md_code(", ".join(str(v) for v in value))
        return fmt_seq(value, fmt_general, limit=12)
    return fmt_general(value)


def flatten(mapping: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in mapping.items():
        if isinstance(value, Mapping):
            out += flatten(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out
