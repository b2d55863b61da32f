"""Local Hugging Face folders: loading, MoE router discovery, replay and expert execution.

Every model is a tiny random config built here and saved with ``save_pretrained``
(safetensors) next to a tokenizer.json trained on the spot: nothing is downloaded.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import COMMON, FAMILIES, SEQ_LEN, VOCAB, optional_extra, save, token_batches
from safetensors.torch import load_file, save_file
from torch import nn

transformers = optional_extra("transformers")


from fcaudit.core.contract import Site, SiteCall  # noqa: E402
from fcaudit.core.discovery import transformers_layer_stack as discover_blocks  # noqa: E402
from fcaudit.core.errors import FcauditError  # noqa: E402
from fcaudit.core.recording import record  # noqa: E402
from fcaudit.core.replaying import replaying  # noqa: E402
from fcaudit.core.routers import counting_experts, selection_change  # noqa: E402
from fcaudit.core.routers import moe_expert_layers as discover_experts  # noqa: E402
from fcaudit.core.routers import moe_router_sites as discover_sites  # noqa: E402
from fcaudit.io.hf import is_hf_folder, load_hf_folder  # noqa: E402


@pytest.fixture(scope="module")
def mixtral_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(FAMILIES["mixtral"][0](), tmp_path_factory.mktemp("mixtral"))


def replay_routing(model: nn.Module, sites: list[Site], fed: dict[str, torch.Tensor],
                   x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Replay ``fed`` (all sites); logits and each router's selected experts [B, T, k]."""
    routers = {s.name: model.get_submodule(s.path) for s in sites if s.family == "router"}
    chosen: dict[str, torch.Tensor] = {}
    with torch.no_grad(), replaying(model, {s: fed[s.name] for s in sites}) as stubs:
        for site in sites:
            if site.name in routers:
                def hook(stub: nn.Module, args: tuple, kwargs: dict, output: Any,
                         site: Site = site) -> None:
                    call = SiteCall(routers[site.name], args, kwargs, *x.shape)
                    chosen[site.name] = site.adapter.selected_experts(output, call)
                stubs[site.name].register_forward_hook(hook, with_kwargs=True)
        logits = model(x).logits
    return logits, chosen


def one_ranking(chosen: torch.Tensor, dims: tuple[int, ...]) -> bool:
    """True when every token along ``dims`` of [B, T, k] picked the same expert set."""
    rows = chosen.sort(dim=-1).values
    first = tuple(slice(0, 1) if d in dims else slice(None) for d in range(2))
    return bool((rows == rows[first]).all())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_replays_and_routes(family: str, tmp_path: Path):
    config, shared_gates, experts_per_token = FAMILIES[family]
    folder = save(config(), tmp_path)
    model, tokenizer, files = load_hf_folder(folder)
    assert tokenizer is not None and (folder / "tokenizer.json") in files
    x, calib = token_batches(tokenizer)
    sites = discover_sites(model)
    routers = [s for s in sites if s.family == "router"]
    layers = discover_experts(model)
    assert len(routers) == len(layers) == 2 and [s.layer for s in routers] == [0, 1]
    assert len([s for s in sites if s.family == "shared_expert_gate"]) == 2 * shared_gates
    assert discover_blocks(model) == ["model.layers.0", "model.layers.1"]

    with torch.no_grad():
        original = model(x).logits
        cached = record(model, x, sites)
    assert all(cached[s.name].shape[:2] == x.shape for s in sites)
    with counting_experts(model, layers) as counts:
        logits, own = replay_routing(model, sites, cached, x)
    assert torch.equal(logits, original)  # identity replay is bitwise exact
    for layer in layers:
        assert counts[layer.name].experts_per_token(x.numel()) == experts_per_token
        assert counts[layer.name].matches(own[layer.name]) == (experts_per_token == layer.top_k)

    donors = torch.tensor([1, 2, 3, 0])
    _, given = replay_routing(model, sites, {
        s.name: cached[s.name][donors] if s.family == "router" else cached[s.name]
        for s in sites}, x)
    for name in own:  # the donor's logits route exactly as they did for the donor
        assert torch.equal(given[name], own[name][donors])
        assert selection_change(given[name], own[name]) > 0

    with torch.no_grad():
        calibration = record(model, calib, routers)
    layer_mean = {s.name: calibration[s.name].mean(dim=(0, 1)).expand_as(cached[s.name])
                  for s in routers}
    _, static = replay_routing(model, sites, {**cached, **layer_mean}, x)
    assert all(one_ranking(static[name], dims=(0, 1)) for name in static)
    position_mean = {s.name: calibration[s.name].mean(dim=0).expand_as(cached[s.name])
                     for s in routers}
    _, by_position = replay_routing(model, sites, {**cached, **position_mean}, x)
    assert all(one_ranking(by_position[name], dims=(0,)) for name in by_position)


