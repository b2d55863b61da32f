"""MUDDPythia / MUDDFormer: exactness against the official code, record/replay, loading.

The fixtures in ``fixtures/mudd_tiny`` and ``fixtures/muddformer_tiny`` hold data only:
an official config.json (4 layers, dim 64, 2 heads, vocab 256, block 64), random weights
stored in bf16, and what the official PyTorch code (Caiyun-AI/MUDDFormer at fc067b2,
torch 2.13 CPU, transformers 4.40.2) computed from them for 2 x 64 random ids: logits in
float32 and bfloat16, the sources X_0..X_4 and the coefficients W_i ``[B, T, C, L]``.
The weights are the official init with norm scales 1 + 0.2 N(0,1), norm biases
0.2 N(0,1) and ``dense_bs`` one-hot(last) + 0.3 N(0,1), rounded to bf16 (seeds 1234 and
4321). The script that made them imports the official code, so it stays outside the
repository. Here they match bitwise; another GEMM backend (oneDNN off) moves float32
logits by 3e-6 and bfloat16 logits by 2e-2, inside the tolerances below.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, write_folder
from safetensors.torch import load_file
from torch import nn

from fcaudit.core.errors import FcauditError
from fcaudit.core.recording import record
from fcaudit.core.replaying import replaying
from fcaudit.io.data import folder_tokenizer
from fcaudit.io.mudd_checkpoint import (
    is_mudd_folder,
    load_mudd_folder,
)
from fcaudit.models.mudd import PRESETS, MuddConfig, MuddModel

VARIANTS = ["mudd_tiny", "muddformer_tiny"]


def expected(name: str) -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / name / "expected.safetensors")


def run_with_hidden(model: MuddModel, ids: torch.Tensor) -> tuple[torch.Tensor, list]:
    """Logits and the sources X_0..X_N (embeddings, then raw block outputs)."""
    hidden: list[torch.Tensor] = []
    modules = [model.tok_embeddings, *model.layers]
    hooks = [m.register_forward_hook(lambda _m, _a, out: hidden.append(out)) for m in modules]
    with torch.no_grad():
        logits = model(ids)
    for h in hooks:
        h.remove()
    return logits, hidden


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("name", VARIANTS)
def test_float32_matches_official(name: str) -> None:
    exp = expected(name)
    model = load_mudd_folder(FIXTURES / name, dtype=torch.float32)
    logits, hidden = run_with_hidden(model, exp["input_ids"])
    assert max_diff(logits, exp["logits_fp32"]) <= 1e-5
    assert len(hidden) == model.config.n_layer + 1
    for i, h in enumerate(hidden):
        assert max_diff(h, exp[f"hidden.{i}"]) <= 1e-5, f"hidden state {i}"
    coefficients = record(model, exp["input_ids"])
    for i, c in enumerate(coefficients.values()):
        assert c.shape == exp[f"coef.{i}"].shape
        assert max_diff(c, exp[f"coef.{i}"]) <= 1e-5, f"coefficients of layer {i}"


@pytest.mark.parametrize("name", VARIANTS)
def test_bfloat16_matches_official(name: str) -> None:
    exp = expected(name)
    model = load_mudd_folder(FIXTURES / name)  # config.json says torch_dtype bfloat16
    assert model.output.weight.dtype == torch.bfloat16
    with torch.no_grad():
        logits = model(exp["input_ids"])
    assert logits.dtype == torch.bfloat16
    assert max_diff(logits, exp["logits_bf16"]) <= 5e-2


class Explode(nn.Module):
    def forward(self, *args: object) -> torch.Tensor:
        raise AssertionError("the generator ran during a replay")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_record_then_replay_is_bitwise_identical(dtype: torch.dtype) -> None:
    model = load_mudd_folder(FIXTURES / "mudd_tiny", dtype=dtype)
    ids = expected("mudd_tiny")["input_ids"]
    sites = model.controller_sites()
    recorded = record(model, ids)
    assert list(recorded) == [s.name for s in sites]
    cfg = model.config
    for i, tensor in enumerate(recorded.values()):
        assert tensor.shape == (*ids.shape, cfg.streams(i), i + 2)
    with torch.no_grad():
        native = model(ids)
        for i in range(cfg.n_layer):  # a replay must never call a generator
            model.dynamic_dense[i] = Explode()
        with replaying(model, {s: recorded[s.name] for s in sites}):
            replayed = model(ids)
        assert torch.equal(replayed, native)
        shuffled = {s: recorded[s.name].flip(1) for s in sites}
        with replaying(model, shuffled):
            assert not torch.equal(model(ids), native)  # the supplied coefficients are used
        with pytest.raises(AssertionError, match="generator ran"):
            model(ids)


def test_sites_families_and_blocks() -> None:
    model = MuddModel(PRESETS["tiny"])
    sites = model.controller_sites()
    n = model.config.n_layer
    assert [s.path for s in sites] == [f"dynamic_dense.{i}" for i in range(n)]
    assert [(s.family, s.layer) for s in sites] == (
        [("mudd", i) for i in range(n - 1)] + [("mudd.final", 0)])
    for path in model.execution_blocks():
        model.get_submodule(path)
    assert len(model.execution_blocks()) == n


def test_fresh_model_starts_as_plain_residual_transformer() -> None:
    torch.manual_seed(0)
    model = MuddModel(PRESETS["tiny"]).eval()
    twin = model.dense_counterpart().eval()
    twin.load_state_dict(model.state_dict(), strict=False)  # shared names; norms are all 1/0
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    with torch.no_grad():
        assert torch.equal(model(ids), twin(ids))


def test_dense_counterpart() -> None:
    model = MuddModel(PRESETS["tiny"]).to(torch.bfloat16)
    twin = model.dense_counterpart()
    names = [n for n, _ in twin.named_parameters()]
    assert not any("dynamic_dense" in n or "dense_bs" in n for n in names)
    assert twin.controller_sites() == []
    assert twin.execution_blocks() == model.execution_blocks()
    assert twin.output.weight.dtype == torch.bfloat16
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    with torch.no_grad():
        assert twin(ids).shape == (1, 8, model.config.vocab_size)


def test_1p4b_state_dict_matches_official_shapes() -> None:
    official = json.loads((FIXTURES / "muddpythia-1.4b-state-dict-shapes.json").read_text())
    with torch.device("meta"):
        model = MuddModel(PRESETS["1.4b"])
    ours = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert ours == official["shapes"]
    assert sum(p.numel() for p in model.parameters()) == official["n_params"]


def test_2p8b_size_matches_official() -> None:
    with torch.device("meta"):
        model = MuddModel(PRESETS["2.8b"])
    assert len(model.state_dict()) == 800
    assert sum(p.numel() for p in model.parameters()) == 2_784_962_589


def test_config_without_dense_connections_is_refused() -> None:
    raw = json.loads((FIXTURES / "mudd_tiny" / "config.json").read_text())
    with pytest.raises(FcauditError, match="no controllers to audit"):
        MuddConfig.from_hf({**raw, "dense": False, "dynamic_dense": False})


def test_1p4b_config_from_official_json() -> None:
    raw = json.loads((FIXTURES / "muddpythia-1.4b-config.json").read_text())
    config = MuddConfig.from_hf(raw)
    assert config == PRESETS["1.4b"]
    assert MuddConfig(**dataclasses.asdict(config)) == config  # how run folders store it


# --- checkpoint layouts -------------------------------------------------------------


@pytest.mark.parametrize("layout", ["safetensors", "sharded-safetensors", "bin", "sharded-bin"])
def test_loads_every_layout(tmp_path: Path, tiny_state: dict, layout: str) -> None:
    exp = expected("mudd_tiny")
    folder = write_folder(tmp_path, tiny_state, layout)
    assert is_mudd_folder(folder)
    model = load_mudd_folder(folder, dtype=torch.float32)
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())
    with torch.no_grad():
        assert max_diff(model(exp["input_ids"]), exp["logits_fp32"]) <= 1e-5


def test_decoding_cache_keys_are_ignored(tmp_path: Path, tiny_state: dict) -> None:
    """Buffers the official code saves for decoding are skipped: the model loads with
    exactly the checkpoint's other tensors and computes the official logits."""
    state = {**tiny_state, "layers.0.attention.kv_cache.k_cache": torch.zeros(1, 2, 8, 32),
             "layer_cache.layer_cache": torch.zeros(5, 1, 1, 64)}
    model = load_mudd_folder(write_folder(tmp_path, state, "bin"), dtype=torch.float32)
    loaded = model.state_dict()
    assert sorted(loaded) == sorted(tiny_state)
    assert all(torch.equal(loaded[k].float(), v.float()) for k, v in tiny_state.items())
    exp = expected("mudd_tiny")
    with torch.no_grad():
        assert max_diff(model(exp["input_ids"]), exp["logits_fp32"]) <= 1e-5


