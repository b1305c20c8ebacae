"""Reduced configs, one per supported family: the same layer pattern as the real models, tiny dims.

Head dims are 64 (divisible by every KV group size we test) unless a test says otherwise.
"""

from __future__ import annotations

from typing import Any

_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "vocab_size": 128,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}

WINDOW = 8


def _cfg(model_type: str, layers: int, **extra: Any) -> dict[str, Any]:
    return {**_BASE, "model_type": model_type, "num_hidden_layers": layers, **extra}


def _deepseek(model_type: str, **extra: Any) -> dict[str, Any]:
    """MLA with a small MoE: 2 layers, the first dense."""
    return _cfg(
        model_type,
        2,
        head_dim=None,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        q_lora_rank=None,
        qk_rope_head_dim=32,
        v_head_dim=64,
        qk_nope_head_dim=32,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        **extra,
    )


TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": _cfg("llama", 2),
    "llama-sliding": _cfg(
        "llama",
        3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=WINDOW,
    ),
    "mistral": _cfg("mistral", 2, head_dim=None, hidden_size=256),
    "qwen2": _cfg("qwen2", 2, head_dim=None, hidden_size=256),
    "qwen3": _cfg("qwen3", 2),
    "qwen3_moe": _cfg(
        "qwen3_moe",
        2,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=32,
        norm_topk_prob=True,
    ),
    "phi3": _cfg("phi3", 2, head_dim=None, hidden_size=256, tie_word_embeddings=False),
    "gemma2": _cfg(
        "gemma2",
        2,
        query_pre_attn_scalar=64,
        sliding_window=WINDOW,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    ),
    "gemma3_text": _cfg("gemma3_text", 4, sliding_window=WINDOW, sliding_window_pattern=2, query_pre_attn_scalar=64),
    "gemma3": {
        "model_type": "gemma3",
        "vocab_size": 128,
        "text_config": _cfg(
            "gemma3_text", 4, sliding_window=WINDOW, sliding_window_pattern=2, query_pre_attn_scalar=64
        ),
    },
    "gemma3n": {
        "model_type": "gemma3n",
        "text_config": _cfg(
            "gemma3n_text",
            6,
            num_kv_shared_layers=2,
            vocab_size_per_layer_input=128,
            sliding_window=WINDOW,
            rope_local_base_freq=10000.0,
            final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "full_attention"] * 3,
            activation_sparsity_pattern=[0.0] * 6,
            hidden_size_per_layer_input=16,
            altup_num_inputs=2,
            altup_coef_clip=120.0,
            altup_correct_scale=True,
            altup_active_idx=0,
            laurel_rank=8,
        ),
    },
    "gemma4_text": _cfg(
        "gemma4_text",
        6,
        num_kv_shared_layers=2,
        sliding_window=WINDOW,
        sliding_window_pattern=3,
        global_head_dim=128,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=128,
    ),
    "gemma4": {
        "model_type": "gemma4",
        "vocab_size": 128,
        "text_config": _cfg(
            "gemma4_text",
            5,
            num_kv_shared_layers=0,
            sliding_window=WINDOW,
            sliding_window_pattern=5,
            global_head_dim=128,
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=128,
        ),
    },
    "gpt_oss": _cfg(
        "gpt_oss",
        4,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    "qwen3_next": _cfg(
        "qwen3_next",
        4,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[],
        moe_intermediate_size=32,
        partial_rotary_factor=0.25,
        full_attention_interval=2,
    ),
    "qwen3_5": {
        "model_type": "qwen3_5",
        "text_config": _cfg(
            "qwen3_5_text",
            4,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_conv_kernel_dim=4,
            partial_rotary_factor=0.25,
            full_attention_interval=2,
        ),
    },
    "deepseek_v2": _deepseek(
        "deepseek_v2",
        kv_lora_rank=32,
        topk_method="greedy",
        rope_scaling={"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096},
    ),
    "deepseek_v3": _deepseek("deepseek_v3", kv_lora_rank=64, topk_method="noaux_tc"),
}
