"""Every number of README.md and docs/*.md comes from a committed result file.

``docs/make_docs.py --check`` must find every generated block equal to what its result
files give, and outside the generated blocks a page may hold only the numbers of
:data:`ALLOWED`: versions, settings and constants of the code, the paper's figures
(checked against the one place the code keeps them), section and row numbers. So a
hand-typed result cannot come back unnoticed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "docs"))

import doc_blocks  # noqa: E402
import make_docs  # noqa: E402

# A number: digits not glued to a word on their left (bf16, SHA-256, Qwen2 are names).
X
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
COMMENT = re.compile(r"<!--.*?-->", re.S)
CODE = re.compile(r"`[^`\n]+`")
BARE = re.compile(r"`[\s\d.,%x+-]+`")  # a number alone in code format is still a number

# (page or "*", phrase or regex, why it is not a result). A number is allowed when it lies
# inside a match of an entry for its page.
ALLOWED: tuple[tuple[str, str, str], ...] = ()


def blank(match: re.Match[str]) -> str:
    """The match replaced by spaces, keeping line breaks (so line numbers stay right)."""
    return re.sub(r"[^\n]", " ", match[0])


def prose(text: str) -> str:
    """The page without generated blocks, comments, fenced code and inline code that holds
    more than a number (commands, option values, formulas)."""
    text = make_docs.MARKER.sub(blank, text)
    for pattern in (COMMENT, FENCE):
        text = pattern.sub(blank, text)
    return CODE.sub(lambda m: m[0] if BARE.fullmatch(m[0]) else blank(m), text)


def stray_numbers(page: str, text: str) -> list[str]:
    """Each number outside the allowed places, as ``page:line: number in 'context'``."""
    cleaned = prose(text)
    allowed: set[int] = set()
    for where, pattern, _ in ALLOWED:
        if where in ("*", page):
            for m in re.finditer(pattern, cleaned, re.M):
                allowed.update(range(m.start(), m.end()))
    out = []
    for m in NUMBER.finditer(cleaned):
        if m.start() not in allowed:
            line = cleaned.count("\n", 0, m.start()) + 1
            context = cleaned[max(0, m.start() - 30):m.end() + 30].replace("\n", " ")
            out.append(f"{page}:{line}: {m[0]} in '{context.strip()}'")
    return out


def test_every_generated_block_matches_its_results() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "docs" / "make_docs.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("page", make_docs.PAGES)
def test_no_hand_typed_number_outside_the_generated_blocks(page: str) -> None:
    stray = stray_numbers(page, (REPO / page).read_text(encoding="utf-8"))
    assert not stray, "numbers typed by hand (render them from a result file, or justify "\
        "them in ALLOWED):\n" + "\n".join(stray)
