"""Execution blocks a model or its dense twin declares (``execution_blocks()``) that are
not modules of it: refused before the record stage, in one line naming whose declaration
(the model, the twin given as ``--dense``, the twin its ``dense_counterpart()`` builds)
and the path, never an AttributeError reported as a bug (issue 37)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import toys
from conftest import assert_clean_failure, run_inprocess

import fcaudit
from fcaudit import AuditData, AuditOptions
from fcaudit.core.errors import ModelError


class MissingBlock(toys.ToyGatedModel):
    """The gated toy (or its dense twin, ``mode=None``) declaring a block it lacks."""

    def execution_blocks(self) -> list[str]:
        return ["blocks.0", "layers.9"]


class BuildsMissingTwin(toys.ToyGatedModel):
    def dense_counterpart(self) -> toys.ToyGatedModel:
        return MissingBlock(None)


def missing_block_model() -> toys.ToyGatedModel:
    return MissingBlock("informative")


def missing_block_twin() -> toys.ToyGatedModel:
    return MissingBlock(None)


def builds_missing_twin() -> toys.ToyGatedModel:
    return BuildsMissingTwin("informative")


CASES = {  # model spec, --dense spec, whose declaration the line names
    "the model": ("test_declared_blocks:missing_block_model", None,
                  "the model (MissingBlock) declares"),
    "a twin given": ("toys:informative_gated_model", "test_declared_blocks:missing_block_twin",
                     "the dense counterpart --dense test_declared_blocks:missing_block_twin "
                     "(MissingBlock) declares"),
    "a twin built": ("test_declared_blocks:builds_missing_twin", None,
                     "the dense counterpart that BuildsMissingTwin.dense_counterpart() built "
                     "(MissingBlock) declares"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_declared_block_that_is_no_module_is_one_line(case, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]):
    model, dense, whose = CASES[case]
    rng = np.random.default_rng(0)
    for name in ("eval", "calib"):
        np.save(tmp_path / f"{name}.npy", rng.integers(0, toys.V, (8, 12)))
    out = tmp_path / "out"
    res = run_inprocess(["audit", "--model", model, *(["--dense", dense] if dense else []),
                         "--tokens", tmp_path / "eval.npy", "--calib-tokens",
                         tmp_path / "calib.npy", "--out", out, "--quiet"], capsys)
    assert_clean_failure(res, tmp_path, out, (whose, "execution block 'layers.9', which is "
                                              "not one of its modules", "--blocks GLOB"))
    assert not (out / "cache").exists()  # refused before the record stage


def test_python_callers_get_the_model_error_in_their_words():
    rng = np.random.default_rng(0)
    data = AuditData(rng.integers(0, toys.V, (4, 8)), rng.integers(0, toys.V, (4, 8)),
                     {"source": "tokens"})
    with pytest.raises(ModelError, match=r"^the dense counterpart dense=.*declares execution "
                                         r"block 'layers\.9'.* blocks='GLOB'$"):
        fcaudit.audit(toys.informative_gated_model(), None, data=data,
                      dense=missing_block_twin(),
                      options=AuditOptions(repeats=1, bootstrap=10, progress=False),
                      report=False)
