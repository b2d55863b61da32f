"""The human-facing report, rendered from real audits of toy models: sections and their
order, the numbers, escaping, determinism, figures, the non-exact identity warning."""

from __future__ import annotations

import dataclasses
import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import toys
from conftest import FAST, chromium, toy_data

from fcaudit.api import audit
from fcaudit.engine.result import (
    MAIN_CONDITIONS,
    AuditResult,
    Identity,
    LayerVariation,
    Profile,
    Retention,
    Variation,
)
from fcaudit.report.audit_report import IDENTITY_WARNING, write_report
from fcaudit.report.figures import heatmap_figure
from fcaudit.report.markdown import md_text

SECTIONS = ["The three answers", "Conditions", "Gap retention", "Interaction", "Per layer",
            "Variance decomposition", "Variation summary", "Execution", "Token-id profiles",
            "Reproducibility"]
# the answer each figure illustrates, where a reader of that answer must find it
FIGURE_ANSWERS = {"profile": "1. Variation", "heatmap": "1. Variation", "variance": "1. Variation",
                  "penalties": "2. Dependence"}
FIGURES = ("profile", "heatmap", "penalties", "variance")
# Markup, a table cell break, a link, code and emphasis in one user-supplied string.
HOSTILE = ('<script>alert("x")</script> | [a](https://evil.example/) [b](javascript:alert(1)) '
           '](x) `tick` *b* _c_ ~~d~~ &amp; #')


def _audit(out: Path, **kw: object) -> AuditResult:
    return audit(toys.content_model(), out, sites=["gates.*"], data=toy_data(), report=False,
                 **kw)


@pytest.fixture(scope="module")
def audited(tmp_path_factory: pytest.TempPathFactory) -> AuditResult:
    """A real audit of the content toy model (execution not measured)."""
    return _audit(tmp_path_factory.mktemp("audit"), options=FAST)


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory) -> AuditResult:
    """A real audit with the execution measured against a dense twin, timing included."""
    return _audit(tmp_path_factory.mktemp("executed"), dense=toys.constant_model(),
                  blocks="gates.*",
                  options=dataclasses.replace(FAST, execution=True, timing_pairs=10))


@pytest.fixture(scope="module")
def rendered(audited: AuditResult, tmp_path_factory: pytest.TempPathFactory,
             ) -> tuple[Path, list[Path]]:
    out = tmp_path_factory.mktemp("report")
    return out, write_report(audited, out)


def _render(result: AuditResult, out: Path) -> tuple[str, str]:
    write_report(result, out)
    return ((out / "report.md").read_text(encoding="utf-8"),
            (out / "report.html").read_text(encoding="utf-8"))


def _section(md: str, title: str) -> str:
    """The Markdown from the ``## title`` heading to the next ``##`` heading."""
    start = md.index(f"\n## {title}\n")
    end = md.find("\n## ", start + 1)
    return md[start:] if end < 0 else md[start:end]


def _cells(line: str) -> list[str]:
    """The cells of one GFM table row (escaped pipes do not split)."""
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def _table(text: str) -> list[dict[str, str]]:
    """The first table in ``text`` as rows of header -> cell."""
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    headers = _cells(lines[0])
    return [dict(zip(headers, _cells(ln), strict=True)) for ln in lines[2:]]


def _numbers(cell: str) -> list[float]:
    return [float(x.replace(",", "")) for x in re.findall(r"[-+]?[\d,]*\.?\d+(?:e[-+]\d+)?", cell)]


def _close(value: float, digits: int = 4) -> object:
    """Equal to ``value`` as shown with ``digits`` decimals or in 4-digit scientific form."""
    return pytest.approx(value, abs=0.51 * 10.0 ** -digits, rel=5e-4)


