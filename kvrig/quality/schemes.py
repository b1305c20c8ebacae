"""The caches a KV spec makes for a model on this host, for the quality bench and the gate: mlx-lm's own caches
for an unquantized spec, otherwise the ones kvcache.json would make (`kvcache.caches`)."""

from __future__ import annotations

from typing import Any

from kvrig.bundle.kvcache_json import host_config
from kvrig.exceptions import KVSchemeError
from kvrig.kvcache.caches import make_caches
from kvrig.models.spec import ModelSpec
from kvrig.recipes import KVSpec


def make_kv_caches(model: Any, spec: ModelSpec, kv: KVSpec) -> list[Any]:
    from mlx_lm.models.cache import make_prompt_cache

    if kv.promote_keys is not None:
        raise KVSchemeError(f"KV spec '{kv}': resolve its +k{kv.promote_keys[0]}@top layers first")
    if not kv.quantized:
        return make_prompt_cache(model)
    return make_caches(model, host_config(spec, kv), spec.model_type)
