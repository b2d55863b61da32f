"""The human-facing report: content order, undefined values, self-contained HTML, determinism."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fcaudit.report import write_report

VERDICT = {
    "variation": "Coefficients vary mostly across layers: layer identity explains 91% of variance.",
    "dependence": "The frozen model barely needs matched coefficients: reassign costs 0.002 nats.",
    "execution": "Every block runs for every token: no conditional execution, 31% slower.",
}


def _ci(x: float, half: float) -> list[float]:
    return [x - half, x + half]


def make_audit(n_layers: int = 4, seq_len: int = 16, families: tuple[str, ...] = ("gate",),
               seed: int = 0) -> dict[str, Any]:
    """A plausible audit.json dict with every optional section filled in."""
    rng = np.random.default_rng(seed)
    deltas = {"original": 0.0, "correct": 0.0, "reassign": 0.002, "shuffle": 0.004,
              "reassign+shuffle": 0.0055, "static-layer": 0.003,
              "static-layer-position": 0.0025, "global-mean": 0.25}
    random = {"reassign", "shuffle", "reassign+shuffle"}
    conditions = {}
    for name, d in deltas.items():
        repeats = [3.5 + d + 0.0005 * k for k in range(3 if name in random else 1)]
        conditions[name] = {"nll": 3.5 + d, "delta": d, "ci95": _ci(d, 0.001),
                            "repeats": repeats, "repeat_deltas": [r - 3.5 for r in repeats]}
    sites, variance, variation, profiles = [], {}, {}, {}
    per_layer: dict[str, list[dict[str, Any]]] = {"reassign": [], "static-layer": []}
    for fam in families:
        names = [f"blocks.{i}.{fam}" for i in range(n_layers)]
        sites += [{"name": n, "family": fam, "layer": i, "trailing_shape": [1]}
                  for i, n in enumerate(names)]
        mean = rng.uniform(0.2, 0.9, n_layers)
        profiles[fam] = {"sites": names, "mean": mean.tolist(), "sd": [0.05] * n_layers,
                         "q10": (mean - 0.08).tolist(), "q90": (mean + 0.08).tolist(),
                         "position_mean": (mean[:, None] + 0.01 * rng.standard_normal(
                             (n_layers, seq_len))).tolist()}
        variance[fam] = {"eta2_layer": 0.91, "eta2_position": 0.01, "eta2_layer_position": 0.005,
                         "eta2_component": 0.0, "eta2_residual": 0.075,
                         "n_values": n_layers * seq_len * 8,
                         "components": [{"index": [0], "eta2_layer": 0.91, "eta2_position": 0.01,
                                         "eta2_layer_position": 0.005, "eta2_residual": 0.075}],
                         "components_note": "scalar gate: one component"}
        variation[fam] = {"per_layer": [{"layer": i, "site": n, "mean": float(mean[i]),
                                         "sd_total": 0.05, "sd_across_inputs": 0.03,
                                         "sd_across_positions": 0.02}
                                        for i, n in enumerate(names)],
                          "across_layer_sd": float(mean.std()), "mean_sd_across_inputs": 0.03,
                          "mean_sd_across_positions": 0.02, "ratio_inputs_to_layers": 0.15,
                          "ratio_positions_to_layers": 0.1}
        for name in per_layer:
            per_layer[name] += [{"layer": i, "site": n, "family": fam, "nll": 3.5 + 0.001 * i,
                                 "delta": 0.001 * i, "ci95": _ci(0.001 * i, 0.0005),
                                 "repeats": [3.5 + 0.001 * i]} for i, n in enumerate(names)]
    return {
        "schema": "fcaudit.audit/1", "fcaudit_version": "0.1.0",
        "command": "fcaudit audit --model runs/fg --out out",
        "model": {"spec": "runs/fg", "kind": "featuregate", "arch": "featuregate",
                  "class": "FeatureGateLM", "n_params": 1234567, "fingerprint": "sha256:abc",
                  "dtype": "float32"},
        "data": {"eval_sequences": 32, "calib_sequences": 32, "seq_len": seq_len,
                 "eval_tokens": 32 * (seq_len - 1), "source": "builtin"},
        "sites": sites, "identity_replay_max_abs_diff": 0.0, "conditions": conditions,
        "per_layer": per_layer,
        "retention": {"static-layer": {"value": 98.7, "ci95": [97.5, 99.6], "gap": 0.247,
                                       "gap_ci95": [0.2, 0.3], "defined": True},
                      "static-layer-position": {"value": 99.0, "ci95": [98.0, 99.8],
                                                "gap": 0.247, "gap_ci95": [0.2, 0.3],
                                                "defined": True}},
        "interaction": {"value": -0.0005, "ci95": [-0.0015, 0.0005]},
        "variance": variance, "variation": variation, "profiles": profiles,
        "execution": {"measured": True, "blocks_executed": float(n_layers),
                      "blocks_present": n_layers,
                      "blocks_executed_per_layer": [1.0] * n_layers,
                      "dense_blocks_executed": float(n_layers), "flops_per_token": 2.5e7,
                      "dense_flops_per_token": 2.4e7, "flops_ratio": 1.04,
                      "conditional_execution": False, "speed_ratio_vs_dense": 1.31,
                      "timing": {"speed_ratio_vs_dense": {"value": 1.31, "ci95": [1.25, 1.36]},
                                 "model": {"median_s": 0.02, "min_s": 0.019, "max_s": 0.03,
                                           "tokens_per_s": 40000.0},
                                 "dense": {"median_s": 0.015, "min_s": 0.014, "max_s": 0.02,
                                           "tokens_per_s": 52000.0},
                                 "pairs": 10, "threads": 2, "device": "cpu", "batch_size": 8,
                                 "seq_len": seq_len}},
        "verdict": dict(VERDICT),
        "seeds": {"master": 0, "reassign": [1, 2, 3], "shuffle": [4, 5, 6], "bootstrap": 7},
        "settings": {"repeats": 3, "bootstrap_resamples": 1000, "batch_size": 8,
                     "per_layer": True},
        "versions": {"fcaudit": "0.1.0", "torch": "2.4.0", "numpy": "2.1", "python": "3.11"},
        "host": {"cpu": "test"}, "timings": {"total_s": 1.0},
    }


def _read(out: Path, name: str) -> str:
    return (out / name).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    out = tmp_path_factory.mktemp("report")
    return out, write_report(make_audit(), out)


def test_writes_reports_and_figures(rendered: tuple[Path, list[Path]]) -> None:
    out, paths = rendered
    names = {p.relative_to(out).as_posix() for p in paths}
    figures = {f"figures/{stem}.{ext}" for stem in ("profile", "heatmap", "penalties", "variance")
               for ext in ("png", "svg")}
    assert names == figures | {"report.md", "report.html"}
    assert all(p.stat().st_size > 0 for p in paths)
    assert not list(out.rglob("*.tmp")), "no temporary files may be left behind"


def test_three_answers_come_first(rendered: tuple[Path, list[Path]]) -> None:
    md = _read(rendered[0], "report.md")
    headings = re.findall(r"^## (.+)$", md, flags=re.M)
    assert headings[0] == "The three answers"
    first_table = md.index("\n## Conditions")
    positions = [md.index(VERDICT[k]) for k in ("variation", "dependence", "execution")]
    assert positions == sorted(positions) and positions[-1] < first_table
    answers = md[:first_table]
    for number in ("91.0%", "+0.0020", "98.70%", "1.3100 [1.2500, 1.3600]", "Conditional"):
        assert number in answers, number


def test_tables_and_reproducibility(rendered: tuple[Path, list[Path]]) -> None:
    md = _read(rendered[0], "report.md")
    for text in ("| `reassign+shuffle` |", "Gap retention", "## Interaction", "Family gate",
                 "`blocks.3.gate`", "Variation summary", "fcaudit audit --model runs/fg",
                 "| `master` | 0 |", "| `reassign` | 1, 2, 3 |", "figures/heatmap.svg"):
        assert text in md, text


@pytest.fixture(scope="module")
def degraded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Undefined retention, no execution measurement, and markup in user-supplied strings."""
    audit = make_audit()
    audit["retention"]["static-layer"] = {"value": None, "ci95": None, "gap": 0.001,
                                          "gap_ci95": [-0.002, 0.004], "defined": False,
                                          "reason": "gap CI includes 0"}
    audit["execution"] = {"measured": False, "reason": "no dense counterpart given"}
    del audit["verdict"]["execution"]
    audit["model"]["spec"] = '<script>alert("x")</script>'
    audit["verdict"]["variation"] = "a < b & c"
    out = tmp_path_factory.mktemp("degraded")
    write_report(audit, out)
    return out


