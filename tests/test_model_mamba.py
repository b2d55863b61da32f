"""Mamba and its LTI twin S4D: the chunked scan against a plain loop, the selection sites,
replay, the twin's convolution modes, and run folders.

References: the recurrence ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t u_t``, ``y_t = C_t . h_t``
written as a step-by-step loop here (not the model's scan), and autograd through that loop
for the hand-written backward pass.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from fcaudit.core.errors import FcauditError, ModelError
from fcaudit.core.layout import TOKEN_AXES
from fcaudit.core.recording import record
from fcaudit.core.replaying import replay, replaying
from fcaudit.io.loading import load
from fcaudit.models.mamba import PRESETS, Mamba, MambaConfig, selective_scan
from fcaudit.models.s4d import S4D, S4DConfig
from fcaudit.study.train import train

CFG = MambaConfig(vocab_size=97, block_size=32, n_layer=3, n_embd=16, d_state=4, dt_rank=2,
                  chunk=5)
B, T = 2, 12
D, N = 32, 4  # d_inner = expand * n_embd, d_state


@pytest.fixture
def model() -> Mamba:
    torch.manual_seed(0)
    return Mamba(CFG).eval()


def loop_scan(u, dt, A, Bs, Cs):
    """The recurrence one step at a time (the independent reference)."""
    h = torch.zeros(u.shape[0], u.shape[2], A.shape[1], dtype=u.dtype)
    ys = []
    for t in range(u.shape[1]):
        h = torch.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * u[:, t])[..., None] * Bs[:, t, None]
        ys.append((h * Cs[:, t, None]).sum(-1))
    return torch.stack(ys, 1)


def scan_inputs(dtype=torch.float32, step=3.0, b=2, t=37, d=5, n=3):
    torch.manual_seed(1)
    return [torch.randn(b, t, d, dtype=dtype), torch.rand(b, t, d, dtype=dtype) * step,
            -torch.rand(d, n, dtype=dtype) * 20, torch.randn(b, t, n, dtype=dtype),
            torch.randn(b, t, n, dtype=dtype)]


@pytest.mark.parametrize("chunk", [1, 4, 16, 37, 64])
def test_chunked_scan_equals_the_sequential_loop(chunk):
    args = scan_inputs()  # 37 steps: chunks that do and do not divide the length
    got = selective_scan(*args, chunk)
    assert (got - loop_scan(*args)).abs().max() < 1e-5


def test_chunk_length_changes_no_bit():
    """Chunks only group the work: the state is carried, not recombined, between them."""
    args = scan_inputs()
    first = selective_scan(*args, 1)
    assert all(torch.equal(selective_scan(*args, c), first) for c in (3, 16, 64))


def test_scan_stays_finite_where_a_dividing_form_overflows():
    # dt |A| up to 10 * 20 = 200 per step: exp(-cumsum) would pass float32's 3.4e38
    args = scan_inputs(step=10.0)
    got = selective_scan(*args, 16)
    assert torch.isfinite(got).all()
    assert (got - loop_scan(*args)).abs().max() < 1e-5


def test_scan_gradients_equal_autograd_through_the_loop():
    args = [a.requires_grad_() for a in scan_inputs(torch.float64, t=13)]
    twins = [a.detach().clone().requires_grad_() for a in args]
    weights = torch.randn(2, 13, 5, dtype=torch.float64)
    got = torch.autograd.grad((selective_scan(*args, 4) * weights).sum(), args)
    want = torch.autograd.grad((loop_scan(*twins) * weights).sum(), twins)
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, atol=1e-10, rtol=1e-9)


def test_shapes_and_selection_sites(model):
    ids = torch.randint(0, 97, (B, T))
    assert model(ids).shape == (B, T, 97)
    coeffs = record(model, ids)
    names = [f"layers.{i}.{f}" for f in ("dt", "B", "C") for i in range(3)]
    assert list(coeffs) == names
    assert all(coeffs[f"layers.{i}.dt"].shape == (B, T, D) for i in range(3))
    assert all(coeffs[f"layers.{i}.{f}"].shape == (B, T, N) for i in range(3) for f in "BC")
    sites = {s.name: s for s in model.controller_sites()}
    assert sites["layers.1.dt"].path == "layers.1.mixer.dt_proj"
    assert sites["layers.2.C"].path == "layers.2.mixer.C_proj"
    assert {s.family for s in sites.values()} == {"dt", "B", "C"}
    assert sites["layers.0.dt"].selection.space == "Δ before softplus"
    assert all(s.selection and s.axes == TOKEN_AXES and s.positions == (1,)
               for s in sites.values())
    assert model.execution_blocks() == ["layers.0", "layers.1", "layers.2"]


@pytest.mark.parametrize("mode", [None, "fft", "conv", "scan"])
def test_a_later_token_changes_no_earlier_logit(model, mode):
    net = model if mode is None else S4D(S4DConfig(**{**dataclasses.asdict(CFG), "mode": mode}))
    ids = torch.randint(0, 97, (1, T))
    later = ids.clone()
    later[0, 7] = (ids[0, 7] + 1) % 97
    with torch.no_grad():
        a, b = net.eval()(ids), net(later)
    assert not torch.allclose(a[:, 7:], b[:, 7:])
    if mode == "fft":  # every output is a sum over all frequencies: causal up to rounding
        assert torch.allclose(a[:, :7], b[:, :7], atol=1e-5, rtol=0)
    else:
        assert torch.equal(a[:, :7], b[:, :7])


def test_identity_replay_is_bitwise_exact(model):
    ids = torch.randint(0, 97, (B, T))
    with torch.no_grad():
        live = model(ids)
    coeffs = record(model, ids)
    with torch.no_grad(), replay(model, coeffs):
        replayed = model(ids)
    assert torch.equal(live.view(torch.uint8), replayed.view(torch.uint8))


@pytest.mark.parametrize("family", ["dt", "B", "C"])
def test_donor_selection_changes_the_output(model, family):
    ids = torch.randint(0, 97, (2, 1, T))
    donor = {k: v for k, v in record(model, ids[1]).items() if k.endswith(f".{family}")}
    with torch.no_grad():
        live = model(ids[0])
        with replay(model, donor):
            assert not torch.allclose(model(ids[0]), live)


def twin_weights(model: Mamba, dt: torch.Tensor, b: torch.Tensor,
                 c: torch.Tensor) -> dict[str, torch.Tensor]:
    """The Mamba's state with its selection modules swapped for the constants."""
    kept = {k: v for k, v in model.state_dict().items()
            if not any(f".{m}." in k for m in ("dt_proj", "B_proj", "C_proj"))}
    for i in range(CFG.n_layer):
        kept.update({f"layers.{i}.mixer.dt": dt[i], f"layers.{i}.mixer.B": b[i],
                     f"layers.{i}.mixer.C": c[i]})
    return kept