def one_line_error(folder: Path, match: str) -> str:
    with pytest.raises(FcauditError, match=match) as info:
        load_mudd_folder(folder)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_error_missing_and_unexpected_keys(tmp_path: Path, tiny_state: dict) -> None:
    state = {k: v for k, v in tiny_state.items() if k != "dense_bs.2"}
    state["layers.0.attention.wqkv.weight"] = torch.zeros(3)
    message = one_line_error(write_folder(tmp_path, state, "safetensors"), "missing keys")
    assert "dense_bs.2" in message and "unexpected keys: layers.0.attention.wqkv" in message


def test_error_wrong_shape(tmp_path: Path, tiny_state: dict) -> None:
    state = {**tiny_state, "dynamic_dense.1.w2.weight": torch.zeros(13, 64)}
    one_line_error(write_folder(tmp_path, state, "sharded-bin"),
                   r"wrong shapes: dynamic_dense.1.w2.weight \[13, 64\]")


def test_error_missing_config_fields(tmp_path: Path, tiny_state: dict) -> None:
    config = json.loads((FIXTURES / "mudd_tiny" / "config.json").read_text())
    del config["round64"], config["rotary_pct"]
    one_line_error(write_folder(tmp_path, tiny_state, "safetensors", config),
                   r"config.json lacks required field\(s\): round64, rotary_pct")