def test_files_read_are_exactly_what_loading_opened(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch):
    folder = save(FAMILIES["qwen3_moe"][0](), tmp_path, max_shard_size="40KB")
    (folder / "generation_config.json").write_text("{}")  # not needed for logits: not read
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1
    opened: list[Path] = []
    real_safe_open = transformers.modeling_utils.safe_open

    def spy(file: str, *args: Any, **kwargs: Any) -> Any:
        opened.append(Path(file))
        return real_safe_open(file, *args, **kwargs)

    watched = [str(folder)]

    def audit(event: str, args: tuple) -> None:
        if event == "open" and isinstance(args[0], str) and args[0].startswith(tuple(watched)):
            opened.append(Path(args[0]))

    monkeypatch.setattr(transformers.modeling_utils, "safe_open", spy)
    sys.addaudithook(audit)  # Python-level opens (config, index); a hook cannot be removed,
    _, _, files = load_hf_folder(folder)
    watched.clear()  # so it is made inert
    assert files == [tmp_path / "config.json", tmp_path / "model.safetensors.index.json",
                     *shards, tmp_path / "tokenizer.json"]
    assert set(opened) <= set(files)
    assert set(shards) | {tmp_path / "config.json"} <= set(opened)


def test_legacy_per_expert_mixtral_layout_loads(mixtral_folder: Path, tmp_path: Path):
    """Published Mixtral checkpoints keep one w1/w2/w3 per expert under block_sparse_moe;
    transformers fuses them while loading, and the model is the same."""
    state = load_file(mixtral_folder / "model.safetensors")
    legacy = {}
    for key, tensor in state.items():
        moe = key.replace(".mlp.", ".block_sparse_moe.")
        if key.endswith("experts.gate_up_proj"):
            w1, w3 = tensor.chunk(2, dim=1)
            for e in range(len(tensor)):
                legacy[f"{moe.removesuffix('gate_up_proj')}{e}.w1.weight"] = w1[e].contiguous()
                legacy[f"{moe.removesuffix('gate_up_proj')}{e}.w3.weight"] = w3[e].contiguous()
        elif key.endswith("experts.down_proj"):
            for e in range(len(tensor)):
                legacy[f"{moe.removesuffix('down_proj')}{e}.w2.weight"] = tensor[e].clone()
        else:
            legacy[moe] = tensor
    save_file(legacy, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    write_config(mixtral_folder, tmp_path)
    fused, _, _ = load_hf_folder(mixtral_folder)
    converted, _, _ = load_hf_folder(tmp_path)
    x = torch.randint(3, VOCAB, (2, SEQ_LEN))
    with torch.no_grad():
        assert torch.equal(converted(x).logits, fused(x).logits)


def test_dtype_is_honoured(mixtral_folder: Path):
    model, _, _ = load_hf_folder(mixtral_folder)
    assert next(model.parameters()).dtype == torch.float32  # the config's
    model, _, _ = load_hf_folder(mixtral_folder, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    x = torch.randint(3, VOCAB, (2, SEQ_LEN))
    sites = discover_sites(model)
    with torch.no_grad():
        original = model(x).logits
        cached = record(model, x, sites)
    assert {c.dtype for c in cached.values()} == {torch.bfloat16}
    assert torch.equal(replay_routing(model, sites, cached, x)[0], original)


@pytest.mark.parametrize("config", [
    lambda: transformers.LlamaConfig(**COMMON, intermediate_size=64, num_key_value_heads=2),
    lambda: transformers.Qwen2Config(**COMMON, intermediate_size=64, num_key_value_heads=2),
])
def test_dense_models_have_no_routers(config: Callable[[], Any]):
    model = transformers.AutoModelForCausalLM.from_config(config())
    assert discover_sites(model) == [] and discover_experts(model) == []
    assert discover_blocks(model) == ["model.layers.0", "model.layers.1"]


def test_folder_without_tokenizer_loads(mixtral_folder: Path, tmp_path: Path):
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((mixtral_folder / name).read_bytes())
    _, tokenizer, files = load_hf_folder(tmp_path)
    assert tokenizer is None and files == [tmp_path / "config.json",
                                           tmp_path / "model.safetensors"]


def test_native_model_type_with_auto_map_loads_the_builtin_code(mixtral_folder: Path,
                                                                 tmp_path: Path):
    raw = json.loads((mixtral_folder / "config.json").read_text())
    raw["auto_map"] = {"AutoModelForCausalLM": "modeling_mine.MixtralForCausalLM"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").write_bytes((mixtral_folder / "model.safetensors")
                                                 .read_bytes())
    model, _, _ = load_hf_folder(tmp_path)
    assert type(model).__module__.startswith("transformers.models.mixtral")


def write_config(src: Path, dst: Path, **changes: Any) -> None:
    raw = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**raw, **changes}))


