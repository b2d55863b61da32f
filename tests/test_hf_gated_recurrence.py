"""Selection sites of gated linear attention and gated recurrences in ``transformers``
(issue 30, item 1): Gated DeltaNet (Qwen3-Next), Kimi Delta Attention, RG-LRU
(RecurrentGemma), mLSTM (xLSTM), RWKV-4, LFM2's short convolution, Zamba's Mamba.

Every family of ``tests/ssm_families.py`` is built from a tiny random config. The
expected sites (paths, families, widths) are read off the config, not off the rule;
what each coefficient is, is checked against the tensors the model's own code hands its
recurrence (captured by patching the recurrence function) or against a hand computation.
Fused kernels are simulated by patching; none is installed here.
"""

from __future__ import annotations

import functools
import time
import types
from typing import Any

import pytest
import ssm_families
import torch
from conftest import optional_extra
from ssm_families import SSM_FAMILIES, VOCAB
from torch import Tensor, nn

transformers = optional_extra("transformers")

import fcaudit  # noqa: E402
from fcaudit.core.contract import Site, SiteCall  # noqa: E402
from fcaudit.core.discovery import declared_sites  # noqa: E402
from fcaudit.core.errors import FcauditError, ModelError  # noqa: E402
from fcaudit.core.gated_recurrence import (  # noqa: E402
    HEADS_TOKENS,
    Tap,
    WeightTapAdapter,
    gated_recurrence_sites,
)

ROUTER_FAMILIES = {"router", "shared_expert_gate"}
SEQ_LEN = 12  # a multiple of the xLSTM config's chunk size


# the families whose selection sites the gated-recurrence rule finds (the rest of the
# table are Mamba-style mixers: tests/test_hf_selection.py)
GATED = ("bailing_hybrid", "kimi_linear", "lara_mini", "lfm2", "lfm2_moe", "lfm3",
         "olmo_hybrid", "qwen3_5", "qwen3_5_moe", "qwen3_next", "recurrent_gemma", "rwkv",
         "xlstm", "zamba")
build = functools.cache(ssm_families.build)  # one model per family for the whole file


