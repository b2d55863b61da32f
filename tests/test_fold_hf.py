"""``fcaudit fold`` of checkpoint folders in Hugging Face layout: a MUDDPythia folder (loaded
by fcaudit's own MUDD code, folded into a run folder with static dense connections) and a
Mixtral folder (its experts merged into one MLP per layer: a Mistral folder that
transformers loads without fcaudit; per token id or position: a run folder of fcaudit's
Mixtral routed by a table). The references are read here: the generators' outputs with
this test's hooks, the routers' logits and top-k from their own weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from conftest import make_mudd_folder, run_inprocess

from fcaudit.io.loading import load_run
from fcaudit.io.mudd_checkpoint import load_mudd_folder

LENGTH = 16
QUICK = ["--repeats", "1", "--bootstrap", "50", "--timing-pairs", "0", "--batch-size", "4",
         "--no-per-layer", "--quiet"]


def _tokens(root: Path, vocab: int) -> list[str]:
    rng = np.random.default_rng(0)
    np.save(root / "eval.npy", rng.integers(0, vocab, (8, LENGTH)))
    np.save(root / "calib.npy", rng.integers(0, vocab, (8, LENGTH)))
    return ["--tokens", str(root / "eval.npy"), "--calib-tokens", str(root / "calib.npy")]


def _generator_means(model: torch.nn.Module, ids: np.ndarray) -> list[torch.Tensor]:
    """Each weight generator's mean output (its static part included) over the calibration
    tokens, flattened, read with hooks."""
    seen: list[list[torch.Tensor]] = [[] for _ in model.dynamic_dense]
    handles = [g.register_forward_hook(lambda _m, _a, out, i=i: seen[i].append(
        out.detach().double().flatten(2).flatten(0, 1))) for i, g in enumerate(
        model.dynamic_dense)]
    with torch.no_grad():
        model(torch.from_numpy(ids))
    for h in handles:
        h.remove()
    return [torch.cat(s).mean(0) for s in seen]


def test_a_mudd_checkpoint_folder_folds_into_a_run_folder(tmp_path: Path, capsys) -> None:
    """The folder stores bfloat16 and is audited in float32: the fold loads it as the
    audit did, and writes an fcaudit run folder (arch mudd, no generators, the folder's
    tokenizer) whose NLL is the audit's static-layer condition's."""
    folder = make_mudd_folder(tmp_path)
    data = _tokens(tmp_path, 256)
    audit = run_inprocess(["audit", "--model", str(folder), *data, "--dtype", "float32",
                           "--out", str(tmp_path / "audit"), *QUICK], capsys)
    assert audit.returncode == 0, audit.stderr
    res = run_inprocess(["fold", "--audit", str(tmp_path / "audit"), "--profile",
                         "static-layer", "--out", str(tmp_path / "folded"), *data,
                         "--timing-pairs", "0", "--quiet"], capsys)
    assert res.returncode == 0, res.stderr
    config = json.loads((tmp_path / "folded" / "config.json").read_text())
    assert config["arch"] == "mudd" and config["fold"]["source"] == str(folder)
    want = json.loads((tmp_path / "audit" / "audit.json").read_text())["conditions"][
        "static-layer"]["nll"]
    assert abs(config["fold"]["exactness"]["folded_nll"] - want) <= 1e-5 * max(1, abs(want))
    folded = load_run(tmp_path / "folded").model
    assert not hasattr(folded, "dynamic_dense") and folded.controller_sites() == []
    assert next(folded.parameters()).dtype == torch.float32
    original = load_mudd_folder(folder, dtype=torch.float32)
    for i, mean in enumerate(_generator_means(original, np.load(tmp_path / "calib.npy"))):
        assert torch.allclose(folded.dense_bs[i].double().reshape(-1), mean, atol=1e-5), i
    assert (tmp_path / "folded" / "tokenizer.json").read_bytes() == \
        (folder / "tokenizer.json").read_bytes()
    heal = run_inprocess(["fold", "--audit", str(tmp_path / "audit"), "--profile",
                          "static-layer", "--out", str(tmp_path / "f2"), *data,
                          "--heal-steps", "2", "--quiet"], capsys)
    assert heal.returncode == 2 and "is not a run folder of fcaudit train" in heal.stderr
    assert not (tmp_path / "f2").exists()


def _router_logits(model: torch.nn.Module, ids: np.ndarray) -> list[torch.Tensor]:
    """Each layer's router logits ``[tokens, E]`` on ``ids``, recomputed here from the
    router's weight and its input (read with hooks)."""
    routers = [layer.mlp.gate for layer in model.model.layers]
    seen: list[list[torch.Tensor]] = [[] for _ in routers]
    handles = [r.register_forward_hook(lambda m, args, _out, i=i: seen[i].append(
        args[0].detach().double().reshape(-1, m.weight.shape[1]) @ m.weight.double().T))
        for i, r in enumerate(routers)]
    with torch.no_grad():
        model(torch.from_numpy(ids))
    for h in handles:
        h.remove()
    return [torch.cat(s) for s in seen]


