"""Models bigger than memory: accelerate's big-model dispatch (``--device-map auto``).

Tiny random Mixtral and Qwen2-MoE folders (built here with ``save_pretrained``) are audited
with a ``--max-memory`` budget so small that some or all layers go to disk, where
accelerate's ``AlignDevicesHook`` reads each module's weights in per call and leaves them on
the meta device in between. The audit must be the in-memory audit's, bit for bit outside
``runtime``: recording, router stubs, prefix reuse and expert counting all run through the
hooks. Every mistake a user can make with the options is refused before any work.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import FAMILIES, optional_extra, save, strip_nondeterministic, token_batches

transformers = optional_extra("transformers")
optional_extra("accelerate")

from fcaudit import AuditOptions, audit  # noqa: E402
from fcaudit.cli import main  # noqa: E402
from fcaudit.core.errors import FcauditError  # noqa: E402
from fcaudit.io.data import load_tokenizer  # noqa: E402
from fcaudit.io.placement import MARKER, parse_max_memory  # noqa: E402

LAYERS = 4
# bytes of CPU memory: the 4-layer models take about 480 KB in float32, so the first
# budget holds no module (everything on disk) and the second about a third of them
BUDGETS = {"all-on-disk": 50_000, "part-on-disk": 300_000}


def four_layers(family: str) -> Any:
    config = FAMILIES[family][0]()
    return type(config)(**{**config.to_dict(), "num_hidden_layers": LAYERS,
                           "layer_types": None})


def model_and_args(family: str, root: Path) -> tuple[Path, list[str]]:
    """A saved 4-layer model and the arguments of a small audit of it (per-layer runs on,
    for prefix reuse; expert ablation off, which only repeats the replays per expert)."""
    folder = save(four_layers(family), root / "model")
    ev, ca = token_batches(load_tokenizer(folder / "tokenizer.json"))
    np.save(root / "eval.npy", ev.numpy())
    np.save(root / "calib.npy", ca.numpy())
    return folder, ["--model", str(folder), "--tokens", str(root / "eval.npy"),
                    "--calib-tokens", str(root / "calib.npy"), "--quiet", "--repeats", "1",
                    "--bootstrap", "10", "--batch-size", "2", "--timing-pairs", "0",
                    "--no-expert-ablation"]


# Qwen2-MoE (routers and shared-expert gates, every layer read from disk) is the slow one
@pytest.fixture(scope="module", params=["mixtral",
                                        pytest.param("qwen2_moe", marks=pytest.mark.slow)])
def moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
        ) -> tuple[Path, list[str], dict]:
    """(model folder, audit arguments, the in-memory audit.json) for one family."""
    root = tmp_path_factory.mktemp(request.param)
    folder, args = model_and_args(request.param, root)
    assert main(["audit", *args, "--out", str(root / "memory")]) == 0
    return folder, args, json.loads((root / "memory" / "audit.json").read_text())


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A model folder and audit arguments, for the refusals (no audit run)."""
    return model_and_args("mixtral", tmp_path_factory.mktemp("mixtral"))


def check_same_audit(in_memory: dict, offloaded: dict, budget: int) -> None:
    placed = offloaded["runtime"]["placement"]
    assert placed["max_memory_bytes"] == {"cpu": budget}
    per_device = placed["modules_per_device"]
    assert per_device.get("disk", 0) > 0  # the budget really sent modules to disk
    assert offloaded["identity_replay_max_abs_diff"] == 0.0 and "identity" not in offloaded
    # per-layer runs took their prefix from cached block outputs on both sides
    for side in (in_memory, offloaded):
        assert side["runtime"]["schedule"]["batches_prefix_reused"] > 0
        assert side["execution"]["measured"]
    assert strip_nondeterministic(offloaded) == strip_nondeterministic(in_memory)


