"""Selective recurrences in the audit (issue 30, items 2 and 4): each named coefficient of
a site (``Selection.parts``) gets its own variance decomposition beside the pooled one, sites
that are selection parameters (``Selection.space``) are said to give the LTI twin under
``static-layer`` with the space named, and the execution section names the twin and the
compute modes timed.

Reference: the shares are recomputed here with numpy from the toy's coefficients, taken
by a forward hook of our own on the evaluation windows (full data, fitted means, not the
engine's streaming sums); a constructed tensor checks the accumulators alone.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import toys
from conftest import FAST, md_cells, toy_data
from torch import nn

from fcaudit.api import audit
from fcaudit.core.contract import Selection, Site
from fcaudit.core.errors import DataError, ModelError
from fcaudit.engine.metrics import TokenShare, VarianceAccumulator
from fcaudit.engine.result import AuditResult

D, LAYERS = 4, 2
PARTS = (("decay", D), ("write", D))
SPACE = "decay before sigmoid, write as is"
GATE_SPACE = "gate logit before sigmoid"


class SelectiveLayer(nn.Module):
    """``h_t = a_t h_{t-1} + b_t x_t`` with ``a_t = sigmoid(decay_t)`` and
    ``[decay_t, b_t] = select(x_t)`` (the site ``select``, two named parts), and an output
    gate ``sigmoid(gate(x_t))`` (the site ``gate``, one coefficient)."""

    def __init__(self) -> None:
        super().__init__()
        self.select, self.gate = nn.Linear(D, 2 * D), nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        decay, write = self.select(x).split(D, dim=-1)
        return x + torch.sigmoid(self.gate(x)) * scan(torch.sigmoid(decay), write, x)


def scan(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    h, out = torch.zeros_like(x[:, 0]), []
    for t in range(x.shape[1]):
        h = a[:, t] * h + b[:, t] * x[:, t]
        out.append(h)
    return torch.stack(out, 1)


class LTILayer(nn.Module):
    """The twin: the same recurrence with its decay and write learned as constants."""

    def __init__(self) -> None:
        super().__init__()
        self.decay, self.write = nn.Parameter(torch.zeros(D)), nn.Parameter(torch.ones(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.sigmoid(self.decay).expand_as(x)
        return x + scan(a, self.write.expand_as(x), x)


class ToySelective(nn.Module):
    execution_mode = "recurrent scan"

    def __init__(self, lti: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(toys.V, D), nn.Linear(D, toys.V)
        self.layers = nn.ModuleList((LTILayer if lti else SelectiveLayer)()
                                    for _ in range(LAYERS))
        if lti:
            self.execution_mode = "fft convolution"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)

    def controller_sites(self) -> list[Site]:
        return [site for i in range(LAYERS) for site in (
            Site(f"select.{i}", f"layers.{i}.select", "select", i,
                 role=Selection(SPACE, PARTS)),
            Site(f"gate.{i}", f"layers.{i}.gate", "gate", i, role=Selection(GATE_SPACE)))]

    def execution_blocks(self) -> list[str]:
        return [f"layers.{i}" for i in range(LAYERS)]

    def dense_counterpart(self) -> nn.Module:
        return ToySelective(lti=True)


# ---------------------------------------------------------------- the reference, in numpy

def shares(x: np.ndarray) -> dict[str, float]:
    """Two-way decomposition of ``x [L, N, T, K]`` (layer, sequence, position, channel) from
    fitted means of the full data."""
    grand = x.mean()
    total = ((x - grand) ** 2).sum()
    layer = x.mean(axis=(1, 2, 3), keepdims=True)
    pos = x.mean(axis=(0, 1, 3), keepdims=True)
    cell = x.mean(axis=(1, 3), keepdims=True)
    comp = x.mean(axis=1, keepdims=True)
    ss = {k: float(np.broadcast_to((m - grand) ** 2, x.shape).sum())
          for k, m in (("layer", layer), ("pos", pos), ("cell", cell), ("comp", comp))}
    return {"eta2_layer": ss["layer"] / total, "eta2_position": ss["pos"] / total,
            "eta2_layer_position": (ss["cell"] - ss["layer"] - ss["pos"]) / total,
            "eta2_component": (ss["comp"] - ss["cell"]) / total,
            "eta2_residual": float(((x - comp) ** 2).sum()) / total}


def token_share(x: np.ndarray, ids: np.ndarray) -> float:
    """Within each (layer, channel) cell, one-way eta^2 over token ids, pooled (sums of
    squares added over cells)."""
    between = total = 0.0
    flat_ids = ids.reshape(-1)
    for layer in x:
        for k in range(layer.shape[-1]):
            v = layer[..., k].reshape(-1)
            total += float(((v - v.mean()) ** 2).sum())
            for token in np.unique(flat_ids):
                here = v[flat_ids == token]
                between += len(here) * float((here.mean() - v.mean()) ** 2)
    return between / total


# ------------------------------------------------------------------------------- accumulators

def test_each_part_is_decomposed_alone_as_numpy_does_on_a_constructed_tensor() -> None:
    """Two layers, 5 sequences of 6 positions, 3 channels: part ``p`` is channel 0, ``q``
    channels 1-2, with a layer offset, a position ramp and noise in different amounts."""
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 4, (5, 6))
    base = rng.normal(size=(2, 5, 6, 3))
    x = base + np.array([0.0, 3.0])[:, None, None, None] * np.array([1, 0, 1]) \
        + np.linspace(0, 2, 6)[None, None, :, None] * np.array([0, 1, 0]) + ids[None, ..., None]
    sites = [Site(f"s{i}", f"s{i}", "fam", i, role=Selection(SPACE, (("p", 1), ("q", 2))))
             for i in range(2)]
    variance, tokens = VarianceAccumulator(sites), TokenShare(sites)
    for rows in (slice(0, 3), slice(3, 5)):  # streamed in two batches
        batch = {f"s{i}": torch.from_numpy(x[i, rows]) for i in range(2)}
        variance.add(batch)
        tokens.add(batch, torch.from_numpy(ids[rows]))
    for cut in (slice(0, 1), slice(1, 3)):
        got = variance.part(cut)
        for key, want in shares(x[..., cut]).items():
            assert getattr(got, key) == pytest.approx(want, abs=1e-12), key
        assert tokens.share(cut) == pytest.approx(token_share(x[..., cut], ids), abs=1e-12)
    assert variance.part(slice(0, 1)).eta2_component == pytest.approx(0.0, abs=1e-12)


# ------------------------------------------------------------------------------- the audit

def _recorded(model: nn.Module, ids: np.ndarray) -> dict[str, np.ndarray]:
    """Each family's coefficients ``[L, N, T, K]`` on ``ids``, taken by our own hooks."""
    out: dict[str, list] = {"select": [[] for _ in range(LAYERS)],
                            "gate": [[] for _ in range(LAYERS)]}
    handles = [model.layers[i].get_submodule(fam).register_forward_hook(
        lambda _m, _a, y, fam=fam, i=i: out[fam][i].append(y.detach().double().numpy()))
        for i in range(LAYERS) for fam in out]
    with torch.no_grad():
        model(torch.from_numpy(ids))
    for h in handles:
        h.remove()
    return {fam: np.stack([np.concatenate(v) for v in per]) for fam, per in out.items()}


