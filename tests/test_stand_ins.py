"""Stubs stand in for a module's call only: a model that reads attributes of its blocks or
controllers (a hybrid's ``layer.block_type``) runs under the prefix schedule as under
full passes, and a model that tells a stub from its block falls back to full passes.
Reference: the naive schedule, whose every replay is a full pass with no block stubbed
(its numbers must equal the prefix schedule's), and a Nemotron-H hybrid saved with
``save_pretrained``, audited with the default options (issue 37)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import canonical, run_inprocess, tokenizer_file
from torch import nn

import fcaudit
from fcaudit import AuditData, AuditOptions
from fcaudit.core.contract import Site
from fcaudit.core.replaying import CoefficientStub, OutputStub

V, WIDTH, LAYERS = 32, 8, 3


class KindBlock(nn.Module):
    """``h + sigmoid(g) * mlp(h)``, ``g = w . h`` the controller; ``kind`` an attribute the
    model reads beside calling the block."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.gate = nn.Linear(WIDTH, 1)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.sigmoid(self.gate(h)) * self.mlp(h)


class ReadsKinds(nn.Module):
    """A stack whose forward reads each block's ``kind`` (as Nemotron-H reads
    ``block_type``) and each gate's ``in_features`` before calling them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(V, WIDTH)
        self.blocks = nn.ModuleList(KindBlock("ab"[i % 2]) for i in range(LAYERS))
        self.head = nn.Linear(WIDTH, V)

    def step(self, block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        assert block.gate.in_features == WIDTH
        return block(h) * (1.0 if block.kind == "a" else 0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids)
        for block in self.blocks:
            h = self.step(block, h)
        return self.head(h)

    def controller_sites(self) -> list[Site]:
        return [Site(f"blocks.{i}.gate", f"blocks.{i}.gate", "gate", i) for i in range(LAYERS)]

    def execution_blocks(self) -> list[str]:
        return [f"blocks.{i}" for i in range(LAYERS)]


class TellsStubs(ReadsKinds):
    """A stack that refuses any block that is not of its own class (a stub is not)."""

    def step(self, block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        if not isinstance(block, KindBlock):
            raise TypeError(f"not a KindBlock: {type(block).__name__}")
        return super().step(block, h)


def test_stubs_read_attributes_from_the_module_they_replace():
    block = KindBlock("b")
    out = torch.ones(2, 3, WIDTH)
    stub = OutputStub(block, out)
    assert stub.kind == "b" and stub.mlp is block.mlp  # read from the block
    assert torch.equal(stub(torch.zeros(1)), out) and stub(0) is not out  # a fresh copy
    site = Site("g", "blocks.0.gate", "gate", 0)
    block.gate.top_k = 2  # a router's setting, read as switch_transformers reads num_experts
    gate = CoefficientStub(site, block.gate, torch.zeros(2, 3, 1))
    assert gate.top_k == 2 and gate.site is site and gate.calls == 0  # its own stay its own
    with pytest.raises(AttributeError, match="no_such"):
        _ = stub.no_such


def _audit(model: nn.Module, schedule: str) -> dict:
    rng = np.random.default_rng(0)
    data = AuditData(rng.integers(0, V, (8, 12)), rng.integers(0, V, (8, 12)),
                     {"source": "tokens"})
    opts = AuditOptions(repeats=1, bootstrap=50, batch_size=4, execution=False,
                        progress=False, schedule=schedule)
    return fcaudit.audit(model, None, data=data, options=opts, report=False).to_json()


@pytest.mark.parametrize(("cls", "state"), [(ReadsKinds, "batches_prefix_reused"),
                                            (TellsStubs, "batches_fell_back_to_full_passes")])
def test_prefix_schedule_equals_full_passes_whatever_the_model_reads(cls, state):
    """Reading attributes of stubbed blocks: the prefix is reused on every batch. Telling
    a stub from a block: every batch falls back to full passes, said in the schedule.
    Either way every number equals the naive schedule's."""
    prefix, naive = _audit(cls(), "prefix"), _audit(cls(), "naive")
    schedule = prefix["runtime"]["schedule"]
    assert schedule[state] == schedule["batches"] == 2
    for key in ("conditions", "per_layer", "retention", "verdict"):
        assert prefix[key] == naive[key], key


@pytest.fixture(scope="module")
def nemotron_h(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Nemotron-H hybrid of tests/ssm_families.py (mamba, attention, MoE),
    saved with save_pretrained, with a tokenizer and token windows."""
    pytest.importorskip("transformers")
    from ssm_families import build
    folder = tmp_path_factory.mktemp("nemotron_h")
    build("nemotron_h").save_pretrained(folder)
    tokenizer_file(folder)
    rng = np.random.default_rng(0)
    for name in ("eval", "calib"):
        np.save(folder / f"{name}.npy", rng.integers(3, 120, (8, 12)))
    return folder


def test_nemotron_h_audits_with_the_default_options(nemotron_h: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]):
    """The default options (prefix schedule, per-layer runs, execution): no crash after
    the record stage, the prefix proven and reused, and every number the naive
    schedule's (the issue's ``'OutputStub' object has no attribute 'block_type'``)."""
    data = ["--tokens", nemotron_h / "eval.npy", "--calib-tokens", nemotron_h / "calib.npy"]
    outs = {}
    for schedule in ("prefix", "naive"):
        outs[schedule] = tmp_path / schedule
        res = run_inprocess(["audit", "--model", nemotron_h, "--out", outs[schedule], *data,
                             "--quiet", "--schedule", schedule], capsys)
        assert res.returncode == 0, res.stderr
    prefix = json.loads((outs["prefix"] / "audit.json").read_text())
    assert prefix["runtime"]["schedule"]["batches_prefix_reused"] == 1
    assert prefix["execution"]["measured"] and prefix["per_layer"]
    naive = json.loads(canonical(outs["naive"] / "audit.json"))
    for key in ("conditions", "per_layer", "retention", "variance"):
        assert json.loads(canonical(outs["prefix"] / "audit.json"))[key] == naive[key], key