def test_selection_held_constant_is_the_lti_twin(model):
    """The static-layer profile of a Mamba (dt, B, C fixed per layer) is exactly S4D."""
    torch.manual_seed(2)
    dt, b, c = torch.randn(3, D) - 2, torch.randn(3, N), torch.randn(3, N)
    ids = torch.randint(0, 97, (B, T))
    fixed = {s: {"dt": dt, "B": b, "C": c}[s.family][s.layer].expand(B, T, -1)
             for s in model.controller_sites()}
    with torch.no_grad(), replaying(model, fixed):
        held = model(ids)
    twin = model.dense_counterpart()
    twin.load_state_dict(twin_weights(model, dt, b, c), strict=True)
    for mode in ("scan", "fft"):
        for layer in twin.layers:
            layer.mixer.mode = mode
        with torch.no_grad():
            assert torch.allclose(twin(ids), held, atol=1e-5)


def test_twin_has_the_width_and_depth_and_no_sites(model):
    twin = model.dense_counterpart()
    assert isinstance(twin, S4D) and twin.controller_sites() == []
    assert dataclasses.asdict(twin.config) == {**dataclasses.asdict(CFG), "mode": "fft"}
    assert twin.execution_blocks() == model.execution_blocks()
    # selection modules: dt (D -> 2 -> D, bias D), B and C (D -> N); the twin's: D + 2N
    selective = D * 2 + 2 * D + D + 2 * D * N
    count = [sum(p.numel() for p in m.parameters()) for m in (model, twin)]
    assert count[0] - count[1] == CFG.n_layer * (selective - (D + 2 * N))


def test_s4d_convolution_modes_equal_its_scan():
    torch.manual_seed(3)
    ids = torch.randint(0, 97, (B, 23))
    outputs = {}
    for mode in ("scan", "fft", "conv"):
        torch.manual_seed(0)
        twin = S4D(S4DConfig(**{**dataclasses.asdict(CFG), "mode": mode})).eval()
        with torch.no_grad():
            for layer in twin.layers:  # steps up to softplus(2) ~ 2.1: long and short memory
                layer.mixer.dt.uniform_(-4, 2)
            outputs[mode] = twin(ids)
    assert (outputs["fft"] - outputs["scan"]).abs().max() < 1e-4
    assert (outputs["conv"] - outputs["scan"]).abs().max() < 1e-4


