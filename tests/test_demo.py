"""The demo's shipped models: pinned files, refused when altered, never mixed with trained
runs in one demo folder; and the thread advice training gives on a busy machine."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
from pathlib import Path

import pytest
from conftest import run_inprocess

from fcaudit.io import demo_models
from fcaudit.io.demo_pins import PINNED
from fcaudit.io.outdir import RUN_FILES
from fcaudit.io.runtime import thread_note
from fcaudit.study import demo

REPO = Path(__file__).resolve().parents[1]


def test_every_shipped_file_is_pinned_packaged_and_small() -> None:
    """The pins are the files' SHA-256 (hashlib here, not fcaudit's reader), every run file
    of both models is pinned, pyproject ships them, and they stay small."""
    section = (REPO / "pyproject.toml").read_text().split("[tool.setuptools.package-data]")[1]
    package_data = re.findall(r'"([^"]+)"', section.split("\n[")[0])  # tomllib: Python 3.11
    total = 0
    for arch in ("featuregate", "dense"):
        folder = REPO / "src" / "fcaudit" / "demo_models" / arch
        assert sorted(PINNED[arch]) == sorted(RUN_FILES)
        for name, digest in PINNED[arch].items():
            data = (folder / name).read_bytes()
            assert hashlib.sha256(data).hexdigest() == digest, (arch, name)
            assert any((folder / name).match(f"fcaudit/{glob}") for glob in package_data), name
            total += len(data)
    assert total < 12 * 2**20  # two float32 models of 1.34M parameters or fewer, and text


def test_the_pins_are_what_the_training_script_writes() -> None:
    """demo_pins.py is byte for byte the module ``python -m fcaudit.study.demo`` writes
    for these digests: nobody edited a pin by hand."""
    pins = REPO / "src" / "fcaudit" / "io" / "demo_pins.py"
    assert demo.pins_module(PINNED) == pins.read_text()
    assert pins.resolve() == demo.PINS


@pytest.fixture
def shipped_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The package's demo_models folder copied, and fcaudit pointed at the copy."""
    copy = tmp_path / "demo_models"
    shutil.copytree(demo_models.SHIPPED, copy)
    monkeypatch.setattr(demo_models, "SHIPPED", copy)
    return copy


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
def test_an_altered_shipped_file_is_refused_in_one_line(name: str, shipped_copy: Path,
                                                        tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    path = shipped_copy / "dense" / name
    data = bytearray(path.read_bytes())
    data[-2] ^= 1  # one bit of the last bytes: a JSON file stays readable
    path.write_bytes(bytes(data))
    out = tmp_path / "demo"
    result = run_inprocess(["demo", "--quiet", "--out", out], capsys)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    found = hashlib.sha256(bytes(data)).hexdigest()[:12]
    assert f"{path} has SHA-256 {found}..., not the pinned {PINNED['dense'][name][:12]}..." \
        in lines[0]
    assert "shipped demo model was altered or corrupted; reinstall fcaudit" in lines[0]
    assert not (out / "dense").exists() and not (out / "audit").exists()


def test_a_missing_shipped_file_is_named(shipped_copy: Path) -> None:
    (shipped_copy / "featuregate" / "tokenizer.json").unlink()
    with pytest.raises(Exception, match=r"featuregate/tokenizer.json is missing: fcaudit's "
                                        "shipped demo model"):
        demo_models.shipped_folder("featuregate")


def test_the_shipped_copy_is_a_run_folder_that_matches_its_pins(tmp_path: Path) -> None:
    from fcaudit.io.loading import load_run
    from fcaudit.io.outdir import owns
    demo.copy_shipped("dense", tmp_path / "dense")
    assert demo_models.pin_mismatch(tmp_path / "dense", "dense") is None
    assert all(owns(tmp_path / "dense", name) for name in RUN_FILES)
    loaded = load_run(tmp_path / "dense")  # the weights' digest in config.json holds too
    presets = json.loads((REPO / "docs" / "results" / "presets.json").read_text())["presets"]
    assert sum(p.numel() for p in loaded.model.parameters()) == \
        presets["dense"]["tiny"]["n_params"] == loaded.run_config["results"]["n_params"]
    assert loaded.run_config["seed"] == demo.SEED and loaded.run_config["preset"] == "tiny"


def _demo_folder_with(tmp_path: Path, trained: bool) -> Path:
    """A demo folder whose featuregate is the shipped copy, or a run that differs from it
    as one trained by ``--train`` does (its log differs, recorded as fcaudit's)."""
    from fcaudit.io.outdir import record_files
    out = tmp_path / "demo"
    demo.copy_shipped("featuregate", out / "featuregate")
    if trained:
        log = out / "featuregate" / "train_log.jsonl"
        log.write_text(log.read_text() + "\n")
        record_files(out / "featuregate", ["train_log.jsonl"])
    return out


def test_demo_refuses_a_folder_of_trained_runs_without_train(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    out = _demo_folder_with(tmp_path, trained=True)
    result = run_inprocess(["demo", "--quiet", "--out", out], capsys)
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert f"{out / 'featuregate'} is not fcaudit's shipped demo model (" in line
    assert "train_log.jsonl has SHA-256" in line
    assert "but a run of `fcaudit demo --train`: pass --train to resume that demo, or choose " \
           "another --out" in line
    assert not (out / "dense").exists() and not (out / "audit").exists()


def test_demo_train_refuses_a_folder_of_the_shipped_models(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    out = _demo_folder_with(tmp_path, trained=False)
    result = run_inprocess(["demo", "--train", "--quiet", "--out", out], capsys)
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert f"{out / 'featuregate'} holds fcaudit's shipped demo model, and --train trains " \
           "afresh: choose another --out" in line
    assert not (out / "dense").exists() and not (out / "audit").exists()


def test_train_trains_both_models_with_the_seed_and_reuses_them(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]
                                                                ) -> None:
    """``--train`` calls training for each model with the demo's seed (training itself is
    tests/test_train.py's), never copies the shipped files, and a rerun reuses its runs."""
    from fcaudit.io.outdir import record_files
    calls = []

    def fake_train(arch: str, preset: str, seed: int, folder: Path, **_: object) -> Path:
        calls.append((arch, preset, seed))
        demo.copy_shipped(arch, folder)  # a run folder, made different from the shipped one
        log = folder / "train_log.jsonl"
        log.write_text(log.read_text() + "\n")
        record_files(folder, ["train_log.jsonl"])
        return folder

    monkeypatch.setattr(demo, "train", fake_train)
    out = tmp_path / "demo"
    runs = demo.demo_runs(out, train_afresh=True, seed=3, progress=False)
    assert calls == [("featuregate", "tiny", 3), ("dense", "tiny", 3)]
    assert runs == {"featuregate": out / "featuregate", "dense": out / "dense"}
    capsys.readouterr()
    assert demo.demo_runs(out, train_afresh=True, seed=3, progress=False) == runs
    assert len(calls) == 2
    assert capsys.readouterr().out.splitlines() == [f"reusing {out / 'featuregate'}",
                                                    f"reusing {out / 'dense'}"]


@pytest.mark.parametrize("train_flag", [[], ["--train"]])
def test_a_demo_model_edited_after_fcaudit_wrote_it_is_refused(train_flag: list[str],
                                                                tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]
                                                                ) -> None:
    out = _demo_folder_with(tmp_path, trained=False)
    config = out / "featuregate" / "config.json"
    config.write_text(config.read_text().replace('"seed": 0', '"seed": 1'))
    result = run_inprocess(["demo", *train_flag, "--quiet", "--out", out], capsys)
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.endswith(f"{out / 'featuregate'}: config.json changed since fcaudit wrote it; "
                         f"remove {out / 'featuregate'} to copy or train that model again, or "
                         "choose another --out")
    assert not (out / "dense").exists() and not (out / "audit").exists()


@pytest.mark.parametrize(("threads", "cores", "load", "chosen", "advised"), [
    (2, 2, 3.93, False, True),   # the shared 2-core machine: 2 threads, no core free
    (2, 2, 0.31, False, False),  # a quiet machine: background noise under half a core
    (2, 2, 0.0, False, False),   # idle: both cores free
    (1, 2, 5.0, False, False),   # one thread never waits for another
    (2, 2, 3.93, True, False),   # OMP_NUM_THREADS set: the user chose
    (8, 8, 1.5, False, True),    # 6.5 cores free for 8 threads
    (4, 8, 1.5, False, False),   # 6.5 free for 4
    (2, 2, 0.6, False, True),    # more than half a core taken by others
])
def test_thread_advice_follows_free_cores(threads: int, cores: int, load: float, chosen: bool,
                                          advised: bool) -> None:
    note = thread_note(threads, cores, load, chosen)
    assert (note is not None) == advised
    if note:
        assert note.startswith(f"the load average is {load:.2f} on {cores} cores, so torch's "
                               f"{threads} threads will wait for each other")
        assert "OMP_NUM_THREADS=1" in note


# The largest change another CPU's float32 rounding made to the shipped demo's audit.json,
# measured: torch's, MKL's and oneDNN's kernels forced to SSE (ATEN_CPU_CAPABILITY=default,
# MKL_ENABLE_INSTRUCTIONS=SSE4_2, ONEDNN_MAX_CPU_ISA=SSE41) against AVX2 on one AMD EPYC moved
# penalties by at most 3.1e-8 nats, retentions by 1.3e-5 percentage points, variance shares
# by 9e-8 points and spreads by 3.3e-10 (rounded up below); 2 threads against 1 gave a
# bitwise-equal audit.json. The README may promise its digits on any CPU only while every
# quoted number lies farther than SAFETY times that from the edge where its rounding
# flips.
MOVED = {"nats": 4e-8, "percent": 2e-5, "share": 1e-9}
# the closest, static-layer retention's lower bound 63.4841 (printed 63.48), lies 46 times
# the bound above from its edge; reassign's lower bound 0.108452 (0.1085), 61 times
SAFETY = 10


def _digits(value: float, significant: int) -> int:
    """Decimals that ``f"{value:.{significant}g}"`` shows."""
    return significant - 1 - math.floor(math.log10(abs(value)))


def _quoted(audit: dict) -> list[tuple[str, float, int, str]]:
    """(name, value, decimals shown, unit) of every number the README's demo table quotes
    but the latency, at the digits docs/doc_blocks.py renders them with."""
    out = []
    for c in ("reassign", "shuffle"):
        cond = audit["conditions"][c]
        out += [(f"{c} {k}", v, 4, "nats") for k, v in
                (("delta", cond["delta"]), ("low", cond["ci95"][0]), ("high", cond["ci95"][1]))]
    for r in ("retention_static_layer", "retention_static_layer_token"):
        ret = audit[r]
        out += [(f"{r} {k}", v, 2, "percent") for k, v in
                (("value", ret["value"]), ("low", ret["ci95"][0]), ("high", ret["ci95"][1]))]
    out += [(f"eta2 {k}", 100 * v, 1, "percent") for k, v in audit["eta2"].items()]
    out += [(k, v, _digits(v, 3), "share") for k, v in audit["variation"].items()]
    return out


def test_no_quoted_demo_number_sits_at_a_rounding_edge() -> None:
    audit = json.loads((REPO / "docs" / "results" / "demo.json").read_text())["audit"]
    quoted = _quoted(audit)
    assert len(quoted) == 20  # with the token-id share's chance level and share beyond it
    for name, value, digits, unit in quoted:
        scaled = value * 10 ** digits
        edge = abs(scaled - math.floor(scaled) - 0.5) / 10 ** digits
        assert edge > SAFETY * MOVED[unit], (name, value, edge)
