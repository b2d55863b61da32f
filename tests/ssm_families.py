"""Tiny random configs of the Hugging Face families with selective recurrences (issue 30).

``SSM_FAMILIES`` maps a family name to a factory of its tiny random config (two layers,
three for Zamba, hidden 32, a vocabulary of conftest's ``VOCAB``, ``use_cache=False`` as
fcaudit loads folders): a plain dict, one entry per family, sorted by name. Imports live
inside the factories so that the table loads without ``transformers``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

VOCAB = 120  # conftest.VOCAB: the tokenizer the tests train
TINY = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, use_cache=False)


def _bailing_hybrid() -> Any:
    import transformers
    return transformers.BailingHybridConfig(
        **TINY, intermediate_size=64, moe_intermediate_size=32, num_attention_heads=4,
        num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        head_dim=8, num_mtp_layers=0, num_expert_group=1, topk_group=1,
        layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse"])


def _kimi_linear() -> Any:
    import transformers
    return transformers.KimiLinearConfig(
        **TINY, intermediate_size=64, moe_intermediate_size=32, num_attention_heads=4,
        num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse"])


def _lara_mini() -> Any:
    import transformers
    return transformers.LaraMiniConfig(
        **TINY, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
        num_experts_per_tok=2, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"])


def _lfm2() -> Any:
    import transformers
    return transformers.Lfm2Config(
        **TINY, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["conv", "full_attention"], conv_L_cache=3)


def _lfm2_moe() -> Any:
    import transformers
    return transformers.Lfm2MoeConfig(
        **TINY, intermediate_size=64, moe_intermediate_size=32, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, num_dense_layers=0,
        layer_types=["conv", "full_attention"], conv_L_cache=3)


def _lfm3() -> Any:
    import transformers
    return transformers.Lfm3Config(
        **TINY, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        layer_types=["conv", "full_attention"], conv_L_cache=3)


def _olmo_hybrid() -> Any:
    import transformers
    return transformers.OlmoHybridConfig(
        **TINY, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"])


def _qwen3_5() -> Any:
    import transformers
    return transformers.Qwen3_5TextConfig(
        **TINY, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"])


def _qwen3_5_moe() -> Any:
    import transformers
    return transformers.Qwen3_5MoeTextConfig(
        **TINY, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
        num_experts_per_tok=2, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"])


def _qwen3_next() -> Any:
    import transformers
    return transformers.Qwen3NextConfig(
        **TINY, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
        num_experts_per_tok=2, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"])


def _recurrent_gemma() -> Any:
    import transformers
    return transformers.RecurrentGemmaConfig(
        **TINY, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        lru_width=32, attention_window_size=8, conv1d_width=3,
        block_types=["recurrent", "attention"])


def _rwkv() -> Any:
    import transformers
    return transformers.RwkvConfig(
        **TINY, attention_hidden_size=32, intermediate_size=64, context_length=64)


def _xlstm() -> Any:
    import transformers
    return transformers.xLSTMConfig(
        **TINY, num_heads=4, qk_dim_factor=0.5, v_dim_factor=1.0, chunk_size=4,
        mode="train", chunkwise_kernel="chunkwise--native_autograd",
        sequence_kernel="native_sequence__native", step_kernel="native")


def _zamba() -> Any:
    import transformers
    return transformers.ZambaConfig(
        **{**TINY, "num_hidden_layers": 3}, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=4, attention_hidden_size=64, attention_head_dim=16, mamba_d_state=4,
        mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, n_mamba_heads=2,
        # three layers: two hybrids, whose tied shared block needs a second copy to tie to
        layers_block_type=["linear_attention", "hybrid", "hybrid"])


# family -> tiny random config
SSM_FAMILIES: dict[str, Callable[[], Any]] = {
    "bailing_hybrid": _bailing_hybrid,
    "kimi_linear": _kimi_linear,
    "lara_mini": _lara_mini,
    "lfm2": _lfm2,
    "lfm2_moe": _lfm2_moe,
    "lfm3": _lfm3,
    "olmo_hybrid": _olmo_hybrid,
    "qwen3_5": _qwen3_5,
    "qwen3_5_moe": _qwen3_5_moe,
    "qwen3_next": _qwen3_next,
    "recurrent_gemma": _recurrent_gemma,
    "rwkv": _rwkv,
    "xlstm": _xlstm,
    "zamba": _zamba,
}
