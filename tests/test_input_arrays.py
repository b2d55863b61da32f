"""Arrays and model inputs a user can get wrong: each is refused in one line that
names the array, says what it holds and what the model takes, through the command line
(exit 2, no output folder) and the Python API alike; none is reported as an fcaudit bug.
Every rule lives in one module (fcaudit/core/arrays.py), so each case here stands for its
class: a run folder's inputs against what it takes, token ids, targets, a model raising
on inputs it cannot take, an objective's losses, a module tree, static profiles."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import toys
import vision_toys as vt
from conftest import FAST_ARGS, run_inprocess, toy_data

import fcaudit
from fcaudit import AuditData, AuditOptions, StaticProfiles, static
from fcaudit.core.errors import FcauditError

FAST = dict(bootstrap=10, repeats=1, execution=False, progress=False, batch_size=8,
            per_layer=False)
BIG = 2**64 - 5  # an unsigned id that a cast to int64 shows as -5


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory, run_folder: Path) -> dict[str, Path]:
    """A vision run folder (a random CondConv, written as `fcaudit train` writes one), the
    hand-made language run of conftest (context 32), and the arrays the cases feed."""
    from fcaudit.io.loading import get_arch, save_run_model
    root = tmp_path_factory.mktemp("inputs")
    arch = get_arch("condconv")
    cfg = arch.config("tiny")
    torch.manual_seed(0)
    vision = root / "vision-run"
    vision.mkdir()
    save_run_model(vision, arch.build(cfg))
    (vision / "config.json").write_text(json.dumps({
        "fcaudit_run": 1, "arch": "condconv", "preset": "tiny", "seed": 0,
        "model_config": dataclasses.asdict(cfg)}))
    rng = np.random.default_rng(0)
    x = rng.random((16, 1, 8, 8), dtype=np.float32)
    xc = rng.random((8, 1, 8, 8), dtype=np.float32)
    y = np.arange(16) % 10
    arrays = {"x": x, "xc": xc, "y": y, "x64": x.astype(np.float64),
              "xc64": xc.astype(np.float64),
              "xflat": x.reshape(16, 64), "x9": rng.random((16, 1, 9, 9), dtype=np.float32),
              "ids": rng.integers(0, 50, (16, 16)),
              "ids3d": rng.integers(0, 50, (16, 16, 1)), "idsc": rng.integers(50, 99, (8, 16)),
              "x1d": x[:8, 0, 0, 0].copy(),
              "x0d": np.float64(3.0), "ybig": np.full(16, BIG, np.uint64),
              "yu32": y.astype(np.uint32), "long": rng.integers(0, 50, (16, 40)),
              "longc": rng.integers(0, 50, (8, 40))}
    for name, arr in arrays.items():
        np.save(root / f"{name}.npy", arr)
    header = repr({"descr": "<i8", "fortran_order": False, "shape": (2**40, 2**40)}).encode()
    header += b" " * (-(10 + len(header) + 1) % 64) + b"\n"
    (root / "huge.npy").write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little")
                                    + header + bytes(64))
    return {"root": root, "vision": vision, "lm": run_folder / "run"}


def _cli(places: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
         model: str, *args: str) -> tuple[int, str]:
    """Run `fcaudit audit`; the return code and the stderr of a refused run."""
    root, execution = places["root"], "--execution" in args
    fast = [a for a in FAST_ARGS if a != "--no-execution" or not execution]
    argv = ["audit", "--model", str(places.get(model, model)), "--out", str(tmp_path / "out"),
            *fast, *(str(root / a) if a.endswith(".npy") else a for a in args
                     if a != "--execution")]
    res = run_inprocess(argv, capsys)
    return res.returncode, res.stderr


VISION = "the vision run {vision} takes images float32 [N, 1, 8, 8]"
# (name, model, args, fragment of the one line; {vision} / {lm}: the run folders)
CLI_CASES = [
    ("float64 images into a vision run", "vision",
     ["--inputs", "x64.npy", "--targets", "y.npy", "--calib-inputs", "xc.npy"],
     f"--inputs holds float64 [16, 1, 8, 8], but {VISION} (cast: x.astype(np.float32))"),
    ("flattened images", "vision",
     ["--inputs", "xflat.npy", "--targets", "y.npy", "--calib-inputs", "xc.npy"],
     f"--inputs holds float32 [16, 64], but {VISION} (reshape: x.reshape(-1, 1, 8, 8))"),
    ("images of another size", "vision",
     ["--inputs", "x9.npy", "--targets", "y.npy", "--calib-inputs", "xc.npy"],
     f"--inputs holds float32 [16, 1, 9, 9], but {VISION} (each example must be [1, 8, 8])"),
    ("token ids into a vision run", "vision",
     ["--inputs", "ids.npy", "--targets", "y.npy", "--calib-inputs", "xc.npy"],
     f"--inputs holds int64 [16, 16], but {VISION} (cast: x.astype(np.float32), each "
     "example must be [1, 8, 8])"),
    ("1-d calibration inputs", "vision",
     ["--inputs", "x.npy", "--targets", "y.npy", "--calib-inputs", "x1d.npy"],
     f"--calib-inputs holds float32 [8], but {VISION}"),
    ("0-d inputs", "vision",
     ["--inputs", "x0d.npy", "--targets", "y.npy", "--calib-inputs", "xc.npy"],
     "--inputs has shape [] (float64); give real arrays with the examples on the first axis"),
    ("uint64 targets beyond int64", "vision",
     ["--inputs", "x.npy", "--targets", "ybig.npy", "--calib-inputs", "xc.npy"],
     f"--targets holds the value {BIG}, beyond int64"),  # before: "min_all" not implemented
    ("images into a language run", "lm",
     ["--inputs", "x.npy", "--targets", "y.npy", "--calib-inputs", "xc.npy"],
     "--inputs holds float32 [16, 1, 8, 8], but the language run {lm} takes token ids, "
     "integers [N, T]: give them as --tokens and --calib-tokens"),
    ("token arrays longer than the context", "lm", ["--tokens", "long.npy", "--calib-tokens",
                                                    "longc.npy"],
     "sequence length 40 exceeds the model's context of 32 tokens; re-cut the token arrays "
     "into windows of at most 32 tokens"),  # before: "use --seq-len 32", which they refuse
    ("token ids [N, T, 1]", "lm", ["--tokens", "ids3d.npy", "--calib-tokens", "longc.npy"],
     "ids3d.npy has shape [16, 16, 1]; expected [N, T] (sequences x tokens) with T >= 2 (drop "
     "the trailing axis of length 1: ids[..., 0])"),
    ("a huge .npy header", "lm", ["--tokens", "huge.npy", "--calib-tokens", "longc.npy"],
     f"is truncated: its header promises {2**83} bytes of [{2**40}, {2**40}] int64 ids, "
     "the file holds 64"),  # before: "needs pickle to load"
    ("float64 images into a factory model", "vision_toys:tiny_condconv",
     ["--inputs", "x64.npy", "--targets", "y.npy", "--calib-inputs", "xc64.npy"],
     "the model raised RuntimeError on the first evaluation batch (float64 [4, 1, 8, 8]): "
     "mat1 and mat2 must have the same dtype"),
    ("float64 images into a factory model and its --dense twin", "vision_toys:tiny_condconv",
     ["--inputs", "x64.npy", "--targets", "y.npy", "--calib-inputs", "xc64.npy", "--dense",
      "vision_toys:tiny_condconv", "--execution"],  # the twin is probed before the audit
     "the model raised RuntimeError on the first evaluation example (float64 [1, 1, 8, 8])"),
    ("a model that contains itself", "toys:self_containing_model",
     ["--sites", "gates.*", "--tokens", "ids.npy", "--calib-tokens", "longc.npy"],
     "ToyModel's module tree contains itself: gates.0.owner is the model itself"),
]


@pytest.mark.parametrize("name, model, args, fragment", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_refuses_in_one_line(name: str, model: str, args: list[str], fragment: str,
                                 places: dict[str, Path], tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, stderr = _cli(places, tmp_path, capsys, model, *args)
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("fcaudit: error: "), stderr
    assert "this is a bug" not in stderr and "unexpected" not in stderr
    assert fragment.format(vision=places["vision"], lm=places["lm"]) in lines[0], lines[0]
    assert "--seq-len" not in lines[0] or "--data" in args
    assert not (tmp_path / "out").exists()


def test_unsigned_targets_are_their_values(places: dict[str, Path], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """uint32 targets (before: a crash in torch's min) audit exactly as their int64 values."""
    audits = []
    for targets in ("yu32.npy", "y.npy"):
        out = tmp_path / targets
        res = run_inprocess(["audit", "--model", places["vision"], "--out", out, *FAST_ARGS,
                             "--inputs", places["root"] / "x.npy", "--targets",
                             places["root"] / targets, "--calib-inputs",
                             places["root"] / "xc.npy"], capsys)
        assert res.returncode == 0, res.stderr
        audits.append(json.loads((out / "audit.json").read_text())["conditions"])
    assert audits[0] == audits[1]


def test_a_vision_run_loaded_in_bfloat16_audits_its_own_digits(places: dict[str, Path],
                                                               tmp_path: Path) -> None:
    """--dtype bfloat16: the run's digits are fed in the model's dtype (the pixels k/16
    are exact in it); before, a raw "mat1 and mat2 must have the same dtype"."""
    from fcaudit.io.loading import load
    r = fcaudit.audit(load(str(places["vision"]), torch.bfloat16),
                      data=fcaudit.DataSpec(max_eval=8, max_calib=8),
                      options=AuditOptions(objective="classification", **FAST))
    assert r.identity_replay_max_abs_diff == 0.0 and r.data["eval_examples"] == 8


def test_the_window_line_names_the_option_that_changes_it(
        places: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Token arrays set their width (--seq-len cannot change it); a Python caller reads
    DataSpec(seq_len=...), not the command line's flag."""
    res = run_inprocess(["audit", "--model", places["lm"], "--out", tmp_path / "out",
                         *FAST_ARGS, "--tokens", places["root"] / "ids.npy", "--calib-tokens",
                         places["root"] / "idsc.npy"], capsys)
    assert res.returncode == 0, res.stderr
    assert "scoring windows of 16 tokens (the width of the --tokens arrays; re-cut the arrays " \
        "to change)" in " ".join(res.stdout.split())  # before: "--seq-len to change"
    fcaudit.audit(str(places["lm"]), data=fcaudit.DataSpec(
        text=str(places["lm"].parent / "text.txt"), max_eval=4, max_calib=4),
        options=AuditOptions(**{**FAST, "progress": True}))
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith("fcaudit: scoring windows of 16 tokens (the run's training "
                            "length; DataSpec(seq_len=...) to change)"), first
    assert "4 of 332, spread evenly (DataSpec(max_eval=...) to change)" in first, first


def test_python_inputs_into_a_run_are_named_in_python_words(places: dict[str, Path]) -> None:
    x = np.random.default_rng(0).random((16, 1, 8, 8))
    with pytest.raises(FcauditError) as caught:
        fcaudit.audit(str(places["vision"]), data=AuditData(
            inputs=x, targets=np.arange(16) % 10, calib_inputs=x[:8].astype(np.float32) + 1),
            options=AuditOptions(objective="classification", **FAST))
    assert str(caught.value) == (
        f"AuditData.inputs holds float64 [16, 1, 8, 8], but the vision run {places['vision']} "
        "takes images float32 [N, 1, 8, 8] (cast: x.astype(np.float32))")


# ------------------------------------------------------------------ the Python API

IDS = torch.from_numpy(toys.pair_sequences(4, 16, 1))


def _recorded() -> tuple[fcaudit.Recording, StaticProfiles]:
    rec = fcaudit.record(toys.content_model(), IDS, ["gates.*"])
    profiles = StaticProfiles(list(rec.sites))
    profiles.add(rec)
    return rec, profiles


def _static(coefficients: object = None, condition: str = "static-layer",
            profiles: object = None, ids: object = None) -> object:
    rec, fitted = _recorded()
    return static(rec if coefficients is None else coefficients,  # type: ignore[arg-type]
                  fitted if profiles is None else profiles, condition, ids)  # type: ignore


def _record(ids: object) -> object:
    return fcaudit.record(toys.content_model(), ids, ["gates.*"])  # type: ignore[arg-type]


def _add_shorter() -> None:
    rec, profiles = _recorded()
    profiles.add({k: v[:, :8] for k, v in rec.items()})


API_CASES = [
    ("record float ids", lambda: _record(IDS.float()),
     "the model raised RuntimeError on record(input_ids=...) (float32 [4, 16]): one_hot is only "
     "applicable to index tensor of type LongTensor; give inputs of the shape and dtype the "
     "model takes; if these are token ids, they must be integers (int64)"),
    ("record [B, T, 1] ids", lambda: _record(IDS[..., None]),
     "record(input_ids=...) holds int64 [4, 16, 1]; token ids are [B, T]: drop the trailing "
     "axis of length 1 (ids[..., 0])"),
    ("record numpy ids", lambda: _record(IDS.numpy()),
     "record(input_ids=...) is a ndarray; give a torch tensor"),
    ("record no examples", lambda: _record(IDS[:0]),
     "record(input_ids=...) holds int64 [0, 16]: no examples"),
    ("record uint64 ids beyond int64",
     lambda: _record(torch.full((4, 16), BIG, dtype=torch.uint64)),
     f"record(input_ids=...) holds token id {BIG}, beyond any vocabulary"),
    ("static unknown condition", lambda: _static(condition="static-layr"),
     "static(condition='static-layr'): choose one of static-layer, static-layer-position, "
     "static-layer-token, global-mean"),  # before: a raw ValueError
    ("static per position, other length", lambda: _static(
        {k: v[:, :8] for k, v in _recorded()[0].items()}, "static-layer-position"),
     f"site gates.0's coefficients [4, 8, {toys.V}] have [positions, *trailing] shape "
     f"[8, {toys.V}], its calibration profile [16, {toys.V}]"),
    ("static other trailing shape", lambda: _static({"gates.0": torch.zeros(4, 16, 1)}),
     f"have trailing shape [1], its calibration profile [{toys.V}]"),
    ("static unknown site", lambda: _static({"nope": torch.zeros(4, 16, toys.V)}),
     "static: the profiles have no site 'nope'; they were added for gates.0, gates.1"),
    ("static before any calibration", lambda: _static(
        profiles=StaticProfiles(list(_recorded()[0].sites))),
     "StaticProfiles holds no calibration batch yet"),
    ("calibration batches of two lengths", _add_shorter,
     f"StaticProfiles.add: site gates.0 has [positions, ...] [8, {toys.V}] in this batch, "
     f"[16, {toys.V}] in earlier ones"),
    ("static-layer-token ids beyond int64", lambda: _static(
        dict(_recorded()[0]), "static-layer-token", ids=np.full((4, 16), BIG, np.uint64)),
     f"static-layer-token holds token id {BIG}, beyond any vocabulary"),
    ("unseen ids beyond int64", lambda: _recorded()[1].unseen(np.full((2, 3), BIG, np.uint64)),
     f"StaticProfiles.unseen holds token id {BIG}, beyond any vocabulary"),  # before: (6, 1)
    ("a model with weights on the meta device", lambda: fcaudit.audit(
        toys.content_model().to("meta"), sites=["gates.*"], data=toy_data(),
        options=AuditOptions(**FAST)),
     "ToyModel: its weight scale is on the meta device, which holds no values"),
    ("a module that contains itself", lambda: fcaudit.record(toys.self_containing_model(), IDS,
                                                             ["gates.*"]),
     "ToyModel's module tree contains itself: gates.0.owner is the model itself"),
]


@pytest.mark.parametrize("name, call, fragment", API_CASES, ids=[c[0] for c in API_CASES])
def test_python_api_refuses_in_one_line(name: str, call: object, fragment: str) -> None:
    with pytest.raises(FcauditError) as caught:
        call()  # type: ignore[operator]
    message = str(caught.value)
    assert "\n" not in message and fragment in message, message


def test_a_shared_submodule_is_not_a_cycle() -> None:
    """A module reached twice (tied weights) is a tree walked twice, not one that contains
    itself: it records as the plain model does."""
    model = toys.content_model()
    model.tied = model.gates[1]
    plain = fcaudit.record(toys.content_model(), IDS, ["gates.*"])
    shared = fcaudit.record(model, IDS, ["gates.*"])
    assert all(torch.equal(shared[k], plain[k]) for k in plain)


def test_audit_of_a_model_that_contains_itself_is_refused() -> None:
    with pytest.raises(FcauditError, match="gates.0.owner is the model itself"):
        fcaudit.audit(toys.self_containing_model(), sites=["gates.*"], data=toy_data(),
                      options=AuditOptions(**FAST))


# ------------------------------------------------------- objectives, named in every line

def _mixer_audit(objective: object, model: object = None) -> str:
    x, y = vt.mixer_data(16, 0)
    data = AuditData(inputs=x, targets=y, calib_inputs=vt.mixer_data(16, 1)[0])
    with pytest.raises(FcauditError) as caught:
        fcaudit.audit(model or vt.class_mixer(), data=data,
                      options=AuditOptions(objective=objective, **FAST))
    assert "\n" not in str(caught.value)
    return str(caught.value)


def nan_losses(output: torch.Tensor, batch: object) -> torch.Tensor:
    return torch.full((len(output),), float("nan"))


def meta_losses(output: torch.Tensor, batch: object) -> torch.Tensor:
    return torch.zeros(len(output), device="meta")


def reads_labels(output: torch.Tensor, batch: object) -> torch.Tensor:
    return batch.labels  # type: ignore[attr-defined]  # an ExampleBatch holds .targets


class PassCounting:
    """Per-unit losses [B, 2] on the first call (the record pass), [B, 3] after."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, output: torch.Tensor, batch: object) -> torch.Tensor:
        self.calls += 1
        return output[:, :2 if self.calls == 1 else 3].abs()


NAME = "callable:test_input_arrays."


def test_an_objective_with_nan_losses_is_named() -> None:
    message = _mixer_audit(nan_losses)
    assert message == (f"objective {NAME}nan_losses: the losses it returned are not finite "
                       "(NaN or inf) for 8 of 8 units in the unperturbed record pass, batch 0; "
                       "no metric can be computed: fix the objective, or the model output it "
                       "reads")  # before: "the model's NLL is not finite"


def test_an_objective_returning_a_meta_tensor_is_named() -> None:
    assert _mixer_audit(meta_losses) == (
        f"objective {NAME}meta_losses must return per-unit losses, a float tensor [B] or "
        "[B, T] with B=8 examples; it returned a meta tensor (no values) float32 [8]")


def test_an_objective_that_raises_is_named() -> None:
    assert _mixer_audit(reads_labels) == (
        f"objective {NAME}reads_labels raised AttributeError: 'ExampleBatch' object has no "
        "attribute 'labels'; it is called as fn(model_output, batch) with batch.inputs and "
        "batch.targets, and must return per-unit losses [B] or [B, T]")  # before: raw


def test_losses_of_another_shape_in_replay_are_named() -> None:
    assert _mixer_audit(PassCounting()) == (
        f"objective {NAME}PassCounting returned losses [8, 3] in replay under correct, batch "
        "0, but [8, 2] for the same examples in their record pass; per-unit losses must "
        "depend on the batch alone, not on the pass (the same units of the same examples "
        "every time)")  # before: a raw "The size of tensor a (3) must match ..."


def test_built_in_objectives_name_themselves() -> None:
    model = vt.class_mixer()
    with torch.no_grad():
        model.scale.fill_(float("nan"))
    assert _mixer_audit("classification", model).startswith(
        "objective 'classification': the model's cross-entropy of its logits is not finite "
        "(NaN or inf) for 8 of 8 examples in the unperturbed record pass, batch 0")
    lm = toys.content_model()
    with torch.no_grad():
        lm.scale.fill_(float("nan"))
    with pytest.raises(FcauditError) as caught:  # 4 sequences x 15 scored tokens
        fcaudit.audit(lm, sites=["gates.*"], data=toy_data(), options=AuditOptions(
            **{**FAST, "batch_size": 4}))
    assert str(caught.value).startswith(
        "objective 'token-nll': the model's next-token NLL is not finite (NaN or inf) for 60 "
        "of 60 tokens in the unperturbed record pass, batch 0")
