"""Which layers' keys suffer most from a KV scheme: the KL divergence of the model's next-token distributions
(against an unquantized cache) when only that layer's cache uses the scheme, on the local calibration text.
A variant `k4v4+k8@top2` gives the two worst layers 8-bit keys; the bits they cost are the planner's."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from toolchain.models.spec import ModelSpec
from toolchain.plan.kv import with_layer_key_bits
from toolchain.quality.schemes import KVVariant, kv_config


def key_sensitivity(model: Any, spec: ModelSpec, variant: KVVariant, tokens: list[int]) -> list[tuple[int, float]]:
    """(layer index, mean KL in nats per token) for every layer the scheme quantizes, worst first."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from toolchain.runtime.caches import make_caches

    ids = mx.array(tokens)[None]

    def log_probs(caches: list[Any]) -> mx.array:
        logits = model(ids, cache=caches)[0].astype(mx.float32)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    reference = log_probs(make_prompt_cache(model))
    p_ref = mx.exp(reference)
    mx.eval(reference, p_ref)
    base = replace(variant, scheme=replace(variant.scheme, layer_key_bits=()))
    full = kv_config(spec, base)
    quantized = [e.layer for e in full.layers if e.kind == "full" and e.key_bits is not None]
    out = []
    for layer in quantized:
        only = [
            e if e.layer == layer else e.model_copy(update={"key_bits": None, "value_bits": None}) for e in full.layers
        ]
        logp = log_probs(make_caches(model, full.model_copy(update={"layers": only}), spec.model_type))
        kl = mx.mean(mx.sum(p_ref * (reference - logp), axis=-1))
        out.append((layer, float(kl.item())))  # type: ignore[arg-type]
        mx.clear_cache()
    return sorted(out, key=lambda lk: -lk[1])


def resolve_variant(model: Any, spec: ModelSpec, variant: KVVariant, tokens: list[int]) -> KVVariant:
    """`variant` with `+kN@topM` replaced by the M most sensitive layers (explicit per-layer key widths)."""
    if variant.promote_keys is None:
        return variant
    bits, count = variant.promote_keys
    ranked = key_sensitivity(model, spec, variant, tokens)
    chosen = {layer: bits for layer, _ in ranked[:count]}
    scheme = with_layer_key_bits(variant.scheme, dict(variant.scheme.layer_key_bits) | chosen)
    return replace(variant, scheme=scheme, promote_keys=None)
