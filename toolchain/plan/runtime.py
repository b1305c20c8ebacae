"""Memory beyond weights and KV cache: MLX buffer cache, prefill activations, growth copies, app baseline.

These are estimates (labelled so in the plan); weights and KV bytes are exact.
"""

from __future__ import annotations

from toolchain.models.spec import DTYPE_BYTES, ModelSpec
from toolchain.plan.kv import KVScheme, row_bytes

DEFAULT_BUFFER_CACHE_BYTES = 20 * 1024 * 1024  # what the MLX-Swift examples cap Memory.cacheLimit at
DEFAULT_PREFILL_STEP = 512  # MLX-Swift's GenerateParameters.prefillStepSize default
FUSED_HEAD_DIMS = (64, 80, 128)  # head dims MLX's fused (steel) attention takes for many-row queries


def _cfg(spec: ModelSpec) -> dict:
    return spec.config.get("text_config", spec.config)


def prefill_activation_bytes(spec: ModelSpec, prefill_step: int, context: int, dtype: str = "float16") -> int:
    """Upper-bound estimate of the live activations while one prefill chunk of `prefill_step` tokens runs at
    `context`: residual stream and projections, the MLP's widest intermediate, and the attention scores when
    they are materialized (chunk × context per head): MLX's fused attention kernel for many-row queries takes
    head dims 64, 80 and 128 without materializing them; other head dims fall back to plain matmuls."""
    cfg = _cfg(spec)
    width = DTYPE_BYTES[dtype]
    s = min(prefill_step, max(context, 1))
    hidden = spec.hidden_size
    heads = int(cfg.get("num_attention_heads") or 1)
    kv = max((layer.kv_heads for layer in spec.layers), default=0)
    head_dim = max((layer.k_head_dim for layer in spec.layers), default=0)
    inter = int(cfg.get("intermediate_size") or 4 * hidden)
    if cfg.get("moe_intermediate_size") and cfg.get("num_experts_per_tok"):
        inter = max(inter, int(cfg["moe_intermediate_size"]) * int(cfg["num_experts_per_tok"]))
    stream = 4 * s * hidden * width
    projections = s * (heads + 2 * kv) * head_dim * width
    mlp = 3 * s * inter * width
    scores = prefill_scores_bytes(spec, prefill_step, context, dtype)
    logits = spec.vocab_size * 4  # only the last position's logits are evaluated
    return stream + projections + mlp + scores + logits


def prefill_scores_bytes(spec: ModelSpec, prefill_step: int, context: int, dtype: str = "float16") -> int:
    """One layer's attention scores for a prefill chunk (chunk × context per head) when Metal materializes
    them (head dims its fused kernel does not take); a single buffer, so Metal's largest-buffer limit applies."""
    fused = all(layer.k_head_dim in FUSED_HEAD_DIMS for layer in spec.layers if layer.grows or layer.kind == "sliding")
    if fused:
        return 0
    heads = int(_cfg(spec).get("num_attention_heads") or 1)
    return heads * min(prefill_step, max(context, 1)) * context * DTYPE_BYTES[dtype]


def kv_read_bytes(spec: ModelSpec, scheme: KVScheme, context: int) -> int:
    """Cache bytes one decode step reads at `context` (growing layers up to context, rings up to window)."""
    total = 0
    for layer in spec.layers:
        if layer.kind in ("full", "latent"):
            total += context * row_bytes(spec, scheme, layer)
        elif layer.kind == "sliding":
            assert layer.window is not None
            total += min(context, layer.window) * row_bytes(spec, scheme, layer)
    probe = spec.probe(scheme.dtype)
    return total + sum(slot.state_bytes for slot in probe.slots if not slot.updates)
