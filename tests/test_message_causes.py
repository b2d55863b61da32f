"""Refusals name what is actually wrong (issue 37, item 6): a rerun into the same ``--out``
names the identity entry that changed (the exit threshold, the objective, the batch size),
never "another model" for an option; a record batch that no longer matches says whether
coefficients or losses alone differ; an exit site whose values are swapped, or whose rule's
threshold its values never or always reach, is refused for that cause; a dense twin that
is not the exit model's network names the first block that differs and both shapes.
The expected words are written out here, not read off fcaudit."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import vision_toys as vt
from conftest import COMMON, FAST_ARGS, audit_argv, run_inprocess, token_batches, tokenizer_file

import fcaudit
from fcaudit import AuditData, AuditOptions
from fcaudit.core.errors import FcauditError

# ------------------------------------------------------------------ cache identity

# every entry of a cache's manifest -> (a changed value, how the refusal names it)
CHANGED: dict[str, tuple[Any, str]] = {
    "model": ("0" * 64, "model (its weights, config or code)"),
    "model_class": ("OtherModel", "model class (OtherModel -> ToyModel)"),
    "eval_data": ("1" * 64, "evaluation data"),
    "calib_data": ("2" * 64, "calibration data"),
    "dtype": ("torch.float16", "parameter dtype (torch.float16 -> torch.float32)"),
    "device": ("cuda", "device (cuda -> cpu)"),
    "sites": (["gates.0"], "controller sites"),
    "adapters": (["other"], "site adapters"),
    "layouts": (["example"], "coefficient layouts"),
    "objective": ("classification", "objective (classification -> token-nll)"),
    "exit_threshold": (0.5, "--exit-threshold (0.5 -> none)"),
    "fcaudit": ("0.0.1", "fcaudit version (0.0.1 -> "),
    "torch": ("1.0", "torch version (1.0 -> "),
    "package versions": ({"fakepkg": "1.0"}, "package versions (fakepkg 1.0 -> absent)"),
    "batch_size": (8, "--batch-size (8 -> 4)"),
    "n_sequences": (99, "number of evaluation sequences (99 -> 16)"),
}


def _changed_words(stderr: str) -> str:
    found = re.search(r"was recorded with a different (.*); delete that folder", stderr)
    assert found, stderr
    return found[1]


def test_every_identity_entry_is_named_by_what_changed(
        tmp_path: Path, tokens: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """Each entry of a real manifest changed in turn (every one: the manifest holds no
    entry without its words here): the refusal names that entry alone, in words."""
    out = tmp_path / "out"
    assert run_inprocess(audit_argv(out, tokens), capsys).returncode == 0
    path = out / "cache" / "manifest.json"
    manifest = json.loads(path.read_text())
    entries = {*manifest["identity"], "batch_size", "n_sequences"}
    assert entries == set(CHANGED)
    for key, (value, words) in CHANGED.items():
        edited = json.loads(json.dumps(manifest))
        held = edited["identity"] if key in edited["identity"] else edited
        held[key] = {**held[key], **value} if isinstance(value, dict) else value
        path.write_text(json.dumps(edited))
        res = run_inprocess(audit_argv(out, tokens), capsys)
        assert res.returncode == 2, (key, res.stderr)
        named = _changed_words(res.stderr)
        assert named.startswith(words) and " and " not in named, (key, named)
    path.write_text(json.dumps(manifest))
    assert run_inprocess(audit_argv(out, tokens), capsys).returncode == 0  # resumes as it was


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-layer random Llama (LM head scaled so exits happen), its tokenizer and windows."""
    transformers = pytest.importorskip("transformers")
    from fcaudit.io.data import load_tokenizer
    folder = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": 3},
                                      intermediate_size=64, num_key_value_heads=2)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)
    model.save_pretrained(folder)
    tokenizer_file(folder)
    ev, ca = token_batches(load_tokenizer(folder / "tokenizer.json"))
    np.save(folder / "eval.npy", ev.numpy())
    np.save(folder / "calib.npy", ca.numpy())
    return folder


