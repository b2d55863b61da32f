"""``fcaudit fold`` (fcaudit.engine.actions.fold): an audit's static profile folded into its model.

A tiny FeatureGate run folder (random weights, gates spread so the profiles differ by
layer, position and token) is audited; each foldable profile is folded. The fixed values
are checked against the gate outputs this test reads off the original model's gate
modules on the calibration data with its own hooks (the reference), the folded run's
NLL against the audit's number, and its loss per token against the replayed condition.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import run_inprocess

import fcaudit
from fcaudit.core.errors import CacheError, DataError, ModelError, UsageError
from fcaudit.engine.options import AuditOptions
from fcaudit.io.data import AuditData
from fcaudit.io.loading import save_run_model
from fcaudit.models.featuregate import GPT, GPTConfig

VOCAB, LENGTH = 48, 12
OPTIONS = AuditOptions(repeats=1, bootstrap=50, batch_size=4, execution=False, progress=False)
PROFILES = ["static-layer", "static-layer-position", "static-layer-token"]


def _run(folder: Path, seed: int = 0, spread: float = 1.0, text: Path | None = None,
         arch: str = "featuregate") -> Path:
    """A FeatureGate (or MoE, or Mixtral) run folder in ``fcaudit train``'s layout, its
    controllers spread (0: every gate a constant); with ``text``, its tokenizer and a
    schedule."""
    tok = None
    if text is not None:
        from fcaudit.io.data import Document, train_tokenizer
        tok = train_tokenizer([Document("text", text.read_text())], VOCAB)
    vocab = max(VOCAB, tok.get_vocab_size() if tok is not None else 0)
    shape = dict(vocab_size=vocab, block_size=32, n_layer=2, n_head=2, n_embd=16)
    torch.manual_seed(seed)
    if arch == "moe":
        from fcaudit.models.moe import MoEConfig, MoEGPT
        cfg: Any = MoEConfig(**shape, num_experts=4, top_k=2)
        model: Any = MoEGPT(cfg)
    elif arch == "mixtral":
        from fcaudit.models.mixtral import Mixtral, MixtralConfig
        cfg = MixtralConfig(**shape, n_kv_head=1, expert_hidden=16, num_experts=4, top_k=2)
        model = Mixtral(cfg)
    else:
        cfg = GPTConfig(**shape)
        model = GPT(cfg)
    with torch.no_grad():
        for site in model.controller_sites():
            model.get_submodule(site.path).get_parameter(
                "proj.weight" if arch == "featuregate" else "weight").normal_(0, 1.0).mul_(spread)
    folder.mkdir(parents=True)
    save_run_model(folder, model)
    extra: dict[str, Any] = {}
    if tok is not None:
        (folder / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
        extra["train"] = {"seq_len": LENGTH, "batch_size": 4, "lr": 3e-3}
    (folder / "config.json").write_text(json.dumps({
        "fcaudit_run": 1, "arch": arch, "preset": "tiny", "seed": seed,
        "model_config": dataclasses.asdict(cfg), **extra}), encoding="utf-8")
    return folder


def _data(seed: int = 0) -> AuditData:
    rng = np.random.default_rng(seed)
    # calibration leaves some ids out: those take the static-layer value when folded
    return AuditData(eval_ids=rng.integers(0, VOCAB, (10, LENGTH)),
                     calib_ids=rng.integers(0, VOCAB - 8, (10, LENGTH)))


@pytest.fixture(scope="module")
def audited(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fold")
    for arch in ("featuregate", "moe", "mixtral"):
        run = _run(root / arch / "run", arch=arch)
        fcaudit.audit(str(run), root / arch / "audit", data=_data(), options=OPTIONS)
    return root / "featuregate"


def _outputs(model: Any, ids: np.ndarray) -> list[torch.Tensor]:
    """Each controller's output ``[N, T, width]`` on ``ids`` ``[N, T]``, read with this
    test's hooks on the modules the model declares."""
    modules = [model.get_submodule(s.path) for s in model.controller_sites()]
    seen: list[list[torch.Tensor]] = [[] for _ in modules]
    handles = [m.register_forward_hook(
        lambda _m, _a, out, i=i: seen[i].append(out.detach().double()))
        for i, m in enumerate(modules)]
    with torch.no_grad():
        for start in range(0, len(ids), 4):
            model(torch.from_numpy(ids[start:start + 4]))
    for h in handles:
        h.remove()
    return [torch.cat(s) for s in seen]


