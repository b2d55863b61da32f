"""Every number of README.md and docs/*.md comes from a committed result file.

``docs/make_docs.py --check`` must find every generated block equal to what its result
files give, and outside the generated blocks a page may hold only the numbers of
:data:`ALLOWED`: versions, settings and constants of the code, the paper's figures
(checked against the one place the code keeps them), section and row numbers. So a
hand-typed result cannot come back unnoticed.
"""

from __future__ import annotations

import importlib
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "docs"))

import doc_blocks  # noqa: E402
import extract_results  # noqa: E402
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
    ("*", r"95% (?:percentile )?intervals?|95% CIs?\b|lower 95% bound",
     "the interval level, a convention"),
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
    ("*", r"(?m)^\s*\d+\. |(?:by )?step \d(?: or \d)?|\bbatch 0\b", "numbered steps of a "
     "procedure and the batch they name"),
    ("*", r"keeps 100% of the gap|the total \(100%\)|(?:leaves:|exactly|above|below|"
          r"score is|around|reaches|penalty|executed <)\s+[01]\b|\(0, 0\)",
     "mathematical facts: whole shares, zero and one, the origin"),
    ("docs/performance.md", r"tiny FeatureGate for 30 steps|--max-calib 64 --no-per-layer"
     r"[^`]*--repeats 1|K = 3 repeats",
     "the settings the benchmark's text describes (its defaults)"),
)