def test_error_truncated_safetensors(tmp_path: Path) -> None:
    folder = tmp_path / "truncated"
    shutil.copytree(FIXTURES / "mudd_tiny", folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    one_line_error(folder, "not a readable safetensors file")


def test_error_no_weights(tmp_path: Path) -> None:
    shutil.copy(FIXTURES / "mudd_tiny" / "config.json", tmp_path / "config.json")
    one_line_error(tmp_path, "no weights in")


class RunsCode:
    """Unpickling this would run a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def test_pickle_that_runs_code_is_refused(tmp_path: Path, tiny_state: dict) -> None:
    marker = tmp_path / "code-ran"
    folder = write_folder(tmp_path, {**tiny_state, "payload": RunsCode(marker)}, "bin")
    message = one_line_error(folder, "refused to load .*convert the checkpoint to safetensors")
    assert "system" in message
    assert not marker.exists()


def test_sequence_longer_than_block_size() -> None:
    model = MuddModel(dataclasses.replace(PRESETS["tiny"], block_size=8))
    with pytest.raises(FcauditError, match="exceeds the model's block_size 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_folder_detection_and_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    assert folder_tokenizer(FIXTURES / "mudd_tiny") is None
    assert not is_mudd_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    assert not is_mudd_folder(tmp_path)
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(
        str(tmp_path / "tokenizer.json"))
    tokenizer = folder_tokenizer(tmp_path)
    assert tokenizer is not None and tokenizer.token_to_id("a") == 0
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(FcauditError, match="not a readable tokenizer"):
        folder_tokenizer(tmp_path)
