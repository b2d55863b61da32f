"""The sizes a Hugging Face folder's config.json claims, checked against the model
transformers itself builds from that config (on the meta device), before anything real
is built: every valid folder loads (OPT-350m's narrower embeddings with project_in and
project_out, LongCat-Flash's two sublayers per listed layer, per-expert weights that
loading merges, every family of the sweeps), and a
config claiming more than its weights hold is refused in one line naming the tensor
and the field. Reference: the model transformers builds in memory, whose logits the
loaded folder must reproduce bit for bit; the weight counts read from the file header
and worked out by hand."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import COMMON, FAMILIES, VOCAB, optional_extra, save
from safetensors import safe_open

from fcaudit.core.errors import ModelError

transformers = optional_extra("transformers")

from ssm_families import SSM_FAMILIES  # noqa: E402

from fcaudit.io.hf import load_hf_folder  # noqa: E402


def _opt_350m_layout() -> Any:
    """OPT-350m's layout, tiny: embeddings (16) narrower than the layers (32), so the
    decoder projects in and out, and no final layer norm (post-norm layers)."""
    return transformers.OPTConfig(vocab_size=VOCAB, hidden_size=32, word_embed_proj_dim=16,
                                  num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                                  max_position_embeddings=64, do_layer_norm_before=False,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _longcat_flash() -> Any:
    """LongCat-Flash: each entry of its layer list holds two sublayers, so its config says
    num_hidden_layers=4 for a list of 2."""
    return transformers.LongcatFlashConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=2, num_attention_heads=4,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        qk_head_dim=16, head_dim=8, v_head_dim=8, n_routed_experts=4, zero_expert_num=2,
        moe_topk=2,
        ffn_hidden_size=64, expert_ffn_hidden_size=32, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)


CONFIGS = {"opt-350m layout": _opt_350m_layout, "longcat_flash (two sublayers a layer)":
           _longcat_flash,
           "gpt2 (Conv1D weights)": lambda: transformers.GPT2Config(
               vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64),
           **{f"moe {name}": entry[0] for name, entry in FAMILIES.items()},
           **{f"ssm {name}": config for name, config in SSM_FAMILIES.items()}}


def _held(folder: Path) -> int:
    """Weights the folder's file holds, counted from its header."""
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 (no __iter__)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_valid_folder_loads_and_computes_as_transformers_does(name, tmp_path: Path):
    """A folder save_pretrained wrote from a config transformers builds is never refused
    as "from different models", and the loaded model's logits are the saved one's."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]()).eval()
    model.save_pretrained(tmp_path)
    loaded, _, _ = load_hf_folder(tmp_path)
    x = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


def _claim(folder: Path, **sizes: Any) -> Path:
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, **sizes}))
    return folder


def test_opt_embedding_width_claimed_wider_is_refused_naming_field_and_tensor(tmp_path: Path):
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_opt_350m_layout()).save_pretrained(tmp_path)
    _claim(tmp_path, word_embed_proj_dim=10**6)
    with pytest.raises(ModelError) as err:
        load_hf_folder(tmp_path)
    assert "\n" not in str(err.value)
    assert re.escape("config.json (word_embed_proj_dim=1000000) builds "
                     f"model.decoder.embed_tokens.weight [{VOCAB}, 1000000] but the weights "
                     f"hold [{VOCAB}, 16]; the config and the weights come from different "
                     "models") in re.escape(str(err.value))


def test_merged_experts_are_matched_by_their_total(tmp_path: Path):
    """Mixtral's experts are saved one by one (experts.N.w1) and built merged
    (experts.gate_up_proj): a config claiming a million experts is refused by the total,
    the counts in the message being the header's and (at least) the experts' by hand."""
    config, _, _ = FAMILIES["mixtral"]
    folder = _claim(save(config(), tmp_path / "mixtral"), num_local_experts=10**6)
    with pytest.raises(ModelError) as err:
        load_hf_folder(folder)
    built, held = (int(n.replace(",", "")) for n in re.findall(
        r"builds ([\d,]+) weights, more than twice the ([\d,]+)", str(err.value))[0])
    assert held == _held(folder)
    hidden, inter, layers = COMMON["hidden_size"], 64, COMMON["num_hidden_layers"]
    experts = 10**6 * (3 * hidden * inter + hidden) * layers  # w1, w3, w2 and the gate rows
    assert experts <= built < experts + held
    assert "(num_local_experts=1000000)" in str(err.value)
