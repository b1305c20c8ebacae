"""The per-family facts kvrig keeps by model type (the planner learns caches from mlx-lm).

Families whose mlx-lm attention cannot read mlx-lm's QuantizedKVCache although it runs with quantized caches
(soft-capping, attention sinks, KV-shared layers handing quantized tuples to plain attention): kvrig's runtime
gives them its dequantize-on-read cache instead, and the planner counts that cache for them.
"""

from __future__ import annotations

NO_QUANTIZED_ATTENTION: set[str] = {"gemma2", "gpt_oss", "gemma4_text"}

# Families whose MLX Swift model (mlx-swift-lm 3.31.4, Gemma3nText.swift) reads a KV-shared layer's keys and values
# from its owner's `cache.state` as float arrays: only MLX's plain cache holds them so, so the app keeps their KV in
# the activation dtype and a bundle of one takes none other. KvrigCore's CachePlan.keepsKVUnquantized is this set.
APP_UNQUANTIZED_KV: set[str] = {"gemma3n"}
