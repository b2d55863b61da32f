"""The scoring window said aloud: its length and where it comes from (`--seq-len`, a run's
training length, a folder's context) in the first line, the summary, audit.json and
the report."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import AUDIT_FAST, run_inprocess

from fcaudit.models.featuregate import GPT, PRESETS


@pytest.mark.parametrize(("extra", "length", "source", "said"), [
    ([], 64, "default for a Hugging Face folder: min(256, context 64)",
     "default for a Hugging Face folder: min(256, context 64); --seq-len to change"),
    (["--seq-len", "32"], 32, "--seq-len", "set by --seq-len")])
def test_the_scoring_window_and_its_source_are_said_everywhere(
        hf_mixtral: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str],
        length: int, source: str, said: str) -> None:
    """Its length and where it comes from, the option named once: a window the option set
    reads "set by --seq-len", never "(--seq-len; --seq-len to change)"."""
    import json
    out = tmp_path / "out"
    res = run_inprocess(["audit", "--model", hf_mixtral, "--out", out, *AUDIT_FAST, *extra], capsys)
    assert res.returncode == 0, res.stderr
    line = f"scoring windows of {length} tokens ({said})"
    first = res.stderr.splitlines()[0]  # before any progress line, then the rows picked
    assert first.startswith(f"fcaudit: {line}; evaluation sequences: 4 of "), first
    summary = " ".join(res.stdout.split())  # the printed summary (rich may wrap)
    assert line in summary
    for text in (first, summary):
        window = text[text.index("scoring windows"):].split("; evaluation sequences")[0]
        assert window.count("--seq-len") == 1, window
    data = json.loads((out / "audit.json").read_text())["data"]
    assert (data["seq_len"], data["seq_len_source"]) == (length, source)
    report = (out / "report.md").read_text()
    shown = said.split(";")[0]
    assert f"of {length} tokens ({4 * length} tokens; window length: {shown})" in report


def test_a_run_folder_window_is_its_training_length_and_help_explains_the_default(
        capsys: pytest.CaptureFixture[str]) -> None:
    import dataclasses

    from fcaudit.engine.inputs import loaded_seq_len
    from fcaudit.io.loading import load_module
    loaded = load_module(GPT(PRESETS["tiny"]), "fg")
    assert loaded_seq_len(loaded) == (128, "default for a model without a training run: "
                                           "min(256, context 128)")
    run = dataclasses.replace(loaded, run_config={"train": {"seq_len": 96}})
    assert loaded_seq_len(run) == (96, "the run's training length")
    with pytest.raises(SystemExit):
        run_inprocess(["audit", "--help"], capsys)
    text = " ".join(capsys.readouterr().out.split())
    assert "a Hugging Face folder or other model: min(256, its context)" in text


