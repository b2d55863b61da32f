"""Every flag of ``fcaudit audit`` takes effect, at the value given, in the part of
``audit.json`` that records it (the flags of ``AuditOptions`` fields are walked by
``test_options_effect.py``); a flag added without an entry here fails the walk. And the
other commands' flags that were once dropped: ``fcaudit sites --inputs`` beside declared
sites runs the probe it feeds, ``fcaudit reproduce --train-data`` for a study that trains
nothing on text is refused before any work. The reference is the value the test gave."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import WORDS, run_inprocess

from fcaudit.cli import build_parser
from fcaudit.engine.options import option_specs

FAST = {"--quiet": True, "--repeats": 1, "--bootstrap": 10, "--no-per-layer": True,
        "--batch-size": 4}
# a flag: (the audit it changes, the flags it sets there, the audit.json part that records
# it, what that part holds then)
Check = Callable[[Any], bool]


def _names(sites: list[dict]) -> list[str]:
    return [s["name"] for s in sites]


FLAGS: dict[str, tuple[str, dict[str, Any], str, Any]] = {
    "model": ("toy", {"--model": "toys:position_model"}, "model.spec", "toys:position_model"),
    "sites": ("toy", {"--sites": ["gates.0"]}, "sites", lambda v: _names(v) == ["gates.0"]),
    "site_axes": ("toy", {"--site-axes": ["gates.*=example,token*,vocab"]}, "sites",
                  lambda v: all(s["axes"] == ["example", "token", "vocab"] for s in v)),
    "tokens": ("toy", {"--tokens": "{eval2}"}, "data.eval_path", "{eval2}"),
    "calib_tokens": ("toy", {"--calib-tokens": "{eval2}"}, "data.calib_path", "{eval2}"),
    "max_eval": ("toy", {"--max-eval": 8}, "data.eval_sequences", 8),
    "max_calib": ("toy", {"--max-calib": 6}, "data.calib_sequences", 6),
    "dtype": ("toy", {"--dtype": "bfloat16"}, "model.dtype", "torch.bfloat16"),
    "dense": ("gated", {"--dense": "toys:dense_gated_model"}, "execution.dense",
              "toys:dense_gated_model"),
    "blocks": ("gated", {"--blocks": "blocks.0"}, "execution.blocks", ["blocks.0"]),
    # cpu is the one device here (cuda absent is refused: test_mistakes.py); it is the
    # device the timing ran on
    "device": ("gated", {"--device": "cpu"}, "execution.timing.device", "cpu"),
    "data": ("run", {"--data": "{text2}"}, "data.eval_path", "{text2}"),
    "calib_data": ("run", {"--calib-data": "{text2}"}, "data.calib_path", "{text2}"),
    "seq_len": ("run", {"--seq-len": 12}, "data.seq_len", 12),
    "inputs": ("images", {"--inputs": "{x2}"}, "data.eval_path", "{x2}"),
    "calib_inputs": ("images", {"--calib-inputs": "{x2}"}, "data.calib_path", "{x2}"),
    "targets": ("images", {"--targets": "{y2}"}, "data.eval_fingerprint", None),
    "calib_targets": ("images", {"--calib-targets": "{y}"}, "data.calib_fingerprint", None),
}
# flags whose effect is not a value in audit.json: where the audit is written, and how a
# failure is shown
OTHER = {"out", "debug"}


@pytest.fixture(scope="module")
def files(run_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    import toys
    import vision_toys as vt
    root = tmp_path_factory.mktemp("flags")
    arrays = {"eval": toys.pair_sequences(16, 16, 1), "calib": toys.pair_sequences(12, 16, 2),
              "eval2": toys.pair_sequences(16, 16, 3)}
    rng = np.random.default_rng(0)
    arrays |= {"x": rng.normal(size=(16, 1, 8, 8)).astype(np.float32),
               "xc": rng.normal(size=(16, 1, 8, 8)).astype(np.float32),
               "x2": rng.normal(size=(16, 1, 8, 8)).astype(np.float32),
               "y": np.arange(16) % vt.CLASSES, "y2": (np.arange(16) + 1) % vt.CLASSES}
    out = {"run": str(run_folder / "run"), "text": str(run_folder / "text.txt"),
           "text2": str(root / "text2.txt")}
    (root / "text2.txt").write_text(" ".join(np.random.default_rng(1).choice(WORDS, 3000)),
                                    encoding="utf-8")
    for name, array in arrays.items():
        np.save(root / f"{name}.npy", array)
        out[name] = str(root / f"{name}.npy")
    return out


BASES: dict[str, dict[str, Any]] = {
    "toy": {"--model": "toys:content_model", "--sites": ["gates.*"], "--tokens": "{eval}",
            "--calib-tokens": "{calib}", "--no-execution": True, **FAST},
    "gated": {"--model": "toys:informative_gated_model", "--tokens": "{eval}",
              "--calib-tokens": "{calib}", **FAST},
    "run": {"--model": "{run}", "--data": "{text}", "--max-eval": 8, "--max-calib": 4,
            "--no-execution": True, **FAST},
    "images": {"--model": "vision_toys:tiny_condconv", "--inputs": "{x}", "--targets": "{y}",
               "--calib-inputs": "{xc}", "--no-execution": True, **FAST},
}


def argv(flags: dict[str, Any], files: dict[str, str]) -> list[str]:
    out: list[str] = []
    for flag, value in flags.items():
        for one in value if isinstance(value, list) else [value]:
            out += [flag] if one is True else [flag, str(one).format(**files)]
    return out


def audit_json(flags: dict[str, Any], files: dict[str, str], out: Path,
               capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    res = run_inprocess(["audit", *argv(flags, files), "--out", out], capsys)
    assert res.returncode == 0, res.stderr
    return json.loads((out / "audit.json").read_text())


def part(content: dict[str, Any], dotted: str) -> Any:
    for key in dotted.split("."):
        content = content.get(key) if isinstance(content, dict) else None
    return content


def audit_flags() -> set[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {a.dest for a in sub.choices["audit"]._actions if a.dest != "help"}


def test_every_flag_of_audit_is_walked() -> None:
    """An option's flag (test_options_effect.py), a flag here, or where the audit goes."""
    options = {f.name for f, _ in option_specs()}
    assert audit_flags() == options | set(FLAGS) | OTHER
    assert not options & set(FLAGS)


