"""Selective state-space families of transformers, found without ``--sites``: which tensors
are the selection coefficients (expected from each config, read by hand here), identity
replay bit for bit, a donor's coefficients changing the output, wrong slices and fused
kernels refused in one line, and whole audits of a hybrid (Jamba: selection sites beside
its MoE routers) and of a saved Mamba folder through the command line."""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import AUDIT_FAST, optional_extra, run_inprocess, save

transformers = optional_extra("transformers")

from ssm_families import SSM_FAMILIES, VOCAB, build  # noqa: E402

import fcaudit  # noqa: E402
from fcaudit.core.adapters import SliceAdapter  # noqa: E402
from fcaudit.core.contract import Site  # noqa: E402
from fcaudit.core.discovery import declared_sites  # noqa: E402
from fcaudit.core.errors import FcauditError, ModelError, UsageError  # noqa: E402

MAMBA, MAMBA2 = "mamba_selection", "mamba2_selection"
Expected = list[tuple[str, str, tuple[tuple[str, int], ...]]]


def _mamba1(path: str, layers: list[int], rank: int, state: int) -> Expected:
    """x_proj's output [dt (rank) | B (state) | C (state)] per Mamba layer."""
    return [(path.format(i), MAMBA, (("dt", rank), ("B", state), ("C", state))) for i in layers]


def _mamba2(path: str, layers: list[int], heads: int, groups: int, state: int) -> Expected:
    """in_proj's dt (one per head), B and C (one state vector per group) slices."""
    return [(path.format(i), MAMBA2, (("dt", heads), ("B", groups * state),
                                      ("C", groups * state))) for i in layers]


def _kind(c: Any, kind: str) -> list[int]:
    return [i for i, t in enumerate(c.layer_types) if t == kind]


# family -> the selection sites its config implies: (module path, family, parts)
EXPECTED: dict[str, Callable[[Any], Expected]] = {
    "bamba": lambda c: _mamba2("model.layers.{}.mamba.in_proj",
                               [i for i in range(c.num_hidden_layers)
                                if i not in c.attn_layer_indices],
                               c.mamba_n_heads, c.mamba_n_groups, c.mamba_d_state),
    "falcon_h1": lambda c: _mamba2("model.layers.{}.mamba.in_proj",
                                   list(range(c.num_hidden_layers)), c.mamba_n_heads,
                                   c.mamba_n_groups, c.mamba_d_state),
    "falcon_mamba": lambda c: _mamba1("backbone.layers.{}.mixer.x_proj",
                                      list(range(c.num_hidden_layers)), c.time_step_rank,
                                      c.state_size),
    "granitemoehybrid": lambda c: _mamba2("model.layers.{}.mamba.in_proj",
                                          _kind(c, "linear_attention"), c.mamba_n_heads,
                                          c.mamba_n_groups, c.mamba_d_state),
    "jamba": lambda c: _mamba1("model.layers.{}.mamba.x_proj",
                               [i for i in range(c.num_hidden_layers)
                                if (i - c.attn_layer_offset) % c.attn_layer_period],
                               c.mamba_dt_rank, c.mamba_d_state),
    "mamba": lambda c: _mamba1("backbone.layers.{}.mixer.x_proj",
                               list(range(c.num_hidden_layers)), c.time_step_rank,
                               c.state_size),
    "mamba2": lambda c: _mamba2("backbone.layers.{}.mixer.in_proj",
                                list(range(c.num_hidden_layers)), c.num_heads, c.n_groups,
                                c.state_size),
    "nemotron_h": lambda c: _mamba2("model.layers.{}.mixer.in_proj",
                                    _kind(c, "linear_attention"), c.mamba_num_heads,
                                    c.n_groups, c.ssm_state_size),
    "zamba2": lambda c: sorted(
        _mamba2("model.layers.{}.mamba.in_proj", _kind(c, "linear_attention"),
                c.n_mamba_heads, c.mamba_ngroups, c.mamba_d_state)
        + _mamba2("model.layers.{}.mamba_decoder.mamba.in_proj", _kind(c, "hybrid"),
                  c.n_mamba_heads, c.mamba_ngroups, c.mamba_d_state)),
}
# the MoE routers of the hybrids, found by the router rule beside the selection sites
ROUTERS = {"granitemoehybrid": 3, "jamba": 1, "nemotron_h": 1}