@pytest.fixture(scope="module")
def selective(tmp_path_factory: pytest.TempPathFactory) -> tuple[AuditResult, Path]:
    out = tmp_path_factory.mktemp("selective") / "out"
    options = dataclasses.replace(FAST, execution=True, timing_pairs=10)
    return audit(ToySelective(), out, data=toy_data(), options=options), out


def test_every_named_coefficient_has_the_shares_numpy_computes(selective) -> None:
    result, _ = selective
    ids = toy_data().eval_ids
    recorded = _recorded(ToySelective(), ids)
    assert result.selection_parts is not None
    assert list(result.selection_parts) == ["select", "gate"]
    select = result.selection_parts["select"]
    assert list(select) == ["decay", "write"]
    for name, cut in (("decay", slice(0, D)), ("write", slice(D, 2 * D))):
        want = shares(recorded["select"][..., cut])
        for key, value in want.items():
            assert getattr(select[name], key) == pytest.approx(value, abs=1e-9), key
        assert select[name].eta2_token_id == pytest.approx(
            token_share(recorded["select"][..., cut], ids), abs=1e-9)
    # the pooled figure is the whole tensor's, as before
    assert result.variance["select"].eta2_layer == pytest.approx(
        shares(recorded["select"])["eta2_layer"], abs=1e-9)
    # a selection family without parts is one coefficient named by its family
    gate = result.selection_parts["gate"]
    assert list(gate) == ["gate"]
    assert gate["gate"].eta2_residual == pytest.approx(
        result.variance["gate"].eta2_residual, abs=1e-12)


