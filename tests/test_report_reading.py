"""The report as a new user reads it, on real audits of a gate toy, a router toy, an
early-exit LM (four and eight layers) and their comparison: it opens with what was audited
and the answers, each figure sits with the answer or section it illustrates, the
conditional-execution line gives its value and then its definition, a component is
explained where the word first appears, the exit frontier is a figure with a short table,
and no page of any kind writes an interval inside a second pair of brackets. The expected
words come from the requirement (issue 38, item 8), not from the code."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import toys
from conftest import FAST, toy_data

import fcaudit
from fcaudit import AuditData, AuditOptions
from fcaudit.models.earlyexit import EarlyExitConfig, EarlyExitGPT

VOCAB = 61
EXIT_OPTS = AuditOptions(repeats=1, bootstrap=50, batch_size=4, progress=False, per_layer=False,
                         timing_pairs=0)
MEANING = ("fewer blocks or FLOPs per token than dense, or experts skipped per token by "
           "routing")


def _exit_model(layers: int) -> EarlyExitGPT:
    """An early-exit LM whose exit scores straddle the threshold token by token."""
    torch.manual_seed(0)
    model = EarlyExitGPT(EarlyExitConfig(vocab_size=VOCAB, block_size=16, n_layer=layers,
                                         n_head=2, n_embd=16, exit_threshold=0.5))
    for name, p in model.named_parameters():
        if ".score." in name and name.endswith("proj.weight"):
            torch.nn.init.normal_(p, std=2.0)
    return model.eval()


def _exit_data() -> AuditData:
    rng = np.random.default_rng(0)
    return AuditData(rng.integers(0, VOCAB, (8, 16)), rng.integers(0, VOCAB, (8, 16)),
                     {"source": "tokens"})


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Audit folders (report.md, report.html, audit.json, figures) and a comparison."""
    root = tmp_path_factory.mktemp("pages")
    out = {"gate": root / "gate", "router": root / "router", "exit": root / "exit",
           "deep exit": root / "deep"}
    fcaudit.audit(toys.content_model(), out["gate"], sites=["gates.*"], data=toy_data(),
                  options=FAST)
    fcaudit.audit(toys.token_router_model(), out["router"], data=toy_data(), options=FAST)
    fcaudit.audit(_exit_model(4), out["exit"], data=_exit_data(), options=EXIT_OPTS)
    fcaudit.audit(_exit_model(8), out["deep exit"], data=_exit_data(), options=EXIT_OPTS)
    fcaudit.compare([out["exit"], out["deep exit"]], root / "compare")
    return {**out, "compare": root / "compare"}


def _md(folder: Path) -> str:
    return (folder / "report.md").read_text(encoding="utf-8")


def _json(folder: Path) -> dict:
    return json.loads((folder / "audit.json").read_text(encoding="utf-8"))


def _section(md: str, heading: str) -> str:
    """From the heading line (any level) to the next heading of the same or a higher level."""
    level = heading.split(" ", 1)[0]
    start = md.index(f"\n{heading}")
    ends = [m.start() for m in re.finditer(rf"\n#{{1,{len(level)}}} ", md[start + 1:])]
    return md[start:start + 1 + ends[0]] if ends else md[start:]


@pytest.mark.parametrize("kind", ["gate", "exit"])
def test_the_report_opens_with_what_was_audited_then_the_answers(pages, kind) -> None:
    """The title, one paragraph naming the model, its evaluation and calibration sets and
    what Δ means, then the answers; an exit model's first answer names what exits."""
    blocks = _md(pages[kind]).split("\n\n")
    assert blocks[0].startswith("# Frozen Controller Audit: ")
    lead = blocks[1]
    assert lead.startswith("Model ") and "\n" not in lead
    assert "evaluation sequences of 16 tokens" in lead and "calibration sequences" in lead
    assert "every Δ is against the correct replay" in lead
    answers = "four" if kind == "exit" else "three"
    assert blocks[2] == f"## The {answers} answers"
    sections = re.findall(r"^## (.+)$", _md(pages[kind]), flags=re.M)
    if kind == "exit":  # the detail in the answers' order: exits first
        assert blocks[3] == ("### 1. Exits: where do tokens stop, what does stopping cost, "
                             "and would a static depth do as well?")
        assert sections[:4] == ["The four answers", "Conditions", "Exits", "Gap retention"]
    else:
        assert sections[:3] == ["The three answers", "Conditions", "Gap retention"]
    assert sections[-1] == "Reproducibility"