@pytest.mark.parametrize("name", ["report.md", "report.html"])
def test_undefined_retention_and_no_execution(degraded: Path, name: str) -> None:
    text = _read(degraded, name)
    assert re.search(r"static-layer\S* \| undefined \|", text) or "undefined</td>" in text
    assert "gap CI includes 0" in text
    assert "not measured: no dense counterpart given" in text
    assert "98.70%" not in text


def test_html_is_self_contained_and_escaped(degraded: Path) -> None:
    page = _read(degraded, "report.html")
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, flags=re.I)
    assert "<script" not in page and "&lt;script&gt;" in page and "a &lt; b &amp; c" in page
    assert page.count('<img src="data:image/png;base64,') == 4
    assert "<style>" in page and "<link" not in page


def test_rerender_is_byte_identical(tmp_path: Path) -> None:
    audit = make_audit(n_layers=3, seq_len=8)
    first = write_report(copy.deepcopy(audit), tmp_path / "a")
    second = write_report(audit, tmp_path / "b")
    assert [p.relative_to(tmp_path / "a") for p in first] == \
        [p.relative_to(tmp_path / "b") for p in second]
    for a, b in zip(first, second, strict=True):
        assert a.read_bytes() == b.read_bytes(), a.name


def test_minimal_audit_renders(tmp_path: Path) -> None:
    """Only the contract keys, with nulls: every section degrades to a short note."""
    audit = {"schema": "fcaudit.audit/1",
             "data": {"eval_sequences": 2, "calib_sequences": 2, "seq_len": 8, "eval_tokens": 14},
             "identity_replay_max_abs_diff": 0.0,
             "conditions": {"correct": {"nll": 3.0, "delta": 0.0, "ci95": None, "repeats": [3.0]},
                            "reassign": {"nll": None, "delta": None, "ci95": None, "repeats": []}},
             "retention": {"static-layer": {"value": None, "ci95": None}},
             "interaction": {"value": None, "ci95": None},
             "variance": {"gate": {"eta2_layer": None}}, "execution": {},
             "verdict": {}, "seeds": {}}
    paths = write_report(audit, tmp_path)
    md = _read(tmp_path, "report.md")
    assert md.index("## The three answers") < md.index("## Conditions")
    assert "undefined" in md and "not measured" in md and "No verdict recorded." in md
    assert {p.name for p in paths} == {"report.md", "report.html"}  # nothing to plot
    assert "No figure data in this audit." in md


