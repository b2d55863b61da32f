"""``--early-exit`` on a Hugging Face causal LM (a tiny random Llama saved to a folder):
exit sites found, exits and oracle layers worked out from the model's own hidden states,
identity replay exact, the exit conditions run, the masking and the untrained-heads
warning said."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import (
    COMMON,
    TOY,
    VOCAB,
    assert_clean_failure,
    md_tables,
    run_inprocess,
    token_batches,
    tokenizer_file,
)

import fcaudit
from fcaudit.core.discovery import declared_experts
from fcaudit.core.errors import ModelError
from fcaudit.core.exits import exit_scores, head_predictions, oracle_layers, own_exits
from fcaudit.core.recording import record
from fcaudit.core.replaying import replay
from fcaudit.core.sites import find_sites

transformers = pytest.importorskip("transformers")

from fcaudit.io.data import load_tokenizer  # noqa: E402
from fcaudit.io.hf_exit import EarlyExitLM  # noqa: E402

THRESHOLD = 0.8
L = 4


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer random Llama whose LM head is scaled up (x60), so that the heads'
    confidences straddle the threshold; its tokenizer and token windows beside it."""
    folder = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": L},
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


def wrapped(folder: Path) -> tuple[EarlyExitLM, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    return EarlyExitLM(model, THRESHOLD).eval(), torch.from_numpy(np.load(folder / "eval.npy"))


def heads_by_hand(net: EarlyExitLM, x: torch.Tensor) -> torch.Tensor:
    """``[L, B, T, V]``: the model's own final norm and LM head on each layer's output,
    read off the unwrapped model's hidden states (every token through every layer)."""
    inner = net.model
    with torch.no_grad():
        out = inner(input_ids=x, output_hidden_states=True)
        states = out.hidden_states[1:L]  # after layers 0..L-2 (the last is normed already)
        logits = [inner.lm_head(inner.model.norm(h)) for h in states]
    return torch.stack([*logits, out.logits])


def test_sites_exits_and_oracle_worked_out_from_hidden_states(llama):
    net, x = wrapped(llama)
    assert [s.name for s in net.controller_sites()] == ["scores.0", "scores.1", "scores.2"]
    assert net.execution_blocks() == [f"model.model.layers.{i}" for i in range(L)]
    heads = heads_by_hand(net, x)
    argmax = heads.argmax(-1)
    B, T = x.shape
    oracle = torch.tensor([[min(i for i in range(L) if argmax[i, b, t] == argmax[-1, b, t])
                            for t in range(T)] for b in range(B)])
    assert torch.equal(oracle_layers(head_predictions(net, lambda: net(x))), oracle)
    # the first exit reads layer 0's output, which masking cannot have changed
    conf = heads[0].softmax(-1).amax(-1)
    first = own_exits(net, lambda: net(x)) == 0
    assert torch.equal(first, conf >= THRESHOLD)
    assert 0 < int(first.sum()) < first.numel()
    # an exited token's logits are its exit head's: its state stays layer 0's
    with torch.no_grad():
        out = net(x)
    torch.testing.assert_close(out[first], heads[0][first], rtol=1e-5, atol=1e-4)


def test_identity_replay_is_bitwise_and_exits_follow_fed_scores(llama):
    net, x = wrapped(llama)
    rec = record(net, x)
    assert all(v.shape == (*x.shape, 1) for v in rec.values())
    with torch.no_grad():
        plain = net(x)
    with replay(net, rec), torch.no_grad():
        assert torch.equal(net(x), plain)
    layers = torch.randint(0, L, x.shape, generator=torch.Generator().manual_seed(3))
    with replay(net, exit_scores(net.controller_sites(), layers, rec)):
        assert torch.equal(own_exits(net, lambda: net(x)), layers)


def test_cli_audit_runs_the_exit_conditions_and_says_masking_and_untrained_heads(
        llama, tmp_path, capsys):
    out = tmp_path / "audit"
    res = run_inprocess(["audit", "--model", llama, "--tokens", llama / "eval.npy",
                         "--calib-tokens", llama / "calib.npy", "--early-exit",
                         "--exit-threshold", THRESHOLD, "--repeats", "1", "--bootstrap", "20",
                         "--batch-size", "2", "--no-per-layer", "--timing-pairs", "0",
                         "--quiet", "--out", out], capsys)
    assert res.returncode == 0, res.stderr
    j = json.loads((out / "audit.json").read_text())
    assert j["model"]["kind"] == "hf-early-exit"
    assert j["settings"]["early_exit"] is True and j["settings"]["exit_threshold"] == THRESHOLD
    assert {"fixed-exit", "fixed-exit-position", "oracle-exit"} <= set(j["conditions"])
    assert j["identity_replay_max_abs_diff"] == 0.0
    assert 1.0 < j["exits"]["evaluation_mean_depth"] < L
    # masked: the execution audit counts every layer on every token, and says why; the
    # answer reads the exits' depth as what a model that skipped would run, never the
    # pass's FLOPs against the model (its exit heads cost more than the model itself)
    assert j["execution"]["blocks_executed"] == L
    assert "counted, not realised" in j["execution"]["mode"]
    depth = j["exits"]["evaluation_mean_depth"]
    assert j["verdict"]["execution_label"] == "counted-not-realised"
    assert j["verdict"]["execution"].startswith("Exits counted, not realised: every layer ran")
    assert f"would run {depth:.2f} of {L} layers per token" in j["verdict"]["execution"]
    assert "x Dense" not in j["verdict"]["execution"]
    assert j["verdict"]["exits"].startswith(f"Tokens stop after {depth:.2f} of {L} layers")
    report = (out / "report.md").read_text()
    assert "**Not trained for early exit:**" in report and "poor predictors" in report


@pytest.mark.parametrize(("argv", "needle"), [
    (["--exit-threshold", "1.5", "--early-exit"], "--exit-threshold 1.5: must be a number in "
                                                  "(0, 1]"),
    (["--exit-threshold", "0.5"], "--exit-threshold 0.5 is read only with --early-exit"),
    (["--early-exit"], "--early-exit wraps a Hugging Face causal LM"),
], ids=["threshold out of range", "threshold without early exit", "not a transformers model"])
def test_early_exit_mistakes_are_one_line(argv, needle, tmp_path, capsys):
    tokens = tmp_path / "t.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 61, (4, 16)))
    out = tmp_path / "out"
    res = run_inprocess(["audit", *TOY, "--tokens", tokens, "--calib-tokens", tokens, *argv,
                         "--quiet", "--out", out], capsys)
    assert_clean_failure(res, tmp_path, out, needle)


def test_the_threshold_is_an_option_not_another_model(llama):
    """The fingerprint stays the model's; the threshold keys the cache as an option of its
    own (a rerun with another one is refused naming it: tests/test_message_causes.py)."""
    from fcaudit.io.hf_exit import with_early_exit
    from fcaudit.io.loading import load
    plain = load(str(llama))
    prints = {t: with_early_exit(load(str(llama)), t).fingerprint for t in (0.5, 0.8)}
    assert set(prints.values()) == {plain.fingerprint}


SMALL = dict(vocab_size=VOCAB, max_position_embeddings=64)


def _tiny(config: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _llama_like(name: str, **extra: Any) -> Any:
    """A 3-layer config of a Llama-shaped family (``name`` a transformers config class)."""
    return getattr(transformers, name)(**{**COMMON, "num_hidden_layers": 3},
                                       intermediate_size=64, num_key_value_heads=2, **extra)


def _opt(**extra: Any) -> Any:
    return transformers.OPTConfig(**SMALL, hidden_size=32, num_hidden_layers=3,
                                  num_attention_heads=4, ffn_dim=64, **extra)


# Each family: its config, the modules from its last layer to its LM head (final norm,
# output projection) and its own logit transform, written
# out by hand from its modeling code (the final norm under other names and nestings:
# OPT's decoder.final_layer_norm, MPT's norm_f, BioGPT's layer_norm, GPT-2's ln_f).
FAMILIES = {
    "gemma2 (softcap)": (lambda: _llama_like("Gemma2Config", final_logit_softcapping=2.0,
                                             head_dim=8),
                         ("model.norm",), lambda x: torch.tanh(x / 2.0) * 2.0),
    "cohere (logit scale)": (lambda: _llama_like("CohereConfig", logit_scale=0.25),
                             ("model.norm",), lambda x: x * 0.25),
    "granite (logits scaling)": (lambda: _llama_like("GraniteConfig", logits_scaling=4.0),
                                 ("model.norm",), lambda x: x / 4.0),
    "llama": (lambda: _llama_like("LlamaConfig"), ("model.norm",), lambda x: x),
    "opt": (lambda: transformers.OPTConfig(**SMALL, hidden_size=32, num_hidden_layers=3,
                                           num_attention_heads=4, ffn_dim=64,
                                           word_embed_proj_dim=32),
            ("model.decoder.final_layer_norm",), lambda x: x),
    # OPT-350m's layout: embeddings narrower than the layers, project_out after them
    "opt (project_out)": (lambda: _opt(word_embed_proj_dim=16, do_layer_norm_before=False),
                          ("model.decoder.project_out",), lambda x: x),
    "opt (final norm, project_out)": (lambda: _opt(word_embed_proj_dim=16),
                                      ("model.decoder.final_layer_norm",
                                       "model.decoder.project_out"), lambda x: x),
    "mpt": (lambda: transformers.MptConfig(vocab_size=VOCAB, d_model=32, n_layers=3,
                                           n_heads=4, max_seq_len=64),
            ("transformer.norm_f",), lambda x: x),
    "biogpt": (lambda: transformers.BioGptConfig(**SMALL, hidden_size=32, num_hidden_layers=3,
                                                 num_attention_heads=4, intermediate_size=64),
               ("biogpt.layer_norm",), lambda x: x),
    "gpt2": (lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4,
                                             n_positions=64),
             ("transformer.ln_f",), lambda x: x),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_exit_heads_read_through_the_model_s_own_norm_head_and_transform(family):
    """Every head is the model's final norm (wherever the family keeps it), LM head and
    its own transform (softcap, logit scale, logits scaling): the last head equals the
    model's logits bit for bit, each earlier head the family's path written out by hand
    on that layer's output."""
    config, paths, by_hand = FAMILIES[family]
    model = _tiny(config())
    net = EarlyExitLM(model, THRESHOLD).eval()
    net.full_depth = True
    x = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    heads = {}
    hooks = [h.register_forward_hook(lambda _m, _a, out, i=i: heads.__setitem__(i, out))
             for i, h in enumerate(net.heads)]
    with torch.no_grad():
        net(x)
        own = model(input_ids=x, output_hidden_states=True, use_cache=False)
    for h in hooks:
        h.remove()
    assert torch.equal(heads[2], own.logits)
    for i in (0, 1):
        h = own.hidden_states[i + 1]
        with torch.no_grad():
            for path in paths:
                h = model.get_submodule(path)(h)
            expected = by_hand(model.get_output_embeddings()(h))
        torch.testing.assert_close(heads[i], expected, rtol=1e-5, atol=1e-5)


def _shifted_llama() -> torch.nn.Module:
    """A Llama that changes its logits after the LM head (x3, +1), by a forward hook."""
    model = _tiny(_llama_like("LlamaConfig"))

    def shifted(_m, _args, out):
        out.logits = out.logits * 3.0 + 1.0
        return out

    model.register_forward_hook(shifted)
    return model


def test_a_head_fcaudit_cannot_reproduce_is_refused():
    """A model whose last layer's output reaches its logits by a way no final norm,
    output projection, LM head and known transform reproduces: refused at wrap time,
    naming what was tried, not read with heads that do not predict what it predicts."""
    model = _shifted_llama()
    with pytest.raises(ModelError, match="logits are not its last layer's output through a "
                                         "final norm and output projection .* its LM head "
                                         "and any transform fcaudit knows"):
        EarlyExitLM(model, THRESHOLD)


def _hybrid(name: str, **extra: Any) -> torch.nn.Module:
    """A 3-layer random hybrid: its LM head scaled up (x60) so that exits happen, its
    routers spread like a trained router's."""
    model = _tiny(getattr(transformers, name)(**{**COMMON, "num_hidden_layers": 3},
                                              intermediate_size=64, num_key_value_heads=2,
                                              num_experts_per_tok=2, **extra))
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)
        for path, param in model.named_parameters():
            if ".gate." in path or ".router." in path:
                param.normal_(0, 0.5)
    return model


# each hybrid's own sites, written out from its modeling code: Mixtral's router per layer;
# Jamba's routers on its expert layers (1, the period 2 from offset 1) and its Mamba
# mixers' selection projection on the others (0, 2)
HYBRIDS = {
    "MixtralConfig": (dict(num_local_experts=4),
                      [f"model.layers.{i}.mlp.gate" for i in range(3)]),
    "JambaConfig": (dict(num_experts=4, attn_layer_period=3, attn_layer_offset=1,
                         expert_layer_period=2, expert_layer_offset=1, mamba_d_state=4,
                         mamba_dt_rank=8),
                    ["model.layers.1.feed_forward.router", "model.layers.0.mamba.x_proj",
                     "model.layers.2.mamba.x_proj"]),
}


@pytest.mark.parametrize("name", list(HYBRIDS))
def test_early_exit_on_a_hybrid_keeps_its_routers_and_selection_sites(name):
    """``--early-exit`` on a model that has sites of its own (a Mixtral's routers, a
    Jamba's routers and selection projections): the wrapped model declares the exit
    scores and every one of them, under ``model.``, as found without the wrapper."""
    extra, own = HYBRIDS[name]
    model = _hybrid(name, **extra)
    plain = [s.name for s in find_sites(model, None)]
    assert plain == own  # the reference: the hybrid's sites written out by hand
    net = EarlyExitLM(model, THRESHOLD)
    assert [s.name for s in find_sites(net, None)] == \
        ["scores.0", "scores.1", *(f"model.{n}" for n in own)]
    assert [(x.name, x.experts) for x in net.expert_layers()] == [
        (f"model.{x.name}", tuple(f"model.{p}" for p in x.experts))
        for x in declared_experts(model) or ()]


def test_an_early_exit_audit_of_a_hybrid_audits_and_reports_every_site(tmp_path):
    """The audit of a Mixtral with ``--early-exit``: its sites are the exit scores and
    the three routers, the routing section and the report's sites table show both
    families, and the exit conditions still run."""
    folder = tmp_path / "mixtral"
    _hybrid("MixtralConfig", num_local_experts=4).save_pretrained(folder)
    ev, ca = token_batches(load_tokenizer(tokenizer_file(folder)))
    out = tmp_path / "audit"
    fcaudit.audit(str(folder), out, data=fcaudit.AuditData(ev.numpy(), ca.numpy()),
                  options=fcaudit.AuditOptions(repeats=1, bootstrap=20, batch_size=2,
                                               per_layer=False, timing_pairs=0,
                                               progress=False, early_exit=True,
                                               exit_threshold=THRESHOLD))
    j = json.loads((out / "audit.json").read_text())
    routers = [f"model.model.layers.{i}.mlp.gate" for i in range(3)]
    assert [s["name"] for s in j["sites"]] == ["scores.0", "scores.1", *routers]
    assert [s["family"] for s in j["sites"]] == ["exit", "exit", *["router"] * 3]
    assert [x["site"] for x in j["routing"]["router"]["per_layer"]] == routers
    assert {"fixed-exit", "oracle-exit"} <= set(j["conditions"])
    assert j["execution"]["experts"] is not None
    sites = next(t for t in md_tables((out / "report.md").read_text()) if "first" in t[0])
    assert [(row["family"], row["sites"], row["first"], row["last"]) for row in sites] == [
        ("`exit`", "2", "`scores.0`", "`scores.1`"),
        ("`router`", "3", f"`{routers[0]}`", f"`{routers[-1]}`")]