def test_audit_json_lists_the_parts_the_selection_space_and_the_modes(selective) -> None:
    _, out = selective
    raw = json.loads((out / "audit.json").read_text(encoding="utf-8"))
    sites = {s["name"]: s for s in raw["sites"]}
    assert sites["select.0"]["parts"] == [{"name": "decay", "width": D},
                                          {"name": "write", "width": D}]
    assert sites["select.1"]["selection"] == SPACE
    assert sites["gate.0"]["selection"] == GATE_SPACE and "parts" not in sites["gate.0"]
    # the selection parts analysis's section, at the top level; the pooled figures alone
    # under variance
    assert {fam: set(named) for fam, named in raw["selection_parts"].items()} == {
        "select": {"decay", "write"}, "gate": {"gate"}}
    assert set(raw["selection_parts"]["select"]["decay"]) >= {
        "eta2_layer", "eta2_position", "eta2_layer_position", "eta2_residual", "eta2_token_id"}
    assert all("parts" not in v for v in raw["variance"].values())
    ex = raw["execution"]
    assert (ex["mode"], ex["dense_mode"], ex["dense_class"]) == (
        "recurrent scan", "fft convolution", "ToySelective")
    assert ex["conditional_execution"] is False
    back = AuditResult.read(out / "audit.json")  # the new keys read back, typed
    assert back.sites[0].parts[1].width == D
    flat = back.metrics()  # each named coefficient's shares, flat for studies
    keys = ("eta2_layer", "eta2_position", "eta2_layer_position", "eta2_component",
            "eta2_residual", "eta2_token_id", "eta2_token_id_chance", "epsilon2_token_id")
    named = {f"selection_parts_{key}@{fam}.{part}": shares.get(key)
             for fam, parts in raw["selection_parts"].items()
             for part, shares in parts.items() for key in keys}
    assert len(named) == 3 * len(keys)
    assert {k: flat[k] for k in named} == named
    assert flat["selection_parts_eta2_layer@gate.gate"] == raw["variance"]["gate"]["eta2_layer"]


def test_an_audit_json_with_the_parts_under_variance_reads_back_alike(selective) -> None:
    """Files written before the selection parts were an analysis hold each family's parts
    at ``variance[family].parts``: they read back to the same result. One with both
    places is no file fcaudit wrote, and is refused."""
    _, out = selective
    raw = json.loads((out / "audit.json").read_text(encoding="utf-8"))
    named = raw["selection_parts"]
    old = {k: v for k, v in raw.items() if k != "selection_parts"}
    old["variance"] = {fam: {**v, "parts": named[fam]} if fam in named else v
                       for fam, v in raw["variance"].items()}
    assert AuditResult.from_json(old) == AuditResult.from_json(raw)
    assert "parts" in old["variance"]["select"]  # the given content is left as it was
    with pytest.raises(DataError, match=r"variance\.\w+\.parts is not a field of this schema"):
        AuditResult.from_json({**old, "selection_parts": named})
    # a wrong value is refused at the path the file has, not where this version keeps it
    for place, bad in ((("select", "parts"), 5), (("select", "parts", "decay"), []),
                       (("gate", "parts", "gate", "eta2_layer"), "x"),
                       (("select", "parts", "write", "n_values"), 1.5)):
        edited = copy.deepcopy(old)
        parent = edited["variance"]
        for key in place[:-1]:
            parent = parent[key]
        parent[place[-1]] = bad
        with pytest.raises(DataError) as caught:
            AuditResult.from_json(edited)
        said = str(caught.value)
        assert f"result: variance.{'.'.join(place)} " in said, said
        assert "selection_parts" not in said, said


def test_the_report_states_the_lti_twin_and_a_row_per_coefficient(selective) -> None:
    _, out = selective
    md = (out / "report.md").read_text(encoding="utf-8")
    assert "`static-layer` feeds each layer the calibration mean of its selection " \
           "parameters: a time-invariant (LTI) recurrence" in md
    assert f"`select`: {SPACE}; `gate`: {GATE_SPACE}" in md
    assert "is selection a lookup of the current token?" in md
    notes = {cells[0]: cells[-1] for cells in map(md_cells, md.split("## Gap retention")[1]
                                                  .split("##")[0].splitlines())
             if cells and cells[0].startswith("`static")}
    assert notes["`static-layer`"].endswith("the LTI twin: a time-invariant recurrence with "
                                            "each layer's mean selection")
    assert notes["`static-layer-token`"].endswith("is selection a lookup of the current token?")
    section = md.split("\n## Named coefficients", 1)[1].split("\n## ", 1)[0]
    table = section.split("### Family `select`", 1)[1].split("###", 1)[0]
    rows = [md_cells(line) for line in table.splitlines() if line.startswith("| `")
            or line.startswith("| pooled")]
    assert [r[:3] for r in rows] == [["`decay`", "0–3", "1,536"], ["`write`", "4–7", "1,536"],
                                     ["pooled", "all", "3,072"]]  # 2 layers x 12 x 16 x 4
    assert "| `gate` | all | 384 |" in section  # the one coefficient of the gate family
    parts = json.loads((out / "audit.json").read_text(encoding="utf-8"))["selection_parts"][
        "select"]
    def said(part: dict) -> str:  # beyond chance, (share - chance) / (1 - chance), first
        share, chance = part["eta2_token_id"], part["eta2_token_id_chance"]
        assert part["epsilon2_token_id"] == pytest.approx((share - chance) / (1 - chance))
        return (f"the current token id explains {100 * (share - chance) / (1 - chance):.1f}% "
                f"beyond chance ({100 * share:.1f}% against a chance level of "
                f"{100 * chance:.1f}%)")
    assert (f"`select` per coefficient, within layers: `decay`: {said(parts['decay'])}; "
            f"`write`: {said(parts['write'])}.") in md
    assert "`gate` per coefficient" not in md  # one coefficient: the pooled figure says it
    assert "compute the same for every token" in md and "(no conditional execution)" in md
    assert "Twin measured against: the model's dense counterpart, class `ToySelective` " \
           "(for a selective recurrence, its LTI twin" in md
    assert "Compute mode timed: model `recurrent scan`, dense counterpart " \
           "`fft convolution`" in md