def tokens(seed: int) -> Tensor:
    return torch.randint(3, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


def expected_sites(family: str, config: Any) -> list[tuple[str, str, tuple[tuple[str, int], ...]]]:
    """(path, site family, parts) in module order, from the config alone; a site with one
    coefficient has the single part (its family, width)."""
    def layers(kinds: list[str], kind: str) -> list[int]:
        return [i for i, k in enumerate(kinds) if k == kind]
    linear = layers(getattr(config, "layer_types", None) or [], "linear_attention")
    if family == "qwen3_next":
        v = config.linear_num_value_heads
        return [(f"model.layers.{i}.linear_attn.in_proj_ba", "gated_deltanet",
                 (("beta", v), ("decay", v))) for i in linear]
    if family in ("lara_mini", "olmo_hybrid", "qwen3_5", "qwen3_5_moe"):
        b, a = ("b_proj", "a_proj") if family == "olmo_hybrid" else ("in_proj_b", "in_proj_a")
        v = config.linear_num_value_heads
        return [site for i in linear for site in (
            (f"model.layers.{i}.linear_attn.{b}", "gated_deltanet_beta",
             (("gated_deltanet_beta", v),)),
            (f"model.layers.{i}.linear_attn.{a}", "gated_deltanet_decay",
             (("gated_deltanet_decay", v),)))]
    if family in ("kimi_linear", "bailing_hybrid"):
        decay = "f_b_proj" if family == "kimi_linear" else "f_proj"  # Bailing: not low-rank
        return [site for i in linear for site in (
            (f"model.layers.{i}.self_attn.forget_gate.{decay}", "kda_decay",
             (("kda_decay", config.linear_num_heads * config.linear_head_dim),)),
            (f"model.layers.{i}.self_attn.b_proj", "kda_beta",
             (("kda_beta", config.linear_num_heads),)))]
    if family == "recurrent_gemma":
        w = config.lru_width
        return [(f"model.layers.{i}.temporal_block.rg_lru", "rglru",
                 (("input_gate", w), ("recurrent_gate", w)))
                for i in range(config.num_hidden_layers)
                if config.block_types[i % len(config.block_types)] == "recurrent"]
    if family == "xlstm":
        return [site for i in range(config.num_hidden_layers) for site in (
            (f"backbone.blocks.{i}.mlstm_layer.igate_preact", "mlstm_input_gate",
             (("mlstm_input_gate", config.num_heads),)),
            (f"backbone.blocks.{i}.mlstm_layer.fgate_preact", "mlstm_forget_gate",
             (("mlstm_forget_gate", config.num_heads),)))]
    if family == "rwkv":
        return [site for i in range(config.num_hidden_layers) for site in (
            (f"rwkv.blocks.{i}.attention.receptance", "rwkv_receptance",
             (("rwkv_receptance", config.attention_hidden_size),)),
            (f"rwkv.blocks.{i}.attention.key", "rwkv_key",
             (("rwkv_key", config.attention_hidden_size),)))]
    if family in ("lfm2", "lfm2_moe", "lfm3"):
        h = config.hidden_size
        return [(f"model.layers.{i}.conv.in_proj", "short_conv", (("B", h), ("C", h)))
                for i in layers(config.layer_types, "conv")]
    assert family == "zamba"
    state = config.n_mamba_heads * config.mamba_d_state
    return [(f"model.layers.{i}." + ("mamba" if kind == "linear_attention"
                                     else "mamba_decoder.mamba"), "mamba_selection",
             (("dt", config.mamba_expand * config.hidden_size), ("B", state), ("C", state)))
            for i, kind in enumerate(config.layers_block_type)]


def selection(sites: list[Site]) -> list[Site]:
    return [s for s in sites if s.family not in ROUTER_FAMILIES]


def parts_of(site: Site) -> tuple[tuple[str, int], ...]:
    return site.selection.parts or ((site.family, -1),)


@pytest.mark.parametrize("family", GATED)
def test_sites_found_without_sites(family: str):
    """Discovery (no sites=) finds exactly the selection sites the config implies, each
    named by path, numbered within its family, with its space named; the recorded
    coefficients are as wide as their parts; hybrids' routers come beside them, in
    families of their own."""
    model = build(family)
    expected = expected_sites(family, model.config)
    found = declared_sites(model)
    assert found is not None
    mine = selection(found)
    assert [(s.path, s.family) for s in mine] == [(p, f) for p, f, _ in expected]
    assert all(s.name == s.path and s.selection for s in mine)
    for fam in {s.family for s in mine}:
        assert [s.layer for s in mine if s.family == fam] == list(
            range(sum(f == fam for _, f, _ in expected)))
    recording = fcaudit.record(model, tokens(1))
    for site, (_, _, parts) in zip(mine, expected, strict=True):
        width = sum(w for _, w in parts)
        assert list(recording[site.name].shape) == [2, SEQ_LEN, width]
        if len(parts) > 1:
            assert site.selection.parts == parts
    routers = {s.family for s in found} & ROUTER_FAMILIES
    # Kimi-Linear's, Bailing's and Lara-Mini's shared experts are not gated; the Qwens' are
    gated = family in ("qwen3_next", "qwen3_5_moe")
    routed = gated or family in ("bailing_hybrid", "kimi_linear", "lara_mini", "lfm2_moe")
    assert routers == ({"router", "shared_expert_gate"} if gated else {"router"} if routed
                       else set())


@pytest.mark.parametrize("family", GATED)
def test_identity_exact_and_each_donor_changes_the_output(family: str):
    """Replaying the recorded coefficients gives the logits bit for bit; feeding one
    selection site another input's coefficients (the rest recorded) changes them."""
    model = build(family)
    x = tokens(1)
    recording = fcaudit.record(model, x)
    donor = fcaudit.record(model, tokens(2))
    with torch.no_grad(), fcaudit.replay(model, recording):
        assert torch.equal(model(x).logits, recording.logits)
    for site in selection(list(recording.sites)):
        assert not torch.equal(donor[site.name], recording[site.name])
        mixed = recording.with_coefficients({site.name: donor[site.name]})
        with torch.no_grad(), fcaudit.replay(model, mixed):
            assert not torch.equal(model(x).logits, recording.logits), site.name


class Lossy:
    """A wrong adapter: the site's own, but its rebuild rounds the coefficients to
    bfloat16 (a stray cast), so the rebuilt output is not the recorded one."""

    name = "lossy"

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter

    def extract(self, output: Any, call: SiteCall) -> Tensor:
        return self.adapter.extract(output, call)

    def rebuild(self, coefficients: Tensor, call: SiteCall) -> Any:
        return self.adapter.rebuild(coefficients.bfloat16().float(), call)


@pytest.mark.parametrize("family", GATED)
def test_a_wrong_adapter_is_refused_naming_the_site(family: str):
    model = build(family)
    site = selection(gated_recurrence_sites(model))[0]
    wrong = Site(site.name, site.path, site.family, 0, Lossy(site.adapter))
    with pytest.raises(FcauditError) as caught:
        fcaudit.record(model, tokens(1), sites=[wrong])
    message = str(caught.value)
    assert f"site {site.name} " in message and "bit for bit" in message
    assert "\n" not in message


# ---- what the coefficients are: the tensors the model's own code hands its recurrence ----

def captured(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[dict[str, Any]]:
    """Patch ``module.name`` (a recurrence function) to note its arguments, then run it."""
    calls: list[dict[str, Any]] = []
    original = getattr(module, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append({"args": args, **kwargs})
        return original(*args, **kwargs)
    monkeypatch.setattr(module, name, spy)
    return calls


def test_gated_deltanet_parts_are_the_b_and_a_inputs():
    """Qwen3-Next interleaves b and a per key head in ``in_proj_ba`` (2 key heads of 2
    value heads here): the site's parts are b then a in value-head order, bit for bit as
    the model's own ``fix_query_key_value_ordering`` splits them (beta = sigmoid(b),
    g = -exp(A_log) softplus(a + dt_bias))."""
    model = build("qwen3_next")
    layer = model.model.layers[0].linear_attn
    seen: list[Tensor] = []
    handle = layer.in_proj_ba.register_forward_hook(lambda m, a, out: seen.append(out))
    try:
        recording = fcaudit.record(model, tokens(1), sites=gated_recurrence_sites(model))
    finally:
        handle.remove()
    qkvz = torch.zeros(*seen[0].shape[:2], layer.in_proj_qkvz.out_features)
    *_, b, a = layer.fix_query_key_value_ordering(qkvz, seen[0])
    coefficients = recording["model.layers.0.linear_attn.in_proj_ba"]
    heads = model.config.linear_num_value_heads
    assert torch.equal(coefficients[..., :heads], b)
    assert torch.equal(coefficients[..., heads:], a)


def test_kda_sites_feed_decay_and_beta(monkeypatch: pytest.MonkeyPatch):
    """Kimi Delta Attention: replaying a donor's ``b_proj`` changes the beta the chunked
    kernel receives to sigmoid of the donor's coefficients, and leaves its g alone."""
    from transformers.models.kimi_linear import modeling_kimi_linear
    model = build("kimi_linear")
    x = tokens(1)
    calls = captured(monkeypatch, modeling_kimi_linear, "chunk_kimi_delta_attention")
    recording = fcaudit.record(model, x)
    donor = fcaudit.record(model, tokens(2))
    beta = "model.layers.0.self_attn.b_proj"
    calls.clear()
    with torch.no_grad(), fcaudit.replay(model, recording.with_coefficients(
            {beta: donor[beta]})):
        model(x)
    assert torch.equal(calls[0]["beta"], donor[beta].sigmoid())
    decay = recording["model.layers.0.self_attn.forget_gate.f_b_proj"]
    gate = model.model.layers[0].self_attn.forget_gate
    g = (decay.float() + gate.dt_bias.float()).view(*decay.shape[:2], -1, gate.head_dim)
    softplus = torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))  # as the gate writes it
    assert torch.equal(calls[0]["g"], -gate.A_log.float().exp() * softplus)


def test_a_kernel_function_gets_the_replayed_coefficients(monkeypatch: pytest.MonkeyPatch):
    """With flash-linear-attention installed, ``chunk_gated_delta_rule`` is its kernel, a
    function run after ``in_proj_ba``: simulated by a stand-in, the site still records,
    identity stays exact, and a donor's coefficients reach the kernel as its beta."""
    from transformers.models.qwen3_next import modeling_qwen3_next
    model = build("qwen3_next")
    x = tokens(1)
    calls = captured(monkeypatch, modeling_qwen3_next, "torch_chunk_gated_delta_rule")
    recording = fcaudit.record(model, x)
    donor = fcaudit.record(model, tokens(2))
    site = "model.layers.0.linear_attn.in_proj_ba"
    heads = model.config.linear_num_value_heads
    for fed in (recording, recording.with_coefficients({site: donor[site]})):
        calls.clear()
        with torch.no_grad(), fcaudit.replay(model, fed):
            logits = model(x).logits
        assert torch.equal(logits, recording.logits) == (fed is recording)
        assert torch.allclose(calls[0]["beta"], fed[site][..., :heads].sigmoid(), atol=1e-7)


def test_rglru_parts_are_its_gate_preactivations():
    """RG-LRU's gates are ``baddbmm`` inside its forward: the site's parts equal the
    per-head block-diagonal projections of its input, computed here with einsum."""
    model = build("recurrent_gemma")
    lru = model.model.layers[0].temporal_block.rg_lru
    seen: list[Tensor] = []
    handle = lru.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    try:
        recording = fcaudit.record(model, tokens(1))
    finally:
        handle.remove()
    x = seen[0].view(2, SEQ_LEN, lru.num_attention_heads, lru.block_width)
    coefficients = recording["model.layers.0.temporal_block.rg_lru"]
    for k, name in enumerate(("input_gate", "recurrent_gate")):
        by_hand = torch.einsum("bthi,hij->bthj", x, getattr(lru, f"{name}_weight")) + \
            getattr(lru, f"{name}_bias")
        width = model.config.lru_width
        assert torch.allclose(coefficients[..., k * width:(k + 1) * width],
                              by_hand.reshape(2, SEQ_LEN, width), atol=1e-6)


def test_zamba_parts_are_dt_b_c_as_the_scan_gets_them(monkeypatch: pytest.MonkeyPatch):
    """Zamba's dt, B and C are matmuls with ``dt_proj_weight`` and ``x_proj_weight``:
    the site's parts equal, bit for bit, what each head's selective scan receives."""
    from transformers.models.zamba import modeling_zamba
    model = build("zamba")
    calls = captured(monkeypatch, modeling_zamba, "mamba_selective_scan")
    recording = fcaudit.record(model, tokens(1), sites=gated_recurrence_sites(model))
    coefficients = recording["model.layers.0.mamba"]
    heads = model.config.n_mamba_heads
    first = calls[:heads]  # the live pass of layer 0, one scan per head
    dt = torch.stack([c["args"][1] for c in first], dim=1)  # [B, heads, head_dim, T]
    b = torch.stack([c["args"][3] for c in first], dim=1)  # [B, heads, state, T]
    c_ = torch.stack([c["args"][4] for c in first], dim=1)
    expected = torch.cat([t.permute(0, 3, 1, 2).reshape(2, SEQ_LEN, -1) for t in (dt, b, c_)], -1)
    assert torch.equal(coefficients, expected)


# ---- kernels, caches and interception refused in one line ----

def fused_gdn_forward(self: nn.Module, hidden_states: Tensor, **kwargs: Any) -> Tensor:
    """Stands in for a hub kernel's forward: it uses in_proj_ba's weight itself."""
    nn.functional.linear(hidden_states, self.in_proj_ba.weight)
    return hidden_states


def test_a_kernel_forward_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch):
    """A GDN block whose forward a kernel replaced (use_kernels=True) would never call
    ``in_proj_ba``: discovery refuses it in one line naming the block and the kernel."""
    model = build("qwen3_next")
    block = model.model.layers[0].linear_attn
    monkeypatch.setattr(block, "forward", types.MethodType(fused_gdn_forward, block))
    with pytest.raises(ModelError) as caught:
        fcaudit.record(model, tokens(1))
    message = str(caught.value)
    assert message.startswith("model.layers.0.linear_attn (Qwen3NextGatedDeltaNet) runs the "
                              "kernel test_hf_gated_recurrence.fused_gdn_forward")
    assert "use_kernels=True" in message and "\n" not in message
    assert caught.value.site == "model.layers.0.linear_attn"


