"""Tiny random configs of the Hugging Face state-space and hybrid families (one entry per
family, sorted by name): ``SSM_FAMILIES[name]()`` is a config that
``AutoModelForCausalLM.from_config`` builds in a fraction of a second. Shared by
tests/test_hf_selection.py and benchmarks/hf_ssm_sweep.py. Sizes are chosen so that every
selection coefficient has its own width (Δ rank, state size, groups and heads differ), so
a slice taken at the wrong offset cannot pass for the right one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import transformers
from conftest import VOCAB  # the ids of the tokenizer a saved folder gets

IDS = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

SSM_FAMILIES: dict[str, Callable[[], Any]] = {
    "bamba": lambda: transformers.BambaConfig(
        **IDS, **ATTENTION, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=6, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8),
    "falcon_h1": lambda: transformers.FalconH1Config(
        **IDS, **ATTENTION, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        head_dim=8, mamba_d_ssm=48, mamba_n_heads=4, mamba_d_head=12, mamba_n_groups=2,
        mamba_d_state=6, mamba_d_conv=4, mamba_chunk_size=8,
        ssm_multipliers=[1.0, 0.5, 2.0, 0.25, 1.5]),
    "falcon_mamba": lambda: transformers.FalconMambaConfig(
        **IDS, hidden_size=16, state_size=6, num_hidden_layers=2, expand=2, conv_kernel=4,
        time_step_rank=3),
    "granitemoehybrid": lambda: transformers.GraniteMoeHybridConfig(
        **IDS, **ATTENTION, hidden_size=32, intermediate_size=32, num_hidden_layers=3,
        layer_types=["mamba", "attention", "mamba"], num_local_experts=4,
        num_experts_per_tok=2, shared_intermediate_size=32, mamba_n_heads=4, mamba_d_head=16,
        mamba_n_groups=2, mamba_d_state=6, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=8),
    "jamba": lambda: transformers.JambaConfig(
        **IDS, **ATTENTION, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=6,
        mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=3),
    "mamba": lambda: transformers.MambaConfig(
        **IDS, hidden_size=16, state_size=6, num_hidden_layers=2, expand=2, conv_kernel=4,
        time_step_rank=3),
    "mamba2": lambda: transformers.Mamba2Config(
        **IDS, hidden_size=16, num_heads=4, head_dim=8, expand=2, n_groups=2, state_size=6,
        conv_kernel=4, chunk_size=8, num_hidden_layers=2),
    "nemotron_h": lambda: transformers.NemotronHConfig(
        **IDS, **ATTENTION, hidden_size=32, head_dim=8, intermediate_size=64,
        layers_block_type=["mamba", "attention", "moe", "mamba"], mamba_num_heads=4,
        mamba_head_dim=16, n_groups=2, ssm_state_size=6, conv_kernel=4, expand=2,
        chunk_size=8, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=16, num_experts_per_tok=2),
    "zamba2": lambda: transformers.Zamba2Config(
        **IDS, hidden_size=32, num_hidden_layers=3, layers_block_type=["mamba", "hybrid",
                                                                       "mamba"],
        mamba_d_state=6, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2, n_mamba_heads=4,
        mamba_headdim=16, chunk_size=8, num_attention_heads=4, num_key_value_heads=4,
        attention_head_dim=16, intermediate_size=64, num_mem_blocks=1, adapter_rank=8,
        max_position_embeddings=64),
}


def build(family: str) -> torch.nn.Module:
    """The family's tiny random model (seed 0, float32, eval mode; nothing downloaded)."""
    torch.manual_seed(0)
    config = SSM_FAMILIES[family]()
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