def test_large_audit_many_layers_long_sequences(tmp_path: Path) -> None:
    """24 layers, 2048 positions, two families, huge numbers; one family's positions strided
    as the engine stores them for long sequences."""
    audit = make_audit(n_layers=24, seq_len=2048, families=("gate", "mudd"))
    mudd = audit["profiles"]["mudd"]
    mudd["position_mean"] = [row[::4] for row in mudd["position_mean"]]
    audit["execution"]["flops_per_token"] = 3.2e30
    audit["conditions"]["global-mean"]["delta"] = 1.5e12
    write_report(audit, tmp_path)
    md = _read(tmp_path, "report.md")
    assert "3.200e+30" in md and "+1.500e+12" in md
    assert "`blocks.23.mudd`" in md and "Family mudd" in md
    svg = _read(tmp_path, "figures/heatmap.svg")  # titles survive as comments in the SVG
    assert "gate: mean coefficient by layer and position (averaged in bins of 8)" in svg
    assert "(sampled every 4 positions, averaged in bins of 2)" in svg
    assert (tmp_path / "figures/heatmap.png").stat().st_size < 2_000_000


def _chromium() -> str | None:
    found = shutil.which("chromium")
    return found or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


def test_renders_in_headless_chromium(rendered: tuple[Path, list[Path]], tmp_path: Path) -> None:
    browser = _chromium()
    if browser is None:
        pytest.skip("chromium not installed (apt-get install -y chromium); render check skipped")
    page = (rendered[0] / "report.html").resolve().as_uri()
    base = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*base, "--dump-dom", page], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    for sentence in VERDICT.values():
        assert sentence in dom
    assert dom.count("<img") == 4

    shot = tmp_path / "shot.png"
    subprocess.run([*base, f"--screenshot={shot}", "--window-size=1200,3000", page],
                   capture_output=True, timeout=120, check=True)
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (3000, 1200)
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 50