def _benchmark(name: str) -> Any:
    """A script of benchmarks/ as a module (its defaults are quoted in the docs)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def _defaults() -> dict[str, float]:
    from fcaudit.core import routers
    from fcaudit.engine import frontier, metrics, options, run, verdicts
    from fcaudit.engine.analyses import expert_importance
    from fcaudit.engine.options import AuditOptions
    from fcaudit.io.data import DataSpec
    from fcaudit.io.loading import get_arch
    from fcaudit.models.moe import MoEConfig
    from fcaudit.models.skipgate import SkipGateConfig
    tiny_moe = get_arch("moe").presets["tiny"]
    from fcaudit.io.digits import SPLITS  # first and last image of each split
    splits = {f"digits_{name}_{end}": getattr(rows, end) - (end == "stop")
              for name, rows in SPLITS.items() for end in ("start", "stop")}
    return {**splits, "strong_penalty": verdicts.STRONG_PENALTY,
            "strong_retention": verdicts.STRONG_RETENTION,
            "weak_retention": verdicts.WEAK_RETENTION, "weak_penalty": verdicts.WEAK_PENALTY,
            "negligible": round(verdicts.NEGLIGIBLE, 5),
            "max_share_width": metrics.MAX_SHARE_WIDTH,
            "min_pairs": options.MIN_TIMING_PAIRS, "tolerance": 100 * verdicts.TOLERANCE,
            "speed_tolerance": 100 * verdicts.SPEED_TOLERANCE,
            "bootstrap": AuditOptions().bootstrap,
            "chunk_log2": metrics.CHUNK_ELEMENTS.bit_length() - 1,
            "max_eval": DataSpec().max_eval, "max_calib": DataSpec().max_calib,
            "capacity": 100 * SkipGateConfig().capacity, "experts": MoEConfig().num_experts,
            "top_k": MoEConfig().top_k, "aux": MoEConfig().aux_loss_coef,
            "auto_ablation": expert_importance.AUTO_ABLATION_MAX_EXPERTS,
            "ablation_margin_log10": math.log10(routers.ABLATION_MARGIN),
            "frontier_points": AuditOptions().frontier_points,
            "min_frontier_points": options.MIN_FRONTIER_POINTS,
            "max_frontier_points": options.MAX_FRONTIER_POINTS,
            **{f"matched_{round(100 * x)}": 100 * x for x in frontier.MATCHED},
            "frontier_grid": frontier.GRID, "frontier_tolerance": 100 * frontier.FLOPS_TOLERANCE,
            "min_sequences": run.DEFAULT_MIN_SEQUENCES,
            "offload_headroom_gib": _benchmark("memory").HEADROOM / 2**30,
            "moe_layers": tiny_moe.n_layer, "moe_ablation_runs": tiny_moe.n_layer
            * MoEConfig().num_experts}


# (page, regex whose groups are numbers, the code constants they must equal): settings
# quoted in prose, checked against the code that applies them.
CONSTANTS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("docs/method.md", r"interval lies above\s+(0\.1) nats", ("strong_penalty",)),
    ("docs/method.md", r"a floor of default (16)\s+sequences", ("min_sequences",)),
    ("docs/method.md", r"retention's interval below (50)%", ("strong_retention",)),
    ("docs/method.md", r"lies at or above (90)%", ("weak_retention",)),
    ("docs/method.md", r"intervals below (0\.05) nats", ("weak_penalty",)),
    ("docs/method.md", r"counts only above (1)% of perplexity", ("tolerance",)),
    ("docs/method.md", r"about (0\.00995) nats", ("negligible",)),
    ("docs/method.md", r"at most (100) percentage points wide", ("max_share_width",)),
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
    ("docs/method.md", r"at most (64) experts, else off", ("auto_ablation",)),
    ("docs/moe.md", r"on by default up to (64) experts per layer", ("auto_ablation",)),
    ("docs/method.md", r"a gap of 10\^(4) gives", ("ablation_margin_log10",)),
    ("docs/method.md", r"default (6), (2) to (20);", ("frontier_points", "min_frontier_points",
                                                      "max_frontier_points")),
    ("docs/method.md", r"at (10)/(25)/(50)% saved", ("matched_10", "matched_25", "matched_50")),
    ("docs/method.md", r"curves reach \((101) points\)", ("frontier_grid",)),
    ("docs/method.md", r"smallest gap at (25)%", ("matched_25",)),
    ("docs/method.md", r"agree within (5) points", ("frontier_tolerance",)),
    ("docs/method.md", r"images (0) to (1196)\s+train, (1197) to (1496) calibrate "
     r"\(static profiles only\), (1497) to (1796) evaluate",
     ("digits_train_start", "digits_train_stop", "digits_calib_start", "digits_calib_stop",
      "digits_eval_start", "digits_eval_stop")),
    ("docs/performance.md", r"default the budget plus (1) GiB", ("offload_headroom_gib",)),
    ("docs/performance.md", r"the tiny MoE: (4) x (8) = (32)\)",
     ("moe_layers", "experts", "moe_ablation_runs")),
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


# ------------------------------------------------------------------ the generator itself

def test_check_names_a_block_whose_text_was_edited(tmp_path: Path) -> None:
    """A hand edit inside a generated block is caught, and only that block is named."""
    for rel in (*make_docs.PAGES, make_docs.INDEX):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((REPO / rel).read_text(encoding="utf-8"), encoding="utf-8")
    for rel in ("docs/results", "docs/trend/results"):
        (tmp_path / rel).mkdir(parents=True, exist_ok=True)
        for f in (REPO / rel).glob("*.json"):
            (tmp_path / rel / f.name).write_bytes(f.read_bytes())
    (tmp_path / "src" / "fcaudit").mkdir(parents=True)
    (tmp_path / doc_blocks.TIMINGS).write_bytes((REPO / doc_blocks.TIMINGS).read_bytes())
    assert all(not changed for _, _, changed in make_docs.build(tmp_path).values())
    readme = tmp_path / "README.md"
    text = readme.read_text(encoding="utf-8")
    begin, end = "<!-- fcaudit:begin time-demo -->", "<!-- fcaudit:end time-demo -->"
    start = text.index(begin) + len(begin)
    readme.write_text(text[:start] + "about 1.0 minutes" + text[text.index(end):],
                      encoding="utf-8")
    stale = {p: c for p, (_, _, c) in make_docs.build(tmp_path).items() if c}
    assert stale == {"README.md": ["time-demo"]}


def test_an_unknown_block_is_refused() -> None:
    with pytest.raises(make_docs.DocsError, match="unknown block 'nope'"):
        make_docs.render_page("<!-- fcaudit:begin nope -->x<!-- fcaudit:end nope -->",
                              doc_blocks.Results(REPO), "page.md")


def test_presets_file_holds_the_code_s_parameter_counts() -> None:
    import torch

    from fcaudit.io.loading import get_arch
    committed = json.loads((REPO / doc_blocks.PRESETS).read_text())["presets"]
    assert committed["featuregate"]["tiny"]["n_params"] == 1_335_556  # known, see test_trend
    for arch, sizes in committed.items():
        spec = get_arch(arch)
        for size, row in sizes.items():
            with torch.device("meta"):
                model = spec.build(spec.config(size))
            assert row["n_params"] == sum(p.numel() for p in model.parameters()), (arch, size)


# ------------------------------------------------------------------ extraction

def _audit_json(**override: object) -> dict:
    """The keys of audit.json that extract_results reads, with hand-picked values."""
    audit = {
        "model": {"n_params": 1_335_556},
        "sites": [{"family": "featuregate"}] * 4,
        "identity_replay_max_abs_diff": 0.0,
        "conditions": {"reassign": {"delta": 0.11472, "ci95": [0.10381, 0.12594]},
                       "shuffle": {"delta": 0.1161, "ci95": [0.1049, 0.1277]}},
        "retention": {"static-layer": {"value": 72.2449, "ci95": [68.551, 75.849]},
                      "static-layer-token": {"value": 94.5822, "ci95": [92.08, 96.604]}},
        "variance": {"featuregate": {"eta2_layer": 0.38904, "eta2_residual": 0.6012,
                                     "eta2_token_id": 0.97518}},
        "variation": {"featuregate": {"mean_sd_across_inputs": 0.18712,
                                      "mean_sd_across_positions": 0.1866,
                                      "across_layer_sd": 0.1556}},
        "execution": {"blocks_executed": 4.0, "blocks_present": 4, "flops_ratio": 1.0,
                      "speed_ratio_vs_dense": 1.0637, "conditional_execution": False,
                      "timing": {"speed_ratio_vs_dense": {"ci95": [1.031, 1.1049]},
                                 "pairs": 10, "threads": 2, "batch_size": 16}},
        "runtime": {"host": {"torch_threads": 2}},
    }
    audit.update(override)
    return audit


def _demo_folder(root: Path, audit: dict) -> Path:
    (root / "audit").mkdir(parents=True)
    (root / "featuregate").mkdir()
    (root / "audit" / "audit.json").write_text(json.dumps(audit))
    (root / "featuregate" / "config.json").write_text(json.dumps(
        {"results": {"eval_nll": 4.4968, "unigram_nll": 6.0412, "cpu": "AMD EPYC",
                     "torch_threads": 1}, "train": {"steps": 600}}))
    return root


def test_demo_extraction_and_table_quote_the_audit(tmp_path: Path) -> None:
    demo = extract_results.demo(_demo_folder(tmp_path / "demo", _audit_json()))
    table = doc_blocks._demo_table(demo)
    assert demo["run"] == {"eval_nll": 4.4968, "unigram_nll": 6.0412, "steps": 600,
                           "cpu": "AMD EPYC", "torch_threads": 1}
    # the audit's numbers rounded by hand to the digits `fcaudit demo` prints
    for text in ("4 layers, 1.34M parameters, eval NLL 4.4968 vs unigram 6.0412",
                 "sd across inputs 0.187, across positions 0.187, across layers 0.156",
                 "explains 38.9% of their variance, input and token content 60.1%",
                 "costs +0.1147 [+0.1038, +0.1259] nats", "tokens +0.1161 [+0.1049, +0.1277]",
                 "keeps 72.24% [68.55, 75.85] of", "identity replay is bitwise exact",
                 "the current token id explains 97.5% (chance level not recorded)",
                 "a static profile per (layer, token id) 94.58% [92.08, 96.60]",
                 "4.00 of 4 blocks run per token, FLOPs 1.000x Dense, latency 1.06x Dense "
                 "[1.03, 1.10]: no conditional execution"):
        assert text in table, text
    # an audit since issue 37: the share beyond chance, (0.97518 - 0.02) / 0.98, headlined
    variance = {"featuregate": {"eta2_layer": 0.38904, "eta2_residual": 0.6012,
                                "eta2_token_id": 0.97518, "eta2_token_id_chance": 0.02,
                                "epsilon2_token_id": 0.9726327}}
    demo = extract_results.demo(_demo_folder(tmp_path / "new", _audit_json(variance=variance)))
    assert "the current token id explains 97.3% beyond chance (97.5% against a chance level " \
        "of 2.0%) |" in doc_blocks._demo_table(demo)


def test_a_missing_audit_key_is_named_not_dropped(tmp_path: Path) -> None:
    audit = _audit_json()
    del audit["variation"]["featuregate"]["across_layer_sd"]
    with pytest.raises(SystemExit, match="variation.featuregate.across_layer_sd"):
        extract_results.demo(_demo_folder(tmp_path / "demo", audit))


def _stats(mean: float, low: float, high: float) -> dict:
    return {"mean": mean, "min": low, "max": high, "n": 3, "sd": 0.1}


def _fake_study() -> dict:
    """A study-tiny.json with hand-picked aggregates, and verdicts the renderer must copy."""
    ex = {"execution": {"blocks_present": 4}}
    experts = {"num_experts_per_layer": [8] * 4, "top_k_per_layer": [2] * 4,
               "active_expert_flops_per_token": 1.0,
               "all_expert_flops_per_token": 4.0}
    one = {"blocks_executed_fraction": _stats(1, 1, 1), "flops_ratio": _stats(1.0314, 1, 1.1),
           "speed_ratio": _stats(1.0684, 1.0621, 1.0779)}
    groups = {
        "featuregate-tiny": {**one, "retention_static_layer": _stats(72.14, 66.04, 75.36),
                             "eta2_layer": _stats(0.2924, 0.2051, 0.3834),
                             "delta_reassign": _stats(0.1171, 0.11, 0.12),
                             "retention_static_layer_token": _stats(94.51, 93.2, 95.04),
                             "eta2_token_id": _stats(0.9751, 0.97, 0.98),
                             "frontier_gap_25": _stats(0.01234, 0.0051, 0.0202)},
        "mudd-tiny": {**one, "delta_reassign": _stats(0.3341, 0.3, 0.36),
                      "delta_shuffle": _stats(0.3212, 0.3, 0.34),
                      "retention_static_layer": _stats(30.0, 20.0, 40.0),
                      "retention_static_layer_token": _stats(88.0, 85.0, 91.0),
                      "eta2_token_id": _stats(0.8054, 0.8, 0.81),
                      # a study since issue 37: the chance level, the share beyond it
                      "eta2_token_id_chance": _stats(0.1, 0.1, 0.1),
                      "epsilon2_token_id": _stats(0.7838, 0.7778, 0.7889)},
        "moe-tiny": {**one, "rerouted_reassign": _stats(0.9271, 0.9, 0.95),
                     "delta_reassign": _stats(1.5614, 1.3811, 1.6932),
                     "retention_static_layer": _stats(7.51, -1.84, 14.66),
                     "experts_executed_fraction": _stats(0.25, 0.25, 0.25),
                     "retention_static_layer_token": _stats(94.4, 92.0, 96.0),
                     "eta2_token_id": _stats(0.97, 0.96, 0.98),
                     "frontier_gap_25": _stats(-0.0021, -0.004, 0.0013)},
        "skipgate-tiny": {**one, "blocks_executed_fraction": _stats(0.505, 0.505, 0.505)},
    }
    claims = ("FeatureGate: a static per-layer", "FeatureGate: layer identity",
              "FeatureGate runs every block", "FeatureGate is slower", "MUDD: reassignment",
              "The contrast: MUDD", "MUDD runs every block", "MoE (hard routing)",
              "MoE: the frozen")
    words = ("does not hold", "does not hold", "holds", "holds", "holds",
             "holds: ... seed ranges overlap", "holds", "holds", "does not hold")
    return {"commit": "abc1234", "date": "2026-12-01", "command": "fcaudit reproduce",
            "steps": 600, "host": {"torch_threads": 1},
            "findings": [[c, f"{w}: ..."] for c, w in zip(claims, words, strict=True)],
            "groups": {n: {"seeds": 1 if n.startswith("skip") else 3, "aggregate": a,
                           "seed0": {**ex, **({"experts": experts} if n == "moe-tiny" else {})}}
                       for n, a in groups.items()}}


def test_study_rows_quote_the_aggregates_and_the_study_s_own_verdicts() -> None:
    rows = doc_blocks._study_rows(_fake_study())
    expected = ("does not hold: 72.1% (66.0 to 75.4)", "does not hold: 29.2% (20.5 to 38.3)",
                "holds: 4.00 of 4 blocks", "holds: latency 1.068x (1.062 to 1.078)",
                "holds: +0.334 and +0.321 nats", "holds: +0.334 vs +0.117 nats, seed ranges "
                "overlap", "holds: 4.00 of 4 blocks, FLOPs 1.03x, latency 1.07x",
                "holds: 2.00 of 8 experts run per token and layer, 25% of the expert FLOPs",
                "does not hold: reassigning router logits re-routes 92.7% of the (token, layer) "
                "expert sets and costs +1.56 (1.38 to 1.69) nats; a static per-layer profile "
                "keeps 7.5% (-1.8 to 14.7) of the gap",
                # beyond the paper: the word follows the seed range against the 90% line
                "mostly the token id: a profile per token id keeps at least 90% in every seed; "
                "static-layer-token keeps 94.5% (93.2 to 95.0) (static-layer 72.1% (66.0 to "
                "75.4)), the token id explains 97.5% (97.0 to 98.0) of the within-layer "
                "variance (eta squared; these results predate its chance level)",
                "context beyond the token id: a profile per token id keeps less than 90% in "
                "some seed; static-layer-token keeps 88.0% (85.0 to 91.0) (static-layer 30.0% "
                "(20.0 to 40.0)), the token id explains 78.4% (77.8 to 78.9) of the "
                "within-layer variance beyond chance (80.5% (80.0 to 81.0) against a chance "
                "level of 10.0% (10.0 to 10.0))",
                "mostly the token id: a profile per token id keeps at least 90% in every seed; "
                "static-layer-token keeps 94.4% (92.0 to 96.0) (static-layer 7.5% (-1.8 to "
                "14.7)), the token id explains 97.0% (96.0 to 98.0) of the within-layer "
                "variance (eta squared; these results predate its chance level)",
                "the dynamic rule is cheaper in NLL in every seed: best static minus dynamic "
                "penalty +0.0123 (0.0051 to 0.0202) nats (`--frontier`)",
                "the seeds disagree: best static minus dynamic penalty -0.0021 (-0.0040 to "
                "0.0013) nats (`--frontier`)")
    assert len(rows) == len(expected)
    for row, here in zip(rows, expected, strict=True):
        assert row.endswith(f"| {here} |"), (row, here)
