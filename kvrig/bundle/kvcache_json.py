"""kvcache.json for a bundle: the scheme, the paging parameters and one entry per layer, as the model's own
caches are (what mlx-lm really stores per layer)."""

from __future__ import annotations

from typing import Any

from kvrig.bundle.mapped import PAGE_BYTES
from kvrig.bundle.options import MLX_CACHE_STEP, PackageOptions, PlanView
from kvrig.models.spec import ModelSpec
from kvrig.recipes import KVSpec
from kvrig.schemas.kvcache import KVCacheConfig, LayerCache, host_kvcache


def layer_caches(spec: ModelSpec, kv: KVSpec) -> list[LayerCache]:
    """Per-layer cache entries from the model spec (what mlx-lm really stores per layer). Only growing
    full-attention layers are quantized: mlx-lm cannot quantize rotating (sliding) caches, and latent (MLA)
    and linear caches are read as plain arrays."""
    out = []
    for layer in spec.layers:
        bits = (kv.key_bits_for(layer.index), kv.value_bits) if layer.kind == "full" else (None, None)
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


def host_config(spec: ModelSpec, kv: KVSpec, *, max_context: int = 4096) -> KVCacheConfig:
    """The kvcache.json a bundle with `kv` would carry for a run on this host (no phone plan behind it)."""
    return host_kvcache(
        layer_caches(spec, kv),
        max_context=max_context,
        prefill_step_size=256,
        **kv_fields(kv),
    )


def kv_fields(kv: KVSpec) -> dict[str, Any]:
    """The fields of kvcache.json that one KV spec decides."""
    return {
        "scheme": kv.scheme,
        "key_bits": kv.key_bits,
        "value_bits": kv.value_bits,
        "group_size": kv.group_size,
        "rotation": kv.rotation,
        "sink_tokens": kv.sink_tokens,
        "recent_tokens": kv.recent_tokens,
    }


def build_kvcache_config(
    config: dict[str, Any], spec: ModelSpec, kv: KVSpec, options: PackageOptions, plan: PlanView | None
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
        dtype=dtype,  # type: ignore[arg-type]
        quantized_kv_start=options.quantized_kv_start,
        step=MLX_CACHE_STEP,
        page_tokens=options.page_tokens,
        max_context=max_context,
        keep_tokens=options.keep_tokens,
        prefill_step_size=options.prefill_step_size,
        buffer_cache_limit_bytes=options.buffer_cache_limit_bytes,
        memory_limit_bytes=memory_limit,
        pressure=options.pressure,
        weights_layout=options.weights_layout,
        weights_alignment_bytes=PAGE_BYTES if options.weights_layout == "mapped" else None,
        layers=layer_caches(spec, kv),
        **kv_fields(kv),
    )