@pytest.mark.parametrize("uses", [0, 2])
def test_a_weight_hidden_or_reused_in_the_forward_is_refused(
        uses: int, monkeypatch: pytest.MonkeyPatch):
    """The RG-LRU input gate's weight entering no projection (a fused kernel that takes
    its data) or two: the tap cannot say which is the coefficient, refused naming the site."""
    from transformers.models.recurrent_gemma import modeling_recurrent_gemma as rg
    model = build("recurrent_gemma")
    site = gated_recurrence_sites(model)[0]
    original = rg.RecurrentGemmaRglru.forward

    def forward(self: nn.Module, activations: Tensor, position_ids: Tensor) -> Tensor:
        weight = self.input_gate_weight
        self.input_gate_weight = nn.Parameter(weight.detach().clone()) if uses == 0 else weight
        if uses == 2:
            heads = activations.reshape(-1, self.num_attention_heads, self.block_width)
            torch.baddbmm(self.input_gate_bias[:, None, :], heads.permute(1, 0, 2), weight)
        try:
            return original(self, activations, position_ids)
        finally:
            self.input_gate_weight = weight
    monkeypatch.setattr(rg.RecurrentGemmaRglru, "forward", forward)
    with pytest.raises(FcauditError) as caught:
        fcaudit.record(model, tokens(1), sites=[site])
    message = str(caught.value)
    assert message.startswith(f"site {site.name} (RecurrentGemmaRglru, adapter weight-taps): ")
    assert f"input_gate_weight entered {uses} projections in one call, expected 1" in message