def test_a_changed_exit_threshold_is_named_not_the_model(
        llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["audit", "--model", llama, "--tokens", llama / "eval.npy", "--calib-tokens",
            llama / "calib.npy", "--early-exit", "--out", tmp_path / "out", *FAST_ARGS,
            "--batch-size", "2"]
    assert run_inprocess([*argv, "--exit-threshold", "0.8"], capsys).returncode == 0
    res = run_inprocess([*argv, "--exit-threshold", "0.5"], capsys)
    assert res.returncode == 2
    assert _changed_words(res.stderr) == "--exit-threshold (0.8 -> 0.5)", res.stderr
    assert "model" not in res.stderr.split("; delete")[0].split("different")[1]


def _scaled_by_env(out: Any, batch: Any) -> torch.Tensor:
    loss = torch.nn.functional.cross_entropy(out, batch.targets, reduction="none")
    return loss * float(os.environ["FCAUDIT_TEST_SCALE"])


def test_a_changed_objective_is_named_not_the_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another objective by name (the identity), and one whose losses moved through state
    the identity cannot see (the record batch): neither is called another model."""
    x, y = vt.mixer_data(16, 0)
    data = AuditData(inputs=x, targets=y, calib_inputs=vt.mixer_data(16, 1)[0])
    options = AuditOptions(bootstrap=50, repeats=1, execution=False, progress=False,
                           batch_size=8, per_layer=False, objective="classification")
    out = tmp_path / "audit"
    fcaudit.audit(vt.class_mixer(), out, data=data, options=options, report=False)
    own = dataclasses.replace(options, objective=_scaled_by_env)
    monkeypatch.setenv("FCAUDIT_TEST_SCALE", "1")
    with pytest.raises(FcauditError) as err:
        fcaudit.audit(vt.class_mixer(), out, data=data, options=own, report=False)
    assert _changed_words(str(err.value)) == \
        "objective (classification -> callable:test_message_causes._scaled_by_env)"

    other = tmp_path / "own"
    fcaudit.audit(vt.class_mixer(), other, data=data, options=own, report=False)
    monkeypatch.setenv("FCAUDIT_TEST_SCALE", "2")
    with pytest.raises(FcauditError) as err:
        fcaudit.audit(vt.class_mixer(), other, data=data, options=own, report=False)
    message = str(err.value)
    assert "a fresh pass over evaluation batch 0 (rows 1-8) gives other losses than its " \
        "cached record while every coefficient is bitwise equal (the objective" in message
    assert "another model" not in message and "recorded by" not in message


def test_changed_coefficients_name_the_site(tmp_path: Path) -> None:
    """A cached record whose coefficients differ names the first such site; one holding
    entries the fresh pass does not names them."""
    from fcaudit.engine.cache import CoefficientCache
    cache = CoefficientCache(tmp_path / "cache", {}, 4, 8)
    name = CoefficientCache.eval_name(0)
    cache.write(name, {"nll": torch.ones(4), "site::a": torch.ones(4), "site::b": torch.ones(4)})
    with pytest.raises(FcauditError, match=r"gives other coefficients of site b than its "
                                           r"cached record \(the model, or state it reads"):
        cache.settle(name, {"nll": torch.ones(4), "site::a": torch.ones(4),
                            "site::b": torch.zeros(4)}, "evaluation batch 0")
    with pytest.raises(FcauditError, match=r"gives other coefficients of site a and 2 more "
                                           r"than its cached record \(the model"):
        cache.settle(name, {"nll": torch.zeros(4), "site::a": torch.zeros(4),
                            "site::b": torch.zeros(4)}, "evaluation batch 0")
    with pytest.raises(FcauditError, match=r"gives other entries than its cached record "
                                           r"\(coefficients of site c in only one of them\)"):
        cache.settle(name, {"nll": torch.ones(4), "site::a": torch.ones(4),
                            "site::b": torch.ones(4), "site::c": torch.ones(4)}, "batch 0")


# ------------------------------------------------------------------ exit sites

RNG = np.random.default_rng(0)
TOKENS = AuditData(RNG.integers(0, 61, (8, 16)), RNG.integers(0, 61, (8, 16)),
                   {"source": "tokens"})
EXIT_OPTS = AuditOptions(repeats=1, bootstrap=20, batch_size=4, progress=False,
                         per_layer=False, timing_pairs=0, execution=False)


def _spread(model: torch.nn.Module) -> torch.nn.Module:
    """Large classifier weights, so that scores straddle the threshold token by token."""
    for name, p in model.named_parameters():
        if (".score." in name or name.startswith("unit.")) and name.endswith("proj.weight"):
            torch.nn.init.normal_(p, std=2.0)
    return model.eval()


def _early_exit() -> tuple[torch.nn.Module, AuditData, AuditOptions]:
    from fcaudit.models.earlyexit import EarlyExitConfig, EarlyExitGPT
    torch.manual_seed(0)
    return _spread(EarlyExitGPT(EarlyExitConfig(
        vocab_size=61, block_size=16, n_layer=3, n_head=2, n_embd=16, exit_threshold=0.5))), \
        TOKENS, EXIT_OPTS


def _ponder() -> tuple[torch.nn.Module, AuditData, AuditOptions]:
    from fcaudit.models.ponder import PonderConfig, PonderGPT
    torch.manual_seed(1)
    return _spread(PonderGPT(PonderConfig(vocab_size=61, block_size=16, n_layer=1, n_head=2,
                                          n_embd=16, max_steps=3))), TOKENS, EXIT_OPTS


def _branchy() -> tuple[torch.nn.Module, AuditData, AuditOptions]:
    from fcaudit.io.digits import digits
    from fcaudit.models.branchy import BranchyCNN, BranchyConfig
    torch.manual_seed(0)
    model = BranchyCNN(BranchyConfig(exit_threshold=0.5))
    with torch.no_grad():
        for head in model.heads:
            head.proj.weight.mul_(40.0)
    x, y = digits("eval")
    data = AuditData(inputs=x[:16], targets=y[:16], calib_inputs=digits("train")[0][:16])
    return model.eval(), data, dataclasses.replace(EXIT_OPTS, objective="classification")


def _hf_early_exit() -> tuple[torch.nn.Module, AuditData, AuditOptions]:
    transformers = pytest.importorskip("transformers")
    from fcaudit.io.hf_exit import EarlyExitLM
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": 3},
                                      intermediate_size=64, num_key_value_heads=2)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)
    ids = AuditData(RNG.integers(3, 120, (8, 12)), RNG.integers(3, 120, (8, 12)),
                    {"source": "tokens"})
    return EarlyExitLM(model, 0.8).eval(), ids, EXIT_OPTS


EXIT_FAMILIES = {"early-exit LM": _early_exit, "ponder": _ponder, "branchy": _branchy,
                 "hugging face --early-exit": _hf_early_exit}
UNIT = {"branchy": "example"}  # what one exit decision stops (the others: a token)


def _declared(model: torch.nn.Module, exit: Any) -> None:
    """``model`` declares its exit sites with ``exit(site)`` as their role."""
    sites = model.controller_sites()
    model.controller_sites = lambda: [dataclasses.replace(s, role=exit(s)) for s in sites]


def _thresholds(model: torch.nn.Module, value: float, rules: slice = slice(None)) -> None:
    for path in model.exit_rules()[rules]:
        model.get_submodule(path).threshold = value


def _exit_refusal(model: torch.nn.Module, data: AuditData, options: AuditOptions,
                  **kw: Any) -> str:
    with pytest.raises(FcauditError) as err:
        fcaudit.audit(model, None, data=data, options=options, report=False, **kw)
    return str(err.value)


@pytest.mark.parametrize("family", EXIT_FAMILIES)
def test_a_reversed_site_exit_is_refused_as_reversed(family: str) -> None:
    model, data, options = EXIT_FAMILIES[family]()
    first = model.controller_sites()[0].name
    _declared(model, lambda s: fcaudit.Exit(1.0, 0.0))
    assert _exit_refusal(model, data, options) == (
        f"exit site {first}: Exit(go=1.0, stop=0.0) is reversed: the model's rule stops every "
        f"{UNIT.get(family, 'token')} on the continue value 1.0 and none on the exit value "
        "0.0; declare Exit(go=0.0, stop=1.0)")


@pytest.mark.parametrize("family", EXIT_FAMILIES)
def test_a_threshold_the_exit_value_never_reaches_is_refused_for_that(family: str) -> None:
    """The rules' threshold above the sites' exit value 1.0 (from the second rule on
    where there are several: the site named is the first that never stops a token)."""
    model, data, options = EXIT_FAMILIES[family]()
    rules = slice(1, None) if len(model.exit_rules()) > 1 else slice(None)
    site = model.controller_sites()[rules][0].name
    _thresholds(model, 1.5, rules)
    assert _exit_refusal(model, data, options) == (
        f"exit site {site}: its exit value 1.0 (Exit(go=0.0, stop=1.0)) stops no "
        f"{UNIT.get(family, 'token')}, a value 1001 does: the rule's threshold is never "
        "reached by the declared exit value; declare one that reaches it")


@pytest.mark.parametrize("family", EXIT_FAMILIES)
def test_a_threshold_the_continue_value_reaches_is_refused_for_that(family: str) -> None:
    model, data, options = EXIT_FAMILIES[family]()
    _thresholds(model, 0.0)
    assert _exit_refusal(model, data, options) == (
        f"exit site {model.controller_sites()[0].name}: its continue value 0.0 "
        f"(Exit(go=0.0, stop=1.0)) stops every {UNIT.get(family, 'token')}, a value -1000 does "
        "not: the rule's threshold is always reached, even by the declared continue value; "
        "declare one that does not reach it")


# ------------------------------------------------------------------ dense twin


def test_a_twin_whose_blocks_did_not_all_run_names_the_first_that_did_not() -> None:
    """An exit model given as its own twin, with a threshold every token reaches at the first
    rule: its later blocks never run on the first window, which the old message listed as
    '4 blocks of [16] -> [16]' on both sides; now the first block that differs is named."""
    model, data, options = _early_exit()
    twin, _, _ = _early_exit()
    _thresholds(twin, 1e-9)
    assert _exit_refusal(model, data, dataclasses.replace(options, execution=True),
                         dense=twin) == (
        "exit site blocks.0.score: the dense twin is not the model's network at full depth: "
        "block 1 maps per-token shapes [16] -> [16] in the model (blocks.1.body), did not run "
        "on the first evaluation window in the twin (blocks.1.body); executed depth and FLOPs "
        "are read against the twin, so give the same network run to full depth (dense=)")
