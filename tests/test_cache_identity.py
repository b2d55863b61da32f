"""The cache key is everything that defines the result: a changed config, an edited factory,
a shard index pointing at other files, weights outside their folder: each refuses a stale
cache (or the load) instead of reusing it."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import toys
from conftest import FAST_ARGS, run_inprocess, write_folder
from safetensors.torch import load_file

from fcaudit.core.errors import FcauditError
from fcaudit.io.mudd_checkpoint import load_mudd_folder


def _tokens(root: Path) -> list[str]:
    np.save(root / "eval.npy", toys.pair_sequences(8, 16, 1))
    np.save(root / "calib.npy", toys.pair_sequences(8, 16, 2))
    return ["--tokens", str(root / "eval.npy"), "--calib-tokens", str(root / "calib.npy")]


def test_a_changed_config_is_a_different_model(run_folder: Path, tmp_path: Path,  # noqa: F811
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """n_head changes no weight shape but every number: the cache must not be reused."""
    run = tmp_path / "run"
    shutil.copytree(run_folder / "run", run)
    argv = ["audit", "--model", run, "--data", run_folder / "text.txt", "--out",
            tmp_path / "out", *FAST_ARGS]
    assert run_inprocess(argv, capsys).returncode == 0
    config = json.loads((run / "config.json").read_text())
    config["model_config"]["n_head"] = 1
    (run / "config.json").write_text(json.dumps(config))
    res = run_inprocess(argv, capsys)
    assert res.returncode == 2 and "recorded with a different model" in res.stderr


FACTORY = '''
import toys

def build():
    return toys.ToyModel("{mode}")
'''


def test_an_edited_factory_is_a_different_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # the factory is imported from the current folder
    (tmp_path / "mymodels.py").write_text(FACTORY.format(mode="content"))
    argv = ["audit", "--model", "mymodels:build", "--sites", "gates.*", *_tokens(tmp_path),
            "--out", tmp_path / "out", *FAST_ARGS]
    assert run_inprocess(argv, capsys).returncode == 0
    result = json.loads((tmp_path / "out" / "audit.json").read_text())
    assert "everything their code reads" in result["model"]["identity_note"]
    (tmp_path / "mymodels.py").write_text(FACTORY.format(mode="constant"))
    sys.modules.pop("mymodels", None)
    res = run_inprocess(argv, capsys)
    assert res.returncode == 2 and "recorded with a different model" in res.stderr


HELPER = '''
import toys

SCALE = {scale}

class Scaled(toys.ToyModel):
    def forward(self, ids):
        return super().forward(ids) * SCALE
'''


def test_an_edit_to_code_the_factory_imports_is_a_different_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The factory's own file is unchanged; a module-level constant in the module its
    model's class comes from changes every logit. The cache's identity sees it (before,
    only the first batch's recheck did, and it blamed an unseen change of the model)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "factory.py").write_text("import helpers\n\ndef build():\n"
                                         "    return helpers.Scaled('content')\n")
    (tmp_path / "helpers.py").write_text(HELPER.format(scale=1.0))
    argv = ["audit", "--model", "factory:build", "--sites", "gates.*", *_tokens(tmp_path),
            "--out", tmp_path / "out", *FAST_ARGS]
    assert run_inprocess(argv, capsys).returncode == 0
    for name in ("factory", "helpers"):
        sys.modules.pop(name, None)
    assert run_inprocess(argv, capsys).returncode == 0  # unchanged: resumed
    (tmp_path / "helpers.py").write_text(HELPER.format(scale=2.0))
    for name in ("factory", "helpers"):
        sys.modules.pop(name, None)
    res = run_inprocess(argv, capsys)
    assert res.returncode == 2 and "recorded with a different model" in res.stderr, res.stderr


def test_a_shard_index_pointing_at_other_files_is_a_different_model(
        tiny_state: dict, tmp_path: Path) -> None:  # noqa: F811
    from fcaudit.io.loading import load
    folder = write_folder(tmp_path, tiny_state, "sharded-safetensors")
    before = load(str(folder)).fingerprint
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shutil.copy(folder / "model-00002-of-00002.safetensors", folder / "other.safetensors")
    moved = load_file(folder / "other.safetensors")
    first = next(iter(moved))
    moved[first] = moved[first] + 1  # other bytes, same keys and shapes
    from safetensors.torch import save_file
    save_file(moved, folder / "other.safetensors")
    index["weight_map"] = {k: ("other.safetensors" if v.startswith("model-00002") else v)
                           for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    after = load(str(folder))
    assert after.fingerprint != before and "other.safetensors" in after.files


@pytest.mark.parametrize("name", ["../elsewhere/model.safetensors", "/tmp/model.safetensors",
                                  "sub/../../model.safetensors"])
def test_weights_outside_their_folder_are_refused(name: str, tiny_state: dict,  # noqa: F811
                                                  tmp_path: Path) -> None:
    folder = write_folder(tmp_path, tiny_state, "sharded-safetensors")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = dict.fromkeys(index["weight_map"], name)
    index_path.write_text(json.dumps(index))
    with pytest.raises(FcauditError, match="outside its folder"):
        load_mudd_folder(folder)


FAKEPKG = '''
import toys


class Model(toys.ToyModel):
    def forward(self, ids):
        return super().forward(ids) * {scale}
'''


def _install_fakepkg(site: Path, version: str, scale: float) -> None:
    """An installed distribution ``fakepkg`` (a package folder and its dist-info, as pip
    leaves them) whose model class computes ``scale`` times the toy's logits."""
    for old in site.glob("fakepkg-*.dist-info"):
        shutil.rmtree(old)
    (site / "fakepkg").mkdir(parents=True, exist_ok=True)
    (site / "fakepkg" / "__init__.py").write_text(FAKEPKG.format(scale=scale))
    info = site / f"fakepkg-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakepkg\nVersion: {version}\n")
    (info / "top_level.txt").write_text("fakepkg\n")
    (info / "RECORD").write_text("fakepkg/__init__.py,,\n")


