"""State carried across calls (issue 30, bad input): a recurrent model whose state crosses
batches or calls (a hidden state kept on the model, a generation cache) would replay from
what the record pass left behind. The identity probe refuses it in one line that says the
output depends on earlier calls and what to do; randomness keeps its own message.

Reference: each toy is the content toy (tests/toys.py) plus an offset it changes on every
call, kept where the mode says; by construction two calls on one batch differ.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import toys
from conftest import FAST, FAST_ARGS, assert_clean_failure, run_inprocess, toy_data
from torch import nn

from fcaudit.api import audit
from fcaudit.core.errors import IdentityError


class Remembering(nn.Module):
    """The content toy's logits scaled by 1 + a memory that grows by 0.01 on every call
    (a shift alone would leave the NLL as it is), kept in a buffer (``buffer``), a dict of
    tensors on the model (``cache``, like a generation cache) or a Python number fcaudit
    cannot see (``hidden``); ``noisy`` adds fresh noise instead (randomness, no state)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode, self.inner = mode, toys.content_model()
        self.register_buffer("memory", torch.zeros(()))
        self.cache: dict[str, torch.Tensor] = {"h": torch.zeros(())}
        self.calls = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.inner(ids)
        if self.mode == "noisy":
            return logits + 0.01 * torch.randn_like(logits)
        if self.mode == "buffer":
            self.memory += 0.01
            return logits * (1 + self.memory)
        if self.mode == "cache":
            self.cache = {"h": self.cache["h"] + 0.01}
            return logits * (1 + self.cache["h"])
        self.calls += 1
        return logits * (1 + 0.01 * self.calls)


def buffer_model() -> nn.Module:
    return Remembering("buffer")


@pytest.mark.parametrize("mode, named", [("buffer", "(memory)"), ("cache", "(cache['h'])"),
                                         ("hidden", "from the same random seed differ")])
def test_a_model_carrying_state_across_calls_is_refused_saying_so(mode, named, tmp_path):
    with pytest.raises(IdentityError) as caught:
        audit(Remembering(mode), tmp_path / "out", sites=["inner.gates.*"], data=toy_data(),
              options=FAST)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("identity replay is not exact: the model's output depends on "
                              "earlier calls")
    assert named in message
    assert "reset that state at the start of every forward pass" in message
    assert "use_cache=False" in message
    assert caught.value.max_abs_diff > 0
    assert not (tmp_path / "out" / "audit.json").exists()


def test_the_command_line_stops_in_one_line(capsys, tmp_path: Path) -> None:
    out, files = tmp_path / "out", {}
    for name, seed in (("eval", 1), ("calib", 2)):
        files[name] = tmp_path / f"{name}.npy"
        np.save(files[name], toys.pair_sequences(12, 16, seed))
    res = run_inprocess(["audit", "--model", "test_carried_state:buffer_model", "--sites",
                         "inner.gates.*", "--out", out, *FAST_ARGS, "--tokens", files["eval"],
                         "--calib-tokens", files["calib"]], capsys)
    assert_clean_failure(res, tmp_path, out, (
        "the model's output depends on earlier calls", "(memory)",
        "state carried across calls such as a recurrent state or a generation cache",
        "disable any generation cache"))


def test_randomness_keeps_its_own_message(tmp_path) -> None:
    with pytest.raises(IdentityError, match="not deterministic \\(dropout, sampling or "
                                            "training mode\\?\\)") as caught:
        audit(Remembering("noisy"), tmp_path / "out", sites=["inner.gates.*"],
              data=toy_data(), options=FAST)
    assert "earlier calls" not in str(caught.value)


def test_allowed_it_runs_flagged_with_the_cause_in_the_identity_note(tmp_path) -> None:
    allowed = dataclasses.replace(FAST, allow_nonexact_identity=True)
    result = audit(Remembering("buffer"), tmp_path / "out", sites=["inner.gates.*"],
                   data=toy_data(), options=allowed)
    assert result.identity is not None and not result.identity.exact
    assert result.identity.note.startswith("identity replay is not exact: the model's output "
                                           "depends on earlier calls")
    md = (tmp_path / "out" / "report.md").read_text(encoding="utf-8")
    assert "Warning: the identity replay is not exact." in md
    assert "depends on earlier calls" in md