def test_writes_reports_and_figures(rendered: tuple[Path, list[Path]]) -> None:
    out, paths = rendered
    names = {p.relative_to(out).as_posix() for p in paths}
    figures = {f"figures/{stem}.{ext}" for stem in FIGURES for ext in ("png", "svg")}
    assert names == figures | {"report.md", "report.html"}
    for stem in FIGURES:
        assert (out / f"figures/{stem}.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
        svg = (out / f"figures/{stem}.svg").read_text(encoding="utf-8")
        assert svg.startswith("<?xml") and "<dc:date>" not in svg
    assert not list(out.rglob("*.tmp")), "no temporary files may be left behind"


def test_sections_in_order_answers_first(rendered: tuple[Path, list[Path]],
                                         audited: AuditResult) -> None:
    md = (rendered[0] / "report.md").read_text(encoding="utf-8")
    assert re.findall(r"^## (.+)$", md, flags=re.M) == SECTIONS
    assert md.startswith(f"# Frozen Controller Audit: {md_text(audited.model.spec)}\n")
    verdicts = [md.index(f"**{md_text(getattr(audited.verdict, k))}**")
                for k in ("variation", "dependence", "execution")]
    assert verdicts == sorted(verdicts) and verdicts[-1] < md.index("\n## Conditions")
    page = (rendered[0] / "report.html").read_text(encoding="utf-8")
    assert re.findall(r"<h2>(.+?)</h2>", page) == SECTIONS


def test_each_figure_sits_with_the_answer_it_illustrates(rendered: tuple[Path, list[Path]]
                                                        ) -> None:
    """Not two screens of tables below: the coefficient figures under the variation answer,
    the penalties under the dependence answer, each once, all before the first table."""
    md = (rendered[0] / "report.md").read_text(encoding="utf-8")
    answers = _section(md, "The three answers")
    for stem, answer in FIGURE_ANSWERS.items():
        image = f"](figures/{stem}.png)"
        assert md.count(image) == 1, stem
        part = next(p for p in answers.split("\n### ")[1:] if p.startswith(answer))
        assert image in part, (stem, answer)
    assert set(FIGURE_ANSWERS) == set(FIGURES)
    page = (rendered[0] / "report.html").read_text(encoding="utf-8")
    assert page.count("<img") == len(FIGURES) and \
        page.rindex("<img") < page.index("<h2>Conditions</h2>")


def test_numbers_equal_the_result(rendered: tuple[Path, list[Path]],
                                  audited: AuditResult) -> None:
    md = (rendered[0] / "report.md").read_text(encoding="utf-8")
    rows = {r["condition"].strip("`"): r for r in _table(_section(md, "Conditions"))}
    assert list(rows) == list(MAIN_CONDITIONS)
    for name, c in audited.conditions.items():
        assert _numbers(rows[name]["NLL (nats)"]) == [_close(c.nll)]
        assert _numbers(rows[name]["Δ vs correct"]) == [_close(c.delta)]
        assert _numbers(rows[name]["95% CI"]) == [_close(v) for v in c.ci95]
        assert rows[name]["repeats"].startswith(str(len(c.repeats)))

    retention = {r["profile"].strip("`"): r for r in _table(_section(md, "Gap retention"))}
    for name, ret in audited.retention.items():
        assert ret.value is not None
        assert _numbers(retention[name]["retention"]) == [_close(ret.value, 2)]
        assert _numbers(retention[name]["95% CI"]) == [_close(v, 2) for v in ret.ci95]

    inter = _numbers(_section(md, "Interaction").split("=")[-1].split("nats")[0])
    assert inter == [_close(audited.interaction.value), *map(_close, audited.interaction.ci95)]

    per_layer = _table(_section(md, "Per layer"))
    assert [int(r["layer"]) for r in per_layer] == [0, 1]
    for entry in audited.per_layer["reassign"]:
        row = per_layer[entry.layer]
        assert row["site"] == f"`{entry.site}`"
        assert _numbers(row["Δ reassign@layer [95% CI]"]) == \
            [_close(entry.delta), *map(_close, entry.ci95)]

    (fam, var), = audited.variance.items()
    pooled = _table(_section(md, "Variance decomposition"))[0]
    assert _numbers(pooled["layer"]) == [_close(100 * var.eta2_layer, 1)]
    assert _numbers(pooled["residual (input/token content)"]) == \
        [_close(100 * var.eta2_residual, 1)]
    summary = _table(_section(md, "Variation summary"))[0]
    assert summary["family"] == f"`{fam}`"
    assert _numbers(summary["sd across inputs"]) == \
        [_close(audited.variation[fam].mean_sd_across_inputs)]

    repro = _section(md, "Reproducibility")
    seeds = {r["item"]: r["value"] for r in _table(repro[repro.index("### Seeds"):])}
    assert _numbers(seeds["`reassign`"]) == audited.seeds.reassign


def test_execution_section_is_one_table(executed: AuditResult, tmp_path: Path) -> None:
    ex = dataclasses.replace(executed.execution,  # the engine will fill this field
                             uncounted_operators=["aten::fancy_op", "aten::other"])
    assert ex.measured and ex.timing is not None
    md, _ = _render(dataclasses.replace(executed, execution=ex), tmp_path)
    section = _section(md, "Execution")
    rows = {r["measure"]: r for r in _table(section)}
    blocks = rows["blocks executed per token"]
    assert _numbers(blocks["model"]) == [_close(ex.blocks_executed, 2), ex.blocks_present]
    assert _numbers(blocks["dense"]) == [_close(ex.dense_blocks_executed, 2),
                                         ex.dense_blocks_present]
    flops = rows["FLOPs per token"]
    assert _numbers(flops["model"]) == [_close(ex.flops_per_token)]
    latency = rows["latency per batch (ms), median [min, max]"]
    for side, timing in (("model", ex.timing.model), ("dense", ex.timing.dense)):
        assert _numbers(latency[side]) == [_close(1e3 * s, 3) for s in
                                           (timing.median_s, timing.min_s, timing.max_s)]
    ratio = ex.timing.speed_ratio_vs_dense
    assert _numbers(latency["model / dense"])[:3] == [_close(ratio.value),
                                                      *map(_close, ratio.ci95)]
    assert _numbers(rows["throughput (tokens/s)"]["model"]) == \
        [pytest.approx(ex.timing.model.tokens_per_s, abs=0.51)]
    assert "min / mean / max" in " ".join(rows)
    shown_ratio = latency["model / dense"].split(" (")[0]
    assert section.count(shown_ratio) == 1, "the latency ratio is shown once"
    assert "pairs_s" not in md and "slowdown" not in section
    assert f"Conditional execution: **{'yes' if ex.conditional_execution else 'no'}**" in section
    for text in (section, _section(md, "The three answers")):
        assert "FLOPs verdict refused" in text and "`aten::fancy_op`" in text


def test_not_measured_and_undefined_retention(audited: AuditResult, tmp_path: Path) -> None:
    result = dataclasses.replace(audited, retention={**audited.retention, "static-layer": Retention(
        gap=0.001, gap_ci95=[-0.002, 0.004], value=None, ci95=None, defined=False,
        reason="gap CI includes 0")})
    md, page = _render(result, tmp_path)
    row = _table(_section(md, "Gap retention"))[0]
    assert row["retention"] == "undefined" and row["note"] == "gap CI includes 0"
    assert f"Execution was not measured: {md_text(audited.execution.reason)}." in \
        _section(md, "Execution")
    assert "undefined</td>" in page


def test_custom_conditions_table(audited: AuditResult, tmp_path: Path) -> None:
    custom = audited.conditions["global-mean"]
    md, _ = _render(dataclasses.replace(audited, custom_conditions={"zero-gates": custom}),
                    tmp_path)
    headings = re.findall(r"^## (.+)$", md, flags=re.M)
    assert headings[headings.index("Conditions") + 1] == "Custom conditions"
    (row,) = _table(_section(md, "Custom conditions"))
    assert row["condition"] == "`zero-gates`"
    assert _numbers(row["Δ vs correct"]) == [_close(custom.delta)]


def test_nonexact_identity_warns_at_top_and_beside_each_verdict(audited: AuditResult,
                                                                tmp_path: Path) -> None:
    md, page = _render(audited, tmp_path / "exact")
    assert IDENTITY_WARNING not in md
    ident = Identity(exact=False, max_abs_diff=2.5e-6, allowed_nonexact=True,
                     note="cuBLAS kernels are not deterministic")
    md, page = _render(dataclasses.replace(audited, identity=ident), tmp_path / "inexact")
    blocks = md.split("\n\n")
    assert blocks[0].startswith("# ") and blocks[1].startswith(f"> **{IDENTITY_WARNING}**")
    assert "2.500e-06" in blocks[1] and ident.note in blocks[1]
    answers = _section(md, "The three answers").split("\n### ")[1:]
    assert len(answers) == 3
    for answer in answers:
        assert answer.index(IDENTITY_WARNING) < answer.index("\n**")
    assert md.count(IDENTITY_WARNING) == 4
    assert "**not exact**" in _section(md, "Conditions")
    assert page.count("<blockquote>") == 4
    assert page.index("<blockquote>") < page.index("<h2>The three answers</h2>")


class _Page(HTMLParser):
    """Cell counts of every table row, every link and image target, and the text shown in
    headings, code and warnings."""

    SHOWN = ("h1", "code", "blockquote")

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[int]] = []
        self.targets: list[str] = []
        self.text: dict[str, list[str]] = {tag: [] for tag in self.SHOWN}
        self._open: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self.rows.append([])
        elif tag == "tr":
            self.rows[-1].append(0)
        elif tag in ("td", "th"):
            self.rows[-1][-1] += 1
        elif tag in ("a", "img", "script", "link", "iframe"):
            self.targets += [f"{tag}:{v}" for k, v in attrs if k in ("href", "src")] or [tag]
        elif tag in self.SHOWN:
            self._open.add(tag)
            self.text[tag].append("")

    def handle_endtag(self, tag: str) -> None:
        self._open.discard(tag)

    def handle_data(self, data: str) -> None:
        for tag in self._open:
            self.text[tag][-1] += data