def _nll(model: torch.nn.Module, ids: np.ndarray) -> float:
    x = torch.from_numpy(ids)
    with torch.no_grad():
        logits = model(x).logits[:, :-1].double()
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                   x[:, 1:].reshape(-1)))


def test_a_mixtral_folder_folds_into_a_mistral_folder_transformers_loads(
        tmp_path: Path, capsys) -> None:
    """At static-layer each layer routes every token to the experts the mean logits pick,
    at their softmax weights renormalised over the top k (Mixtral's routing, worked out
    here): the folded folder is a Mistral whose MLP is those experts side by side, the
    down projections scaled by the weights; transformers loads it alone, and its NLL is
    the audit's static-layer condition's."""
    import transformers
    from conftest import FAMILIES, save
    folder = save(FAMILIES["mixtral"][0](), tmp_path / "mixtral")
    data = _tokens(tmp_path, 120)
    audit = run_inprocess(["audit", "--model", str(folder), *data, "--out",
                           str(tmp_path / "audit"), *QUICK], capsys)
    assert audit.returncode == 0, audit.stderr
    res = run_inprocess(["fold", "--audit", str(tmp_path / "audit"), "--profile",
                         "static-layer", "--out", str(tmp_path / "folded"), *data,
                         "--quiet"], capsys)
    assert res.returncode == 0, res.stderr
    assert "against the original: latency" in res.stdout
    original = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    folded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "folded").eval()
    assert type(folded).__name__ == "MistralForCausalLM"
    k, width = original.config.num_experts_per_tok, original.config.intermediate_size
    assert folded.config.intermediate_size == k * width
    calib = np.load(tmp_path / "calib.npy")
    for i, logits in enumerate(_router_logits(original, calib)):
        probs = torch.softmax(logits.mean(0), -1)
        top = probs.topk(k)
        weights, ids = top.values / top.values.sum(), top.indices
        experts, mlp = original.model.layers[i].mlp.experts, folded.model.layers[i].mlp
        for j, (e, w) in enumerate(zip(ids.tolist(), weights.tolist(), strict=True)):
            rows = slice(j * width, (j + 1) * width)
            assert torch.equal(mlp.gate_proj.weight[rows], experts.gate_up_proj[e][:width])
            assert torch.equal(mlp.up_proj.weight[rows], experts.gate_up_proj[e][width:])
            assert torch.allclose(mlp.down_proj.weight[:, rows].double(),
                                  experts.down_proj[e].double() * w, atol=1e-6)
    config = json.loads((tmp_path / "folded" / "config.json").read_text())
    want = json.loads((tmp_path / "audit" / "audit.json").read_text())["conditions"][
        "static-layer"]["nll"]
    assert config["fcaudit_fold"]["arch"] == "mistral"
    assert abs(_nll(folded, np.load(tmp_path / "eval.npy")) - want) <= 1e-5 * max(1, want)
    assert (tmp_path / "folded" / "tokenizer.json").read_bytes() == \
        (folder / "tokenizer.json").read_bytes()
    again = run_inprocess(["fold", "--audit", str(tmp_path / "audit"), "--profile",
                           "static-layer", "--out", str(tmp_path / "folded"), *data,
                           "--quiet", "--timing-pairs", "0", "--force"], capsys)
    assert again.returncode == 0, again.stderr  # fcaudit's own folder: replaced