def test_a_fresh_generation_cache_is_left_out_of_the_rebuild(monkeypatch: pytest.MonkeyPatch):
    """Zamba run with use_cache=True hands its mixers a cache the model made for this
    call: the adapter re-runs the mixer without it (the live call already advanced it),
    and the recording is exact as without a cache."""
    model = build("zamba")
    x = tokens(1)
    plain = fcaudit.record(model, x)
    monkeypatch.setattr(model.config, "use_cache", True)
    cached = fcaudit.record(model, x)
    with torch.no_grad(), fcaudit.replay(model, cached):
        assert torch.equal(model(x).logits, cached.logits)
    assert all(torch.equal(cached[name], plain[name]) for name in plain)


class Continued(nn.Module):
    """Decoding that continues a prefix: each call runs the model on its ids after a copy
    of the prefix's generation cache (state from an earlier call)."""

    def __init__(self, model: nn.Module, prefix: Tensor) -> None:
        super().__init__()
        self.model = model
        with torch.no_grad():
            self.cache = model(prefix, use_cache=True).past_key_values

    def forward(self, ids: Tensor) -> Tensor:
        import copy
        return self.model(ids, cache=copy.deepcopy(self.cache), use_cache=True).logits


def test_a_generation_cache_holding_earlier_state_is_refused():
    """Recording a call that continues from an earlier call's cache: the mixer's output
    depends on state a replay cannot carry. Refused in one line that says why."""
    model = build("zamba")
    wrapped = Continued(model, tokens(3)[:, :4])
    site = gated_recurrence_sites(model)[0]
    inner = Site(site.name, "model." + site.path, site.family, 0, site.adapter)
    with pytest.raises(FcauditError) as caught:
        fcaudit.record(wrapped, tokens(1), sites=[inner])
    message = str(caught.value)
    assert message.startswith(f"site {site.name} (ZambaMambaMixer, adapter weight-taps): "
                              "ZambaMambaMixer was called with a generation cache (cache) "
                              "holding state from earlier calls")
    assert "use_cache=False" in message and "\n" not in message


