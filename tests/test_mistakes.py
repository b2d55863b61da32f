"""A catalogue of user mistakes, each run through the command line as a user would: every
one is refused before any work with exit status 2 and one line that names the option or
input and says what to do, and none is reported as an fcaudit bug. A refused run leaves
no output folder behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import toys
from test_reliability import FAST, TOY, run_folder, run_inprocess  # noqa: F401 (fixture)

TOKENS = ["--tokens", "{eval}", "--calib-tokens", "{calib}"]


def _config(run: Path, tmp: Path, **changes: object) -> Path:
    """A copy of the run folder whose config.json claims other sizes."""
    import shutil
    copy = tmp / "lying-run"
    shutil.copytree(run, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["model_config"].update(changes)
    (copy / "config.json").write_text(json.dumps(cfg))
    return copy


# (name, argv with placeholders, fragment the one line must contain)
MISTAKES: list[tuple[str, list[str], str]] = [
    # --- train
    ("train steps 0", ["train", "--arch", "featuregate", "--steps", "0", "--out", "{out}"],
     "--steps 0: must be"),
    ("train steps negative", ["train", "--arch", "dense", "--steps", "-3", "--out", "{out}"],
     "--steps -3: must be"),
    ("train seed negative", ["train", "--arch", "featuregate", "--seed", "-1", "--out", "{out}"],
     "--seed -1: must be"),
    ("train unknown preset", ["train", "--arch", "featuregate", "--preset", "huge", "--out",
                              "{out}"], "unknown preset 'huge'"),
    ("train device unknown", ["train", "--arch", "featuregate", "--device", "tpu", "--out",
                              "{out}"], "--device 'tpu'"),
    ("train device cuda absent", ["train", "--arch", "featuregate", "--device", "cuda", "--out",
                                  "{out}"], "no CUDA device"),
    ("train out is a file", ["train", "--arch", "featuregate", "--out", "{file}"], "a file"),
    ("train data missing", ["train", "--arch", "featuregate", "--data", "{missing}", "--out",
                            "{out}"], "not found"),
    # --- audit options
    ("bootstrap too few", [*TOY, *TOKENS, "--bootstrap", "5"], "--bootstrap 5"),
    ("bootstrap too many", [*TOY, *TOKENS, "--bootstrap", "10000000"], "--bootstrap 10000000"),
    ("repeats 0", [*TOY, *TOKENS, "--repeats", "0"], "--repeats 0"),
    ("batch size 0", [*TOY, *TOKENS, "--batch-size", "0"], "--batch-size 0"),
    ("timing pairs negative", [*TOY, *TOKENS, "--timing-pairs", "-2"], "--timing-pairs -2"),
    ("timing pairs too few", [*TOY, *TOKENS, "--timing-pairs", "5"], "--timing-pairs 5"),
    ("seed negative", [*TOY, *TOKENS, "--seed", "-1"], "--seed -1"),
    ("max eval 1", [*TOY, *TOKENS, "--max-eval", "1"], "--max-eval 1"),
    ("max calib 0", [*TOY, *TOKENS, "--max-calib", "0"], "--max-calib 0"),
    ("seq len 1", ["--model", "{run}", "--data", "{text}", "--seq-len", "1"], "--seq-len 1"),
    ("device unknown", [*TOY, *TOKENS, "--device", "gpu0"], "--device 'gpu0'"),
    ("device cuda absent", [*TOY, *TOKENS, "--device", "cuda"], "no CUDA device"),
    ("data and tokens", [*TOY, *TOKENS, "--data", "{text}"], "choose one source"),
    ("calib data without data", [*TOY, "--calib-data", "{text}"], "--calib-data needs --data"),
    ("tokens without calib", [*TOY, "--tokens", "{eval}"], "pass both --tokens"),
    # --- audit inputs
    ("out is a file", [*TOY, *TOKENS, "--out", "{file}"], "a file"),
    ("out under a file", [*TOY, *TOKENS, "--out", "{file}/sub"], "under"),
    ("out dangling link", [*TOY, *TOKENS, "--out", "{dangling}"], "link"),
    ("out holds user files", [*TOY, *TOKENS, "--out", "{userdir}"], "did not write"),
    ("sites match nothing", ["--model", "toys:content_model", "--sites", "layers.*.gate",
                             *TOKENS], "matched no module"),
    ("sites twice", [*TOY, "--sites", "gates.*", *TOKENS], "more than once"),
    ("blocks match nothing", [*TOY, *TOKENS, "--blocks", "layers.*"], "matched no module"),
    ("dense missing", [*TOY, *TOKENS, "--dense", "{missing}", "--execution"], "not found"),
    ("dense ignored", [*TOY, *TOKENS, "--dense", "{run}"], "--dense is ignored"),
    ("model missing", ["--model", "{missing}", *TOKENS], "model not found"),
    ("factory not importable", ["--model", "nowhere_pkg:build", "--sites", "x", *TOKENS],
     "cannot import"),
    ("factory not callable", ["--model", "toys:V", "--sites", "x", *TOKENS], "no callable"),
    ("factory needs arguments", ["--model", "toys:pair_sequences", "--sites", "x", *TOKENS],
     "toys:pair_sequences() raised TypeError"),
    ("config zero layers", ["--model", "{lying:n_layer=0}", "--data", "{text}"],
     "n_layer=0 must be a positive integer"),
    ("config heads do not divide", ["--model", "{lying:n_head=3}", "--data", "{text}"],
     "n_head=3 does not divide n_embd=16"),
    ("config vocab 1e9 float", ["--model", "{lying:vocab_size=1e9}", "--data", "{text}"],
     "vocab_size=1000000000.0 must be a positive integer"),
    ("config vocab 1e9", ["--model", "{lying:vocab_size=1000000000}", "--data", "{text}"],
     "come from different models"),
    ("config a million layers", ["--model", "{lying:n_layer=1000000}", "--data", "{text}"],
     "n_layer=1000000 but the weights hold 2 layers"),
    ("truncated npy", [*TOY, "--tokens", "{truncated}", "--calib-tokens", "{calib}"],
     "cut.npy is truncated: its header promises 2048 bytes of [16, 16] int64 ids, the file "
     "holds 2008"),
    ("float npy", [*TOY, "--tokens", "{floats}", "--calib-tokens", "{calib}"], "dtype float"),
    ("tokens out of vocabulary", ["--model", "{run}", "--tokens", "{oov}", "--calib-tokens",
                                  "{calib}"], "vocabulary"),
    # --- reproduce, bench, sites
    ("reproduce seeds 0", ["reproduce", "--seeds", "0", "--out", "{out}"], "--seeds 0"),
    ("reproduce steps 0", ["reproduce", "--steps", "0", "--out", "{out}"], "--steps 0"),
    ("reproduce bootstrap 5", ["reproduce", "--bootstrap", "5", "--out", "{out}"],
     "--bootstrap 5"),
    ("reproduce checkpoint missing", ["reproduce", "--mudd-checkpoint", "{missing}", "--out",
                                      "{out}"], "model not found"),
    ("bench pairs 3", ["bench", "--model", "{run}", "--pairs", "3"], "--pairs 3"),
    ("bench batch 0", ["bench", "--model", "{run}", "--batch-size", "0"], "--batch-size 0"),
    ("bench blocks nothing", ["bench", "--model", "{run}", "--blocks", "layers.*"],
     "--blocks 'layers.*' matched no module"),
    ("sites model missing", ["sites", "--model", "{missing}"], "model not found"),
]


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory, run_folder: Path) -> dict[str, Path]:  # noqa: F811
    root = tmp_path_factory.mktemp("mistakes")
    np.save(root / "eval.npy", toys.pair_sequences(16, 16, 1))
    np.save(root / "calib.npy", toys.pair_sequences(12, 16, 2))
    np.save(root / "floats.npy", toys.pair_sequences(16, 16, 1).astype(float))
    np.save(root / "oov.npy", np.full((4, 16), 9999))
    (root / "cut.npy").write_bytes((root / "eval.npy").read_bytes()[:-40])  # not "truncated"
    (root / "file").write_text("a file of the user's")
    os.symlink(root / "nowhere", root / "dangling")
    (root / "userdir").mkdir()
    (root / "userdir" / "thesis.txt").write_text("years of work")
    return {"root": root, "run": run_folder / "run", "text": run_folder / "text.txt"}


def _argv(template: list[str], places: dict[str, Path], tmp: Path) -> list[str]:
    root = places["root"]
    values = {"eval": root / "eval.npy", "calib": root / "calib.npy", "out": tmp / "out",
              "file": root / "file", "missing": root / "does-not-exist",
              "dangling": root / "dangling", "userdir": root / "userdir",
              "truncated": root / "cut.npy", "floats": root / "floats.npy",
              "oov": root / "oov.npy", "run": places["run"], "text": places["text"]}
    argv = []
    for item in template:
        if item.startswith("{lying:"):
            key, _, value = item[7:-1].partition("=")
            item = str(_config(places["run"], tmp, **{key: json.loads(value)}))
        argv.append(item.format(**{k: str(v) for k, v in values.items()}))
    if argv[0] not in ("train", "reproduce", "bench", "sites"):
        fast = [a for a in FAST if a != "--no-execution" or "--execution" not in argv]
        argv = ["audit", *fast, *(a for a in argv if a != "--execution")]
        if "--out" not in argv:
            argv += ["--out", str(tmp / "out")]
    return argv


@pytest.mark.parametrize("name, template, fragment", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_user_mistake_is_one_clear_line(name: str, template: list[str], fragment: str,
                                        places: dict[str, Path], tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    res = run_inprocess(_argv(template, places, tmp_path), capsys)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1 and lines[0].startswith("fcaudit: error: "), res.stderr
    assert "this is a bug" not in res.stderr and "unexpected" not in res.stderr
    assert fragment in lines[0], lines[0]
    assert not (tmp_path / "out").exists()  # refused before anything was written
    assert (places["root"] / "userdir" / "thesis.txt").read_text() == "years of work"


def test_the_catalogue_is_large() -> None:
    assert len(MISTAKES) >= 50
