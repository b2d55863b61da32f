"""Tiny random configs of the Hugging Face families with selective recurrences: state-space
mixers and hybrids, gated linear attention, gated recurrences (one entry per family, sorted
by name): ``SSM_FAMILIES[name]()`` is a config that
``AutoModelForCausalLM.from_config`` builds in a fraction of a second. Shared by
tests/test_hf_selection.py, tests/test_hf_gated_recurrence.py and
benchmarks/hf_ssm_sweep.py. Sizes are chosen so that every
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

TINY = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, use_cache=False)


def _bailing_hybrid() -> Any:
    return transformers.BailingHybridConfig(
        **TINY, intermediate_size=64, moe_intermediate_size=32, num_attention_heads=4,
        num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        head_dim=8, num_mtp_layers=0, num_expert_group=1, topk_group=1,
        layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse"])


def _kimi_linear() -> Any:
    return transformers.KimiLinearConfig(
        **TINY, intermediate_size=64, moe_intermediate_size=32, num_attention_heads=4,
        num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse"])


def _lara_mini() -> Any:
    return transformers.LaraMiniConfig(
        **TINY, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
        num_experts_per_tok=2, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"])


def _lfm2() -> Any:
    return transformers.Lfm2Config(
        **TINY, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["conv", "full_attention"], conv_L_cache=3)


def _lfm2_moe() -> Any:
    return transformers.Lfm2MoeConfig(
        **TINY, intermediate_size=64, moe_intermediate_size=32, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, num_dense_layers=0,
        layer_types=["conv", "full_attention"], conv_L_cache=3)


def _lfm3() -> Any:
    return transformers.Lfm3Config(
        **TINY, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        layer_types=["conv", "full_attention"], conv_L_cache=3)


def _olmo_hybrid() -> Any:
    return transformers.OlmoHybridConfig(
        **TINY, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"])


def _qwen3_5() -> Any:
    return transformers.Qwen3_5TextConfig(
        **TINY, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"])


def _qwen3_5_moe() -> Any:
    return transformers.Qwen3_5MoeTextConfig(
        **TINY, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
        num_experts_per_tok=2, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"])


def _qwen3_next() -> Any:
    return transformers.Qwen3NextConfig(
        **TINY, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
        num_experts_per_tok=2, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"])


def _recurrent_gemma() -> Any:
    return transformers.RecurrentGemmaConfig(
        **TINY, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        lru_width=32, attention_window_size=8, conv1d_width=3,
        block_types=["recurrent", "attention"])


def _rwkv() -> Any:
    return transformers.RwkvConfig(
        **TINY, attention_hidden_size=32, intermediate_size=64, context_length=64)


def _xlstm() -> Any:
    return transformers.xLSTMConfig(
        **TINY, num_heads=4, qk_dim_factor=0.5, v_dim_factor=1.0, chunk_size=4,
        mode="train", chunkwise_kernel="chunkwise--native_autograd",
        sequence_kernel="native_sequence__native", step_kernel="native")


def _zamba() -> Any:
    return transformers.ZambaConfig(
        **{**TINY, "num_hidden_layers": 3}, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=4, attention_hidden_size=64, attention_head_dim=16, mamba_d_state=4,
        mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, n_mamba_heads=2,
        # three layers: two hybrids, whose tied shared block needs a second copy to tie to
        layers_block_type=["linear_attention", "hybrid", "hybrid"])


# family -> tiny random config
SSM_FAMILIES: dict[str, Callable[[], Any]] = {
    "bailing_hybrid": _bailing_hybrid,
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
    "kimi_linear": _kimi_linear,
    "lara_mini": _lara_mini,
    "lfm2": _lfm2,
    "lfm2_moe": _lfm2_moe,
    "lfm3": _lfm3,
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
    "olmo_hybrid": _olmo_hybrid,
    "qwen3_5": _qwen3_5,
    "qwen3_5_moe": _qwen3_5_moe,
    "qwen3_next": _qwen3_next,
    "recurrent_gemma": _recurrent_gemma,
    "rwkv": _rwkv,
    "xlstm": _xlstm,
    "zamba": _zamba,
    "zamba2": lambda: transformers.Zamba2Config(
        **IDS, hidden_size=32, num_hidden_layers=3, layers_block_type=["mamba", "hybrid",
                                                                       "mamba"],
        mamba_d_state=6, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2, n_mamba_heads=4,
        mamba_headdim=16, chunk_size=8, num_attention_heads=4, num_key_value_heads=4,
        attention_head_dim=16, intermediate_size=64, num_mem_blocks=1, adapter_rank=8,
        max_position_embeddings=64),
}


def build(family: str) -> torch.nn.Module:
    """The family's tiny random model (seed 0, float32, eval mode; nothing downloaded) with
    every weight moved by seeded noise: a random init leaves some gate weights at 0
    (xLSTM: input-independent gates) or their effect below float resolution (Zamba), which
    a trained model does not."""
    torch.manual_seed(0)
    config = SSM_FAMILIES[family]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=noise).to(param.dtype))
    return model