def test_each_figure_sits_with_its_answer_or_section(pages) -> None:
    """Every figure the audit drew is shown once, where what it illustrates is read: the
    coefficient figures with the variation answer, the penalties with dependence, the exit
    frontier with the exits answer, the expert load map with the routing section; no
    figures section at the end."""
    places = {"profile": "### 1. Variation", "heatmap": "### 1. Variation",
              "variance": "### 1. Variation", "penalties": "### 2. Dependence",
              "exit-frontier": "### 1. Exits", "expert-load": "## Routing",
              "expert-importance": "## Expert importance"}
    seen = set()
    for kind in ("gate", "router", "exit"):
        md = _md(pages[kind])
        assert "## Figures" not in md and "## More figures" not in md
        exits = kind == "exit"
        for png in sorted((pages[kind] / "figures").glob("*.png")):
            stem = png.stem
            place = places[stem]
            if exits and place.startswith("### "):  # the exits answer comes first
                number = int(place[4]) + (stem != "exit-frontier")
                place = f"### {number}{place[5:]}"
            assert md.count(f"](figures/{png.name})") == 1, (kind, stem)
            assert f"](figures/{png.name})" in _section(md, place), (kind, stem, place)
            seen.add(stem)
        page = (pages[kind] / "report.html").read_text(encoding="utf-8")
        assert page.count("<img") == len(list((pages[kind] / "figures").glob("*.png")))
    assert seen == set(places)


def test_the_conditional_execution_line_gives_its_value_then_its_definition(pages) -> None:
    """"no" is followed by what would make it yes, in a sentence of its own; "yes" by what
    yes means; never the value with the definition in parentheses as if it were the
    reason; compare's execution table defines its column the same way."""
    exit_md = _md(pages["exit"])
    assert _json(pages["exit"])["execution"]["conditional_execution"] is True
    assert f"Conditional execution: **yes**. (Yes means {MEANING}.)" in exit_md
    no = pages["gate"].parent / "no-execution"
    result = fcaudit.audit(toys.content_model(), no, sites=["gates.*"], data=toy_data(),
                           dense=toys.constant_model(), blocks="gates.*",
                           options=AuditOptions(**{**FAST.__dict__, "execution": True,
                                                   "timing_pairs": 0}))
    assert result.execution.conditional_execution is False
    md = _md(no)
    said = f"Conditional execution: **no**. (It would be yes with {MEANING}.)"
    assert md.count(said) == 2  # the execution answer and the execution section
    assert "Counted, not read from the coefficients." in _section(md, "## Execution")
    for text in (md, exit_md):
        assert not re.search(r"Conditional execution: \*\*(yes|no)\*\* \(", text)
    compare = (pages["compare"] / "compare.md").read_text(encoding="utf-8")
    per_unit = MEANING.replace("per token than", "per unit than")
    assert f"Conditional execution is yes with {per_unit}." in _section(compare, "## Execution")


def test_a_component_is_explained_where_the_word_first_appears(pages) -> None:
    """Vector coefficients: the first "component" of the page says what one is (which
    entry of the coefficient vector, beyond layer and position); its rows read "component
    [i] alone" and are introduced in words, never "index < [1]"; a router's axis is the
    expert a logit scores; one value per token shows no component at all."""
    md = _md(pages["gate"])
    first = md.index("component")
    sentence = md[first:md.index("\n", first)]
    assert "which entry of a coefficient vector a value is" in sentence
    variance = _section(md, "## Variance decomposition")
    rows = re.findall(r"^\| (component \[\d+\] alone) \|", variance, flags=re.M)
    shares = _json(pages["gate"])["variance"]["gates.*"]
    assert rows == [f"component [{c['index'][0]}] alone" for c in shares["components"]]
    assert "Rows `component [i] alone`: one row per entry of the coefficient vector that " \
           "every layer's sites have" in variance
    for old in ("index <", "index \\<", "trailing components present"):
        assert old not in md
    router = _section(_md(pages["router"]), "### 1. Variation")
    answer = router.split("\n\n")[1]  # the bold sentence
    assert re.search(r"expert \d+\.\d%.*; expert: which expert a router logit scores, "
                     r"beyond its layer and position", answer), answer
    scalar = _section(_md(pages["exit"]), "## Variance decomposition")
    assert "component" not in scalar.split("\n### Family")[1]