def test_user_strings_cannot_inject_markup(audited: AuditResult, tmp_path: Path) -> None:
    """A spec, a site name, a custom condition, a note and a command full of markup are shown
    as the literal text they are, make no link, and every table keeps its shape."""
    site = audited.sites[0]
    variation = {fam: dataclasses.replace(v, per_layer=[
        dataclasses.replace(e, site=HOSTILE) if e.site == site.name else e for e in v.per_layer])
        for fam, v in audited.variation.items()}
    result = dataclasses.replace(
        audited, model=dataclasses.replace(audited.model, spec=HOSTILE),
        sites=[dataclasses.replace(site, name=HOSTILE), *audited.sites[1:]], variation=variation,
        custom_conditions={HOSTILE: audited.conditions["shuffle"]},
        identity=Identity(exact=False, max_abs_diff=1e-6, allowed_nonexact=True, note=HOSTILE),
        verdict=dataclasses.replace(audited.verdict, variation=f"a < b & c {HOSTILE}"),
        command=f"fcaudit audit --model '{HOSTILE}'\n```\n<b>x</b>")
    md, page = _render(result, tmp_path)
    assert "<script" not in page and "<b>" not in page and "a &lt; b &amp; c" in page
    parsed = _Page()
    parsed.feed(page)
    assert all(t.startswith(("a:figures/", "img:data:image/png;base64,")) for t in parsed.targets)
    assert len(parsed.targets) == 2 * len(FIGURES)
    for rows in parsed.rows:
        assert len(set(rows)) == 1, f"a table row lost or gained cells: {rows}"
    assert parsed.text["h1"] == [f"Frozen Controller Audit: {HOSTILE}"]
    assert parsed.text["blockquote"][0].rstrip().endswith(HOSTILE)  # the identity note
    # the lead line, the custom condition, the sites table, the per-layer table, the model
    assert parsed.text["code"].count(HOSTILE) == 5
    assert f"fcaudit audit --model '{HOSTILE}'\n```\n<b>x</b>\n" in parsed.text["code"]