def test_an_inference_kernel_is_reused_only_while_its_weights_are_the_same():
    """Without gradients the kernel of a length is computed once; any change to the
    weights (in place, through ``.data`` with no version bump, or new tensors) or the
    length computes it again: each output equals a model built afresh from the weights."""
    torch.manual_seed(0)
    twin = S4D(S4DConfig(**dataclasses.asdict(CFG))).eval()
    ids = torch.randint(0, 97, (B, 19))

    def fresh(x: torch.Tensor) -> torch.Tensor:
        other = S4D(twin.config).eval()
        other.load_state_dict(twin.state_dict())
        with torch.enable_grad():  # the gradient path never reuses a kernel
            return other(x).detach()
    with torch.no_grad():
        first = twin(ids)
        assert torch.equal(first, fresh(ids)) and torch.equal(twin(ids), first)
        twin.layers[0].mixer.dt.add_(0.5)  # in place
        assert torch.equal(twin(ids), fresh(ids)) and not torch.equal(twin(ids), first)
        twin.layers[1].mixer.C.data.mul_(2.0)  # through .data: the version does not move
        assert torch.equal(twin(ids), fresh(ids))
        twin.layers[0].mixer.B = torch.nn.Parameter(twin.layers[0].mixer.B * 3)  # new tensor
        assert torch.equal(twin(ids), fresh(ids))
        shorter = ids[:, :7]
        assert torch.equal(twin(shorter), fresh(shorter))


def test_counted_flops_do_not_depend_on_what_ran_before():
    """The execution audit counts after an uncounted pass, so a time-invariant model's
    kernel (made once from the weights) is never in the count: a fresh model, one that
    ran this length before and one that ran another length give the same FLOPs."""
    from fcaudit.engine.execution import execution_pass
    ids = torch.randint(0, 97, (B, 21))
    counts = []
    for before in (None, ids, ids[:, :5]):
        torch.manual_seed(0)
        twin = S4D(S4DConfig(**dataclasses.asdict(CFG))).eval()
        if before is not None:
            with torch.no_grad():
                twin(before)
        counts.append(execution_pass(twin, twin.execution_blocks(), [ids])["flops_per_token"])
    assert counts[0] > 0 and counts == [counts[0]] * 3


@pytest.mark.parametrize("cfg, field", [
    (dict(d_state=0), "d_state=0"), (dict(chunk=1.5), "chunk=1.5"),
    (dict(dt_min=0.2, dt_max=0.1), "dt_min=0.2")])
def test_bad_configs_are_refused(cfg, field):
    with pytest.raises(FcauditError, match=field):
        MambaConfig(**cfg)
    with pytest.raises(FcauditError, match="mode='ffft' must be one of fft, conv, scan"):
        S4DConfig(mode="ffft")


def test_tiny_preset_has_the_hand_counted_parameters():
    """Counted by hand from the config: width c, inner D = expand * c, state N, conv k,
    Δ rank r, vocabulary V, L layers (FeatureGate tiny, for scale: 1,335,556)."""
    cfg = PRESETS["tiny"]
    c, N, k, r, V, L = cfg.n_embd, cfg.d_state, cfg.d_conv, cfg.dt_rank, cfg.vocab_size, \
        cfg.n_layer
    D = cfg.expand * c
    layer = (c  # RMSNorm weight
             + c * 2 * D  # in_proj (x and z, no bias)
             + D * k + D  # depthwise conv weight [D, 1, k] and bias
             + D * N + D  # A_log and the skip D
             + D * r + r * D + D  # Δ: down (no bias), up with bias
             + 2 * D * N  # B_proj, C_proj (no bias)
             + D * c)  # out_proj (no bias)
    expected = V * c + L * layer + c + c * V  # embedding, layers, final norm, untied head
    assert (c, D, N, k, r, V, L) == (128, 256, 16, 4, 8, 2048, 4)
    assert expected == 990_848
    with torch.device("meta"):
        n = sum(p.numel() for p in Mamba(cfg).parameters())
    assert n == expected


@pytest.mark.parametrize("arch, cls, mode", [("mamba", Mamba, None), ("s4d", S4D, "fft")])
def test_run_folder_round_trips(tmp_path, arch, cls, mode):
    folder = train(arch, "tiny", 0, tmp_path / "run", steps=1, progress=False)
    saved = json.loads((folder / "config.json").read_text())["model_config"]
    assert saved["d_state"] == 16 and saved.get("mode") == mode
    loaded = load(str(folder))
    assert isinstance(loaded.model, cls)
    assert dataclasses.asdict(loaded.model.config) == saved
    ids = torch.randint(0, 2048, (1, 16))
    if arch == "mamba":
        assert record(loaded.model, ids)["layers.3.dt"].shape == (1, 16, 256)
    else:  # the twin has nothing to record, and says so in one line
        with pytest.raises(ModelError, match="S4D declares no controller sites"):
            record(loaded.model, ids)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mamba", "s4d"])
def test_short_training_lowers_the_loss(tmp_path, arch):
    folder = train(arch, "tiny", 0, tmp_path / "run", steps=60, progress=False)
    log = [json.loads(line) for line in (folder / "train_log.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in log if "loss" in row]
    assert losses[-1] < losses[0] - 1.0
    results = json.loads((folder / "config.json").read_text())["results"]
    assert results["eval_nll"] < results["unigram_nll"]
