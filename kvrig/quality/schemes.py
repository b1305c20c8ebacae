"""KV variants for the quality bench: a planner scheme (kXvY[gZ], fp16, with per-layer key widths `+k8@1.3`)
plus the kvcache.json extras, written `k4v4+rot+s4+w128` (rot: Hadamard on keys and values, rotk: keys only,
sN: N sink tokens, wN: a recent window of N tokens kept in the activation dtype)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvrig.exceptions import KVSchemeError
from kvrig.kvcache.caches import make_caches
from kvrig.models.layers import DTYPE_BYTES
from kvrig.models.spec import ModelSpec
from kvrig.planner.kv import KVScheme, kv_bytes, parse_scheme
from kvrig.schemas.kvcache import KVCacheConfig, LayerCache, host_kvcache

_EXTRA = re.compile(r"^(rot|rotk|s(\d+)|w(\d+))$")
_LAYER_KEYS = re.compile(r"^k\d+@[\d.]+$")
_TOP_KEYS = re.compile(r"^k(\d+)@top(\d+)$")


@dataclass(frozen=True)
class KVVariant:
    name: str
    scheme: KVScheme
    rotation: str = "none"
    sink_tokens: int = 0
    recent_tokens: int = 0
    promote_keys: tuple[int, int] | None = None
    """`+k8@top2`: (bits, count) for the layers whose keys suffer most, chosen by measuring
    (quality/kv_sensitivity.py `resolve_variant`); the caches are made once they are explicit layers."""

    @property
    def has_extras(self) -> bool:
        return self.rotation != "none" or bool(self.sink_tokens or self.recent_tokens)


def parse_kv_variant(text: str, group_size: int = 64) -> KVVariant:
    base, *parts = text.strip().lower().split("+")
    # Per-layer key widths (+k8@1.3) belong to the planner's scheme; the rest are kvcache.json extras.
    layer_keys = [p for p in parts if _LAYER_KEYS.match(p)]
    extras = [p for p in parts if not _LAYER_KEYS.match(p)]
    scheme = parse_scheme("+".join([base, *layer_keys]), group_size=group_size)
    rotation, sinks, recent = "none", 0, 0
    promote = None
    for extra in extras:
        top = _TOP_KEYS.match(extra)
        if top:
            promote = (int(top.group(1)), int(top.group(2)))
            parse_scheme(f"{base}+k{promote[0]}@0", group_size=group_size)  # the width is checked now
            continue
        m = _EXTRA.match(extra)
        if not m:
            raise KVSchemeError(
                f"KV variant '{text}': unknown part '+{extra}' (expected +rot, +rotk, +sN, +wN, +kN@L1.L2, +kN@topM)"
            )
        if m.group(1) == "rot":
            rotation = "hadamard"
        elif m.group(1) == "rotk":
            rotation = "hadamard_keys"
        elif m.group(2):
            sinks = int(m.group(2))
        else:
            recent = int(m.group(3))
    if extras and not scheme.quantized:
        raise KVSchemeError(f"KV variant '{text}': rotation, sinks and windows apply to quantized schemes only")
    return KVVariant(text.strip().lower(), scheme, rotation, sinks, recent, promote)


def kv_config(spec: ModelSpec, variant: KVVariant, *, max_context: int = 4096) -> KVCacheConfig:
    """The kvcache.json a bundle with this variant would carry (host fields only matter here)."""
    s = variant.scheme
    layers = [
        LayerCache(
            layer=layer.index,
            kind=layer.kind,
            window=layer.window if layer.kind == "sliding" else None,
            source_layer=layer.source_layer if layer.kind == "shared" else None,
            key_bits=s.key_bits_for(layer.index) if layer.kind == "full" else None,
            value_bits=s.value_bits if layer.kind == "full" else None,
        )
        for layer in spec.layers
    ]
    return host_kvcache(
        layers,
        max_context=max_context,
        prefill_step_size=256,
        scheme=s.name,
        key_bits=s.key_bits,
        value_bits=s.value_bits,
        group_size=s.group_size,
        rotation=variant.rotation,
        sink_tokens=variant.sink_tokens,
        recent_tokens=variant.recent_tokens,
    )


def make_variant_caches(model: Any, spec: ModelSpec, variant: KVVariant) -> list[Any]:
    from mlx_lm.models.cache import make_prompt_cache

    if variant.promote_keys is not None:
        raise KVSchemeError(f"KV variant '{variant.name}': resolve its +k{variant.promote_keys[0]}@top layers first")
    if not variant.scheme.quantized:
        return make_prompt_cache(model)
    return make_caches(model, kv_config(spec, variant), spec.model_type)


def extra_bytes(spec: ModelSpec, variant: KVVariant, dtype: str) -> int:
    """Bytes of the sink and recent-window copies (activation dtype) on every quantized full layer: fixed once
    the first token is in. The quantized store itself is the planner's (`kv_bytes`)."""
    n = variant.sink_tokens + variant.recent_tokens
    if not n or not variant.scheme.quantized:
        return 0
    width = DTYPE_BYTES[dtype]
    return sum(
        n * layer.kv_heads * (layer.k_head_dim + layer.v_head_dim) * width
        for layer in spec.layers
        if layer.kind == "full"
    )


def predicted_bytes(spec: ModelSpec, variant: KVVariant, schedule: list[int], dtype: str) -> int:
    """The planner's allocation for the schedule (at `dtype`) plus the variant's fixed float copies."""
    from dataclasses import replace

    scheme = replace(variant.scheme, dtype=dtype)
    return kv_bytes(spec, scheme, schedule) + (extra_bytes(spec, variant, dtype) if schedule else 0)
