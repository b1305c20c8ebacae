"""`+kN@topM`: the layers whose keys suffer most from a KV scheme are found by measuring, and get the wider keys.
Tiny mlx-lm llama models built from arguments; the layer that must rank first is made so by construction."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import llama

from kvrig.bundle.kvcache_json import host_config
from kvrig.exceptions import KVSchemeError
from kvrig.models import spec_from_config
from kvrig.quality.kv_sensitivity import key_sensitivity, resolve_variant
from kvrig.quality.schemes import make_kv_caches
from kvrig.recipes import parse_kv

CONFIG = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 3,
    "rms_norm_eps": 1e-5,
    "vocab_size": 97,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}


def model_with_outlier_keys(layer: int) -> tuple[llama.Model, object]:
    """A tiny model whose `layer` has keys with a few channels 40x larger than the rest: a per-token quantization
    group spends its range on them and rounds the other channels away, so that layer's keys suffer most."""
    mx.random.seed(11)
    model = llama.Model(llama.ModelArgs.from_dict(CONFIG))
    model.set_dtype(mx.float32)
    w = model.model.layers[layer].self_attn.k_proj.weight
    scale = mx.ones((w.shape[0], 1)).at[mx.array([3, 70])].add(39.0)
    model.model.layers[layer].self_attn.k_proj.weight = w * scale
    mx.eval(model.parameters())
    return model, spec_from_config(CONFIG)


@pytest.mark.parametrize("layer", [0, 2])
def test_the_layer_with_outlier_keys_ranks_first_and_gets_the_wide_keys(layer: int) -> None:
    model, spec = model_with_outlier_keys(layer)
    tokens = [int(t) for t in mx.random.randint(0, 97, (96,), key=mx.random.key(5)).tolist()]
    variant = parse_kv("k3v8+k8@top1")
    ranked = key_sensitivity(model, spec, variant, tokens)
    assert sorted(i for i, _ in ranked) == [0, 1, 2]
    assert ranked[0][0] == layer
    assert all(kl >= 0 for _, kl in ranked)

    resolved = resolve_variant(model, spec, variant, tokens)
    assert resolved.name == f"k3v8+k8@{layer}"
    assert [e.key_bits for e in host_config(spec, resolved).layers] == [8 if i == layer else 3 for i in range(3)]
    make_kv_caches(model, spec, resolved)  # resolved: caches can be made


def test_unresolved_top_variant_is_a_clear_error() -> None:
    model, spec = model_with_outlier_keys(0)
    with pytest.raises(KVSchemeError, match="resolve"):
        make_kv_caches(model, spec, parse_kv("k4v4+k8@top2"))