def test_an_audit_without_selection_sites_says_none_of_it(tmp_path) -> None:
    result = audit(toys.content_model(), tmp_path / "out", sites=["gates.*"], data=toy_data(),
                   options=FAST)
    md = (tmp_path / "out" / "report.md").read_text(encoding="utf-8")
    raw = json.loads((tmp_path / "out" / "audit.json").read_text(encoding="utf-8"))
    assert "LTI" not in md and "Named coefficients" not in md
    assert "selection_parts" not in raw and result.selection_parts is None
    assert all("parts" not in v for v in raw["variance"].values())
    assert all("selection" not in s and "parts" not in s for s in raw["sites"])


# ------------------------------------------------------------------------- bad declarations

class Declared(ToySelective):
    def __init__(self, sites: list[Site]) -> None:
        super().__init__()
        self.sites = sites

    def controller_sites(self) -> list[Site]:
        return self.sites


@pytest.mark.parametrize("sites, needle", [
    ([Site("select.0", "layers.0.select", "select", 0,
           role=Selection(SPACE, (("decay", 4), ("write", 3))))],
     "site select.0 declares parts decay(4), write(3) (7 channels) but its coefficients have "
     "shape [4, 16, 8], 8 channels"),
    ([Site("gate.0", "layers.0.gate", "gate", 0, role=Selection(SPACE, (("g", 1), ("g", 0))))],
     "site gate.0: parts=(('g', 1), ('g', 0)) is not a tuple of distinct (name, width) pairs"),
    ([Site("select.0", "layers.0.select", "select", 0),
      Site("select.1", "layers.1.select", "select", 1, role=Selection(SPACE, PARTS))],
     "sites select.0 and select.1 of family select declare other coefficients"),
    ([Site("select.0", "layers.0.select", "select", 0, role=Selection("  "))],
     "site select.0: Selection.space='  ' must name the space"),
])
def test_a_wrong_declaration_is_refused_naming_the_site(sites, needle, tmp_path) -> None:
    with pytest.raises(ModelError) as caught:
        audit(Declared(sites), tmp_path / "out", data=toy_data(), options=FAST)
    assert needle in str(caught.value) and "\n" not in str(caught.value)
    assert caught.value.site == sites[-1].name
    assert not (tmp_path / "out" / "audit.json").exists()


def test_parts_given_as_lists_are_read_as_the_tuples(tmp_path) -> None:
    listed = [Site(f"select.{i}", f"layers.{i}.select", "select", i,
                   role=Selection(SPACE, [["decay", D], ["write", D]]))  # type: ignore[arg-type]
              for i in range(LAYERS)]
    result = audit(Declared(listed), tmp_path / "out", data=toy_data(), options=FAST,
                   report=False)
    assert result.selection_parts is not None
    assert list(result.selection_parts["select"]) == ["decay", "write"]
    assert [(p.name, p.width) for p in result.sites[0].parts] == list(PARTS)


class Unnamed(ToySelective):
    execution_mode = 3  # type: ignore[assignment]


def test_an_execution_mode_that_is_no_string_is_refused_before_recording(tmp_path) -> None:
    with pytest.raises(ModelError, match=r"^Unnamed.execution_mode is 3: make it a string "
                                         "naming the compute mode"):
        audit(Unnamed(), tmp_path / "out", data=toy_data(),
              options=dataclasses.replace(FAST, execution=True, timing_pairs=0))
    assert not (tmp_path / "out").exists()