@pytest.mark.parametrize("where", list(BUDGETS))
def test_offloaded_audit_equals_the_in_memory_audit(moe: tuple[Path, list[str], dict],
                                                    where: str, tmp_path: Path) -> None:
    folder, args, in_memory = moe
    offload = tmp_path / "new" / "parents" / "offload"  # fcaudit makes all three: removes them
    assert main(["audit", *args, "--out", str(tmp_path / "out"), "--device-map", "auto",
                 "--max-memory", f"cpu={BUDGETS[where]}", "--offload-folder",
                 str(offload)]) == 0
    offloaded = json.loads((tmp_path / "out" / "audit.json").read_text())
    if where == "all-on-disk":
        assert offloaded["runtime"]["placement"]["modules_per_device"] == {"disk": 1}
    else:
        assert offloaded["runtime"]["placement"]["modules_per_device"]["cpu"] > 0
    check_same_audit(in_memory, offloaded, BUDGETS[where])
    assert not (tmp_path / "new").exists() and (tmp_path / "out").is_dir()


def test_python_api_places_the_model_and_keeps_a_given_folder(
        moe: tuple[Path, list[str], dict], tmp_path: Path) -> None:
    """``AuditOptions(device_map=..., max_memory=..., offload_folder=...)``: the same audit;
    an empty folder the user made is left in place, empty again."""
    folder, args, in_memory = moe
    tokens = dict(zip(("eval", "calib"), (Path(args[args.index(flag) + 1])
                                          for flag in ("--tokens", "--calib-tokens")),
                      strict=True))
    from fcaudit import DataSpec
    offload = tmp_path / "mine"
    offload.mkdir()
    budget = BUDGETS["part-on-disk"]
    options = AuditOptions(repeats=1, bootstrap=10, batch_size=2, timing_pairs=0,
                           progress=False, expert_ablation=False, device_map="auto",
                           max_memory={"cpu": f"{budget}B"}, offload_folder=offload)
    audit(str(folder), tmp_path / "out", options=options, report=False,
          data=DataSpec(tokens=tokens["eval"], calib_tokens=tokens["calib"]))
    offloaded = json.loads((tmp_path / "out" / "audit.json").read_text())
    check_same_audit(in_memory, offloaded, budget)
    assert offload.is_dir() and list(offload.iterdir()) == []
    assert "device_map" not in offloaded["settings"]  # where weights sit changes no number