def pickle_only(src: Path, dst: Path) -> None:
    write_config(src, dst)
    torch.save({}, dst / "pytorch_model.bin")  # written, never loaded


def other_weights(layers: int) -> Callable[[Path, Path], None]:
    def make(src: Path, dst: Path) -> None:
        write_config(src, dst, num_hidden_layers=layers)
        (dst / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    return make


def claim(src: Path, dst: Path, **sizes: int) -> None:
    """The weights with a config claiming other sizes."""
    write_config(src, dst, **sizes)
    shutil.copy(src / "model.safetensors", dst / "model.safetensors")


def truncated(src: Path, dst: Path) -> None:
    write_config(src, dst)
    blob = (src / "model.safetensors").read_bytes()
    (dst / "model.safetensors").write_bytes(blob[:len(blob) // 2])


def peft_adapter(src: Path, dst: Path) -> None:
    write_config(src, dst)
    (dst / "adapter_config.json").write_text("{}")


BAD_FOLDERS: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "no config": (lambda src, dst: None, "has no config.json"),
    "remote code": (lambda src, dst: write_config(
        src, dst, model_type="my_moe", auto_map={"AutoModelForCausalLM": "modeling.M"}),
        "needs the checkpoint's own Python code"),
    "unknown type": (lambda src, dst: write_config(src, dst, model_type="my_moe"),
                     "unknown to transformers"),
    "not a causal LM": (lambda src, dst: write_config(src, dst, model_type="vit"),
                        "not a causal language model"),
    "pickle only": (pickle_only, "safetensors only"),
    "no weights": (write_config, "no weights in"),
    # a layer short: built on the meta device, then transformers' own missing keys
    "weights missing": (other_weights(3), re.escape("do not fit its config.json (9 missing: "
                                                    "model.layers.2.")),
    "weights left over": (other_weights(1), "do not fit its config.json"),
    "peft adapter": (peft_adapter, "PEFT adapter"),
    # claims checked against the weights' header before anything is built (issue 18)
    "a million layers": (other_weights(10**6),
                         "num_hidden_layers=1000000 but the weights hold 2 layers"),
    # every other size against the model transformers builds from the config (issue 37)
    "vocab 1e9": (lambda src, dst: claim(src, dst, vocab_size=10**9),
                  re.escape("(vocab_size=1000000000) builds model.embed_tokens.weight "
                            "[1000000000, 32] but the weights hold [120, 32]")),
    "hidden 1e6": (lambda src, dst: claim(src, dst, hidden_size=10**6),
                   re.escape("(hidden_size=1000000) builds model.embed_tokens.weight "
                             "[120, 1000000] but the weights hold [120, 32]")),
    "a million experts": (lambda src, dst: claim(src, dst, num_local_experts=10**6),
                          # saved per expert, built merged [E, 2 x intermediate, hidden]:
                          # matched by the total (test_model_sizes.py checks the counts)
                          r"\(num_local_experts=1000000\) builds [\d,]+ weights, more than "
                          r"twice the [\d,]+ its weight files hold \(the largest, "
                          + re.escape("model.layers.0.mlp.experts.gate_up_proj "
                                      "[1000000, 128, 32], under a name no file uses)")),
    "truncated weights": (truncated, "may be truncated or corrupt"),
    "mudd": (lambda src, dst: write_config(src, dst, model_type="muddpythia"),
             "MUDD checkpoint"),
}


@pytest.mark.parametrize("case", list(BAD_FOLDERS))
def test_bad_folders_give_one_clear_error(case: str, mixtral_folder: Path, tmp_path: Path):
    make, message = BAD_FOLDERS[case]
    make(mixtral_folder, tmp_path)
    started = time.perf_counter()
    with pytest.raises(FcauditError, match=message) as err:
        load_hf_folder(tmp_path)
    assert "\n" not in str(err.value)
    assert time.perf_counter() - started < 10  # refused before anything big is built


def test_is_hf_folder(mixtral_folder: Path, tmp_path: Path):
    assert is_hf_folder(mixtral_folder)
    assert not is_hf_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "muddformer"}))
    assert not is_hf_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"fcaudit_run": 1, "model_type": "x"}))
    assert not is_hf_folder(tmp_path)


