"""Memory beyond weights and KV cache: MLX buffer cache, prefill activations, growth copies, app baseline.

These are estimates (labelled so in the plan), except the attention scores, which follow what MLX's attention
measurably holds on the named backend (plan/transient.py); weights and KV bytes are exact.
"""

from __future__ import annotations

from kvrig.models.layers import DTYPE_BYTES
from kvrig.models.spec import ModelSpec
from kvrig.planner.kv import dequantizes_on_read, layer_quantized, row_bytes
from kvrig.planner.transient import DEFAULT_BACKEND, Backend, scores_buffers
from kvrig.recipes import KVSpec

DEFAULT_BUFFER_CACHE_BYTES = 20 * 1024 * 1024  # what the MLX-Swift examples cap Memory.cacheLimit at
DEFAULT_PREFILL_STEP = 512  # MLX-Swift's GenerateParameters.prefillStepSize default


def _cfg(spec: ModelSpec) -> dict:
    return spec.config.get("text_config", spec.config)


def prefill_activation_bytes(
    spec: ModelSpec,
    prefill_step: int,
    context: int,
    dtype: str = "float16",
    *,
    scheme: KVSpec | None = None,
    backend: Backend = DEFAULT_BACKEND,
) -> int:
    """Live activations while one prefill chunk of `prefill_step` tokens runs at `context`: residual stream and
    projections, the MLP's widest intermediate (estimates, upper bounds), and one layer's attention scores as
    MLX's attention on `backend` allocates them (plan/transient.py: measured, 0 where Metal's kernel is fused)."""
    return sum(forward_buffers(spec, prefill_step, context, dtype, scheme=scheme, backend=backend))


def forward_buffers(
    spec: ModelSpec,
    tokens: int,
    context: int,
    dtype: str = "float16",
    *,
    scheme: KVSpec | None = None,
    backend: Backend = DEFAULT_BACKEND,
) -> list[int]:
    """`prefill_activation_bytes` as the buffers MLX allocates for them, one layer's worth (the next layer
    takes them again from MLX's buffer cache): what a forward pass of `tokens` at `context` leaves in an
    uncapped cache (planner/allocator.py)."""
    cfg = _cfg(spec)
    width = DTYPE_BYTES[dtype]
    s = min(tokens, max(context, 1))
    hidden = spec.hidden_size
    heads = int(cfg.get("num_attention_heads") or 1)
    kv = max((layer.kv_heads for layer in spec.layers), default=0)
    head_dim = max((layer.k_head_dim for layer in spec.layers), default=0)
    inter = int(cfg.get("intermediate_size") or 4 * hidden)
    if cfg.get("moe_intermediate_size") and cfg.get("num_experts_per_tok"):
        inter = max(inter, int(cfg["moe_intermediate_size"]) * int(cfg["num_experts_per_tok"]))
    # The residual stream, norms and RoPE: on the CPU MLX runs mx.fast.rms_norm and mx.fast.rope unfused (their
    # peaks measured at a few times a query-sized input), on the queries too, so there the buffers are as
    # wide as the wider of the stream and the queries (Qwen3-4B: 4096-wide queries beside a 2560-wide stream).
    wide = max(hidden, heads * head_dim) if backend == "cpu" else hidden
    stream = [s * wide * width] * 4
    projections = [s * heads * head_dim * width, s * kv * head_dim * width, s * kv * head_dim * width]
    mlp = [s * inter * width] * 3
    scores = list(_scores_buffers(spec, tokens, context, dtype, scheme=scheme, backend=backend))
    logits = [spec.vocab_size * 4]  # only the last position's logits are evaluated
    return [b for b in (*stream, *projections, *mlp, *scores, *logits) if b > 0]


def prefill_scores_bytes(
    spec: ModelSpec,
    prefill_step: int,
    context: int,
    dtype: str = "float16",
    *,
    scheme: KVSpec | None = None,
    backend: Backend = DEFAULT_BACKEND,
) -> int:
    """The largest layer's attention scores for a prefill chunk at `context` (chunk × keys per head) as MLX's
    attention on `backend` holds them; one layer at a time, and a single buffer, so Metal's largest-buffer
    limit applies. Attention over a quantized cache (mlx-lm's) materializes them on every backend."""
    return sum(_scores_buffers(spec, prefill_step, context, dtype, scheme=scheme, backend=backend))


def _scores_buffers(
    spec: ModelSpec,
    prefill_step: int,
    context: int,
    dtype: str,
    *,
    scheme: KVSpec | None,
    backend: Backend,
) -> tuple[int, int, int]:
    """The largest layer's attention buffers (transient.scores_buffers) for a chunk at `context`."""
    heads = int(_cfg(spec).get("num_attention_heads") or 1)
    queries = min(prefill_step, max(context, 1))
    largest: tuple[int, int, int] = (0, 0, 0)
    for layer in spec.layers:
        if layer.kind in ("full", "latent", "shared") and layer.k_head_dim:
            keys = context
        elif layer.kind == "sliding" and layer.window is not None:
            keys = min(context, layer.window - 1 + queries)
        else:
            continue
        stored = scheme is not None and layer_quantized(layer, scheme)
        quantized = stored and scheme is not None and not dequantizes_on_read(scheme, spec)
        key_bits = scheme.key_bits if quantized and scheme is not None else None
        parts = scores_buffers(
            backend=backend,
            heads=heads,
            kv_heads=layer.kv_heads,
            head_dim=layer.k_head_dim,
            queries=queries,
            keys=keys,
            width=DTYPE_BYTES[dtype],
            key_bits=key_bits,
        )
        largest = max(largest, parts, key=sum)
    return largest


def kv_read_bytes(spec: ModelSpec, scheme: KVSpec, context: int) -> int:
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