def test_rerender_is_byte_identical(audited: AuditResult, tmp_path: Path) -> None:
    first = write_report(audited, tmp_path / "a")
    second = write_report(AuditResult.from_json(audited.to_json()), tmp_path / "b")
    assert [p.relative_to(tmp_path / "a") for p in first] == \
        [p.relative_to(tmp_path / "b") for p in second]
    for a, b in zip(first, second, strict=True):
        assert a.read_bytes() == b.read_bytes(), a.name


def test_heatmap_reads_position_stride_and_bins_wide_maps() -> None:
    """Titles state what the map shows: every k-th position (the engine's stride), binned."""
    rng = np.random.default_rng(0)
    wide = Profile(sites=["a", "b"], mean=[0.1, 0.2], sd=[0.0, 0.0],
                   position_mean=rng.random((2, 2048)).tolist(), position_stride=1)
    strided = dataclasses.replace(wide, position_mean=rng.random((2, 512)).tolist(),
                                  position_stride=4)
    fig = heatmap_figure({"gate": wide, "mudd": strided})
    maps = [ax for ax in fig.axes if ax.images]
    assert [ax.get_title() for ax in maps] == [
        "gate: mean coefficient by layer and position (averaged in bins of 8)",
        "mudd: mean coefficient by layer and position (sampled every 4 positions, averaged in "
        "bins of 2)"]
    # both span positions 0..2047: the strided map's 512 columns stand for every 4th position
    assert [ax.images[0].get_extent()[1] for ax in maps] == [2048 - 0.5, 2048 - 2.0]


