"""Tiny configs for every model module the installed mlx-lm ships, built from that module's own ModelArgs.

Every field a ModelArgs requires, or that sizes the model, gets a small value by its name; the rest keep the
module's own defaults. A few modules need a field or two more, listed in EXTRA with the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
from typing import Any

from kvrig.models.lazy import mlx_lm_architectures

# Sizes by field name: small enough to run a real model on CPU in milliseconds, head dims of 64 (every KV
# group size divides them).
SIZES: dict[str, Any] = {
    "hidden_size": 128,
    "d_model": 128,
    "n_embd": 128,
    "model_dim": 128,
    "num_vocab": 256,
    "dim": 128,
    "intermediate_size": 256,
    "ffn_hidden_size": 256,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_layers": 2,
    "n_layer": 2,
    "n_layers": 2,
    "num_attention_heads": 2,
    "n_head": 2,
    "n_heads": 2,
    "num_heads": 2,
    "num_key_value_heads": 1,
    "n_kv_heads": 1,
    "num_kv_heads": 1,
    "head_dim": 64,
    "vocab_size": 256,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "layer_norm_eps": 1e-5,
    "norm_eps": 1e-5,
    "layer_norm_epsilon": 1e-5,
    "rope_theta": 10000.0,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
    "kv_lora_rank": 64,
    "q_lora_rank": None,
    "qk_rope_head_dim": 32,
    "qk_nope_head_dim": 32,
    "v_head_dim": 64,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "tie_word_embeddings": True,
}

# Fields left at None by a ModelArgs that its model still does arithmetic with, by name.
WHEN_NONE: dict[str, Any] = {
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "head_dim": 64,
    "moe_intermediate_size": 64,
    "num_key_value_heads": 1,
    "max_position_embeddings": 4096,
}

# Wrappers whose `text_config` is another module's ModelArgs.
TEXT_MODULES: dict[str, str] = {
    "gemma3": "gemma3_text",
    "kimi_k25": "deepseek_v3",
    "kimi_vl": "deepseek_v3",
    "qwen2_vl": "qwen2",
    "qwen3_vl": "qwen3",
    "qwen3_vl_moe": "qwen3_moe",
    "mistral3": "llama",
    "pixtral": "llama",
    "lfm2-vl": "lfm2",
}

# Fields a module needs beyond its ModelArgs' required ones (layer patterns, rope fractions that must give
# even dims).
# Its attention reads the low-rank scales whatever the flags say, and its router knows one zero-expert type.
_LONGCAT = {
    "q_lora_rank": 32,
    "mla_scale_q_lora": True,
    "mla_scale_kv_lora": True,
    "expert_ffn_hidden_size": 64,
    "zero_expert_type": "identity",
}

EXTRA: dict[str, dict[str, Any]] = {
    "phi": {"partial_rotary_factor": 0.5},
    "lfm2_moe": {"full_attn_idxs": [1], "num_dense_layers": 1},
    "ministral3": {
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"rope_theta": 1e4, "llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 4096},
    },
    # Nested or derived sizes the ModelArgs do not name as fields.
    "dbrx": {
        "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
        "attn_config": {"kv_n_heads": 1, "clip_qkv": 8.0, "rope_theta": 1e4},
    },
    "plamo": {"n_shared_head": 2},
    # Its Mamba mixer is mamba_num_heads × hidden_size_per_head wide (64 × 128 by default: 8192 columns, which
    # GPTQ's column loop takes minutes over).
    "plamo2": {"mamba_num_heads": 2, "hidden_size_per_head": 64},
    "deepseek_v32": {"q_lora_rank": 32},  # its attention always has the low-rank query projection
    "deepseek_v41": {"q_lora_rank": 32},
    "glm_moe_dsa": {"q_lora_rank": 32, "rope_parameters": {"rope_theta": 1e4}},
    "mistral4": {
        "q_lora_rank": 32,
        "rope_parameters": {"rope_theta": 1e4, "llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 4096},
    },
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "hunyuan": {"rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"}},
    "kimi_linear": {"linear_attn_config": {"kda_layers": [1], "num_heads": 2, "head_dim": 64}},
    "openelm": {"num_query_heads": [2, 2], "num_kv_heads": [1, 1], "ffn_multipliers": [1.0, 1.0], "ffn_dim_divisor": 8},
    "mellum": {
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_theta": 1e4}, "full_attention": {"rope_theta": 1e4}},
    },
    "llama4_text": {"no_rope_layers": [1, 0], "intermediate_size_mlp": 256},
    "mamba2": {
        "num_heads": 4,
        "head_dim": 32,
        "n_groups": 1,
        "time_step_limit": [0.0, 1e9],
        "conv_kernel": 4,
    },  # KV heads = ceil(heads / n_shared_head)
    "qwen": {"kv_channels": 64, "num_attention_heads": 2},  # head dim = kv_channels; the MLP halves its size
    "olmo3": {"layer_types": ["sliding_attention", "full_attention"]},
    "afmoe": {"layer_types": ["sliding_attention", "full_attention"]},
    "gear": {"layer_types": ["sliding_attention", "full_attention"]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "nemotron_h": {"hybrid_override_pattern": "M*", "mamba_num_heads": 4, "mamba_head_dim": 32, "n_groups": 1},
    "cohere2": {"sliding_window_pattern": 2, "layer_types": ["sliding_attention", "full_attention"]},
    "gemma3_text": {"sliding_window_pattern": 2},
    "lfm2": {"full_attn_idxs": [1], "block_ff_dim": 256, "intermediate_size": 256, "block_dim": 128},
    "nemotron-nas": {  # one attention layer, one without attention (as the published NAS models mix)
        "block_configs": [
            {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.0}},
            {"attention": {"no_op": True}, "ffn": {"ffn_mult": 1.0}},
        ]
    },
    "spark2_5": {
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_theta": 1e4}, "full_attention": {"rope_theta": 1e6}},
    },
    "minicpm3": {"q_lora_rank": 32, "dim_model_base": 128, "rope_scaling": {"original_max_position_embeddings": 4096}},
    "afm7": {"num_layers": 3, "num_kv_reuse_layers": 1},
    "longcat_flash": _LONGCAT,
    "longcat_flash_ngram": _LONGCAT,
    # its attention asserts conv_window == 2; its Model has no tied-embeddings path
    "baichuan_m1": {"conv_window": 2, "sliding_window_layers": [1], "tie_word_embeddings": False},
    "mimo_v2_flash": {
        "hybrid_layer_pattern": [1, 0],
        "moe_layer_freq": [0, 1],
        "sliding_window_size": 8,
        "swa_num_attention_heads": 2,
        "swa_num_key_value_heads": 1,
        "swa_head_dim": 64,
        "swa_v_head_dim": 64,
        "partial_rotary_factor": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
    },
    "bailing_moe_v3": {"n_group": 1, "topk_group": 1, "layer_group_size": 2},
    "exaone_moe": {"layer_types": ["sliding_attention", "full_attention"], "is_moe_layer": [False, True]},
}


# Fields a wrapper's own TextArgs needs beyond its required ones.
TEXT_EXTRA: dict[str, dict[str, Any]] = {
    # Four layers: every fourth is the global (unchunked, no-RoPE) layer; a chunk the schedule overflows.
    "llama4": {
        "num_hidden_layers": 4,
        "rope_scaling": None,
        "attention_chunk_size": 64,
        "interleave_moe_layer_step": 2,
        "num_experts_per_tok": 1,  # its MoE asserts one expert per token
        "intermediate_size_mlp": 256,
        "use_qk_norm": True,
    },
    # One delta-attention layer (linear state) and one MLA layer; attention residual blocks of two layers.
    "kimi_k3": {
        "linear_attn_config": {"kda_layers": [2], "num_heads": 2, "head_dim": 64, "short_conv_kernel_size": 4},
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "attn_res_block_size": 2,
    },
    # A sliding layer with RoPE, a full one without (a 0 theta); every feed-forward is sparse (its only kind).
    "muse_spark": {
        "layer_types": ["sliding_attention", "full_attention"],
        "layer_rope_theta": [1e4, 0],
        "rope_parameters": {"rope_theta": 1e4},
        "moe_hidden_size": 64,
        "moe_intermediate_size": 64,
        "final_logit_softcapping": 30.0,
    },
    # One sparse-attention layer (its indexer keys in a second cache) after a dense one.
    "minimax_m3_vl": {
        "dense_intermediate_size": 256,
        "shared_intermediate_size": 64,
        "moe_layer_freq": [0, 1],
        "sparse_attention_freq": [0, 1],
        "sparse_attention_config": {
            "sparse_num_index_heads": 2,
            "sparse_index_dim": 64,
            "sparse_block_size": 8,
            "sparse_topk_blocks": 2,
            "sparse_local_block": 1,
        },
    },
}


def _qwen3_5_moe() -> dict[str, Any]:
    from tiny_configs import TINY_CONFIGS

    text = dict(TINY_CONFIGS["qwen3_5"]["text_config"])
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1}
    text.update(moe, model_type="qwen3_5_moe_text", shared_expert_intermediate_size=64, mlp_only_layers=[])
    return {"text_config": text}


def _prism_hadamard_qwen35() -> dict[str, Any]:
    """A Hadamard pack of the tiny qwen3_5: the module's own ModelArgs demand a text-only schema, 2-bit affine
    weights of group 128 and a manifest of packed modules; every bias-free Linear/Embedding whose input width
    the 128-wide groups divide is packed, rotated in 512-wide blocks where its width allows."""
    import mlx.nn as nn
    from mlx_lm.models import qwen3_5

    config = {**tiny_config("qwen3_5"), "model_type": "prism_hadamard_qwen35"}
    config["text_config"] = {**config["text_config"], "hidden_size": 512, "intermediate_size": 256}
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config))
    modules = []
    for path, module in model.language_model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) and "bias" not in module:
            width = module.weight.shape[1]
            if width % 128 == 0:
                block = 512 if width % 512 == 0 else 0
                embedding = isinstance(module, nn.Embedding)
                modules.append({"path": path, "embedding": embedding, "dtype": "float16", "block": block})
    pack = {"bits": 2, "group_size": 128, "mode": "affine"}
    return {**config, "schema_version": 1, "tensor_namespace": "mlx-lm-text", "quantization": pack, "modules": modules}


def _by_name(name: str, kind: str) -> Any:
    """A small value for a required field the SIZES table does not name, from its name and type."""
    n = name.lower()
    if kind == "bool":
        return False
    if kind in ("dict", "Dict"):
        return {}
    if kind in ("list", "List"):
        return []
    if kind == "str":
        return "silu" if "act" in n else ""
    if "eps" in n:
        return 1e-5
    if any(w in n for w in ("theta", "base")):
        return 10000.0
    if any(w in n for w in ("factor", "multiplier", "scale", "pct", "ratio")):
        return 1.0
    if kind == "float":
        return 1.0
    if "kv_heads" in n or "key_value" in n:
        return 1
    if any(w in n for w in ("layers", "heads", "topk", "per_tok", "groups", "group")):
        return 2
    if "expert" in n:
        return 4
    if "window" in n:
        return 8
    if any(w in n for w in ("dim", "size", "rank", "inner", "ctx", "positions")):
        return 64
    return 2


def module_args(name: str) -> Any:
    with contextlib.redirect_stdout(io.StringIO()):
        return importlib.import_module(f"mlx_lm.models.{name}").ModelArgs


def _kind(annotation: Any) -> str:
    """'int', 'list', 'dict'... from an annotation, a string or a type (Optional unwrapped)."""
    text = str(annotation).replace("typing.", "").replace("Optional[", "")
    if text.startswith("<class '"):
        text = text[len("<class '") : -2]
    text = text.split("[")[0].split("|")[0].strip(" ]")
    return {"List": "list", "Dict": "dict", "Tuple": "list", "tuple": "list"}.get(text, text)


def _fill(args: Any, name: str) -> dict[str, Any]:
    """Small values for a ModelArgs (or a module's own TextArgs): every field SIZES names, every required field,
    and the None defaults the model still computes with; the rest keep the module's defaults."""
    config: dict[str, Any] = {"model_type": name}
    for f in dataclasses.fields(args):
        if f.name == "model_type":
            continue
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        kind = _kind(f.type)
        if f.name in SIZES:
            config[f.name] = SIZES[f.name]
        elif f.name == "text_config" and name in TEXT_MODULES:
            config[f.name] = tiny_config(TEXT_MODULES[name])
        elif f.name == "text_config" and _own_text_args(name) is not None:
            # A wrapper whose text model's arguments are a TextArgs of its own module (llama4, kimi_k3...).
            text = _fill(_own_text_args(name), name)
            text.update(TEXT_EXTRA.get(name, {}))
            config[f.name] = text
        elif required:
            config[f.name] = _by_name(f.name, kind)
        elif f.default is None and f.name in WHEN_NONE:
            config[f.name] = WHEN_NONE[f.name]
    return config


def _own_text_args(name: str) -> Any:
    with contextlib.redirect_stdout(io.StringIO()):
        args = getattr(importlib.import_module(f"mlx_lm.models.{name}"), "TextArgs", None)
    return args if dataclasses.is_dataclass(args) else None


def tiny_config(name: str) -> dict[str, Any]:
    """The hand-made config where tiny_configs.py has one for this module, else one from its ModelArgs."""
    from tiny_configs import TINY_CONFIGS

    if name in TINY_CONFIGS:
        return TINY_CONFIGS[name]
    config = _fill(module_args(name), name)
    config.update(EXTRA.get(name, {}))
    if name == "qwen3_5_moe":
        config.update(_qwen3_5_moe())
    if name == "prism_hadamard_qwen35":
        return _prism_hadamard_qwen35()
    return config


def architectures() -> list[str]:
    return mlx_lm_architectures()