def _expected(key: str, outs: torch.Tensor, ids: np.ndarray, rows: int) -> torch.Tensor:
    """The fixed rows of one controller, worked out here from its outputs ``[N, T, W]``:
    the mean; the mean per position (the mean beyond the windows); the mean per token id
    (the mean for ids calibration never had)."""
    mean = outs.mean((0, 1))
    if key == "layer":
        return mean[None]
    out = mean.repeat(rows, 1)
    if key == "layer_position":
        out[:outs.shape[1]] = outs.mean(0)
        return out
    flat, keys = outs.reshape(-1, outs.shape[-1]), torch.from_numpy(ids).reshape(-1)
    for token in keys.unique():
        out[token] = flat[keys == token].mean(0)
    return out


@pytest.mark.parametrize("arch", ["featuregate", "moe", "mixtral"])
@pytest.mark.parametrize("profile", PROFILES)
def test_each_profile_folds_exactly(audited: Path, profile: str, arch: str) -> None:
    """The folded run (a FeatureGate: the Dense architecture; an MoE: an MoE routed by a
    table, or at one row per layer the Dense architecture with the chosen experts merged;
    a Mixtral: a Mixtral routed by a table)
    holds fixed rows equal to the controller outputs' means this test reads off the
    original model; no controller is left; its NLL is the audit's for the condition, and
    its losses the replayed condition's."""
    from fcaudit.core.nll import logits_of, token_nll
    from fcaudit.engine.actions.fold import fold
    from fcaudit.io.loading import load_run
    root = audited.parent / arch
    out = root / f"folded-{profile}"
    done = fold(root / "audit", profile, out, data=_data(), timing_pairs=0)
    audit = json.loads((root / "audit" / "audit.json").read_text())
    e = done.exactness
    assert e.max_abs_diff <= e.bound_relative * 10 and e.tokens == 10 * (LENGTH - 1)
    assert abs(e.folded_nll - audit["conditions"][profile]["nll"]) <= 1e-6
    config = json.loads((out / "config.json").read_text())
    assert config["arch"] == {"featuregate": "dense", "mixtral": "mixtral",
                              "moe": "moe" if profile != "static-layer" else "dense"}[arch]
    assert config["fold"]["profile"] == profile
    folded, key = load_run(out).model, done.key
    merged = arch == "moe" and key == "layer"  # one MLP, no fixed values left
    assert folded.config.fixed == ("" if merged else key) and folded.controller_sites() == []
    assert not [n for n, _ in folded.named_parameters() if ".gate." in n or ".router." in n]
    original = load_run(root / "run").model
    data = _data()
    rows = {"layer": 1, "layer_position": folded.config.block_size,
            "layer_token": folded.config.vocab_size}[key]
    for i, outs in enumerate(_outputs(original, data.calib_ids)):
        want = _expected(key, outs, data.calib_ids, rows)
        if merged:
            _check_merged(folded.blocks[i].body.mlp, original.blocks[i], want[0])
        else:
            assert torch.allclose(folded.blocks[i].fixed.value.double(), want, atol=1e-6)
    x = torch.from_numpy(data.eval_ids)
    with torch.no_grad():
        nll = token_nll(logits_of(folded(x)), x).double().mean()
    assert abs(float(nll) - e.folded_nll) <= 1e-6  # the run folder computes what was checked


