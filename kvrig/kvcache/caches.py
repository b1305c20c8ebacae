"""Prompt caches built from kvcache.json: the same per-layer choices the app makes on the phone."""

from __future__ import annotations

from typing import Any

from kvrig.exceptions import KVSchemeError, QuantizationError
from kvrig.kvcache.families import NO_QUANTIZED_ATTENTION
from kvrig.kvcache.kv_cache import DequantizingKVCache, SchemeKVCache, install_attention
from kvrig.schemas.kvcache import KVCacheConfig

CACHE_SETTINGS = frozenset(
    {"key_bits", "value_bits", "group_size", "quantized_kv_start", "rotation", "sink_tokens", "recent_tokens", "layers"}
)
"""The kvcache.json fields `make_caches` reads. The rest (limits, paging, prefill step) never change what a cache
computes, so a measurement keyed by these holds for every plan of the same KV spec."""


def cache_settings(kv: KVCacheConfig) -> dict[str, Any]:
    """What of `kv` the caches `make_caches` builds depend on, as JSON."""
    return kv.model_dump(mode="json", include=set(CACHE_SETTINGS))


def make_caches(model: Any, kv: KVCacheConfig, model_type: str = "") -> list[Any]:
    """One cache per cache-holding layer (shared layers read another layer's). Full-attention layers get the
    kvcache.json bits: mlx-lm's QuantizedKVCache when keys and values share a bit width and the model's
    attention reads quantized keys, kvrig's dequantizing cache otherwise; other kinds keep the model's own
    cache. With `quantized_kv_start` > 0 full layers start unquantized; `maybe_quantize` converts them."""
    from mlx_lm.models import cache as mlx_cache

    base = mlx_cache.make_prompt_cache(model)
    owners = [entry for entry in kv.layers if entry.kind != "shared"]
    if len(owners) != len(base):
        raise QuantizationError(
            f"kvcache.json lists {len(owners)} cache-holding layers but the model makes {len(base)} caches"
        )
    extras = scheme_extras(kv)
    caches = []
    for entry, cache in zip(owners, base, strict=True):
        full = entry.kind == "full" and type(cache) is mlx_cache.KVCache
        if full and kv.quantized_kv_start == 0 and (entry.key_bits or entry.value_bits):
            cache = quantized_cache(entry.key_bits, entry.value_bits, kv.group_size, model_type, **extras)
        caches.append(cache)
    if any(_is_scheme_cache(c) for c in caches) or (kv.quantized_kv_start and _needs_scheme_cache(kv, model_type)):
        check_scheme(model, kv, model_type)

        install_attention(model)
    return caches


def scheme_extras(kv: KVCacheConfig) -> dict[str, Any]:
    """The kvcache.json options beyond bit widths, as SchemeKVCache keywords."""
    return {"rotation": kv.rotation, "sink_tokens": kv.sink_tokens, "recent_tokens": kv.recent_tokens}


def _needs_scheme_cache(kv: KVCacheConfig, model_type: str) -> bool:
    extras = kv.rotation != "none" or kv.sink_tokens or kv.recent_tokens
    mixed = kv.key_bits != kv.value_bits or any(e.key_bits != e.value_bits for e in kv.layers if e.kind == "full")
    return model_type not in NO_QUANTIZED_ATTENTION and bool(extras or mixed)


def _is_scheme_cache(cache: Any) -> bool:
    return isinstance(cache, SchemeKVCache)


def check_scheme(model: Any, kv: KVCacheConfig, model_type: str) -> None:
    """Rotation needs a power-of-two head dim (the Hadamard transform is then its own inverse, on the host and
    in MLX Swift); the extras need attention kvrig can route."""

    extras = kv.rotation != "none" or kv.sink_tokens or kv.recent_tokens
    if extras and model_type in NO_QUANTIZED_ATTENTION:
        raise KVSchemeError(
            f"kvcache.json: rotation, sink_tokens and recent_tokens are not supported for {model_type} "
            "(its attention cannot read kvrig's quantized cache); set them to none/0"
        )
    if kv.rotation == "none":
        return
    layers = getattr(model, "layers", None) or getattr(getattr(model, "model", None), "layers", [])
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        dim = getattr(attn, "head_dim", None)
        if dim is None and attn is not None and hasattr(attn, "k_proj") and hasattr(attn, "n_kv_heads"):
            dim = attn.k_proj.weight.shape[0] // attn.n_kv_heads
        if dim is not None and (dim <= 0 or dim & (dim - 1)):
            raise KVSchemeError(
                f"kvcache.json: field 'rotation' is {kv.rotation} but layer {i} has head dim {dim}, not a power "
                "of two (expected rotation none)"
            )


def quantized_cache(
    key_bits: int | None,
    value_bits: int | None,
    group_size: int,
    model_type: str = "",
    *,
    rotation: str = "none",
    sink_tokens: int = 0,
    recent_tokens: int = 0,
) -> Any:
    """mlx-lm's QuantizedKVCache for one width and no extras; kvrig's SchemeKVCache (quantized attention at
    two widths, rotation, sinks, recent window) otherwise; the dequantize-on-read cache for models whose
    attention cannot read quantized keys."""
    from mlx_lm.models.cache import QuantizedKVCache

    if key_bits is None or value_bits is None:
        raise QuantizationError("a quantized KV cache needs both key and value bits (use k16vN only with fp16 keys)")
    if model_type in NO_QUANTIZED_ATTENTION:
        return DequantizingKVCache(key_bits, value_bits, group_size)
    if key_bits == value_bits and rotation == "none" and not sink_tokens and not recent_tokens:
        return QuantizedKVCache(group_size=group_size, bits=key_bits)
    return SchemeKVCache(
        key_bits,
        value_bits,
        group_size,
        rotation=rotation,
        sink_tokens=sink_tokens,
        recent_tokens=recent_tokens,
    )


def maybe_quantize(caches: list[Any], kv: KVCacheConfig, model_type: str = "") -> None:
    """Converts unquantized full-attention caches once their context exceeds `quantized_kv_start`."""
    if kv.quantized_kv_start == 0:
        return
    from mlx_lm.models import cache as mlx_cache

    owners = [entry for entry in kv.layers if entry.kind != "shared"]
    for i, (entry, cache) in enumerate(zip(owners, caches, strict=True)):
        if entry.kind != "full" or type(cache) is not mlx_cache.KVCache or cache.offset <= kv.quantized_kv_start:
            continue
        if entry.key_bits is None or entry.value_bits is None:
            continue
        target = quantized_cache(entry.key_bits, entry.value_bits, kv.group_size, model_type, **scheme_extras(kv))
        if isinstance(target, DequantizingKVCache):
            caches[i] = DequantizingKVCache.from_kv_cache(cache, entry.key_bits, entry.value_bits, kv.group_size)
        elif isinstance(target, SchemeKVCache):
            caches[i] = SchemeKVCache.from_kv_cache(cache, target)
        else:
            caches[i] = cache.to_quantized(group_size=kv.group_size, bits=entry.key_bits)
