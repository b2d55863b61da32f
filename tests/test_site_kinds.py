"""One judgement, given once before the work, of what kind of coefficient a site is:
``fcaudit sites`` says it for each candidate and declared site, the audit says it on the
console, keeps it in ``audit.json`` (``sites[i].kind``) and the report states it beside
the answers. Each expected kind comes from the model's known structure, written here:
a SwiGLU's SiLU is the MLP's own activation, FeatureGate's ``sigmoid(w . LN(h))`` a
scalar gate, a MoE's router a router, MUDD's dynamic dense weights mixing weights,
Mamba's dt, B, C selection parameters."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import toys
from conftest import AUDIT_FAST, COMMON, make_mudd_folder, run_inprocess

from fcaudit import AuditData, AuditOptions
from fcaudit.engine.prepare import AuditRequest, prepare
from fcaudit.engine.result import AuditResult, SiteInfo
from fcaudit.io.typedjson import load
from fcaudit.models.featuregate import GPT
from fcaudit.models.featuregate import PRESETS as GATE_PRESETS
from fcaudit.models.mamba import PRESETS as MAMBA_PRESETS
from fcaudit.models.mamba import Mamba
from fcaudit.models.moe import PRESETS as MOE_PRESETS
from fcaudit.models.moe import MoEGPT

transformers = pytest.importorskip("transformers")


def kinds_of(model: object, sites: list[str] | None, vocab: int) -> dict[str, str]:
    """Every site's kind as the audit judges it before its first pass (site -> kind)."""
    rng = np.random.default_rng(0)
    data = AuditData(rng.integers(0, vocab, (4, 16)), rng.integers(0, vocab, (4, 16)), {})
    setup = prepare(AuditRequest(model, sites=sites, data=data,
                                 options=AuditOptions(execution=False)))
    assert [s.name for s in setup.sites] == list(setup.kinds)  # every site judged
    return setup.kinds