def _check_merged(mlp: Any, block: Any, logits: torch.Tensor) -> None:
    """The merged MLP of an MoE block routed by the fixed ``logits`` (worked out here: the
    top-k logits' experts, a softmax over those logits): their first layers side by side,
    their second layers scaled by the weights side by side, the shared bias."""
    top = sorted(range(len(logits)), key=lambda e: -float(logits[e]))[:block.top_k]
    weights = torch.softmax(logits[top], dim=0)
    experts = [block.experts[e] for e in top]
    assert torch.equal(mlp.fc.weight, torch.cat([e.fc.weight for e in experts]))
    assert torch.equal(mlp.fc.bias, torch.cat([e.fc.bias for e in experts]))
    want = torch.cat([w * e.proj.weight.double()
                      for w, e in zip(weights, experts, strict=True)], dim=1)
    assert torch.allclose(mlp.proj.weight.double(), want, atol=1e-6)
    assert torch.equal(mlp.proj.bias, block.expert_bias)


def _mamba_run(folder: Path) -> Path:
    """A tiny Mamba run folder, its Δ, B and C projections spread so that they vary."""
    from fcaudit.models.mamba import Mamba, MambaConfig
    torch.manual_seed(0)
    cfg = MambaConfig(vocab_size=VOCAB, block_size=32, n_layer=2, n_embd=16, d_state=4,
                      dt_rank=2, chunk=4)
    model = Mamba(cfg)
    with torch.no_grad():
        for site in model.controller_sites():
            for p in model.get_submodule(site.path).parameters():
                p.normal_(0, 0.5)
    folder.mkdir(parents=True)
    save_run_model(folder, model)
    (folder / "config.json").write_text(json.dumps({
        "fcaudit_run": 1, "arch": "mamba", "preset": "tiny", "seed": 0,
        "model_config": dataclasses.asdict(cfg)}), encoding="utf-8")
    return folder


def test_a_mamba_folds_into_its_time_invariant_twin_run_as_a_convolution(
        tmp_path: Path) -> None:
    """Held at one Δ, B, C per layer a Mamba is time-invariant: the fold is the S4D
    network (run by FFT) with the means of Δ (before softplus), B and C this test reads
    off the original's projections, and every other weight the original's; its losses
    are the static-layer condition's within the bound. A row per token id is not
    time-invariant: refused, naming what folds."""
    from fcaudit.engine.actions.fold import fold
    from fcaudit.io.loading import load_run
    run, data = _mamba_run(tmp_path / "run"), _data()
    fcaudit.audit(str(run), tmp_path / "audit", data=data, options=OPTIONS)
    done = fold(tmp_path / "audit", "static-layer", tmp_path / "folded", data=data,
                timing_pairs=0)
    audit = json.loads((tmp_path / "audit" / "audit.json").read_text())
    assert done.arch == "s4d" and done.exactness.max_abs_diff <= 1e-5
    assert abs(done.exactness.folded_nll - audit["conditions"]["static-layer"]["nll"]) <= 1e-5
    folded, original = load_run(tmp_path / "folded").model, load_run(run).model
    assert type(folded).__name__ == "S4D" and folded.config.mode == "fft"
    assert folded.controller_sites() == []
    means = [outs.mean((0, 1)) for outs in _outputs(original, data.calib_ids)]
    for site, mean in zip(original.controller_sites(), means, strict=True):
        value = folded.get_parameter(f"layers.{site.layer}.mixer.{site.family}")
        assert torch.allclose(value.double(), mean, atol=1e-6), site.name
    kept = {k: v for k, v in original.state_dict().items()
            if not any(k.startswith(s.path + ".") for s in original.controller_sites())}
    assert all(torch.equal(folded.state_dict()[k], v) for k, v in kept.items())
    with pytest.raises(UsageError, match=r"mamba does not fold it; folds exist for .*mamba "
                                         r"\(static-layer\)"):
        fold(tmp_path / "audit", "static-layer-token", tmp_path / "token", data=data,
             timing_pairs=0)
    assert not (tmp_path / "token").exists()


