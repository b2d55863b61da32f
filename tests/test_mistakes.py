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
from conftest import FAST_ARGS, TOY, run_inprocess

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
                              "{out}"], "--device tpu is not a device"),
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
    ("no tensor-parallel rank", [*TOY, *TOKENS, "--tensor-parallel-size", "0"],
     "--tensor-parallel-size 0"),
    ("tensor parallelism without an engine", [*TOY, *TOKENS, "--tensor-parallel-size", "2"],
     "--tensor-parallel-size 2 is read only with"),
    ("no pipeline stage", [*TOY, *TOKENS, "--pipeline-parallel-size", "0"],
     "--pipeline-parallel-size 0"),
    ("frontier points 1", [*TOY, *TOKENS, "--frontier", "--frontier-points", "1"],
     "--frontier-points 1: must be an integer between 2 and 20"),
    ("min sequences 1", [*TOY, *TOKENS, "--target-ci", "0.1", "--min-sequences", "1"],
     "--min-sequences 1: must be an integer of at least 2"),
    ("frontier without execution", [*TOY, *TOKENS, "--frontier", "--no-execution"],
     "--frontier is read only with the execution audit"),
    ("lm-eval limit 0", [*TOY, *TOKENS, "--lm-eval-tasks", "t", "--lm-eval-limit", "0"],
     "--lm-eval-limit 0: must be an integer at least 1"),
    ("lm-eval tasks none", [*TOY, *TOKENS, "--lm-eval-tasks", ","],
     "give task names, e.g. --lm-eval-tasks arc_easy,piqa"),
    ("frontier points without frontier", [*TOY, *TOKENS, "--frontier-points", "6"],
     "--frontier-points 6 is read only with --frontier or an exit model (its threshold "
     "sweep): add it or drop --frontier-points"),
    ("timing pairs without execution", [*TOY, *TOKENS, "--no-execution", "--timing-pairs",
                                        "20"], "--timing-pairs 20 is read only with the "
                                               "execution audit"),
    ("seed negative", [*TOY, *TOKENS, "--seed", "-1"], "--seed -1"),
    ("max eval 1", [*TOY, *TOKENS, "--max-eval", "1"], "--max-eval 1"),
    ("max calib 0", [*TOY, *TOKENS, "--max-calib", "0"], "--max-calib 0"),
    ("seq len 1", ["--model", "{run}", "--data", "{text}", "--seq-len", "1"], "--seq-len 1"),
    ("device unknown", [*TOY, *TOKENS, "--device", "gpu0"], "--device gpu0 is not a device"),
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
    ("site axes without a layout", [*TOY, *TOKENS, "--site-axes", "gates.*"],
     "give --site-axes GLOB=AXES for each glob of sites (AXES: comma-separated axis names)"),
    ("site axes on no site", [*TOY, *TOKENS, "--site-axes", "blocks.*=example,token*"],
     "--site-axes 'blocks.*=example,token*' matches none of the audited sites"),
    ("site axes starred examples", [*TOY, *TOKENS, "--site-axes", "gates.*=example*,token"],
     "the first axis is the examples axis"),
    ("site axes named twice", [*TOY, *TOKENS, "--site-axes", "gates.*=example,a*,a"],
     "each axis is named once"),
    ("site axes twice, two layouts", [*TOY, *TOKENS, "--site-axes", "gates.*=example,token*",
                                      "--site-axes", "gates.0=example,unit"],
     "site gates.0: --site-axes gives it more than one layout"),
    ("site axes per example on tokens", [*TOY, *TOKENS, "--site-axes", "gates.*=example,unit"],
     "sites without a token axis give --inputs"),
    ("sites are whole blocks", ["--model", "{run}", "--sites", "blocks.*", "--data", "{text}"],
     "site blocks.0 is one of the model's execution blocks and outputs the hidden states"),
    ("blocks match nothing", [*TOY, *TOKENS, "--blocks", "layers.*"], "matched no module"),
    ("blocks never called", ["--model", "toys:spare_model", "--sites", "gates.*", *TOKENS,
                             "--blocks", "spare.*"],
     "--blocks 'spare.*': the model's forward never calls 2 of the 2 modules it names on the "
     "first batch (spare.0, spare.1)"),
    ("blocks partly called", ["--model", "toys:spare_model", "--sites", "gates.*", *TOKENS,
                              "--blocks", "*.1"],
     "--blocks '*.1': the model's forward never calls 1 of the 2 modules it names on the "
     "first batch (spare.1)"),
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
    ("uint64 ids beyond int64", [*TOY, "--tokens", "{uint64}", "--calib-tokens", "{calib}"],
     f"holds token id {2**64 - 5}, beyond any vocabulary"),  # before: shown as -5
    ("repeats a million", [*TOY, *TOKENS, "--repeats", "1000000"],
     "--repeats 1000000: must be an integer between 1 and 100"),
    ("timing pairs too many", [*TOY, *TOKENS, "--timing-pairs", "100000"],
     "--timing-pairs 100000: must be an integer between 0 and 1000"),
    ("seed beyond generators", [*TOY, *TOKENS, "--seed", str(2**64)],
     f"--seed {2**64}: must be an integer between 0 and {2**32 - 1}"),
    ("dense other vocabulary", ["--model", "{run}", "--data", "{text}", "--dense", "{wide}",
                                "--execution"], "is not comparable with the model: for the same"),
    ("demo seed negative", ["demo", "--seed", "-1", "--out", "{out}"],
     "--seed -1: must be an integer"),
    # --- reproduce, bench, sites
    ("reproduce seeds 0", ["reproduce", "--seeds", "0", "--out", "{out}"], "--seeds 0"),
    ("reproduce steps 0", ["reproduce", "--steps", "0", "--out", "{out}"], "--steps 0"),
    ("reproduce bootstrap 5", ["reproduce", "--bootstrap", "5", "--out", "{out}"],
     "--bootstrap 5"),
    ("reproduce checkpoint missing", ["reproduce", "--mudd-checkpoint", "{missing}", "--out",
                                      "{out}"], "model not found"),
    ("reproduce checkpoint not MUDD", ["reproduce", "--mudd-checkpoint", "{run}", "--out",
                                       "{out}"], "is an fcaudit run folder, not a MUDDPythia"),
    ("reproduce checkpoint a factory", ["reproduce", "--mudd-checkpoint", "toys:content_model",
                                        "--out", "{out}"], "is not a folder, not a MUDDPythia"),
    ("bench seq len beyond context", ["bench", "--model", "{run}", "--seq-len", "500"],
     "--seq-len 500 exceeds the context of the model (32 tokens)"),
    ("bench pairs too many", ["bench", "--model", "{run}", "--pairs", "5000"],
     "--pairs 5000: must be between 10 and 1000"),
    ("bench dense other vocabulary", ["bench", "--model", "{run}", "--dense", "{wide}",
                                      "--seq-len", "16"], "is not comparable with the model"),
    ("bench json overwrites a user file", ["bench", "--model", "{run}", "--json", "{file}"],
     "exists and is not a file fcaudit wrote (fcaudit.bench/1)"),
    ("bench pairs 3", ["bench", "--model", "{run}", "--pairs", "3"], "--pairs 3"),
    ("bench batch 0", ["bench", "--model", "{run}", "--batch-size", "0"], "--batch-size 0"),
    ("bench blocks nothing", ["bench", "--model", "{run}", "--blocks", "layers.*"],
     "--blocks 'layers.*' matched no module"),
    ("bench blocks never called", ["bench", "--model", "toys:spare_model", "--dense",
                                   "toys:spare_model", "--blocks", "spare.*", "--seq-len", "8"],
     "--blocks 'spare.*': the model's forward never calls 2 of the 2 modules"),
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
    np.save(root / "uint64.npy", np.full((4, 16), 2**64 - 5, dtype=np.uint64))
    return {"root": root, "run": run_folder / "run", "text": run_folder / "text.txt",
            "wide": _wider_dense(run_folder / "run", root / "wide")}


