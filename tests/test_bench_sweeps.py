"""The Hugging Face sweeps (benchmarks/hf_ssm_sweep.py, hf_moe_sweep.py) list a family as
passing only when the audit a user runs passes too: ``fcaudit audit`` on the model saved
with ``save_pretrained``, every option at its default (execution included). Their own
checks ran with reduced inputs, and a Nemotron-H that crashed under the default schedule
was listed as passing (issue 37). Reference: the command line's own parser, whose
options for the sweep's command must equal ``AuditOptions()``."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from conftest import COMMON, FAMILIES, optional_extra

from fcaudit.cli.parser import audit_options, build_parser
from fcaudit.engine.options import AuditOptions

transformers = optional_extra("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import hf_moe_sweep  # noqa: E402
import hf_ssm_sweep  # noqa: E402
from sweep_audit import audit_argv, default_audit  # noqa: E402


def test_the_sweeps_audit_sets_no_option_but_the_data(tmp_path: Path):
    args = build_parser().parse_args(
        audit_argv(tmp_path, tmp_path / "out", (tmp_path / "e.npy", tmp_path / "c.npy")))
    given, default = audit_options(args), AuditOptions()
    for f in dataclasses.fields(AuditOptions):
        if f.name != "progress":  # --quiet: no number depends on it
            assert getattr(given, f.name) == getattr(default, f.name), f.name
    assert default.execution and default.per_layer and default.schedule == "prefix"


def test_a_routed_family_passes_the_default_audit():
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES["mixtral"][0]()).eval()
    assert default_audit(model, COMMON["vocab_size"], 8) == {
        "audit": "yes", "execution": "conditional", "prefix": "reused", "folder": "saved"}


def test_a_model_transformers_cannot_save_is_audited_in_memory_and_said_so():
    """Inkling 2's shrunk config makes transformers' own save_pretrained raise: the same
    default audit runs on the model in memory, and the row says why."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES["mixtral"][0]()).eval()

    def fails(*_args, **_kwargs):
        raise RuntimeError("Trying to create tensor with negative dimension -199930")
    model.save_pretrained = fails
    cell = default_audit(model, COMMON["vocab_size"], 8)
    assert cell["audit"] == "yes" and cell["execution"] == "conditional"
    assert cell["folder"] == ("in memory (transformers' save_pretrained fails: RuntimeError: "
                              "Trying to create tensor with negative dimension -199930)")


def test_a_failing_audit_is_its_one_line():
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        **COMMON, intermediate_size=64, num_key_value_heads=2)).eval()
    cell = default_audit(model, COMMON["vocab_size"], 8)["audit"]
    assert cell.startswith("error: LlamaForCausalLM declares no controller sites")


@pytest.mark.parametrize("passes", [hf_ssm_sweep.passes, hf_moe_sweep.passes])
def test_a_family_whose_default_audit_fails_does_not_pass(passes):
    row = {"selection_sites": 2, "identity": "yes", "donor": "yes", "experts": "yes",
           "audit": "yes"}
    assert passes(row)
    assert not passes({**row, "audit": "error: 'OutputStub' object has no attribute "
                                       "'block_type'"})
