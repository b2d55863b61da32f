"""Every number of README.md and docs/*.md comes from a committed result file.

``docs/make_docs.py --check`` must find every generated block equal to what its result
files give, and outside the generated blocks a page may hold only the numbers of
:data:`ALLOWED`: versions, settings and constants of the code, the paper's figures
(checked against the one place the code keeps them), section and row numbers. So a
hand-typed result cannot come back unnoticed.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "docs"))

import make_docs  # noqa: E402

# A number: digits not glued to a word on their left (bf16, SHA-256, Qwen2 are names).
NUMBER = re.compile(r"(?<![A-Za-z_\d.])(?<![A-Za-z]-)\d+(?:,\d{3})*(?:\.\d+)?")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
COMMENT = re.compile(r"<!--.*?-->", re.S)
CODE = re.compile(r"`[^`\n]+`")
BARE = re.compile(r"`[\s\d.,%x+-]+`")  # a number alone in code format is still a number

# (page or "*", regex, why it is not a result). A number is allowed when it lies inside a
# match of an entry for its page.
ALLOWED: tuple[tuple[str, str, str], ...] = (
    ("*", r"torch ?(?:==|>=) ?[\d.]+|Python >= [\d.]+|CC-BY [\d.]+",
     "versions required, and the corpus licence's version"),
    ("*", r"SPEC section \d+", "section numbers of the specification"),
    ("*", r"95% (?:percentile )?intervals?|lower 95% bound", "the interval level, a convention"),
    ("*", r"(?:MUDDPythia-|public )?1\.4B(?:-shaped)?|76M/504M|Qwen2/3-MoE|Gemma 4|Llama 4|2-D",
     "names of models, model families and layouts"),
    ("*", r"rank \d+|layers 0, 1, \.\.\.|layers 0\.\.N-2|sources 0 and 1|block 0's|"
          r"positions 1\.\.T-1|shard 0|\(batch 0\)", "indices that name things"),
    ("*", r"sum to 1|excludes [01]\b|\[0, 1\]|\(> 1 means|: 1 = balanced|\|diff\| 0|"
          r"0 for scalar|not above 0|\bk = 1, 4, 16|exits? (?:with )?(?:status )?\d+|"
          r"status \d+", "mathematical facts, exit statuses and option values of the text"),
    ("README.md", r"the 42|other 34 works", "the pinned corpus's number of works (a SHA-256 "
     "fixes it) and of training works (42 less the four evaluation and four calibration ones)"),
    ("docs/reliability.md", r"its\s+42 works", "the same corpus fact"),
    ("docs/reliability.md", r"(?m)^\|.*\|$", "the catalogue and property tables: each row names "
     "its test, and its numbers are what that test constructs or asserts"),
    ("docs/method.md", r"or 256 capped|the first 16", "defaults of the code: window length, "
     "variance components reported"),
    ("docs/performance.md", r"tiny FeatureGate for 30 steps|--max-calib 64 --no-per-layer"
     r"[^`]*--repeats 1|K = 3 repeats",
     "the settings the benchmark's text describes (its defaults)"),
)


def _defaults() -> dict[str, float]:
    from fcaudit import execution, metrics, verdicts
    from fcaudit.data import DataSpec
    from fcaudit.models.moe import MoEConfig
    from fcaudit.models.skipgate import SkipGateConfig
    from fcaudit.options import AuditOptions
    return {"strong_penalty": verdicts.STRONG_PENALTY,
            "strong_retention": verdicts.STRONG_RETENTION,
            "weak_retention": verdicts.WEAK_RETENTION, "weak_penalty": verdicts.WEAK_PENALTY,
            "min_pairs": execution.MIN_PAIRS, "tolerance": 100 * execution.TOLERANCE,
            "speed_tolerance": 100 * execution.SPEED_TOLERANCE,
            "bootstrap": AuditOptions().bootstrap,
            "chunk_log2": metrics.CHUNK_ELEMENTS.bit_length() - 1,
            "max_eval": DataSpec().max_eval, "max_calib": DataSpec().max_calib,
            "capacity": 100 * SkipGateConfig().capacity, "experts": MoEConfig().num_experts,
            "top_k": MoEConfig().top_k, "aux": MoEConfig().aux_loss_coef}


# (page, regex whose groups are numbers, the code constants they must equal): settings
# quoted in prose, checked against the code that applies them.
CONSTANTS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("docs/method.md", r"exceeds (0\.1) nats", ("strong_penalty",)),
    ("docs/method.md", r"keeps less than (50)% of", ("strong_retention",)),
    ("docs/method.md", r"keeps at least (90)%", ("weak_retention",)),
    ("docs/method.md", r"below\s+(0\.05) nats", ("weak_penalty",)),
    ("docs/method.md", r"at least (10) pairs", ("min_pairs",)),
    ("docs/method.md", r"more than (1)% fewer", ("tolerance",)),
    ("docs/method.md", r"more than (2)% away", ("speed_tolerance",)),
    ("docs/method.md", r"default (1000), seeded", ("bootstrap",)),
    ("docs/method.md", r"at most 2\^(18) indices", ("chunk_log2",)),
    ("docs/method.md", r"Defaults: (64) evaluation and (64) calibration",
     ("max_eval", "max_calib")),
    ("docs/method.md", r"the top (50)% of the batch", ("capacity",)),
    ("docs/method.md", r"by (8) experts", ("experts",)),
    ("docs/method.md", r"coefficient (0\.01)\)", ("aux",)),
    ("README.md", r"top-(2) of (8) experts", ("top_k", "experts")),
)


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
    for where, pattern, _ in tuple((w, p, "") for w, p, _ in CONSTANTS) + ALLOWED:
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


@pytest.mark.parametrize(("page", "pattern", "names"), CONSTANTS)
def test_quoted_settings_equal_the_code(page: str, pattern: str, names: tuple[str, ...]) -> None:
    match = re.search(pattern, prose((REPO / page).read_text(encoding="utf-8")))
    assert match, f"{page} no longer says {pattern!r}: update CONSTANTS"
    defaults = _defaults()
    assert [float(g) for g in match.groups()] == [float(defaults[n]) for n in names]