def test_the_exit_frontier_is_a_figure_and_a_short_table(pages) -> None:
    """The figure draws every point of the sweep and of fixed exit (penalty against mean
    executed depth, as audit.json has them); the table has one row per learned point, with
    fixed exit at that depth beside it, and names the whole depths the figure draws."""
    folder = pages["deep exit"]
    frontier = _json(folder)["exits"]["frontier"]
    learned = [p for p in frontier["points"] if p["rule"] == "learned"]
    fixed = [p for p in frontier["points"] if p["rule"] == "fixed"]
    table = _section(_md(folder), "### Exit frontier: would a static depth do as well?")
    rows = [line for line in table.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == len(learned) and len(fixed) > 1
    for row, p in zip(rows, learned, strict=True):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[0] == ("own learned" if p["threshold"] is None else "learned")
        assert float(cells[2]) == pytest.approx(p["mean_depth"], abs=5e-4)
        for cell, key in ((cells[3], "delta"), (cells[4], "fixed"), (cells[5], "gap")):
            assert float(cell.split(" [")[0]) == pytest.approx(p[key]["value"], abs=5e-5,
                                                               rel=5e-3)
    said = ", ".join(f"{a}-{b}" if a != b else f"{a}"
                     for a, b in _runs([int(p["mean_depth"]) for p in fixed]))
    assert f"Fixed exit at each whole depth it was run at ({said}) is drawn in the exit " \
           "frontier's figure" in table
    from fcaudit.report.report_parts import _figure_specs
    result = fcaudit.AuditResult.read(folder / "audit.json")
    [draw] = [d for stem, _, d in _figure_specs(result) if stem == "exit-frontier"]
    fig = draw()
    lines = {c.get_label(): c.lines[0] for c in fig.axes[0].containers}
    sweep, static = (lines[name] for name in ("learned rule (threshold sweep)",
                                              "fixed exit (one depth for all)"))
    order = sorted(learned, key=lambda p: p["mean_depth"])
    assert list(sweep.get_xdata()) == [p["mean_depth"] for p in order]
    assert list(sweep.get_ydata()) == [p["delta"]["value"] for p in order]
    assert list(static.get_xdata()) == [p["mean_depth"] for p in fixed]
    assert list(static.get_ydata()) == [p["delta"]["value"] for p in fixed]
    assert fig.axes[0].get_xlabel() == "mean executed depth (layers per token, of 8)"


def _runs(values: list[int]) -> list[tuple[int, int]]:
    """Consecutive integers as (first, last) runs, by hand."""
    runs: list[tuple[int, int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    return runs


@pytest.mark.parametrize("page", ["gate/report.md", "gate/report.html", "router/report.md",
                                  "exit/report.md", "exit/report.html", "deep exit/report.md",
                                  "compare/compare.md", "compare/compare.html"])
def test_no_page_puts_an_interval_in_a_second_pair_of_brackets(pages, page) -> None:
    """"[[7.51, 57.33]]" was an exit report's gap share: every page of every kind writes
    each interval in its own brackets only."""
    kind, name = page.split("/")
    text = (pages[kind] / name).read_text(encoding="utf-8")
    assert "[[" not in text and "]]" not in text
    assert re.search(r"\[[-+]?\d[\d.,e+-]*, [-+]?\d", text)  # intervals are there


def test_counts_facts_and_notes_read_once_and_plainly(pages) -> None:
    """FLOPs are whole counts with separators (not "19840.0000"); no bullet repeats the
    bold answer above it; the identity check is one sentence about the replay, the cache's
    code-identity note is the model table's."""
    ex = _json(pages["exit"])["execution"]
    flops, dense = ex["flops_per_token"], ex["dense_flops_per_token"]
    assert 1000 <= flops < 1e6 and 1000 <= dense < 1e6
    md = _md(pages["exit"])
    assert f"FLOPs per token: {flops:,.0f} vs dense {dense:,.0f} (ratio " in md
    assert f"| FLOPs per token | {flops:,.0f} | {dense:,.0f} |" in md
    for kind in ("gate", "exit"):
        md = _md(pages[kind])
        variation = _section(md, f"### {2 if kind == 'exit' else 1}. Variation")
        bold = re.search(r"\n\*\*(.+)\*\*\n", variation).group(1)
        bullets = [line.split(": ", 1)[1].rstrip(".") for line in variation.splitlines()
                   if line.startswith("- ")]
        assert bullets and not any(b in bold for b in bullets), bullets
        [check] = [line for line in md.splitlines() if line.startswith("Identity replay check")]
        assert "code identity" not in check
    note = _json(pages["exit"])["model"]["identity_note"]
    assert note.split(";")[0] in _section(_md(pages["exit"]), "### Model")