def _table(logits: torch.Tensor, ids: np.ndarray, key: str, rows: int) -> torch.Tensor:
    """One layer's routing table worked out here from its router logits ``[N * T, E]`` on
    the calibration ``ids`` ``[N, T]``: the mean per token id, or per position (the mean
    over all for ids calibration never had and positions past its windows)."""
    out = logits.mean(0).repeat(rows, 1)
    if key == "layer_position":
        out[:ids.shape[1]] = logits.reshape(*ids.shape, -1).mean(0)
        return out
    flat = torch.from_numpy(ids).reshape(-1)
    for token in flat.unique():
        out[token] = logits[flat == token].mean(0)
    return out


def test_a_mixtral_folder_folds_per_token_or_position_into_fcaudit_s_mixtral(
        tmp_path: Path, capsys) -> None:
    """Per token id (a hash-routed MoE) or per position, the routing still varies and no
    transformers class routes by a table: the fold writes a run folder of fcaudit's
    Mixtral, the folder's weights as they were, each router a table of the calibration's
    mean logits (worked out here from the routers' own weights), no router weight left;
    loaded back, its NLL is the audit's condition's."""
    from conftest import FAMILIES, save

    from fcaudit.core.nll import logits_of, token_nll
    folder = save(FAMILIES["mixtral"][0](), tmp_path / "mixtral")
    data = _tokens(tmp_path, 120)
    calib = np.load(tmp_path / "calib.npy")
    np.save(tmp_path / "calib.npy", calib % 100)  # ids 100..119 never calibrated
    audit = run_inprocess(["audit", "--model", str(folder), *data, "--out",
                           str(tmp_path / "audit"), *QUICK], capsys)
    assert audit.returncode == 0, audit.stderr
    import transformers
    original = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    router_logits = _router_logits(original, calib % 100)
    want = json.loads((tmp_path / "audit" / "audit.json").read_text())["conditions"]
    for profile, key in (("static-layer-token", "layer_token"),
                         ("static-layer-position", "layer_position")):
        out = tmp_path / profile
        res = run_inprocess(["fold", "--audit", str(tmp_path / "audit"), "--profile", profile,
                             "--out", str(out), *data, "--quiet"], capsys)
        assert res.returncode == 0, res.stderr
        assert "against the original: latency" in res.stdout
        config = json.loads((out / "config.json").read_text())
        assert config["arch"] == "mixtral" and config["fold"]["key"] == key
        folded = load_run(out).model
        assert folded.controller_sites() == [] and folded.config.fixed == key
        assert not [n for n in folded.state_dict() if "router" in n]
        rows = {"layer_token": 120, "layer_position": 64}[key]  # vocabulary, context
        for i, logits in enumerate(router_logits):
            table = folded.blocks[i].fixed.value.double()
            assert table.shape == (rows, 4)
            assert torch.allclose(table, _table(logits, calib % 100, key, rows), atol=1e-6), i
        x = torch.from_numpy(np.load(tmp_path / "eval.npy"))
        with torch.no_grad():
            nll = float(token_nll(logits_of(folded(x)), x).double().mean())
        assert abs(nll - want[profile]["nll"]) <= 1e-5 * max(1.0, want[profile]["nll"])
        assert (out / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()


def test_a_bfloat16_mixtral_folds_exactly_at_every_profile(tmp_path: Path, capsys) -> None:
    """Audited in bfloat16, a Mixtral's experts merged into one MLP would miss the
    condition (the scaled down projections round): every profile folds into fcaudit's
    Mixtral, whose losses equal the replayed condition's to the bit, in the audit's dtype."""
    from conftest import FAMILIES, save
    folder = save(FAMILIES["mixtral"][0](), tmp_path / "mixtral")
    data = _tokens(tmp_path, 120)
    audit = run_inprocess(["audit", "--model", str(folder), *data, "--dtype", "bfloat16",
                           "--out", str(tmp_path / "audit"), *QUICK], capsys)
    assert audit.returncode == 0, audit.stderr
    for profile, key in (("static-layer", "layer"), ("static-layer-token", "layer_token")):
        res = run_inprocess(["fold", "--audit", str(tmp_path / "audit"), "--profile", profile,
                             "--out", str(tmp_path / profile), *data, "--timing-pairs", "0",
                             "--quiet"], capsys)
        assert res.returncode == 0, res.stderr
        config = json.loads((tmp_path / profile / "config.json").read_text())
        assert config["arch"] == "mixtral" and config["model_config"]["fixed"] == key
        assert config["fold"]["exactness"]["max_abs_diff"] == 0.0
        model = load_run(tmp_path / profile).model
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
