"""Render every number of README.md and docs/*.md from the committed result files.

A number-bearing part of a page sits between ``<!-- fcaudit:begin NAME -->`` and
``<!-- fcaudit:end NAME -->``; this script rewrites what is between them from the result
files that block NAME reads (docs/results/*.json, docs/trend/results/*.json,
src/fcaudit/timings.json), and writes docs/results/README.md, the index of every block
with its result files and the script that makes them. ``--check`` changes nothing and
exits 1 naming each block whose text differs from what the results give (a test runs
it), so text and results cannot drift apart.

    python docs/make_docs.py            # rewrite the blocks and the index
    python docs/make_docs.py --check
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from doc_blocks import BLOCKS, Results  # noqa: E402

# Every hand-written page: the README and each docs/*.md (a new page is covered the day it
# is added). docs/trend/trend.md and docs/results/README.md are written whole by scripts.
PAGES = ("README.md", *sorted(f"docs/{p.name}" for p in (HERE).glob("*.md")))
INDEX = "docs/results/README.md"
MARKER = re.compile(r"<!-- fcaudit:begin (?P<name>[\w.:-]+) -->(?P<body>.*?)"
                    r"<!-- fcaudit:end (?P=name) -->", re.S)


class DocsError(Exception):
    """A page names a block no renderer knows, or a block is on no page."""


def render_page(text: str, results: Results, page: str) -> tuple[str, list[str]]:
    """The page with every block re-rendered, and the names of the blocks that changed."""
    changed: list[str] = []

    def one(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in BLOCKS:
            raise DocsError(f"{page}: unknown block {name!r} (add it to docs/doc_blocks.py)")
        body = BLOCKS[name].render(results)
        if body != match["body"]:
            changed.append(name)
        return f"<!-- fcaudit:begin {name} -->{body}<!-- fcaudit:end {name} -->"

    return MARKER.sub(one, text), changed


def index(used: dict[str, list[str]]) -> str:
    """docs/results/README.md: every generated block, its result files and their scripts."""
    rows = []
    for name, block in BLOCKS.items():
        for page in used[name]:
            rows.append(f"| `{page}` | `{name}` | {block.what} | "
                        + "<br>".join(f"`{s}`" for s in block.sources) + " | "
                        + "<br>".join(f"`{m}`" for m in block.made_by) + " |")
    return ("# Result files\n\n"
            "Every number of README.md and docs/ is rendered by `python docs/make_docs.py` "
            "from the files below (`--check`, run by `tests/test_docs.py`, fails when a "
            "page and its results disagree). Each result file records the command, commit "
            "and machine that produced it. This index is generated too.\n\n"
            "| page | block | what | result files | made by |\n|---|---|---|---|---|\n"
            + "\n".join(rows) + "\n")


def build(root: Path = ROOT) -> dict[str, tuple[str, str, list[str]]]:
    """path -> (current text, rendered text, changed blocks), the index included."""
    results = Results(root)
    out: dict[str, tuple[str, str, list[str]]] = {}
    used: dict[str, list[str]] = {name: [] for name in BLOCKS}
    for page in PAGES:
        text = (root / page).read_text(encoding="utf-8")
        rendered, changed = render_page(text, results, page)
        for match in MARKER.finditer(text):
            used[match["name"]].append(page)
        out[page] = (text, rendered, changed)
    unused = [name for name, pages in used.items() if not pages]
    if unused:
        raise DocsError(f"blocks on no page: {', '.join(unused)}")
    path = root / INDEX
    current = path.read_text(encoding="utf-8") if path.is_file() else ""
    new = index(used)
    out[INDEX] = (current, new, [] if new == current else ["(index)"])
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if any block differs from its results")
    args = parser.parse_args(argv)
    pages = build()
    stale = {p: changed for p, (_, _, changed) in pages.items() if changed}
    if args.check:
        for page, changed in stale.items():
            print(f"{page}: out of date with its results: {', '.join(changed)}")
        return 1 if stale else 0
    for page, (text, rendered, _) in pages.items():
        if rendered != text:
            (ROOT / page).write_text(rendered, encoding="utf-8")
            print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
