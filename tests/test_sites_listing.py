"""``fcaudit sites``: every site's line shows what the audit will read of it beyond its
name, family and layer: the axes, the named parts side by side in its output (a selective
recurrence's dt, B, C), the selection parameter's space and an exit site's scores, and
its kind."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_inprocess

from fcaudit.models.earlyexit import PRESETS, EarlyExitGPT

transformers = pytest.importorskip("transformers")


def exit_model() -> torch.nn.Module:
    """The tiny early-exit LM (random weights): one exit site per layer but the last."""
    torch.manual_seed(0)
    return EarlyExitGPT(PRESETS["tiny"]).eval()


def _lines(argv: list, capsys) -> list[list[str]]:
    """The declared sites' lines, split into fields (the kinds' lines follow them)."""
    res = run_inprocess(["sites", *argv], capsys)
    assert res.returncode == 0, res.stderr
    return [line.split("\t") for line in res.stdout.splitlines() if "\t" in line]


def test_selection_sites_show_their_parts_and_space(tmp_path: Path, capsys) -> None:
    torch.manual_seed(0)
    config = transformers.MambaConfig(vocab_size=64, hidden_size=16, state_size=6,
                                      num_hidden_layers=3, expand=2, conv_kernel=4,
                                      time_step_rank=3)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    lines = _lines(["--model", tmp_path / "m"], capsys)
    assert [f[0] for f in lines] == [f"backbone.layers.{i}.mixer.x_proj" for i in range(3)]
    for fields in lines:  # the widths are the config's: dt rank 3, state size 6
        assert "axes=example,token" in fields
        assert "parts=dt:3,B:6,C:6" in fields
        assert "kind=selection parameter" in fields  # Mamba's dt, B, C
        (space,) = [f for f in fields if f.startswith("selection=")]
        assert "softplus" in space


def test_exit_sites_show_their_continue_and_exit_scores(capsys) -> None:
    declared = exit_model().controller_sites()
    lines = _lines(["--model", "test_sites_listing:exit_model"], capsys)
    assert [f[0] for f in lines] == [s.name for s in declared]
    for fields, site in zip(lines, declared, strict=True):
        assert f"exit=continue {site.exit.go:g}, exit {site.exit.stop:g}" in fields
        assert "kind=exit score" in fields
        assert not any(f.startswith(("parts=", "selection=")) for f in fields)