def _wider_dense(run: Path, folder: Path) -> Path:
    """A dense run folder like ``run`` but with a 100-entry wider vocabulary (head)."""
    import dataclasses

    from fcaudit.io.loading import save_run_model
    from fcaudit.models.featuregate import GPT, GPTConfig
    cfg = json.loads((run / "config.json").read_text())
    model_cfg = GPTConfig(**{**cfg["model_config"], "gated": False,
                             "vocab_size": cfg["model_config"]["vocab_size"] + 100})
    folder.mkdir()
    save_run_model(folder, GPT(model_cfg))
    (folder / "config.json").write_text(json.dumps({**cfg, "arch": "dense", "model_config":
                                                    dataclasses.asdict(model_cfg)}))
    return folder


def _argv(template: list[str], places: dict[str, Path], tmp: Path) -> list[str]:
    root = places["root"]
    values = {"eval": root / "eval.npy", "calib": root / "calib.npy", "out": tmp / "out",
              "file": root / "file", "missing": root / "does-not-exist",
              "dangling": root / "dangling", "userdir": root / "userdir",
              "truncated": root / "cut.npy", "floats": root / "floats.npy",
              "oov": root / "oov.npy", "run": places["run"], "text": places["text"],
              "uint64": root / "uint64.npy", "wide": places["wide"]}
    argv = []
    for item in template:
        if item.startswith("{lying:"):
            key, _, value = item[7:-1].partition("=")
            item = str(_config(places["run"], tmp, **{key: json.loads(value)}))
        argv.append(item.format(**{k: str(v) for k, v in values.items()}))
    if argv[0] not in ("train", "reproduce", "bench", "sites", "demo"):
        fast = [a for a in FAST_ARGS if a != "--no-execution" or "--execution" not in argv]
        argv = ["audit", *fast, *(a for a in argv if a != "--execution")]
        if "--out" not in argv:
            argv += ["--out", str(tmp / "out")]
    return argv