@pytest.fixture(scope="module")
def baselines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Each base's audit.json, run once when first asked for."""
    return {}


@pytest.mark.parametrize("dest", sorted(FLAGS))
def test_an_audit_flag_changes_the_part_of_audit_json_that_records_it(
        dest: str, files: dict[str, str], baselines: dict[str, dict[str, Any]],
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base, given, where, holds = FLAGS[dest]
    if base not in baselines:
        baselines[base] = audit_json(BASES[base], files, tmp_path / "before", capsys)
    before = part(baselines[base], where)
    after = part(audit_json({**BASES[base], **given}, files, tmp_path / "after", capsys),
                 where)
    if dest != "device":
        assert before != after, f"--{dest} changed nothing in audit.json {where}"
    if callable(holds):
        assert holds(after), after
    elif holds is not None:
        assert after == (holds.format(**files) if isinstance(holds, str) else holds), after


def test_out_and_debug(files: dict[str, str], tmp_path: Path,
                       capsys: pytest.CaptureFixture[str]) -> None:
    """``--out``: the audit is written there; ``--debug``: a refusal raises (its
    traceback) instead of the one line."""
    assert audit_json(BASES["toy"], files, tmp_path / "here", capsys)["model"]["spec"] == \
        "toys:content_model"
    bad = ["audit", *argv({**BASES["toy"], "--max-eval": 1}, files), "--out", tmp_path / "x"]
    assert run_inprocess(bad, capsys).returncode == 2
    from fcaudit.core.errors import UsageError
    with pytest.raises(UsageError, match=r"max_eval=1\)"):
        run_inprocess([*bad, "--debug"], capsys)


def test_sites_inputs_beside_declared_sites_runs_the_probe(
        files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    """Before, ``--inputs`` was read only when the model declared no sites (or with
    ``--all``), and dropped otherwise; now it runs the probe it feeds, which also judges
    the declared site's kind (the images it takes, not token ids, let it run)."""
    plain = run_inprocess(["sites", "--model", "vision_toys:tiny_condconv"], capsys)
    fed = run_inprocess(["sites", "--model", "vision_toys:tiny_condconv", "--inputs",
                         files["x"]], capsys)
    assert plain.returncode == fed.returncode == 0, fed.stderr
    declared = "route\tfamily=mixing\tlayer=0\tadapter=tensor\t{}axes=example,kernel"
    assert plain.stdout.splitlines()[0] == declared.format("")  # no probe: no kind said
    # the route's softmax weights the K kernels of each example
    assert fed.stdout.splitlines()[0] == declared.format("kind=mixing weights\t")
    assert "likely controllers of" not in plain.stdout
    assert "likely controllers of" in fed.stdout, fed.stdout


@pytest.mark.parametrize("preset", ["vision"])
def test_reproduce_train_data_without_a_run_of_text_is_refused(
        preset: str, files: dict[str, str], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "study"
    res = run_inprocess(["reproduce", "--preset", preset, "--train-data", files["text"],
                         "--out", out, "--quiet"], capsys)
    line = res.stderr.strip()
    assert res.returncode == 2 and "\n" not in line, res.stderr
    assert line == (f"fcaudit: error: --train-data {files['text']}: the {preset} study trains "
                    "no model on text (its runs learn the digits or a synthetic task): drop it")
    assert not out.exists()


def test_train_data_reaches_only_the_runs_of_text() -> None:
    """The exit study trains two language models and a digits classifier: before, the
    text reached the classifier's training too, which refused it after the first two
    groups had trained."""
    from fcaudit.study.reproduce import study
    from fcaudit.study.train import reads_text
    assert {g.arch: reads_text(g.arch, g.task) for g in study("exit", 1)} == \
        {"earlyexit": True, "ponder": True, "branchy": False}
    assert [reads_text(g.arch, g.task) for g in study("ssm", 1)] == [True, False]
    assert not any(reads_text(g.arch, g.task) for g in study("vision", 1))