def fails(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fcaudit: error: ") and "\n" not in err
    return err


@pytest.mark.parametrize(("budget", "says"), [
    ("cpu8GiB", "DEVICE=SIZE pairs"), ("gpu=1GiB", "'gpu' is not a device"),
    ("cpu=lots", "'lots' is not a size"), ("cpu=1GiB,cpu=2GiB", "cpu is given twice"),
    ("cpu=0", "'0' is not a size"), ("cpu=2XB", "'2XB' is not a size"),
    ("cpu=1GiB,", "DEVICE=SIZE pairs")])
def test_bad_max_memory_is_refused_before_any_work(budget: str, says: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    err = fails(["audit", "--model", str(tmp_path), "--out", str(tmp_path / "out"),
                 "--device-map", "auto", "--max-memory", budget], capsys)
    assert says in err and f"--max-memory {budget}" in err
    assert not (tmp_path / "out").exists()


def test_max_memory_units() -> None:
    """Sizes by hand: decimal and binary units, fractions, plain bytes, GPUs by index."""
    assert parse_max_memory("cpu=8GiB,cuda:0=70GB,1=1.5MiB,disk=12") == {
        "cpu": 8 * 1024**3, 0: 70 * 10**9, 1: 1572864, "disk": 12}
    assert parse_max_memory({"cpu": "500MB"}) == {"cpu": 500_000_000}


def test_a_budget_below_the_weights_needs_an_offload_folder(
        mixtral: tuple[Path, list[str]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    _, args = mixtral
    err = fails(["audit", *args, "--out", str(tmp_path / "out"), "--device-map", "auto",
                 "--max-memory", "cpu=100KB"], capsys)
    assert "--offload-folder DIR" in err and "0.00 GiB outside disk" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("state", ["no marker", "marker of another audit",
                                   "marker listing other files"])
def test_a_folder_holding_what_fcaudit_did_not_write_is_refused_and_kept(
        mixtral: tuple[Path, list[str]], state: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    _, args = mixtral
    offload = tmp_path / "offload"
    offload.mkdir()
    (offload / "notes.txt").write_text("mine")
    if state != "no marker":
        (offload / MARKER).write_text(json.dumps({"pid": None, "created": True,
                                                  "files": ["other.safetensors"]}))
    err = fails(["audit", *args, "--out", str(tmp_path / "out"), "--device-map", "auto",
                 "--max-memory", "cpu=50KB", "--offload-folder", str(offload)], capsys)
    assert "fcaudit did not write (e.g. notes.txt)" in err
    assert (offload / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "out").exists()


def test_a_folder_in_use_by_a_live_audit_is_refused(mixtral: tuple[Path, list[str]],
                                                    tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    _, args = mixtral
    offload = tmp_path / "offload"
    offload.mkdir()
    (offload / "w.safetensors").write_bytes(b"x")
    (offload / MARKER).write_text(json.dumps({"pid": os.getppid(), "created": False,
                                              "files": ["w.safetensors"]}))
    err = fails(["audit", *args, "--out", str(tmp_path / "out"), "--device-map", "auto",
                 "--max-memory", "cpu=50KB", "--offload-folder", str(offload)], capsys)
    assert f"in use by another fcaudit process (pid {os.getppid()})" in err
    assert (offload / "w.safetensors").read_bytes() == b"x"


def test_what_a_crashed_audit_left_is_cleared_and_the_folder_reused(
        mixtral: tuple[Path, list[str]], tmp_path: Path) -> None:
    """A marker whose process is gone, listing exactly the files there: fcaudit's own."""
    _, args = mixtral
    offload = tmp_path / "offload"
    offload.mkdir()
    (offload / "old.safetensors").write_bytes(b"stale")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (offload / MARKER).write_text(json.dumps({"pid": int(dead), "created": True,
                                              "files": ["old.safetensors"]}))
    assert main(["audit", *args, "--no-per-layer", "--no-execution", "--out",
                 str(tmp_path / "out"), "--device-map", "auto", "--max-memory", "cpu=50KB",
                 "--offload-folder", str(offload)]) == 0
    offloaded = json.loads((tmp_path / "out" / "audit.json").read_text())
    assert offloaded["runtime"]["placement"]["modules_per_device"] == {"disk": 1}
    assert offloaded["identity_replay_max_abs_diff"] == 0.0
    assert not offload.exists()  # the crashed audit had created it


@pytest.mark.parametrize(("extra", "says"), [
    (["--max-memory", "cpu=1GiB"], "--max-memory cpu=1GiB is read only with --device-map auto"),
    (["--offload-folder", "x"], "--offload-folder x is read only with --device-map auto"),
    (["--device-map", "auto", "--device", "cuda"], "drop --device cuda"),
])
def test_placement_options_that_cannot_apply(extra: list[str], says: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    err = fails(["audit", "--model", str(tmp_path), "--out", str(tmp_path / "out"), *extra],
                capsys)
    assert says in err


def test_device_map_needs_a_hugging_face_folder(run_folder: Path, tmp_path: Path) -> None:
    with pytest.raises(FcauditError, match="loads a local Hugging Face model folder"):
        audit(str(run_folder), tmp_path / "out",
              options=AuditOptions(device_map="auto", progress=False))
    assert not (tmp_path / "out").exists()


def test_without_accelerate_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setitem(sys.modules, "accelerate", None)  # import fails as if not installed
    with pytest.raises(FcauditError, match=r'pip install -e "\.\[hf\]" in the fcaudit clone'):
        AuditOptions(device_map="auto").validate()


def test_weights_read_from_disk_sit_where_in_memory_weights_do(
        mixtral: tuple[Path, list[str]], tmp_path: Path) -> None:
    """Every tensor accelerate reads in for a module on disk is a fresh torch allocation
    (64-byte aligned, as the in-memory weights are), bitwise the in-memory weight: a view
    into the memory-mapped file sits at the header's offset, and CPU kernels choose their
    path, hence the last bits, by alignment (a 1024-wide MoE's audit differed by 1e-8)."""
    import torch

    from fcaudit.io.hf import load_hf_folder
    from fcaudit.io.placement import AlignedWeights, offload_space, placement
    folder, _ = mixtral
    whole, _, _ = load_hf_folder(folder)
    expected = dict(whole.named_parameters())
    place = placement("auto", {"cpu": "50KB"}, tmp_path / "offload")
    with offload_space(place):
        model, _, _ = load_hf_folder(folder, placement=place)
        checked = set()
        for path, module in model.named_modules():
            hook = getattr(module, "_hf_hook", None)
            if getattr(hook, "weights_map", None) is None:
                continue
            assert isinstance(hook.weights_map, AlignedWeights)
            for name, _ in module.named_parameters(recurse=False):
                value = hook.weights_map[name]
                full = f"{path}.{name}" if path else name
                assert value.data_ptr() % 64 == 0, full
                assert torch.equal(value, expected[full]), full
                checked.add(full)
    assert checked == set(expected)  # every parameter was on disk and was checked


# where the offload folder is given (relative to the test's folder) -> the one line's words
MISPLACED = {
    "under a file": ("notes.txt/offload", "lies under {root}/notes.txt, which is a file"),
    "a file": ("notes.txt", "--offload-folder {root}/notes.txt is a file, not a folder"),
    "the output folder": ("out", "--offload-folder {root}/out is --out {root}/out, the "
                                 "audit's output folder; give an offload folder outside it"),
    "inside the output folder": ("out/offload", "--offload-folder {root}/out/offload lies "
                                                "inside --out {root}/out"),
    "holding the output folder": ("", "--out {root}/out lies inside --offload-folder {root}, "
                                      "whose files fcaudit removes after the audit"),
}


@pytest.mark.parametrize("case", list(MISPLACED))
def test_a_misplaced_offload_folder_is_refused_before_any_work(
        mixtral: tuple[Path, list[str]], case: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    _, args = mixtral
    given, words = MISPLACED[case]
    (tmp_path / "notes.txt").write_text("mine")
    before = sorted(tmp_path.rglob("*"))
    err = fails(["audit", *args, "--out", str(tmp_path / "out"), "--device-map", "auto",
                 "--max-memory", "cpu=50KB", "--offload-folder", str(tmp_path / given)],
                capsys)
    assert words.format(root=tmp_path) in err, err
    assert sorted(tmp_path.rglob("*")) == before  # no output, no offload folder, no marker
    assert (tmp_path / "notes.txt").read_text() == "mine"


def as_nobody(call: Callable[[], object]) -> str:
    """``call()`` in a forked child, as the user nobody when run as root (root may write
    anywhere): the one-line FcauditError it raised, or "" when it raised none."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        message = ""
        try:
            os.close(read)
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            call()
        except FcauditError as exc:
            message = str(exc)
        finally:
            os.write(write, message.encode())
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as fh:
        message = fh.read()
    os.waitpid(pid, 0)
    return message


def test_a_read_only_offload_folder_is_refused_before_any_work() -> None:
    base = Path(tempfile.mkdtemp())  # in /tmp, so that nobody can reach it
    try:
        os.chmod(base, 0o755)
        (base / "ro").mkdir(mode=0o555)
        for folder in (base / "ro", base / "ro" / "new" / "offload"):
            options = AuditOptions(device_map="auto", offload_folder=folder)
            message = as_nobody(options.validate)
            assert "\n" not in message and f"offload_folder={str(folder)!r}" in message, message
            assert "not writable" in message and str(base / "ro") in message, message
        assert list((base / "ro").iterdir()) == []
    finally:
        shutil.rmtree(base)


def test_only_the_parents_fcaudit_created_are_removed(tmp_path: Path) -> None:
    """Missing parents are made and removed again, up to the first that existed; one the
    user put a file in meanwhile stays with it."""
    from fcaudit.io.placement import Placement, offload_space
    (tmp_path / "kept").mkdir()
    for mine in (None, "p1/mine.txt"):
        root = tmp_path / "kept"
        folder = root / "p1" / "p2" / "offload"
        with offload_space(Placement("auto", None, folder), tmp_path / "out"):
            assert folder.is_dir() and (folder / MARKER).is_file()
            (folder / "w.safetensors").write_bytes(b"x")  # what loading writes
            if mine:
                (root / mine).write_text("mine")
        if mine is None:
            assert list(root.iterdir()) == []  # p1, p2 and the folder: fcaudit's, gone
        else:
            assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) == \
                ["p1", "p1/mine.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]