def test_an_adapter_naming_a_missing_weight_is_refused():
    model = build("zamba")
    site = gated_recurrence_sites(model)[0]
    wrong = Site(site.name, site.path, "mamba_selection", 0,
                 WeightTapAdapter((Tap("input_gate_weight", HEADS_TOKENS, 8),)))
    with pytest.raises(FcauditError, match="ZambaMambaMixer has no parameter input_gate_weight"):
        fcaudit.record(model, tokens(1), sites=[wrong])


# ---- a hybrid audited whole ----

def test_qwen3_next_audits_selection_beside_routers(tmp_path: Any):
    """One audit of tiny Qwen3-Next: its Gated DeltaNet selection site beside the MoE
    routers and shared-expert gates, in families of their own, identity exact."""
    from conftest import FAST

    from fcaudit import AuditData
    model = build("qwen3_next")
    ids = torch.randint(3, VOCAB, (8, SEQ_LEN), generator=torch.Generator().manual_seed(3))
    start = time.perf_counter()
    result = fcaudit.audit(model, data=AuditData(eval_ids=ids[:4].numpy(),
                                                 calib_ids=ids[4:].numpy()),
                           options=FAST)
    assert time.perf_counter() - start < 120
    assert result is not None and result.identity_replay_max_abs_diff == 0.0
    families = {s.name: s.family for s in result.sites}
    assert families == {
        "model.layers.0.linear_attn.in_proj_ba": "gated_deltanet",
        "model.layers.0.mlp.gate": "router", "model.layers.1.mlp.gate": "router",
        "model.layers.0.mlp.shared_expert_gate": "shared_expert_gate",
        "model.layers.1.mlp.shared_expert_gate": "shared_expert_gate"}