def _cases() -> list:
    """The catalogue as parameters; "no CUDA device" cases only where there is none."""
    import torch
    gpu = torch.cuda.is_available()
    return [pytest.param(*m, id=m[0], marks=pytest.mark.skipif(
        gpu and "no CUDA device" in m[2], reason="this machine has a CUDA device"))
        for m in MISTAKES]


@pytest.mark.parametrize("name, template, fragment", _cases())
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
    assert (places["root"] / "file").read_text() == "a file of the user's"


def test_every_bounded_option_has_a_mistake_case() -> None:
    """Each integer or path option of `fcaudit audit` and `fcaudit train` (read off the
    parser, not from this file) is misused by at least one case of the catalogue."""
    from fcaudit.cli import build_parser
    commands = build_parser()._subparsers._group_actions[0].choices
    used = {a for _, argv, _ in MISTAKES for a in argv if a.startswith("--")}
    wanted = {opt for name in ("audit", "train") for action in commands[name]._actions
              if action.type is int for opt in action.option_strings if opt.startswith("--")}
    assert wanted and wanted <= used, sorted(wanted - used)


# ----------------------------------------------------- the Python API, misused

def _api_data(eval_ids: object = None, calib_ids: object = None) -> object:
    from fcaudit.io.data import AuditData
    ev = toys.pair_sequences(8, 16, 1) if eval_ids is None else eval_ids
    ca = toys.pair_sequences(4, 16, 2) if calib_ids is None else calib_ids
    return AuditData(ev, ca, {})  # type: ignore[arg-type]


def _run_api(**changes: object) -> object:
    from fcaudit import AuditOptions, audit
    kwargs: dict[str, object] = {
        "sites": ["gates.*"], "data": _api_data(),
        "options": AuditOptions(repeats=1, bootstrap=10, per_layer=False, execution=False,
                                progress=False, batch_size=4)}
    return audit(toys.content_model(), **{**kwargs, **changes})


