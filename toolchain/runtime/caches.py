"""Prompt caches built from kvcache.json: the same per-layer choices the app makes on the phone."""

from __future__ import annotations

from typing import Any

from toolchain.exceptions import QuantizationError
from toolchain.schemas.kvcache import KVCacheConfig


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
    caches = []
    for entry, cache in zip(owners, base, strict=True):
        full = entry.kind == "full" and type(cache) is mlx_cache.KVCache
        if full and kv.quantized_kv_start == 0 and (entry.key_bits or entry.value_bits):
            cache = quantized_cache(entry.key_bits, entry.value_bits, kv.group_size, model_type)
        caches.append(cache)
    return caches


def quantized_cache(key_bits: int | None, value_bits: int | None, group_size: int, model_type: str = "") -> Any:
    from mlx_lm.models.cache import QuantizedKVCache

    from toolchain.models.families import NO_QUANTIZED_ATTENTION
    from toolchain.runtime.kv_cache import DequantizingKVCache

    if key_bits is None or value_bits is None:
        raise QuantizationError("a quantized KV cache needs both key and value bits (use k16vN only with fp16 keys)")
    if key_bits == value_bits and model_type not in NO_QUANTIZED_ATTENTION:
        return QuantizedKVCache(group_size=group_size, bits=key_bits)
    return DequantizingKVCache(key_bits, value_bits, group_size)


def maybe_quantize(caches: list[Any], kv: KVCacheConfig, model_type: str = "") -> None:
    """Converts unquantized full-attention caches once their context exceeds `quantized_kv_start`."""
    if kv.quantized_kv_start == 0:
        return
    from mlx_lm.models import cache as mlx_cache

    from toolchain.runtime.kv_cache import DequantizingKVCache

    owners = [entry for entry in kv.layers if entry.kind != "shared"]
    for i, (entry, cache) in enumerate(zip(owners, caches, strict=True)):
        if entry.kind != "full" or type(cache) is not mlx_cache.KVCache or cache.offset <= kv.quantized_kv_start:
            continue
        if entry.key_bits is None or entry.value_bits is None:
            continue
        target = quantized_cache(entry.key_bits, entry.value_bits, kv.group_size, model_type)
        if isinstance(target, DequantizingKVCache):
            caches[i] = DequantizingKVCache.from_kv_cache(cache, entry.key_bits, entry.value_bits, kv.group_size)
        else:
            caches[i] = cache.to_quantized(group_size=kv.group_size, bits=entry.key_bits)