@pytest.mark.parametrize("family", ["recurrent_gemma", "zamba"])
def test_intercepted_sites_audit_whole(family: str):
    """The interception adapter through a whole audit: identity exact, and the static
    profile (each layer's calibration mean fed at every token: an LTI recurrence) is
    replayed and moves the NLL off the correct replay's."""
    from conftest import FAST

    from fcaudit import AuditData
    ids = torch.randint(3, VOCAB, (8, SEQ_LEN), generator=torch.Generator().manual_seed(3))
    result = fcaudit.audit(build(family), data=AuditData(eval_ids=ids[:4].numpy(),
                                                         calib_ids=ids[4:].numpy()),
                           options=FAST)
    assert result is not None and result.identity_replay_max_abs_diff == 0.0
    assert {s.family for s in result.sites} == {"rglru" if family == "recurrent_gemma"
                                                else "mamba_selection"}
    static = result.conditions["static-layer"]
    assert static.nll != result.conditions["correct"].nll


def test_xlstm_fused_gates_are_one_site_with_two_parts(monkeypatch: pytest.MonkeyPatch):
    """xLSTM's ``weight_mode='fused'`` projects both gates with one ``ifgate_preact``: one
    site per layer whose parts are the input then the forget gate, as the layer splits
    them. (transformers' own initialisation fails on this mode, so it is skipped and the
    weights drawn here.)"""
    from transformers.models.xlstm import modeling_xlstm
    monkeypatch.setattr(modeling_xlstm.xLSTMPreTrainedModel, "_init_weights", lambda *a: None)
    config = SSM_FAMILIES["xlstm"]()
    config.weight_mode = "fused"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.1)
    sites = selection(declared_sites(model) or [])
    heads = config.num_heads
    assert [(s.path, s.family, s.selection.parts) for s in sites] == [
        (f"backbone.blocks.{i}.mlstm_layer.ifgate_preact", "mlstm_gates",
         (("input_gate", heads), ("forget_gate", heads))) for i in range(2)]
    x = tokens(1)
    recording = fcaudit.record(model, x)
    with torch.no_grad(), fcaudit.replay(model, recording):
        assert torch.equal(model(x).logits, recording.logits)