def test_an_upgraded_installed_package_is_a_different_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Installed code enters the identity by name; its version enters with it, so a model
    class from a package upgraded 1.0 -> 2.0 is refused at once, naming the package."""
    from fcaudit.core import codestate
    from fcaudit.io import runtime
    site = tmp_path / "site-packages"
    _install_fakepkg(site, "1.0", 1.0)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(codestate, "_LIBRARY_ROOTS", (*codestate._LIBRARY_ROOTS,
                                                      str(site.resolve()) + "/"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "factory.py").write_text("import fakepkg\n\ndef build():\n"
                                         "    return fakepkg.Model('content')\n")

    def fresh_imports() -> None:
        for name in ("factory", "fakepkg"):
            sys.modules.pop(name, None)
        codestate._library_module.cache_clear()
        runtime._distributions.cache_clear()

    argv = ["audit", "--model", "factory:build", "--sites", "gates.*", *_tokens(tmp_path),
            "--out", tmp_path / "out", *FAST_ARGS]
    fresh_imports()
    assert run_inprocess(argv, capsys).returncode == 0
    model = json.loads((tmp_path / "out" / "audit.json").read_text())["model"]
    assert model["packages"]["fakepkg"] == "1.0"
    assert "torch" in model["packages"]  # the toy's classes are torch modules
    _install_fakepkg(site, "2.0", 2.0)
    fresh_imports()
    res = run_inprocess(argv, capsys)
    assert res.returncode == 2, res.stderr
    assert "recorded with a different package versions (fakepkg 1.0 -> 2.0)" in res.stderr
    fresh_imports()


@pytest.mark.parametrize("how", ["copied", "linked"])
def test_a_factory_reached_through_another_folder_is_the_same_model(
        how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Identity by content, as run folders already are: the same files in a copied or
    symlinked folder resume the audit instead of being refused as another model."""
    first = tmp_path / "first"
    first.mkdir()
    (first / "mymodels.py").write_text(FACTORY.format(mode="content"))
    tokens = _tokens(tmp_path)
    out = tmp_path / "out"
    argv = ["audit", "--model", "mymodels:build", "--sites", "gates.*", *tokens,
            "--out", out, *FAST_ARGS]
    monkeypatch.chdir(first)
    sys.modules.pop("mymodels", None)
    assert run_inprocess(argv, capsys).returncode == 0
    before = json.loads((out / "audit.json").read_text())
    other = tmp_path / "other"
    if how == "copied":
        shutil.copytree(first, other)
    else:
        other.symlink_to(first, target_is_directory=True)
    monkeypatch.chdir(other)
    sys.modules.pop("mymodels", None)
    res = run_inprocess(argv, capsys)
    assert res.returncode == 0, res.stderr
    after = json.loads((out / "audit.json").read_text())
    assert after["runtime"]["reuse"]["batches_reused"] == 2
    assert {k: v for k, v in after.items() if k != "runtime"} == \
        {k: v for k, v in before.items() if k != "runtime"}
    sys.modules.pop("mymodels", None)
