"""Prompt caches built from kvcache.json: the same per-layer choices the app makes on the phone."""

from __future__ import annotations

from typing import Any

from toolchain.exceptions import QuantizationError
from toolchain.schemas.kvcache import KVCacheConfig


def make_caches(model: Any, kv: KVCacheConfig) -> list[Any]:
    """One cache per layer. Full-attention layers get the kvcache.json bits: mlx-lm's QuantizedKVCache when
    keys and values share a bit width, the mixed K/V cache otherwise; other kinds keep the model's own cache
    (mlx-lm cannot quantize a rotating or recurrent cache). With `quantized_kv_start` > 0 full layers start
    unquantized and `maybe_quantize` converts them once the context passes it."""
    from mlx_lm.models import cache as mlx_cache

    base = model.make_cache() if hasattr(model, "make_cache") else mlx_cache.make_prompt_cache(model)
    if len(kv.layers) != len(base):
        raise QuantizationError(
            f"kvcache.json lists {len(kv.layers)} layers but the model has {len(base)} caches"
        )
    caches = []
    for entry, cache in zip(kv.layers, base, strict=True):
        full = entry.kind == "full" and type(cache) is mlx_cache.KVCache
        if full and kv.quantized_kv_start == 0 and (entry.key_bits or entry.value_bits):
            cache = quantized_cache(entry.key_bits, entry.value_bits, kv.group_size)
        caches.append(cache)
    return caches


def quantized_cache(key_bits: int | None, value_bits: int | None, group_size: int) -> Any:
    from mlx_lm.models.cache import QuantizedKVCache

    if key_bits == value_bits and key_bits is not None:
        return QuantizedKVCache(group_size=group_size, bits=key_bits)
    try:
        from toolchain.runtime.kv_cache import MixedQuantizedKVCache  # type: ignore[import-not-found]
    except ImportError:
        raise QuantizationError(
            f"keys at {key_bits} bits and values at {value_bits} bits need the mixed K/V cache "
            "(toolchain.runtime.kv_cache), which is not available in this build"
        ) from None
    return MixedQuantizedKVCache(key_bits=key_bits, value_bits=value_bits, group_size=group_size)


def maybe_quantize(caches: list[Any], kv: KVCacheConfig) -> None:
    """Converts unquantized full-attention caches once their context exceeds `quantized_kv_start`."""
    if kv.quantized_kv_start == 0:
        return
    from mlx_lm.models import cache as mlx_cache

    for i, (entry, cache) in enumerate(zip(kv.layers, caches, strict=True)):
        if (
            entry.kind != "full"
            or type(cache) is not mlx_cache.KVCache
            or cache.offset <= kv.quantized_kv_start
        ):
            continue
        if not (entry.key_bits or entry.value_bits):
            continue
        if entry.key_bits == entry.value_bits:
            caches[i] = cache.to_quantized(group_size=kv.group_size, bits=entry.key_bits)
        else:
            new = quantized_cache(entry.key_bits, entry.value_bits, kv.group_size)
            keys, values = cache.state
            new.update_and_fetch(keys, values)
            caches[i] = new
