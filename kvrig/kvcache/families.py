"""The per-family facts kvrig keeps by model type (the planner learns caches from mlx-lm).

Families whose attention cannot read MLX's quantized cache, in mlx-lm (soft-capping, attention sinks, KV-shared
layers handing quantized tuples to plain attention) or in MLX Swift (attention that calls `cache.update` itself):
kvrig's runtime and the app give them its dequantize-on-read cache instead, and the planner counts that cache for
them. KvrigCore's CachePlan.readsDequantized is the same set (a contract test holds them to one).
"""

from __future__ import annotations

NO_QUANTIZED_ATTENTION: set[str] = {
    # mlx-lm's Python attention cannot read its QuantizedKVCache here
    "gemma2",
    "gpt_oss",
    "gemma4_text",
    # MLX Swift's attention (mlx-swift-lm 3.31.4) calls the cache's `update` itself, which MLX's QuantizedKVCache
    # answers with fatalError: the app reads kvrig's cache there, so the host and the plan do the same (deepseek_v3
    # and glm4_moe_lite do too, but their latent (MLA) caches are never quantized: kvcache.json leaves them so)
    "apertus",
    "baichuan_m1",
    "bitnet",
}

# Families whose MLX Swift model (mlx-swift-lm 3.31.4, Gemma3nText.swift) reads a KV-shared layer's keys and values
# from its owner's `cache.state` as float arrays: only MLX's plain cache holds them so, so the app keeps their KV in
# the activation dtype and a bundle of one takes none other. KvrigCore's CachePlan.keepsKVUnquantized is this set.
APP_UNQUANTIZED_KV: set[str] = {"gemma3n"}