def test_the_fold_is_timed_against_the_original_and_the_dense_twin(audited: Path) -> None:
    from fcaudit.engine.actions.fold import fold
    done = fold(audited / "audit", "static-layer", None, data=_data(), timing_pairs=10)
    assert done.out is None and done.timing["pairs"] == 10
    for speed in (done.vs_original, done.vs_dense):
        assert speed is not None and speed.folded_tokens_per_s > 0
        lo, hi = speed.latency_ratio.ci95
        assert lo <= speed.latency_ratio.value <= hi
    # the gate networks' matrix products are gone; the dense twin has the same ones
    assert done.vs_original.flops_ratio < 1.0 and done.vs_dense.flops_ratio == 1.0


def test_the_command_line_folds_and_never_replaces_what_it_did_not_write(
        audited: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _data()
    np.save(tmp_path / "eval.npy", data.eval_ids)
    np.save(tmp_path / "calib.npy", data.calib_ids)
    run = audited / "run"
    assert run_inprocess(["audit", "--model", str(run), "--tokens", str(tmp_path / "eval.npy"),
                          "--calib-tokens", str(tmp_path / "calib.npy"), "--out",
                          str(tmp_path / "audit"), "--repeats", "1", "--bootstrap", "50",
                          "--batch-size", "4", "--no-execution", "--quiet"],
                         capsys).returncode == 0
    argv = ["fold", "--audit", str(tmp_path / "audit"), "--profile", "static-layer-token",
            "--out", str(tmp_path / "folded"), "--tokens", str(tmp_path / "eval.npy"),
            "--calib-tokens", str(tmp_path / "calib.npy"), "--timing-pairs", "0", "--quiet",
            "--json", str(tmp_path / "fold.json")]
    res = run_inprocess(argv, capsys)
    assert res.returncode == 0, res.stderr
    written = json.loads((tmp_path / "fold.json").read_text())
    e = written["exactness"]
    assert f"NLL {e['folded_nll']:.4f}, the audit's {e['audit_nll']:.4f}" in res.stdout
    assert written["schema"] == "fcaudit.fold/1" and written["arch"] == "dense"
    again = run_inprocess(argv, capsys)  # the run folder exists: --force to replace it
    assert again.returncode == 2 and "--force" in again.stderr
    assert run_inprocess([*argv, "--force"], capsys).returncode == 0
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    at = argv.index("--out") + 1
    theirs = run_inprocess([*argv[:at], str(tmp_path / "mine"), *argv[at + 1:], "--force"],
                           capsys)
    assert theirs.returncode == 2 and (tmp_path / "mine" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]


@pytest.mark.parametrize(("change", "error", "needle"), [
    (dict(profile="reassign"), UsageError, "does not fold: choose one of static-layer"),
    (dict(profile="global-mean"), UsageError, "does not fold"),
    (dict(data=_data(1)), DataError, "not the audit's"),
])
def test_a_fold_that_cannot_be_done_is_one_line_and_writes_nothing(
        audited: Path, tmp_path: Path, change: dict[str, Any], error: type,
        needle: str) -> None:
    from fcaudit.engine.actions.fold import fold
    asked = {"profile": "static-layer", "data": _data(), **change}
    with pytest.raises(error, match=needle) as caught:
        fold(audited / "audit", asked["profile"], tmp_path / "out", data=asked["data"],
             timing_pairs=0)
    assert "\n" not in str(caught.value) and not (tmp_path / "out").exists()


def test_an_edited_audit_or_a_changed_model_is_refused(audited: Path, tmp_path: Path) -> None:
    import shutil

    from fcaudit.engine.actions.fold import fold
    copy = tmp_path / "audit"
    shutil.copytree(audited / "audit", copy)
    text = (copy / "audit.json").read_text()
    (copy / "audit.json").write_text(text + " ")  # well formed, yet not what fcaudit wrote
    with pytest.raises(CacheError, match="changed after fcaudit wrote it"):
        fold(copy, "static-layer", None, data=_data(), timing_pairs=0)
    other = _run(tmp_path / "other", seed=1)  # another model given for the audit's
    with pytest.raises(ModelError, match="not the model the audit measured"):
        fold(audited / "audit", "static-layer", None, model=str(other), data=_data(),
             timing_pairs=0)
    with pytest.raises(UsageError, match="holds no audit.json"):
        fold(tmp_path, "static-layer", None, timing_pairs=0)


def test_a_model_whose_family_does_not_fold_is_refused_naming_those_that_do(
        tmp_path: Path) -> None:
    """A Qwen2-MoE folder (a shared expert beside the routed ones: no fold entry)."""
    from conftest import FAMILIES, save

    from fcaudit.engine.actions.fold import fold
    folder = save(FAMILIES["qwen2_moe"][0](), tmp_path / "qwen")
    rng = np.random.default_rng(0)
    data = AuditData(eval_ids=rng.integers(3, 64, (4, 8)), calib_ids=rng.integers(3, 64, (4, 8)))
    fcaudit.audit(str(folder), tmp_path / "audit", data=data, options=OPTIONS)
    with pytest.raises(UsageError, match=r"of a family that does not fold; folds exist for "
                                         r"featuregate \(static-layer, static-layer-position, "
                                         r"static-layer-token\).*; mixtral folders "
                                         r"\(static-layer: a mistral folder \(float32\) or an "
                                         r"fcaudit mixtral run folder, static-layer-position and "
                                         r"static-layer-token: an fcaudit mixtral run folder\)"):
        fold(tmp_path / "audit", "static-layer", tmp_path / "out", data=data, timing_pairs=0)
    assert not (tmp_path / "out").exists()


def _text(folder: Path) -> Path:
    from conftest import WORDS
    path = folder / "text.txt"
    path.write_text(" ".join(np.random.default_rng(0).choice(WORDS, size=3000)),
                    encoding="utf-8")
    return path


@pytest.mark.parametrize("spread", [1.0, 0.0])
def test_healing_is_measured_against_the_original_fine_tuned_alike(
        tmp_path: Path, spread: float) -> None:
    """Step 0 of the curve is the fold's checked NLL and the audit's own original NLL;
    both models train on the same batches; the healed run folder computes the curve's
    last point. Planted: with every gate a constant, the fold is the original itself, so
    the penalty before healing is exactly zero and no share of it is defined."""
    from fcaudit.engine.actions.fold import fold
    from fcaudit.io.loading import load_run
    from fcaudit.study.heal import heal
    text = _text(tmp_path)
    run = _run(tmp_path / "run", spread=spread, text=text)
    data = _data()
    fcaudit.audit(str(run), tmp_path / "audit", data=data, options=OPTIONS)
    done = fold(tmp_path / "audit", "static-layer", tmp_path / "folded", data=data,
                timing_pairs=0)
    healed = heal(tmp_path / "folded", run, 8, done.eval_ids, data=text,
                  out=tmp_path / "healed", progress=False)
    audit = json.loads((tmp_path / "audit" / "audit.json").read_text())
    assert [p.step for p in healed.curve] == [0, 2, 4, 6, 8]
    first, last = healed.curve[0], healed.curve[-1]
    assert abs(first.folded_nll - done.exactness.folded_nll) <= 1e-9
    assert abs(first.original_nll - audit["conditions"]["original"]["nll"]) <= 1e-9
    assert abs(healed.penalty_before.value - (first.folded_nll - first.original_nll)) <= 1e-9
    assert last.original_nll != first.original_nll  # the control trained too
    x = torch.from_numpy(done.eval_ids)
    from fcaudit.core.nll import logits_of, token_nll
    model = load_run(tmp_path / "healed").model
    with torch.no_grad():
        nll = float(token_nll(logits_of(model(x)), x).double().mean(-1).mean())
    assert abs(nll - last.folded_nll) <= 1e-6
    if spread == 0.0:
        assert healed.penalty_before.value == 0.0 and healed.recovered is None


def test_healing_without_text_the_run_can_read_is_refused(tmp_path: Path) -> None:
    from fcaudit.study.heal import heal
    run = _run(tmp_path / "run")  # no tokenizer, no schedule
    with pytest.raises(DataError, match="records no training schedule"):
        heal(run, run, 4, _data().eval_ids, progress=False)
    with pytest.raises(UsageError, match="at least 1"):
        heal(run, run, 0, _data().eval_ids, progress=False)


def test_the_command_line_heals_and_prints_the_curve_with_its_control(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = _text(tmp_path)
    run = _run(tmp_path / "run", text=text)
    data = _data()
    fcaudit.audit(str(run), tmp_path / "audit", data=data, options=OPTIONS)
    np.save(tmp_path / "eval.npy", data.eval_ids)
    np.save(tmp_path / "calib.npy", data.calib_ids)
    argv = ["fold", "--audit", str(tmp_path / "audit"), "--profile", "static-layer",
            "--out", str(tmp_path / "folded"), "--tokens", str(tmp_path / "eval.npy"),
            "--calib-tokens", str(tmp_path / "calib.npy"), "--timing-pairs", "0", "--quiet",
            "--heal-steps", "4", "--heal-data", str(text), "--heal-out",
            str(tmp_path / "healed"), "--json", str(tmp_path / "fold.json")]
    res = run_inprocess(argv, capsys)
    assert res.returncode == 0, res.stderr
    healed = json.loads((tmp_path / "fold.json").read_text())["heal"]
    assert [p["step"] for p in healed["curve"]] == [0, 1, 2, 3, 4]
    last = healed["curve"][-1]
    assert f"| 4 | {last['folded_nll']:.4f} | {last['original_nll']:.4f} |" in res.stdout
    assert "penalty against the original" in res.stdout
    assert (tmp_path / "healed" / "model.safetensors").is_file()
    alone = run_inprocess([*argv[:argv.index("--heal-steps")], "--heal-out",
                           str(tmp_path / "x")], capsys)
    assert alone.returncode == 2 and "only with --heal-steps" in alone.stderr
    (tmp_path / "mine").mkdir()  # a folder of the user's as --heal-out: refused first
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    moved = {str(tmp_path / "folded"): str(tmp_path / "folded2"),
             str(tmp_path / "healed"): str(tmp_path / "mine")}
    theirs = run_inprocess([*(moved.get(a, a) for a in argv), "--force"], capsys)
    assert theirs.returncode == 2 and "notes.txt" in theirs.stderr
    assert not (tmp_path / "folded2").exists()
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]
    moved = {str(tmp_path / "folded"): str(tmp_path / "folded3"),
             str(tmp_path / "healed"): str(tmp_path / "healed3")}
    gate = run_inprocess([*(moved.get(a, a) for a in argv), "--heal-params", "blocks.*.gate.*"],
                         capsys)  # the fold removed the gates: no such weight to heal
    assert gate.returncode == 2 and "names no weight of the folded model" in gate.stderr
    assert not (tmp_path / "folded3").exists() and not (tmp_path / "healed3").exists()


def test_healing_a_named_subset_trains_only_those_weights(tmp_path: Path) -> None:
    """With ``params``, only the weights the globs name change, in the folded model and
    the control; every other weight stays bit for bit the folded run's. A glob that names
    no weight of the folded model (the gate, which the fold removed) is refused before the
    fold writes anything."""
    from fcaudit.engine.actions.fold import fold
    from fcaudit.io.loading import load_run
    from fcaudit.study.heal import check_params, heal
    text = _text(tmp_path)
    run = _run(tmp_path / "run", text=text)
    data = _data()
    fcaudit.audit(str(run), tmp_path / "audit", data=data, options=OPTIONS)
    with pytest.raises(UsageError, match="names no weight of the folded model"):
        fold(tmp_path / "audit", "static-layer", tmp_path / "refused", data=data,
             timing_pairs=0, accept=lambda m: check_params(m, ["blocks.*.gate.*"]))
    assert not (tmp_path / "refused").exists()
    done = fold(tmp_path / "audit", "static-layer", tmp_path / "folded", data=data,
                timing_pairs=0)
    healed = heal(tmp_path / "folded", run, 4, done.eval_ids, data=text,
                  params=["blocks.1.*.mlp.*"], out=tmp_path / "healed", progress=False)
    before = load_run(tmp_path / "folded").model.state_dict()
    after = load_run(tmp_path / "healed").model.state_dict()
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    named = sorted(k for k in before if k.startswith("blocks.1.body.mlp."))
    assert changed == named and healed.params == ["blocks.1.*.mlp.*"]
    assert healed.trained["folded"] == healed.trained["control"] == sum(
        before[k].numel() for k in named)
    assert healed.curve[-1].original_nll != healed.curve[0].original_nll  # the control trained


def _exit_run(folder: Path, arch: str) -> Path:
    """A tiny early-exit (or ponder) run folder, its exit scores spread so that tokens
    stop at different depths."""
    from fcaudit.models.earlyexit import EarlyExitConfig, EarlyExitGPT
    from fcaudit.models.ponder import PonderConfig, PonderGPT
    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, block_size=32, n_head=2, n_embd=16)
    cfg: Any = EarlyExitConfig(**shape, n_layer=4, exit_threshold=0.5) if arch == "earlyexit" \
        else PonderConfig(**shape, max_steps=4, halt_threshold=0.5)
    model: Any = (EarlyExitGPT if arch == "earlyexit" else PonderGPT)(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if (".score." in name or name.startswith("unit.")) and name.endswith("proj.weight"):
                p.normal_(0, 2.0)
    folder.mkdir(parents=True)
    save_run_model(folder, model)
    (folder / "config.json").write_text(json.dumps({
        "fcaudit_run": 1, "arch": arch, "preset": "tiny", "seed": 0,
        "model_config": dataclasses.asdict(cfg)}), encoding="utf-8")
    return folder


@pytest.mark.parametrize("arch", ["earlyexit", "ponder"])
def test_fixed_exit_folds_into_the_twin_truncated_at_that_depth(tmp_path: Path,
                                                                arch: str) -> None:
    """Under fixed exit every token stops at one depth: the fold is the dense twin cut
    there (FeatureGate's Dense with that many blocks; Ponder's shared block run that many
    steps), no exit rule left. The depth is the one closest to the model's mean executed
    depth on calibration, worked out here from the exits this test reads off the rule
    modules; the folded model's logits equal the original's exit head at that depth in a
    full-depth pass, and its NLL the audit's fixed-exit NLL."""
    from fcaudit.core.nll import logits_of, token_nll
    from fcaudit.engine.actions.fold import fold
    from fcaudit.io.loading import load_run
    run, data = _exit_run(tmp_path / "run", arch), _data()
    options = dataclasses.replace(OPTIONS, conditions=("fixed-exit",))
    fcaudit.audit(str(run), tmp_path / "audit", data=data, options=options)
    done = fold(tmp_path / "audit", "fixed-exit", tmp_path / "folded", data=data,
                timing_pairs=0)
    audit = json.loads((tmp_path / "audit" / "audit.json").read_text())
    assert abs(done.exactness.folded_nll - audit["conditions"]["fixed-exit"]["nll"]) <= 1e-5
    original, folded = load_run(run).model, load_run(tmp_path / "folded").model
    rules = original.exit_rules()
    stops: list[torch.Tensor] = []
    handles = [original.get_submodule(r).register_forward_hook(
        lambda _m, _a, out: stops.append(out.bool())) for r in rules]
    with torch.no_grad():
        original(torch.from_numpy(data.calib_ids))
    for h in handles:
        h.remove()
    stopped = torch.stack(stops + [torch.ones_like(stops[0])]).int().argmax(0)  # exit layer
    mean_depth = float((stopped + 1).double().mean())
    depth = min(range(1, len(rules) + 2), key=lambda d: (abs(d - mean_depth), -d))
    assert 1 < depth < len(rules) + 1  # a cut inside the model, not at either end
    assert done.exit_depth == depth
    config = json.loads((tmp_path / "folded" / "config.json").read_text())
    if arch == "earlyexit":
        assert config["arch"] == "dense" and len(folded.blocks) == depth
    else:
        assert config["arch"] == "dense-ponder" and folded.config.max_steps == depth
    assert folded.controller_sites() == []
    x = torch.from_numpy(data.eval_ids)
    heads: list[torch.Tensor] = []
    hooked = original.get_submodule(original.exit_heads()[depth - 1]).register_forward_hook(
        lambda _m, _a, out: heads.append(out))
    original.full_depth = True
    with torch.no_grad():
        original(x)
        got = folded(x)
    hooked.remove()
    assert (got - heads[0]).abs().max() <= 1e-5
    assert abs(float(token_nll(logits_of(got), x).double().mean()) -
               done.exactness.folded_nll) <= 1e-6


def test_a_mudd_folds_into_static_dense_connections(tmp_path: Path) -> None:
    """At one set of mixing weights per layer a MUDD model is DenseFormer-like: no weight
    generator, ``dense_bs`` holding the mean generator outputs this test reads off the
    original's generators (bias included), every other weight the original's; its losses
    are the static-layer condition's bit for bit (the same products in the same order)."""
    from fcaudit.engine.actions.fold import fold
    from fcaudit.io.loading import load_run
    from fcaudit.models.mudd import MuddConfig, MuddModel
    torch.manual_seed(0)
    cfg = MuddConfig(n_layer=3, dim=16, n_head=2, n_local_heads=2, intermediate_size=256,
                     vocab_size=VOCAB, block_size=32)
    model = MuddModel(cfg)
    with torch.no_grad():
        for generator in model.dynamic_dense:
            generator.w2.weight.normal_(0, 0.5)  # weights that vary by token
    run = tmp_path / "run"
    run.mkdir()
    save_run_model(run, model)
    (run / "config.json").write_text(json.dumps({
        "fcaudit_run": 1, "arch": "mudd", "preset": "tiny", "seed": 0,
        "model_config": dataclasses.asdict(cfg)}), encoding="utf-8")
    data = _data()
    fcaudit.audit(str(run), tmp_path / "audit", data=data, options=OPTIONS)
    done = fold(tmp_path / "audit", "static-layer", tmp_path / "folded", data=data,
                timing_pairs=0)
    assert done.arch == "mudd" and done.exactness.max_abs_diff == 0.0
    folded, original = load_run(tmp_path / "folded").model, load_run(run).model
    assert folded.controller_sites() == [] and not hasattr(folded, "dynamic_dense")
    for i, outs in enumerate(_outputs(original, data.calib_ids)):
        assert float(outs.std((0, 1)).max()) > 0.01  # the weights did vary by token
        assert torch.allclose(folded.dense_bs[i].double(), outs.mean((0, 1)), atol=1e-6)
    kept = {k: v for k, v in original.state_dict().items()
            if not k.startswith(("dynamic_dense.", "dense_bs."))}
    assert all(torch.equal(folded.state_dict()[k], v) for k, v in kept.items())
    with pytest.raises(UsageError, match="mudd does not fold it"):
        fold(tmp_path / "audit", "static-layer-token", None, data=data, timing_pairs=0)
