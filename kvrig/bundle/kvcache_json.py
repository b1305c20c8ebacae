"""kvcache.json for a bundle: the scheme, the paging parameters and one entry per layer, as the model's own
caches are (what mlx-lm really stores per layer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvrig.bundle.options import MLX_CACHE_STEP, PackageOptions, PlanView
from kvrig.models import load_model_spec
from kvrig.planner.kv import KVScheme
from kvrig.schemas.kvcache import KVCacheConfig, LayerCache


def layer_caches(src_dir: Path, scheme: KVScheme) -> list[LayerCache]:
    """Per-layer cache entries from the model spec (what mlx-lm really stores per layer). Only growing
    full-attention layers are quantized: mlx-lm cannot quantize rotating (sliding) caches, and latent (MLA)
    and linear caches are read as plain arrays."""
    spec = load_model_spec(src_dir / "config.json")
    out = []
    for layer in spec.layers:
        bits = (scheme.key_bits_for(layer.index), scheme.value_bits) if layer.kind == "full" else (None, None)
        out.append(
            LayerCache(
                layer=layer.index,
                kind=layer.kind,
                window=layer.window if layer.kind == "sliding" else None,
                source_layer=layer.source_layer if layer.kind == "shared" else None,
                key_bits=bits[0],
                value_bits=bits[1],
            )
        )
    return out


def build_kvcache_config(
    config: dict[str, Any], src_dir: Path, scheme: KVScheme, options: PackageOptions, plan: PlanView | None
) -> KVCacheConfig:
    dtype = str(config.get("torch_dtype") or "float16")
    if dtype not in ("float16", "bfloat16", "float32"):
        dtype = "float16"
    if plan is not None:
        max_context = max(plan.max_context, 1)
        memory_limit = plan.memory_limit_bytes
    else:
        text = config.get("text_config", config)
        max_context = options.max_context or int(text.get("max_position_embeddings", 4096))
        memory_limit = 0
    return KVCacheConfig(
        scheme=scheme.name,
        dtype=dtype,  # type: ignore[arg-type]
        key_bits=scheme.key_bits,
        value_bits=scheme.value_bits,
        group_size=options.kv_group_size,
        quantized_kv_start=options.quantized_kv_start,
        rotation=options.rotation,  # type: ignore[arg-type]
        sink_tokens=options.sink_tokens,
        recent_tokens=options.recent_tokens,
        step=MLX_CACHE_STEP,
        page_tokens=options.page_tokens,
        max_context=max_context,
        keep_tokens=options.keep_tokens,
        prefill_step_size=options.prefill_step_size,
        buffer_cache_limit_bytes=options.buffer_cache_limit_bytes,
        memory_limit_bytes=memory_limit,
        pressure=options.pressure,
        layers=layer_caches(src_dir, scheme),
    )
