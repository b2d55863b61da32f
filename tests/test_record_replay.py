"""`fcaudit.record` / `fcaudit.replay` round trips by glob: Hugging Face routers recorded
and replayed bit for bit, a Recording replays on a fresh copy of the model, an unknown
tuple output names both adapters, and the CLI audits a router glob."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import AUDIT_FAST, run_inprocess
from torch import nn

ROUTER_GLOB = "model.layers.*.mlp.gate"


def test_a_router_glob_records_and_replays_a_hugging_face_model(hf_mixtral: Path) -> None:
    import fcaudit
    from fcaudit.core.routers import RouterAdapter
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_mixtral).eval()
    ids = torch.randint(0, 120, (3, 10), generator=torch.Generator().manual_seed(0))
    recording = fcaudit.record(model, ids, sites=[ROUTER_GLOB])
    names = ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    assert list(recording) == names and len(recording) == 2
    assert [s.name for s in recording.sites] == names
    for site in recording.sites:
        assert isinstance(site.adapter, RouterAdapter) and site.family == ROUTER_GLOB
        assert list(recording[site.name].shape) == [3, 10, 4]  # [B, T, experts]
    with torch.no_grad():
        live = model(ids).logits
        assert torch.equal(recording.logits, live)
        with fcaudit.replay(model, recording):  # no globs repeated
            assert torch.equal(model(ids).logits, live)
        with fcaudit.replay(model, fcaudit.reassign(recording, donor=[1, 2, 0])):
            reassigned = model(ids).logits
        with fcaudit.replay(model, dict(recording), sites=[ROUTER_GLOB]):  # a plain dict
            assert torch.equal(model(ids).logits, live)
    assert not torch.equal(reassigned, live)  # other routing, other logits


def test_a_recording_replays_without_any_memory_of_the_record_call() -> None:
    """Glob sites resolved to the plain tensor adapter travel in the Recording: replaying
    it on a copy of the model (which no earlier call saw) is bit exact."""
    import copy

    import toys

    import fcaudit
    from fcaudit.core.adapters import TENSOR
    torch.manual_seed(0)
    model = toys.content_model().eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    recording = fcaudit.record(model, ids, sites=["gates.*"])
    assert [s.adapter for s in recording.sites] == [TENSOR] * len(recording.sites)
    twin = copy.deepcopy(model)
    with torch.no_grad(), fcaudit.replay(twin, recording):
        assert torch.equal(fcaudit.logits_of(twin(ids)), recording.logits)


class _TupleGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 2)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.proj(h)
        return scores, scores.argmax(-1)


class _TupleModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.gate = _TupleGate()
        self.head = nn.Linear(4, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        scores, _ = self.gate(h)
        return self.head(h * scores[..., :1].sigmoid())


def test_an_unknown_tuple_output_names_both_adapters_and_the_python_argument() -> None:
    import fcaudit
    from fcaudit.core.errors import FcauditError
    with pytest.raises(FcauditError) as err:
        fcaudit.record(_TupleModel(), torch.zeros(2, 3, dtype=torch.long), sites=["gate"])
    message = str(err.value)
    assert "fcaudit.TupleAdapter" in message
    assert "fcaudit.RouterAdapter" in message
    assert "sites=[Site(...)]" in message
    with pytest.raises(FcauditError, match=r"sites='nope'"):
        fcaudit.record(_TupleModel(), torch.zeros(2, 3, dtype=torch.long), sites=["nope"])


def test_the_cli_audits_a_router_glob(hf_mixtral: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    import json
    out = tmp_path / "out"
    res = run_inprocess(["audit", "--model", hf_mixtral, "--out", out, "--sites", ROUTER_GLOB,
                         "--quiet", *AUDIT_FAST], capsys)
    assert res.returncode == 0, res.stderr
    result = json.loads((out / "audit.json").read_text())
    assert [(s["name"], s["family"], s.get("adapter")) for s in result["sites"]] == [
        (f"model.layers.{i}.mlp.gate", ROUTER_GLOB, "router") for i in range(2)]
    assert result["identity_replay_max_abs_diff"] == 0.0


