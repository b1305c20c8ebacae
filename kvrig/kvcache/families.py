"""The one per-family fact kvrig's runtime still keeps by model type (the planner learns caches from mlx-lm).

Families whose mlx-lm attention cannot read mlx-lm's QuantizedKVCache although it runs with quantized caches
(soft-capping, attention sinks, KV-shared layers handing quantized tuples to plain attention): kvrig's runtime
gives them its dequantize-on-read cache instead, and the planner counts that cache for them.
"""

from __future__ import annotations

NO_QUANTIZED_ATTENTION: set[str] = {"gemma2", "gpt_oss", "gemma4_text"}