def tokens(batch: int = 3, seq_len: int = 10, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def selection(sites: list[Site]) -> list[Site]:
    return [s for s in sites if s.selection is not None]


def test_the_family_table_is_sorted_and_holds_every_expected_family() -> None:
    assert list(SSM_FAMILIES) == sorted(SSM_FAMILIES)  # one entry per family, sorted
    assert set(EXPECTED) <= set(SSM_FAMILIES)


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_selection_sites_are_the_ones_the_config_implies(family: str) -> None:
    model = build(family)
    sites = declared_sites(model) or []
    found = [(s.name, s.family, s.selection.parts) for s in selection(sites)]
    assert sorted(found) == sorted(EXPECTED[family](model.config))
    assert all(s.path == s.name for s in sites)
    for fam in (MAMBA, MAMBA2):  # layer = order within the family, in module order
        assert [s.layer for s in sites if s.family == fam] == \
            list(range(sum(s.family == fam for s in sites)))
    assert sum(s.family == "router" for s in sites) == ROUTERS.get(family, 0)
    assert all(s.family in ("router", "shared_expert_gate", MAMBA, MAMBA2) for s in sites)
    assert all(s.axes == ("example", "token") and s.positions == (1,) for s in sites)


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_coefficients_are_the_slices_the_scan_reads(family: str) -> None:
    """Against the module's output seen by a plain hook: x_proj's whole output (Mamba-1);
    in_proj's B, C and dt, which end its output in that order (Mamba-2)."""
    model = build(family)
    ids = tokens()
    sites = selection(declared_sites(model) or [])
    seen: dict[str, torch.Tensor] = {}
    handles = [model.get_submodule(s.path).register_forward_hook(
        lambda _m, _a, out, name=s.name: seen.setdefault(name, out.detach().clone()))
        for s in sites]
    recorded = fcaudit.record(model, ids)
    for h in handles:
        h.remove()
    for site in sites:
        out = seen[site.name]
        (_, dt), (_, bc), _ = site.selection.parts
        if site.family == MAMBA:
            expected = out
        else:
            tail = out[..., out.shape[-1] - dt - 2 * bc:]
            expected = torch.cat([tail[..., 2 * bc:], tail[..., :2 * bc]], dim=-1)
        assert torch.equal(recorded[site.name], expected)


@pytest.mark.parametrize("family", list(EXPECTED))
def test_identity_replay_is_exact_and_a_donor_changes_the_output(family: str) -> None:
    model = build(family)
    ids = tokens()
    assert selection(declared_sites(model) or [])  # found without --sites
    with torch.no_grad():
        plain = model(ids).logits
        recorded = fcaudit.record(model, ids)
        with fcaudit.replay(model, recorded):
            replayed = model(ids).logits
        assert torch.equal(replayed, plain)  # bit for bit
        donor = [1, 2, 0]  # each sequence gets the next one's selection coefficients
        swapped = recorded.with_coefficients({s.name: recorded[s.name][donor]
                                              for s in selection(recorded.sites)})
        with fcaudit.replay(model, swapped):
            given = model(ids).logits
    for row in range(len(ids)):
        assert not torch.equal(given[row], plain[row])


@pytest.mark.parametrize("family", ["mamba", "mamba2"])
def test_a_slice_outside_the_output_is_refused_naming_the_site(family: str) -> None:
    model = build(family)
    site = selection(declared_sites(model) or [])[0]
    width = model.get_submodule(site.path).out_features
    wrong = Site(site.name, site.path, "wrong", 0, SliceAdapter(((width - 2, width + 2),)))
    with pytest.raises(FcauditError) as caught:
        fcaudit.record(model, tokens(), sites=[wrong])
    message = str(caught.value)
    assert message.startswith(f"site {site.name} (Linear, adapter slice): ")
    assert f"narrower than the channel slices [({width - 2}, {width + 2})]" in message
    assert "\n" not in message


@pytest.mark.parametrize("spans", [(), ((4, 4),), ((3, 1),), ((-1, 2),), ((0, 4), (2, 6))])
def test_malformed_slices_are_refused(spans: tuple) -> None:
    with pytest.raises(UsageError, match=r"SliceAdapter spans must be \(start, stop\) channel "
                                         r"pairs with 0 <= start < stop, none overlapping"):
        SliceAdapter(spans)


# ---- fused kernels: transformers' own dispatch, given a stand-in for the mamba_ssm package


# family -> its modeling module and the path of its first mixer
MIXERS = {"mamba": ("mamba", "backbone.layers.0.mixer"),
          "falcon_mamba": ("falcon_mamba", "backbone.layers.0.mixer"),
          "jamba": ("jamba", "model.layers.0.mamba")}


@pytest.fixture(params=sorted(MIXERS))
def fused(request: pytest.FixtureRequest,
          monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """The family's ``mamba_inner_fn`` dispatched as transformers does when ``mamba_ssm``
    is installed: transformers' own decorator applied afresh to its PyTorch stand-in (which
    returns None), with a stand-in package whose kernel returns the block's output without
    calling ``x_proj`` (the real one reads its weight) and, from transformers 5.25, which
    runs only on the devices the package supports, CPU among them here. ``calls_fused``:
    whether this transformers' mixer calls ``mamba_inner_fn`` at all (5.25 dropped
    FalconMamba's training path; Jamba never had one)."""
    import importlib
    import inspect

    from transformers.integrations import hub_kernels
    module, mixer = MIXERS[request.param]
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    calls = []

    def kernel(xz: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(xz.shape)
        out_weight = args[4]
        return torch.zeros(xz.shape[0], xz.shape[2], out_weight.shape[0])

    def torch_path(*args: Any, **kwargs: Any) -> None:  # transformers' stand-in
        return None

    kernel.__module__ = "mamba_ssm.ops.selective_scan_interface"
    kernel.__name__ = "mamba_inner_fn"
    package = types.ModuleType("mamba_ssm")
    package.mamba_inner_fn = kernel  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mamba_ssm", package)
    devices = getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", None)
    if devices is not None:
        monkeypatch.setitem(devices, "mamba_ssm", ("cuda", "cpu"))
    dispatch = hub_kernels.use_kernel_func_from_hub_with_fallback(
        "mamba_inner_fn", "mamba_ssm")(torch_path)
    monkeypatch.setattr(modeling, "mamba_inner_fn", dispatch, raising=False)
    model = build(request.param)
    forward = inspect.unwrap(type(model.get_submodule(mixer)).forward)
    return types.SimpleNamespace(family=request.param, mixer=mixer, calls=calls, model=model,
                                 calls_fused="mamba_inner_fn" in forward.__code__.co_names)


def test_a_fused_training_kernel_that_skips_x_proj_is_refused(fused) -> None:
    """A mixer whose forward calls mamba_inner_fn in training mode (Mamba; FalconMamba
    before transformers 5.25) is refused there; one that never does (Jamba) records."""
    model = fused.model.train()
    x_proj_calls = []
    model.get_submodule(f"{fused.mixer}.x_proj").register_forward_hook(
        lambda *_: x_proj_calls.append(1))
    with torch.no_grad():
        model(tokens())
    assert fused.calls_fused or fused.family != "mamba"  # the refusal is tested somewhere
    if not fused.calls_fused:
        assert not fused.calls and x_proj_calls
        assert len(selection(fcaudit.record(model, tokens()).sites)) == 2
        return
    assert len(fused.calls) == 2 and not x_proj_calls  # the kernel ran, x_proj never did
    for attempt in (lambda: declared_sites(model), lambda: fcaudit.record(model, tokens())):
        with pytest.raises(ModelError) as caught:
            attempt()
        assert str(caught.value) == (
            f"Mamba mixer {fused.mixer} is in training mode, where transformers runs the fused "
            "kernel mamba_ssm.ops.selective_scan_interface.mamba_inner_fn, which reads "
            "x_proj's weight without calling x_proj: its selection coefficients (dt, B, C) "
            "could be neither recorded nor replayed; call model.eval() before the audit "
            "(fcaudit audit does)")
        assert caught.value.site == f"{fused.mixer}.x_proj"


def test_in_eval_mode_the_module_path_runs_beside_the_kernel(fused) -> None:
    model = fused.model.eval()
    ids = tokens()
    with torch.no_grad():
        plain = model(ids).logits
        recorded = fcaudit.record(model, ids)
        with fcaudit.replay(model, recorded):
            assert torch.equal(model(ids).logits, plain)
    assert not fused.calls


def test_hub_kernels_in_training_mode_are_refused_too() -> None:
    """``use_kernels=True`` swaps transformers' functions for hub kernels at run time, out of
    sight of the closure read: a Mamba mixer that would call ``mamba_inner_fn`` is refused."""
    model = build("mamba").train()
    model._use_kernels = True  # what transformers' kernelize() sets
    with pytest.raises(ModelError, match=r"^Mamba mixer backbone\.layers\.0\.mixer is in "
                                         r"training mode, where transformers runs a hub kernel "
                                         r"for mamba_inner_fn \(use_kernels=True\), which "
                                         r"reads x_proj's weight"):
        declared_sites(model)
    for module in model.modules():  # eval mode (model.eval() would call kernelize() here)
        module.training = False
    assert len(selection(declared_sites(model) or [])) == 2


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba", "jamba"])
def test_training_mode_without_a_kernel_keeps_the_module_path(family: str) -> None:
    """transformers' PyTorch stand-in returns None there, and the module path runs."""
    model = build(family).train()
    assert len(selection(declared_sites(model) or [])) == 2
    recorded = fcaudit.record(model, tokens())
    assert len(selection(recorded.sites)) == 2


# ---- whole audits


def test_a_hybrid_audits_selection_beside_its_routers(tmp_path: Path) -> None:
    from fcaudit.api import audit
    from fcaudit.engine.run import AuditOptions
    from fcaudit.io.data import AuditData
    model = build("jamba")
    rng = np.random.default_rng(0)
    data = AuditData(rng.integers(3, VOCAB, (8, 12)), rng.integers(3, VOCAB, (8, 12)), {})
    result = audit(model, tmp_path, data=data, options=AuditOptions(
        repeats=1, bootstrap=50, batch_size=4, timing_pairs=0, progress=False))
    assert result.identity_replay_max_abs_diff == 0.0
    sites = json.loads((tmp_path / "audit.json").read_text())["sites"]
    assert [(s["name"], s["family"], s["layer"], s["trailing_shape"]) for s in sites] == [
        ("model.layers.1.feed_forward.router", "router", 0, [4]),
        ("model.layers.0.mamba.x_proj", MAMBA, 0, [3 + 6 + 6]),
        ("model.layers.2.mamba.x_proj", MAMBA, 1, [3 + 6 + 6])]
    assert set(result.variance) == {"router", MAMBA}  # families kept apart
    assert set(result.routing) == {"router"}  # routing metrics only where experts are chosen
    report = (tmp_path / "report.md").read_text()
    for family in ("router", MAMBA):  # each family its own section of the report
        assert f"### Family `{family}`" in report
        escaped = family.replace("_", r"\_")  # as Markdown writes it
        assert f"{escaped}: coefficients vary" in report  # and its own part of the answer
    answer = next(line for line in report.splitlines() if line.startswith("**router: "))
    assert answer.count("their variance splits into layer identity") == 2


def test_the_cli_audits_a_saved_mamba_folder(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    folder = save(SSM_FAMILIES["mamba"](), tmp_path / "mamba")
    listed = run_inprocess(["sites", "--model", folder], capsys)
    assert listed.returncode == 0, listed.stderr
    names = [f"backbone.layers.{i}.mixer.x_proj" for i in range(2)]
    assert all(name in listed.stdout for name in names)
    out = tmp_path / "out"
    res = run_inprocess(["audit", "--model", folder, "--out", out, "--quiet", *AUDIT_FAST],
                        capsys)
    assert res.returncode == 0, res.stderr
    result = json.loads((out / "audit.json").read_text())
    assert [(s["name"], s["family"], s["trailing_shape"]) for s in result["sites"]] == [
        (name, MAMBA, [3 + 6 + 6]) for name in names]
    assert result["identity_replay_max_abs_diff"] == 0.0