def _seeded(build: type, config: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return build(config).eval()


def test_the_planted_toys_get_the_kind_their_gates_have() -> None:
    """constant and position: one coefficient per token [B, T, 1], scalar gates; content:
    a one-hot of the token [B, T, V] that the model sums into its prediction, scaling no
    branch, so no kind fits; the toy routers' top-1 logits: routers."""
    assert kinds_of(toys.constant_model(), ["gates.*"], toys.V) == {
        "gates.0": "scalar gate", "gates.1": "scalar gate"}
    assert kinds_of(toys.position_model(), ["gates.*"], toys.V) == {
        "gates.0": "scalar gate", "gates.1": "scalar gate"}
    assert kinds_of(toys.content_model(), ["gates.*"], toys.V) == {
        "gates.0": "unclassified", "gates.1": "unclassified"}
    assert kinds_of(toys.token_router_model(), None, toys.V) == {
        "routers.0": "router", "routers.1": "router"}


@pytest.mark.parametrize(("build", "config", "expected"), [
    (GPT, GATE_PRESETS["tiny"], "scalar gate"),  # sigmoid(w . LN(h)): [B, T, 1]
    (MoEGPT, MOE_PRESETS["tiny"], "router"),  # top-k logits over 8 experts
    (Mamba, MAMBA_PRESETS["tiny"], "selection parameter"),  # dt, B, C of the scan
])
def test_our_families_get_the_kind_their_controllers_have(build: type, config: object,
                                                          expected: str) -> None:
    model = _seeded(build, config)
    kinds = kinds_of(model, None, 2048)
    assert kinds == {s.name: expected for s in model.controller_sites()}


def test_mudd_weights_are_mixing_weights(tmp_path: Path) -> None:
    """MUDD's generators give [B, T, 4, i + 2] weights over the stream sources (and the
    last layer [B, T, 1, N + 1]), summed into the streams: mixing weights, both families."""
    kinds = kinds_of(str(make_mudd_folder(tmp_path)), None, 256)
    assert kinds == {f"dynamic_dense.{i}": "mixing weights" for i in range(4)}


def test_a_glob_over_whole_mlps_is_hidden_states_and_a_block_is_refused() -> None:
    """FeatureGate's GELU MLP returns the hidden states it reads and scales nothing: its
    kind says so (the warning that said it before lived in a table cell)."""
    model = _seeded(GPT, GATE_PRESETS["tiny"])
    assert set(kinds_of(model, ["blocks.*.body.mlp"], 2048).values()) == {"hidden states"}


def test_a_channel_gate_of_images_is_feature_wise_in_sites(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture
                                                           ) -> None:
    """An SE gate: sigmoid weights [B, C], one per channel, viewed [B, C, 1, 1] to scale
    the map [B, C, 8, 8]. Block 0's near one-hot gate (sigmoid(8) and three sigmoid(-8))
    sums to about one, like a softmax: the product that broadcasts over the whole map, not
    its values, says it is a gate."""
    import vision_toys as vt
    np.save(tmp_path / "x.npy", vt.image_data(2, 0)[0])
    res = run_inprocess(["sites", "--model", "vision_toys:se_unequal", "--inputs",
                         tmp_path / "x.npy"], capsys)
    assert res.returncode == 0, res.stderr
    gates = [line for line in res.stdout.splitlines() if ".gate\tSEGate" in line]
    assert len(gates) == 2 and all(g.endswith("; kind: feature-wise gate") for g in gates)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (SwiGLU MLPs: act_fn is SiLU of gate_proj times up_proj)."""
    from conftest import save
    return save(transformers.LlamaConfig(**COMMON, intermediate_size=64),
                tmp_path_factory.mktemp("llama") / "llama")


def test_sites_and_the_audit_say_the_same_kind_of_a_swiglu_activation(
        llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before, `sites` suggested `model.layers.*.mlp.act_fn` as a likely controller and
    the audit warned, in a reproducibility table cell, that its coefficients "have exactly
    the shape of the hidden states it reads", while the bold answer read as a controller's.
    Now `sites`, the console, audit.json, the dependence answer and the report all say it
    is the MLP's own activation."""
    listing = run_inprocess(["sites", "--model", llama], capsys)
    assert listing.returncode == 0, listing.stderr
    act = [line for line in listing.stdout.splitlines() if "mlp.act_fn\t" in line]
    assert len(act) == COMMON["num_hidden_layers"]
    assert all(line.endswith("; kind: activation") for line in act)
    assert "suggested: fcaudit audit --sites 'model.layers.*.mlp.act_fn' ...  (activation)" \
        in listing.stdout
    (legend,) = [line for line in listing.stdout.splitlines() if line.startswith("kind ")]
    assert legend.startswith("kind activation: an elementwise nonlinearity of what it reads")
    assert legend.endswith("dense counterpart: none, the coefficients are the MLPs' own "
                           "activations, so there is no model without them to compare")
    out = tmp_path / "out"
    audit = run_inprocess(["audit", "--model", llama, "--sites", "model.layers.*.mlp.act_fn",
                           "--out", out, *AUDIT_FAST], capsys)
    assert audit.returncode == 0, audit.stderr
    assert "fcaudit: sites model.layers.*.mlp.act_fn (2, e.g. model.layers.0.mlp.act_fn): " \
           "kind activation: an elementwise nonlinearity" in audit.stderr
    assert "warning" not in audit.stderr
    result = json.loads((out / "audit.json").read_text())
    assert [(s["name"], s["kind"], s.get("layout")) for s in result["sites"]] == [
        (f"model.layers.{i}.mlp.act_fn", "activation", None) for i in range(2)]
    assert result["verdict"]["dependence"].endswith(
        "The coefficients of model.layers.*.mlp.act_fn are the MLPs' own activations, not a "
        "separate controller: a dependence on them says the MLP needs its activations, not "
        "that a controller computes dynamically.")
    report = (out / "report.md").read_text()
    answer = report[report.index("### 2. Dependence"):report.index("### 3. Execution")]
    assert "- `model.layers.*.mlp.act_fn` is of kind **activation**: an elementwise " \
           "nonlinearity of what it reads" in answer
    assert "exactly the shape of the hidden states" not in report
    for site in result["sites"]:  # an audit.json written before kinds still reads
        del site["kind"]
    assert [s.kind for s in AuditResult.from_json(result).sites] == [None, None]
    assert load(SiteInfo, {"name": "g", "family": "f", "layer": 0, "trailing_shape": [1]}
                ).kind is None
