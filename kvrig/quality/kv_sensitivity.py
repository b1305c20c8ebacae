"""Which layers' keys suffer most from a KV scheme: the KL divergence of the model's next-token distributions
(against an unquantized cache) when only that layer's cache uses the scheme, on the local calibration text.
A variant `k4v4+k8@top2` gives the two worst layers 8-bit keys; the bits they cost are the planner's."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvrig.bundle.kvcache_json import host_config
from kvrig.kvcache.caches import check_scheme, scheme_extras
from kvrig.kvcache.kv_cache import SchemeKVCache, install_attention
from kvrig.models import load_model_spec
from kvrig.models.source import read_tokenizer
from kvrig.models.spec import ModelSpec
from kvrig.quantize.base import load_source_model
from kvrig.quantize.recipes import calibration_tokens
from kvrig.recipes import KVSpec
from kvrig.runtime.host import prepare_for_host


def key_sensitivity(model: Any, spec: ModelSpec, variant: KVSpec, tokens: list[int]) -> list[tuple[int, float]]:
    """(layer index, mean KL in nats per token) for every layer the scheme quantizes, worst first. The layer
    under test gets kvrig's scheme cache (its prefill reads dequantized copies through BLAS: MLX's CPU
    quantized matmul is a slow loop), every other layer the model's own unquantized cache."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    ids = mx.array(tokens)[None]

    def log_probs(caches: list[Any]) -> mx.array:
        logits = model(ids, cache=caches)[0].astype(mx.float32)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    reference = log_probs(make_prompt_cache(model))
    p_ref = mx.exp(reference)
    mx.eval(reference, p_ref)
    kv = host_config(spec, replace(variant, layer_key_bits=(), promote_keys=None))
    check_scheme(model, kv, spec.model_type)
    install_attention(model)
    owners = [e for e in kv.layers if e.kind != "shared"]
    out = []
    for index, entry in enumerate(owners):
        if entry.kind != "full" or entry.key_bits is None or entry.value_bits is None:
            continue
        caches = make_prompt_cache(model)
        caches[index] = SchemeKVCache(entry.key_bits, entry.value_bits, kv.group_size, **scheme_extras(kv))
        kl = mx.mean(mx.sum(p_ref * (reference - log_probs(caches)), axis=-1))
        out.append((entry.layer, float(kl.item())))  # type: ignore[arg-type]
        mx.clear_cache()
    return sorted(out, key=lambda lk: -lk[1])


def resolve_variant(model: Any, spec: ModelSpec, variant: KVSpec, tokens: list[int]) -> KVSpec:
    """`variant` with `+kN@topM` replaced by the M most sensitive layers (explicit per-layer key widths)."""
    if variant.promote_keys is None:
        return variant
    bits, count = variant.promote_keys
    ranked = key_sensitivity(model, spec, variant, tokens)
    chosen = {layer: bits for layer, _ in ranked[:count]}
    return variant.with_layer_key_bits(dict(variant.layer_key_bits) | chosen)


def resolve_for_source(src_dir: Any, variant: KVSpec) -> KVSpec:
    """A package's `--kv` with `+kN@topM`, resolved on the source model in `src_dir` (float weights, the local
    calibration text): what `kvrig package` writes to kvcache.json."""

    if variant.promote_keys is None:
        return variant
    model = prepare_for_host(load_source_model(src_dir)[0])
    tokens = sensitivity_tokens(read_tokenizer(src_dir))
    return resolve_variant(model, load_model_spec(src_dir / "config.json"), variant, tokens)


def sensitivity_tokens(tokenizer: Any, length: int = 256) -> list[int]:
    """The calibration text's first tokens: where `+kN@topM` variants measure which layers' keys suffer most."""
    return [int(t) for t in calibration_tokens(tokenizer, samples=1, length=length).reshape(-1).tolist()]