def test_sites_listed_by_fcaudit_sites_work_as_sites_globs(mixtral_folder: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]):
    """`fcaudit sites` lists a router path; `--sites` naming exactly that path must audit it
    (with the router adapter), not end in advice only Python can follow."""
    from fcaudit.cli import main
    from fcaudit.io.data import load_tokenizer
    assert main(["sites", "--model", str(mixtral_folder)]) == 0
    listed = [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()
              if "family=router" in line]
    assert listed == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    ev, ca = token_batches(load_tokenizer(mixtral_folder / "tokenizer.json"))
    np.save(tmp_path / "eval.npy", ev.numpy())
    np.save(tmp_path / "calib.npy", ca.numpy())
    code = main(["audit", "--model", str(mixtral_folder), "--sites", listed[0], "--tokens",
                 str(tmp_path / "eval.npy"), "--calib-tokens", str(tmp_path / "calib.npy"),
                 "--quiet", "--no-execution", "--repeats", "1", "--bootstrap", "10",
                 "--no-per-layer", "--batch-size", "2", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 0, err
    sites = json.loads((tmp_path / "out" / "audit.json").read_text())["sites"]
    assert [(s["name"], s["adapter"]) for s in sites] == [(listed[0], "router")]


def _nll_of_targets(output: Any, batch: Any) -> torch.Tensor:
    """Next-token NLL per token ``[B, T-1]`` of the ids given as targets ``[B, T]``."""
    logits, ids = output.logits[:, :-1].double(), batch.targets
    return (logits.logsumexp(-1) - logits.gather(-1, ids[:, 1:, None])[..., 0]).float()


@pytest.mark.parametrize("given", ["dict", "ids", "embeds"])
def test_token_inputs_route_one_row_per_token(given: str, mixtral_folder: Path):
    """A Hugging Face MoE given ``{'input_ids', 'attention_mask'}``, the ids themselves as
    ``inputs=``, or ``{'inputs_embeds'}`` once died in a TypeError in the router adapter
    (no positions for its flattened logits). It audits as token data does: bitwise
    identity, the NLL of its own logits (computed here) and the config's 2 of 4 experts."""
    from fcaudit import AuditData, AuditOptions, audit
    model, tokenizer, _ = load_hf_folder(mixtral_folder)
    x, calib = token_batches(tokenizer)
    embed = model.get_input_embeddings()

    def inputs(ids: torch.Tensor) -> Any:
        with torch.no_grad():
            return {"dict": {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                    "ids": ids, "embeds": {"inputs_embeds": embed(ids)}}[given]
    r = audit(model, data=AuditData(inputs=inputs(x), targets=x, calib_inputs=inputs(calib),
                                    calib_targets=calib),
              options=AuditOptions(objective=_nll_of_targets, repeats=1, bootstrap=100,
                                   batch_size=2, per_layer=False, timing_pairs=0,
                                   progress=False))
    with torch.no_grad():
        logits = model(x).logits[:, :-1].double()
    expected = (logits.logsumexp(-1) - logits.gather(-1, x[:, 1:, None])[..., 0]).mean()
    assert r.identity_replay_max_abs_diff == 0.0
    assert r.conditions["correct"].nll == pytest.approx(float(expected), rel=1e-6)
    assert r.execution.experts.experts_per_token_per_layer == [2.0, 2.0]


class _Embedded(nn.Module):
    """Takes token vectors as a plain tensor: nothing says where its tokens are."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, vectors: torch.Tensor) -> Any:
        return self.hf(inputs_embeds=vectors)


def test_router_inputs_without_token_positions_are_refused_in_one_line(mixtral_folder: Path):
    from fcaudit import AuditData, AuditOptions, audit
    model, tokenizer, _ = load_hf_folder(mixtral_folder)
    x, calib = token_batches(tokenizer)
    with torch.no_grad():
        vectors, calib_vectors = (model.get_input_embeddings()(i) for i in (x, calib))
    net = _Embedded(model)
    with pytest.raises(FcauditError) as info:
        audit(net, data=AuditData(inputs=vectors, targets=x, calib_inputs=calib_vectors,
                                  calib_targets=calib), sites=discover_sites(net),
              options=AuditOptions(objective=_nll_of_targets, execution=False,
                                   progress=False))
    message = str(info.value)
    assert "\n" not in message and "do not say how many tokens each of the 4 examples" in \
        message and "'input_ids'" in message


def test_hub_kernels_are_never_swapped_in_at_load(mixtral_folder: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers >= 5.25 kernelizes a model at load unless told not to (kernels fetched
    from the hub on a GPU: network at run time, and fused paths that may bypass the sites):
    fcaudit loads with ``use_kernels=False``, also where the environment would allow them."""
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    seen = {}
    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args: object, **kwargs: object) -> object:
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    model, _, _ = load_hf_folder(mixtral_folder)
    assert seen["use_kernels"] is False
    assert getattr(model, "use_kernels", False) is False