def _coefficients() -> dict[str, object]:
    import torch
    return {"gates.0": torch.rand(4, 6, 2), "gates.1": torch.rand(4, 6, 2)}


def _reassign(donor: object, coefficients: object = None) -> object:
    from fcaudit import reassign
    return reassign(coefficients or _coefficients(), donor)  # type: ignore[arg-type]


def _shuffle(positions: object) -> object:
    from fcaudit import shuffle
    return shuffle(_coefficients(), positions)  # type: ignore[arg-type]


# (name, call, fragment naming the Python argument): each an FcauditError in one line
API_MISTAKES = [
    ("sites a number", lambda: _run_api(sites=5), "audit(sites=...) must be a non-empty list"),
    ("sites a dict", lambda: _run_api(sites={"gates.*": 1}), "audit(sites=...) must be"),
    ("sites empty", lambda: _run_api(sites=[]), "audit(sites=...) must be a non-empty list"),
    ("options a dict", lambda: _run_api(options={"repeats": 1}),
     "audit(options=...) must be fcaudit.AuditOptions(...), not dict"),
    ("data an array", lambda: _run_api(data=toys.pair_sequences(8, 16, 1)),
     "audit(data=...) must be fcaudit.DataSpec(...) or fcaudit.AuditData(...), not ndarray"),
    ("blocks a list", lambda: _run_api(blocks=["gates.*"]),
     "audit(blocks=...) must be one module-path glob string, not list"),
    ("interventions plain functions", lambda: _run_api(interventions=[lambda c, ctx: c]),
     "audit(interventions=...) must be {name: fn} or a list of fcaudit.Intervention"),
    ("intervention not callable", lambda: _run_api(interventions={"mine": 3}),
     "intervention 'mine': give a new name (not a built-in condition or per-layer run)"),
    ("1-D ids", lambda: _run_api(data=_api_data(np.arange(16))),
     "AuditData.eval_ids has shape [16]; expected [N, T]"),
    ("one-token ids", lambda: _run_api(data=_api_data(calib_ids=np.zeros((4, 1), np.int64))),
     "AuditData.calib_ids has shape [4, 1]; expected [N, T] (sequences x tokens) with T >= 2"),
    ("torch tensors", lambda: _run_api(data=_api_data(
        __import__("torch").from_numpy(toys.pair_sequences(8, 16, 1)))),
     "AuditData.eval_ids is a Tensor, not a numpy integer array [N, T] (use "
     "tensor.cpu().numpy())"),
    ("float ids", lambda: _run_api(data=_api_data(np.zeros((8, 16)))),
     "AuditData.eval_ids has dtype float64; token ids must be integers"),
    ("ids beyond int64", lambda: _run_api(data=_api_data(np.full((8, 16), 2**63, np.uint64))),
     f"AuditData.eval_ids holds token id {2**63}, beyond any vocabulary"),
    ("ids out of vocabulary", lambda: _run_api(data=_api_data(np.full((8, 16), 99))),
     f"span [99, 99] but the model's vocabulary has {toys.V} entries"),
    ("empty data", lambda: _run_api(data=_api_data(np.zeros((0, 16), np.int64))),
     "the audit needs at least 2 evaluation sequences of 16 tokens"),
    ("negative repeats", lambda: _run_api(options=__import__("fcaudit").AuditOptions(
        repeats=-1)), "AuditOptions(repeats=-1): must be an integer between 1 and 100"),
    ("repeats a float", lambda: _run_api(options=__import__("fcaudit").AuditOptions(
        repeats=2.5)), "AuditOptions(repeats=2.5): must be an integer"),
    ("schedule unknown", lambda: _run_api(options=__import__("fcaudit").AuditOptions(
        schedule="fast")), "AuditOptions(schedule='fast'): choose one of prefix, naive"),
    ("donor list too short", lambda: _reassign([1, 0]),
     "reassign(donor=...) must be integers in [0, 4) of shape [4] (one per sequence of the "
     "batch), got int64 [2]"),
    ("donor out of range", lambda: _reassign([1, 0, 3, 9]),
     "reassign(donor=...) must be integers in [0, 4)"),
    ("donor floats", lambda: _reassign([1.0, 0.0, 3.0, 2.0]),
     "reassign(donor=...) must be integers in [0, 4) of shape [4] (one per sequence of the "
     "batch), got float64 [4]"),
    ("positions wrong shape", lambda: _shuffle(np.zeros((4, 5), np.int64)),
     "shuffle(positions=...) must be integers in [0, 6) of shape [4, 6]"),
]