def test_many_families_and_sites(audited: AuditResult, tmp_path: Path) -> None:
    """A second family gets its own per-layer and variance tables and figure panels."""
    fam = audited.families[0]
    sites = [*audited.sites, *(dataclasses.replace(s, name=f"other.{s.layer}", family="other")
                               for s in audited.sites)]
    variation = {**audited.variation, "other": Variation(
        per_layer=[LayerVariation(0, "other.0", 0.5, 0.1, 0.1, 0.1)], across_layer_sd=0.0,
        mean_sd_across_inputs=0.1, mean_sd_across_positions=0.1, ratio_inputs_to_layers=None,
        ratio_positions_to_layers=None)}
    result = dataclasses.replace(
        audited, sites=sites, variation=variation,
        variance={**audited.variance, "other": audited.variance[fam]},
        profiles={**audited.profiles, "other": audited.profiles[fam]})
    md, _ = _render(result, tmp_path)
    assert md.count("### Family `other`") == 2  # per layer, variance
    assert _table(_section(md, "Variation summary"))[1]["inputs / layers"] == "n/a"


def test_renders_in_headless_chromium(rendered: tuple[Path, list[Path]], audited: AuditResult,
                                      tmp_path: Path) -> None:
    browser = chromium()
    if browser is None:
        pytest.skip("chromium not installed (apt-get install -y chromium); render check skipped")
    page = (rendered[0] / "report.html").resolve().as_uri()
    base = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*base, "--dump-dom", page], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    for key in ("variation", "dependence", "execution"):
        assert getattr(audited.verdict, key) in dom
    assert dom.count("<img") == len(FIGURES)

    shot = tmp_path / "shot.png"
    subprocess.run([*base, f"--screenshot={shot}", "--window-size=1200,3000", page],
                   capture_output=True, timeout=120, check=True)
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (3000, 1200)
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 50
