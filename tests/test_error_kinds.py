"""Errors with structure: a user mistake raises the kind of FcauditError that says which
input is at fault (usage, data, model, cache), with that input in a field, while the
message, ``except FcauditError`` and the CLI's exit status 2 stay as they were.

Each mistake is made twice: through the Python API (the class and its field) and through
the command line (exit 2 and the one line; with ``--debug`` the same class propagates)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import toys
from conftest import FAST, TOY, run_inprocess, toy_data

import fcaudit
from fcaudit import cli
from fcaudit.core.errors import CacheError, DataError, FcauditError, ModelError, UsageError
from fcaudit.core.sites import find_sites
from fcaudit.engine.options import AuditOptions
from fcaudit.io.data import text_documents
from fcaudit.io.placement import Placement, offload_space


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], kind: type[FcauditError],
             fragment: str) -> FcauditError:
    """The CLI refuses ``argv`` with exit 2 and one line holding ``fragment``; rerun with
    --debug, the error that reaches main is of ``kind`` (returned, to read its field)."""
    res = run_inprocess(argv, capsys)
    line = res.stderr.strip()
    assert res.returncode == 2, res.stderr
    assert line.startswith("fcaudit: error: ") and "\n" not in line and fragment in line, line
    with pytest.raises(kind) as caught:
        cli.main([*argv, "--debug"])
    return caught.value


def test_a_bad_option_value_is_a_usage_error_naming_the_option(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(FcauditError) as caught:  # callers that catch the base still do
        AuditOptions(repeats=0).validate()
    assert type(caught.value) is UsageError and caught.value.option == "repeats"
    assert str(caught.value) == "AuditOptions(repeats=0): must be an integer between 1 and 100"
    error = _refused(["audit", *TOY, "--repeats", "0", "--out", str(tmp_path / "out")], capsys,
                     UsageError, "--repeats 0: must be an integer between 1 and 100")
    assert error.option == "repeats"
    assert not (tmp_path / "out").exists()


def test_an_option_of_the_placement_part_is_a_usage_error_too() -> None:
    with pytest.raises(UsageError) as caught:
        AuditOptions(max_memory="cpu=8GiB").validate()  # a budget without a device map
    assert caught.value.option == "max_memory"
    assert str(caught.value).startswith("AuditOptions(max_memory='cpu=8GiB') is read only with "
                                        "device_map='auto'")


def test_a_missing_data_file_is_a_data_error_with_its_path(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "essay.txt"
    with pytest.raises(FcauditError) as caught:
        text_documents(missing)
    assert type(caught.value) is DataError and caught.value.path == str(missing)
    assert str(caught.value).startswith(f"data path not found: {missing};")
    error = _refused(["train", "--arch", "featuregate", "--data", str(missing), "--out",
                      str(tmp_path / "run")], capsys, DataError, "data path not found")
    assert error.path == str(missing)


def test_a_site_glob_matching_nothing_is_a_model_error_naming_the_glob(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(FcauditError) as caught:
        find_sites(toys.content_model(), ["nothing.*"])
    assert type(caught.value) is ModelError and caught.value.site == "nothing.*"
    assert str(caught.value).startswith("sites='nothing.*' matched no module of ")
    error = _refused(["audit", "--model", "toys:content_model", "--sites", "nothing.*",
                      "--quiet", "--out", str(tmp_path / "out")], capsys, ModelError,
                     "--sites 'nothing.*' matched no module")
    assert error.site == "nothing.*"
    assert not (tmp_path / "out").exists()


def test_a_folder_fcaudit_did_not_write_is_a_cache_error_with_the_folder(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The offload folder: fcaudit claims it as it claims --out, and never deletes a file
    it did not write there."""
    folder = tmp_path / "offload"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(FcauditError) as caught, \
            offload_space(Placement("auto", None, folder), tmp_path / "out"):
        pass
    assert type(caught.value) is CacheError and caught.value.folder == str(folder)
    assert "holds 1 file(s) fcaudit did not write (e.g. notes.txt)" in str(caught.value)
    error = _refused(["audit", *TOY, "--device-map", "auto", "--offload-folder", str(folder),
                      "--out", str(tmp_path / "out")], capsys, CacheError,
                     "fcaudit did not write")
    assert error.folder == str(folder)
    assert (folder / "notes.txt").read_text() == "mine"


def test_every_kind_keeps_the_exit_status_of_a_user_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bad --inputs with --tokens (usage) and an --inputs file of strings (data) both
    exit 2, as every FcauditError did before it had kinds."""
    import numpy as np
    words = tmp_path / "words.npy"
    np.save(words, np.array(["a", "b"]))
    error = _refused(["audit", *TOY, "--inputs", str(words), "--tokens", str(words), "--out",
                      str(tmp_path / "out")], capsys, UsageError, "--inputs and --tokens both")
    assert error.option == "tokens"
    error = _refused(["sites", "--model", "toys:content_model", "--all", "--inputs",
                      str(words)], capsys, DataError, "has dtype <U1")
    assert error.path == str(words)


class _Noisy(toys.ToyModel):
    """Randomness in the forward pass (dropout left on): no replay can be exact."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) + 0.1 * torch.randn(*ids.shape, toys.V)


def test_a_replay_that_is_not_bit_for_bit_is_an_identity_error_with_its_difference(
        tmp_path: Path) -> None:
    with pytest.raises(fcaudit.IdentityError) as caught:
        fcaudit.audit(_Noisy("content"), tmp_path / "out", sites=["gates.*"], data=toy_data(),
                      options=FAST)
    error = caught.value
    assert isinstance(error, ModelError) and isinstance(error, FcauditError)
    said = float(re.search(r"by up to ([0-9.e+-]+) nats", str(error)).group(1))
    assert error.max_abs_diff is not None and error.max_abs_diff > 0
    assert f"{error.max_abs_diff:.3g}" == f"{said:.3g}"  # the field is the number said
    assert error.site is None  # two unperturbed passes differ: no site to blame
    assert not (tmp_path / "out").exists()


def test_a_cache_of_other_data_is_a_cache_error_naming_its_folder(tmp_path: Path) -> None:
    out = tmp_path / "out"
    fcaudit.audit(toys.content_model(), out, sites=["gates.*"], data=toy_data(), options=FAST,
                  report=False)
    with pytest.raises(CacheError) as caught:
        fcaudit.audit(toys.content_model(), out, sites=["gates.*"], options=FAST,
                      data=toy_data(n_eval=8), report=False)
    assert caught.value.folder == str(out / "cache")
    assert "recorded with a different" in str(caught.value)