@pytest.mark.parametrize("name, call, fragment", API_MISTAKES, ids=[m[0] for m in API_MISTAKES])
def test_python_api_misuse_is_one_clear_error(name: str, call: object, fragment: str) -> None:
    from fcaudit.core.errors import FcauditError
    with pytest.raises(FcauditError) as caught:
        call()  # type: ignore[operator]
    message = str(caught.value)
    assert "\n" not in message and fragment in message, message


def test_a_string_for_sites_is_one_glob() -> None:
    result = _run_api(sites="gates.*")
    assert [s.name for s in result.sites] == ["gates.0", "gates.1"]  # type: ignore[attr-defined]


def test_a_valid_donor_list_still_reassigns() -> None:
    import torch
    coefficients = _coefficients()
    out = _reassign(np.array([1, 0, 3, 2]), coefficients)
    for name, value in coefficients.items():  # type: ignore[union-attr]
        assert torch.equal(out[name], value[[1, 0, 3, 2]])  # type: ignore[index]


# ---------------------------------------------------------- paths and outputs

def test_a_quoted_tilde_is_the_home_folder_not_a_folder_named_tilde(
        places: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("the user's home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    res = run_inprocess(_argv([*TOY, *TOKENS, "--out", "~"], places, tmp_path), capsys)
    assert res.returncode == 2 and f"--out {home} holds files fcaudit did not write" \
        in res.stderr, res.stderr
    assert not (tmp_path / "~").exists()
    res = run_inprocess(_argv([*TOY, *TOKENS, "--out", "~/audit"], places, tmp_path), capsys)
    assert res.returncode == 0, res.stderr
    assert (home / "audit" / "audit.json").is_file() and not (tmp_path / "~").exists()


def test_bench_json_replaces_only_its_own_file(places: dict[str, Path], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", places["run"], "--batch-size", "2", "--seq-len", "8",
            "--json", out]
    for _ in range(2):  # written, then replaced: it is fcaudit's own bench JSON
        res = run_inprocess(argv, capsys)
        assert res.returncode == 0, res.stderr
        assert json.loads(out.read_text())["schema"] == "fcaudit.bench/1"
    out.write_text('{"schema": "mine"}')
    res = run_inprocess(argv, capsys)
    assert res.returncode == 2 and "is not a file fcaudit wrote" in res.stderr, res.stderr
    assert out.read_text() == '{"schema": "mine"}'


def test_quiet_does_not_change_audit_json(places: dict[str, Path], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from conftest import strip_nondeterministic
    audits = []
    for quiet in (True, False):
        out = tmp_path / f"quiet-{quiet}"
        argv = [a for a in _argv([*TOY, *TOKENS, "--out", str(out)], places, tmp_path)
                if quiet or a != "--quiet"]
        assert run_inprocess(argv, capsys).returncode == 0
        audit_json = json.loads((out / "audit.json").read_text())
        assert audit_json["command"].endswith(str(out))
        audits.append({k: v for k, v in strip_nondeterministic(audit_json).items()
                       if k != "command"})
    assert audits[0] == audits[1]  # before: settings.progress was false, then true
